"""Heads: checkpoint names and shapes, the TTT attention pattern against step-by-step decoding,
save/load, and learning on a tiny overfit set."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from heads import Eagle3Config, Eagle3Head, MedusaConfig, MedusaHead, load_head, save_head
from heads.eagle3 import KVCache, TTTCache
from tests.conftest import load_script
from train.extract import capture
from train.losses import (
    TargetView,
    eagle3_loss,
    full_argmax,
    loss_counts,
    medusa_loss,
    shift,
    soft_ce,
    target_view,
    weights,
)
from train.target import load_target

HEAD_CFG = OmegaConf.create({"aux_layers": None, "hidden_size": None, "intermediate_size": None,
                             "num_attention_heads": None, "num_key_value_heads": None, "head_dim": None,
                             "rope_theta": None, "rms_norm_eps": None, "num_heads": 3, "num_layers": 2})


def tiny_eagle3(target, dv: int = 48, seed: int = 0) -> Eagle3Head:
    torch.manual_seed(seed)
    head = Eagle3Head(Eagle3Config.from_target(target.config, HEAD_CFG, dv))
    kept = torch.randperm(target.config.vocab_size)[:dv].sort().values
    t2d = torch.zeros(target.config.vocab_size, dtype=torch.bool)
    t2d[kept] = True
    head.set_vocab(kept - torch.arange(dv), t2d)
    head.init_from_target(target)
    return head


def test_eagle3_checkpoint_names_and_shapes(tiny_llama_cfg):
    target = load_target(tiny_llama_cfg)
    head = tiny_eagle3(target)
    c, H = head.config, target.config.hidden_size
    assert c.aux_layers == [2, 4, 5]  # [2, N//2, N-3] for N = 8 layers
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    expected = {
        "fc.weight": (H, 3 * H),
        "midlayer.input_layernorm.weight": (H,), "midlayer.hidden_norm.weight": (H,),
        "midlayer.post_attention_layernorm.weight": (H,),
        "midlayer.self_attn.q_proj.weight": (q, 2 * H), "midlayer.self_attn.k_proj.weight": (kv, 2 * H),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * H), "midlayer.self_attn.o_proj.weight": (H, q),
        "midlayer.mlp.gate_proj.weight": (c.intermediate_size, H), "midlayer.mlp.up_proj.weight": (c.intermediate_size, H),
        "midlayer.mlp.down_proj.weight": (H, c.intermediate_size),
        "norm.weight": (H,), "lm_head.weight": (48, H), "d2t": (48,), "t2d": (target.config.vocab_size,),
    }
    state = head.trained_state_dict()
    assert {k: tuple(v.shape) for k, v in state.items()} == expected
    assert state["d2t"].dtype == torch.int64 and state["t2d"].dtype == torch.bool
    assert not head.embed_tokens.weight.requires_grad
    assert torch.equal(head.embed_tokens.weight, target.get_input_embeddings().weight)
    assert torch.equal(head.lm_head.weight, target.get_output_embeddings().weight[head.draft_ids()])


def test_medusa_checkpoint_names_and_init(tiny_qwen2_cfg):
    target = load_target(tiny_qwen2_cfg)
    H, V = target.config.hidden_size, target.config.vocab_size
    head = MedusaHead(MedusaConfig.from_target(target.config, HEAD_CFG, 32))
    state = head.trained_state_dict()
    names = {f"blocks.{h}.layers.{i}.{p}" for h in range(3) for i in range(2) for p in ("weight", "bias")}
    names |= {f"lm_heads.{h}.weight" for h in range(3)} | {"d2t", "t2d"}
    assert set(state) == names
    assert state["blocks.0.layers.1.weight"].shape == (H, H) and state["lm_heads.2.weight"].shape == (32, H)
    assert all(torch.count_nonzero(state[f"blocks.{h}.layers.{i}.weight"]) == 0 for h in range(3) for i in range(2))
    assert head(torch.randn(2, 5, H)).shape == (3, 2, 5, 32)
    assert state["t2d"].shape == (V,)


def test_ttt_attention_equals_step_by_step_decoding(tiny_llama_cfg):
    """Row t of TTT step k must equal decoding: context rows 0..t, then k chained draft rows."""
    target = load_target(tiny_llama_cfg)
    head = tiny_eagle3(target).double()
    torch.manual_seed(1)
    T, steps = 9, 4
    ids = torch.randint(0, target.config.vocab_size, (1, T + steps + 1))
    taps = torch.randn(1, T, 3 * target.config.hidden_size, dtype=torch.float64)
    pos = torch.arange(T)[None]
    cache = TTTCache()
    hidden, ttt = head.project(taps), []
    for k in range(steps):
        hidden = head(hidden, ids[:, 1 + k: 1 + k + T], pos + k, cache)
        ttt.append(hidden)
    for t in range(T):
        kv = KVCache()
        ctx = head(head.project(taps[:, : t + 1]), ids[:, 1: t + 2], pos[:, : t + 1], kv)
        kv.commit()
        feature = ctx[:, -1:]
        assert torch.allclose(feature, ttt[0][:, t: t + 1], atol=1e-10)
        for k in range(1, steps):
            feature = head(feature, ids[:, t + 1 + k: t + 2 + k], torch.tensor([[t + k]]), kv)
            assert torch.allclose(feature, ttt[k][:, t: t + 1], atol=1e-10), (t, k)


@pytest.mark.parametrize("autocast", [False, True])
def test_ttt_steps_attend_as_precisely_as_step_0_in_bfloat16(autocast):
    """In bf16 (GPU training; also under train.autocast) the steps after step 0 compute their scores in float32 as
    step 0's fused attention does: their error against float64 is step 0's (scores rounded to bf16 before the
    softmax gave ~1.7x it on sharp attention, a noisier context than the engines serve the head with)."""
    torch.manual_seed(0)
    B, H, KV, T, d = 1, 8, 2, 256, 64
    qkv = [[torch.randn(B, heads, T, d, dtype=torch.float64) * scale for _ in range(2)]
           for heads, scale in ((H, 2.0), (KV, 2.0), (KV, 1.0))]
    exact, low = TTTCache(), TTTCache()
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        errors = [(low.attend(*(t.bfloat16() for t in step)).double() - exact.attend(*step)).abs().mean()
                  for step in zip(*qkv, strict=True)]
    assert errors[1] < 1.2 * errors[0], errors


def test_ttt_scores_of_bf16_values_use_tensor_cores_and_float32_ones_do_not(monkeypatch):
    """On a GPU the float32 score products of bf16/fp16 values run as TF32 (exact for such values), only inside the
    chunk (the flag is restored, also after an error); float32 values (a float32 run) keep IEEE float32. A TTT step
    1+ enters it for each chunk's forward and again for its recompute in the backward."""
    from contextlib import contextmanager
    from types import SimpleNamespace

    import heads.eagle3
    from heads.eagle3 import _tensor_core_products

    entered = []

    @contextmanager
    def record(x):
        entered.append(x.dtype)
        yield

    monkeypatch.setattr(heads.eagle3, "_tensor_core_products", record)
    cache, (q, k, v) = TTTCache(chunk_rows=4), [torch.randn(1, 2, 8, 4, requires_grad=True) for _ in range(3)]
    out = [cache.attend(q, k, v) for _ in range(2)]   # step 0 (fused), step 1 (two chunks of 4 rows)
    assert len(entered) == 2
    out[1].sum().backward()
    assert len(entered) == 4   # each chunk recomputed in the backward
    monkeypatch.undo()

    matmul = torch.backends.cuda.matmul
    assert not matmul.allow_tf32   # (PyTorch's default)

    def inside(dtype: torch.dtype, device: str = "cuda") -> bool:
        with _tensor_core_products(SimpleNamespace(device=torch.device(device), dtype=dtype)):
            return matmul.allow_tf32

    assert inside(torch.bfloat16) and inside(torch.float16) and not matmul.allow_tf32
    assert not inside(torch.float32) and not inside(torch.bfloat16, "cpu")
    with pytest.raises(RuntimeError), _tensor_core_products(SimpleNamespace(device=torch.device("cuda"),
                                                                            dtype=torch.bfloat16)):
        raise RuntimeError("out of memory")
    assert not matmul.allow_tf32


def reference_ttt_cache() -> type:
    """The O(T^2) TTT attention kept as reference in scripts/bench_ttt_attention.py."""
    return load_script("bench_ttt_attention").ReferenceTTTCache


@pytest.mark.parametrize("chunk_rows", [4, None])
def test_ttt_attention_chunked_equals_reference(chunk_rows):
    """Chunked TTT attention (T not a multiple of the chunk) equals the full-scores reference: outputs
    and gradients wrt q, k, v of every step, GQA, float64; and the same outputs under no_grad."""
    torch.manual_seed(0)
    B, H, KV, T, d, n = 2, 4, 2, 11, 8, 4  # step 0 + 3 TTT steps

    def make(heads: int) -> list[torch.Tensor]:  # the [B, T, heads, d] layout of the projections
        return [torch.randn(B, T, heads, d, dtype=torch.float64).transpose(1, 2).requires_grad_() for _ in range(n)]

    q, k, v = make(H), make(KV), make(KV)
    grads = [torch.randn(B, H, T, d, dtype=torch.float64) for _ in range(n)]
    results = []
    for cache in (reference_ttt_cache()(), TTTCache(chunk_rows)):
        outs = [cache.attend(*qkv) for qkv in zip(q, k, v, strict=True)]
        results.append((outs, torch.autograd.grad(outs, q + k + v, grads)))
    (ref_out, ref_grad), (out, grad) = results
    for a, b in zip(ref_out + list(ref_grad), out + list(grad), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)
    with torch.no_grad():
        cache = TTTCache(chunk_rows)
        for qkv, a in zip(zip(q, k, v, strict=True), ref_out, strict=True):
            torch.testing.assert_close(cache.attend(*qkv), a, rtol=1e-10, atol=1e-12)


def test_save_load_round_trip(tiny_qwen2_cfg, tmp_path, monkeypatch):
    target = load_target(tiny_qwen2_cfg)
    head = tiny_eagle3(target)
    with torch.no_grad():
        head.fc.weight.normal_()
    save_head(head, tmp_path / "h")
    initialised, reset = [], torch.nn.Embedding.reset_parameters
    monkeypatch.setattr(torch.nn.Embedding, "reset_parameters",
                        lambda self: initialised.append(self.weight.device.type) or reset(self))
    again = load_head(tmp_path / "h", target)
    assert initialised == ["meta"]   # no random embedding of the whole vocabulary made to be replaced (2.2 GB at 8B)
    assert again.embed_tokens.weight is target.get_input_embeddings().weight   # shared, not a second copy
    x = torch.randn(1, 4, 3 * target.config.hidden_size)
    ids = torch.randint(0, target.config.vocab_size, (1, 4))
    pos = torch.arange(4)[None]
    assert torch.equal(head.logits(head(head.project(x), ids, pos, KVCache())),
                       again.logits(again(again.project(x), ids, pos, KVCache())))


def overfit(head, loss_fn, steps: int) -> tuple[list[float], list[float]]:
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    losses, accs = [], []
    for _ in range(steps):
        stats = loss_fn()
        opt.zero_grad()
        stats.loss.backward()
        opt.step()
        losses.append(stats.loss.item())
        w = stats.weight[0] > 0
        accs.append(((stats.correct[0] & w).sum() / w.sum()).item())
    return losses, accs


def tiny_batch(target, layers):
    torch.manual_seed(0)
    ids = target.generate(torch.randint(0, 256, (4, 3)), max_new_tokens=37, do_sample=True, top_k=8)
    with torch.no_grad():
        states = capture(target, ids, layers)
    lengths = torch.full((4,), ids.shape[1])
    return ids, states, lengths, torch.ones_like(ids)


def tiny_view(target, head, states):
    lm_head = target.get_output_embeddings().weight
    return target_view(states[:, :, -1], lm_head[head.draft_ids()], head.t2d, full_argmax(states[:, :, -1], lm_head))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_full_argmax_is_the_first_maximal_index_across_chunks(dtype):
    """Chunked over rows, in either dtype, and on exact ties (duplicated lm_head rows) the lowest id, as
    ``argmax`` of the full logits: the stored target argmax does not depend on the chunk size."""
    torch.manual_seed(0)
    lm_head = torch.randn(300, 16).to(dtype)
    lm_head[200:] = lm_head[:100]  # ids 200.. tie with ids 0..
    last = torch.randn(3, 900, 16)
    want = (last.to(dtype) @ lm_head.T).argmax(-1)
    assert (want < 200).all()
    for chunk in (1024, 128, 7):
        assert torch.equal(full_argmax(last, lm_head, chunk), want)


def target_entropy(view, lengths, mask) -> float:
    """The floor of the soft cross-entropy (the target's own entropy, weighted as the 3-step loss): the
    overfit tests compare the excess over it (the KL)."""
    return sum(0.8**k * soft_ce(shift(view.log_p, 1 + k), shift(view.log_p, 1 + k),
                                weights(view.in_vocab, lengths, mask, k, "all")).item() for k in range(3))


def test_eagle3_overfits_tiny_set(tiny_llama_cfg):
    target = load_target(tiny_llama_cfg)
    head = tiny_eagle3(target, dv=target.config.vocab_size)
    ids, states, lengths, mask = tiny_batch(target, [*head.config.aux_layers, target.config.num_hidden_layers])
    view = tiny_view(target, head, states)
    entropy = target_entropy(view, lengths, mask)
    losses, accs = overfit(head, lambda: eagle3_loss(head, states[:, :, :-1].flatten(2), ids, lengths, mask, view,
                                                     3, 0.8, "all"), 150)
    assert losses[-1] - entropy < 0.5 * (losses[0] - entropy)
    assert accs[-1] > accs[0] + 0.3


def test_medusa_overfits_tiny_set(tiny_llama_cfg):
    target = load_target(tiny_llama_cfg)
    V = target.config.vocab_size
    head = MedusaHead(MedusaConfig.from_target(target.config, HEAD_CFG, V))
    head.set_vocab(torch.zeros(V, dtype=torch.long), torch.ones(V, dtype=torch.bool))
    head.init_from_target(target)
    ids, states, lengths, mask = tiny_batch(target, [target.config.num_hidden_layers])
    view = tiny_view(target, head, states)
    entropy = target_entropy(view, lengths, mask)
    losses, accs = overfit(head, lambda: medusa_loss(head, states[:, :, -1], ids, lengths, mask, view,
                                                     0.8, "all", "kl"), 100)
    assert losses[-1] - entropy < 0.5 * (losses[0] - entropy)
    assert accs[-1] > accs[0] + 0.2
    losses, accs = overfit(head, lambda: medusa_loss(head, states[:, :, -1], ids, lengths, mask, view,
                                                     0.8, "all", "ce"), 100)
    assert losses[-1] < 0.7 * losses[0]


@pytest.mark.parametrize("kind, loss, reach", [("eagle3", "kl", 0), ("eagle3", "tv", 0), ("eagle3", "kl", 1),
                                               ("medusa", "ce", 0), ("medusa", "kl_mix", 0)])
def test_token_norm_gives_a_step_the_gradient_of_its_rows_in_one_batch(tiny_llama_cfg, kind, loss, reach):
    """train.loss_norm=token: a step of two micro-batches, one row with many loss positions and three rows with few
    (assistant tokens only), averaged as DeepSpeed averages micro-batches, has the gradient of its four rows in one
    batch; each micro-batch's own mean (loss_norm=micro_batch) weighs the few positions 2-3x more. With GRIFFIN's
    reach mask the one batch, too, is divided by its count before the mask (what the Trainer does then)."""
    target = load_target(tiny_llama_cfg)
    n, V = target.config.num_hidden_layers, target.config.vocab_size
    config = (Eagle3Config if kind == "eagle3" else MedusaConfig).from_target(target.config, HEAD_CFG, V)
    ids, states, lengths, mask = tiny_batch(target, [*getattr(config, "aux_layers", []), n])
    mask[1:, : -4] = 0   # rows 1-3: only their last 4 tokens are the assistant's
    lm_head = target.get_output_embeddings().weight
    argmax = full_argmax(states[:, :, -1], lm_head)
    # a draft vocabulary of the target's argmax tokens and half the data's others: some positions leave each out
    kept = argmax.unique()
    others = ids.unique()[~torch.isin(ids.unique(), kept)]
    kept = torch.cat([kept[: len(kept) * 3 // 4], others[: len(others) // 2]]).sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[kept] = True
    torch.manual_seed(0)
    config = (Eagle3Config if kind == "eagle3" else MedusaConfig).from_target(target.config, HEAD_CFG, len(kept))
    head = Eagle3Head(config) if kind == "eagle3" else MedusaHead(config)
    head.set_vocab(kept - torch.arange(len(kept)), t2d)
    head.init_from_target(target)
    view = target_view(states[:, :, -1], lm_head[head.draft_ids()], head.t2d, argmax)
    ce = loss == "ce"

    def grad(rows: list[int], norms: torch.Tensor | None) -> list[torch.Tensor]:
        part = TargetView(view.log_p[rows], view.argmax[rows], view.in_vocab[rows])
        head.zero_grad()
        if kind == "eagle3":
            out = eagle3_loss(head, states[rows, :, :-1].flatten(2), ids[rows], lengths[rows], mask[rows], part, 3,
                              0.8, "assistant", loss, reach_topk=reach, norms=norms)
        else:
            out = medusa_loss(head, states[rows, :, -1], ids[rows], lengths[rows], mask[rows], part, 0.8, "assistant",
                              loss, norms=norms)
        out.loss.backward()
        return [p.grad.clone() for p in head.parameters() if p.grad is not None]

    steps = 3
    batches = [[0], [1, 2, 3]]
    counts = [loss_counts(head.t2d, {"input_ids": ids[r], "lengths": lengths[r], "loss_mask": mask[r],
                                     "argmax": argmax[r]}, steps, "assistant", ce) for r in batches]
    assert counts[0][0] > 2 * counts[1][0] > 0
    norms = sum(counts) / len(batches)
    whole = grad([0, 1, 2, 3], sum(counts) if reach else None)
    token = [sum(g) / 2 for g in zip(*(grad(r, norms) for r in batches), strict=True)]
    own = [sum(g) / 2 for g in zip(*(grad(r, None) for r in batches), strict=True)]
    for a, b in zip(token, whole, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert max((a - b).norm() / b.norm() for a, b in zip(own, whole, strict=True)) > 0.1


def test_chain_tau_stops_where_a_step_is_not_counted():
    """A root near an answer's end: its later steps land past the EOS (not counted, though the draft predicts the
    template's tokens there right); a decoder stops at the EOS, so the chain tau counts no step beyond it."""
    from train.loop import summarise

    correct = [torch.ones(1, 4, dtype=torch.bool)] * 3
    weight = [torch.tensor([[1.0, 1.0, 1.0, 1.0]]), torch.tensor([[1.0, 1.0, 1.0, 0.0]]),
              torch.tensor([[1.0, 1.0, 0.0, 0.0]])]
    figures = summarise(correct, weight)
    assert figures["chain_tau"] == pytest.approx(1 + 1 + 3 / 4 + 2 / 4)
    assert figures["sim_tau"] == pytest.approx(4.0)   # every counted step right


@pytest.mark.parametrize("kind", ["eagle3", "medusa"])
def test_validation_walk_is_what_the_chain_decoder_accepts(tiny_llama_cfg, kind):
    """Validation's ``decode_tau`` walks the rows as a chain decoder would (passes rooted past what they
    accepted): on a row that is the target's greedy answer it gives the decoder's own accept lengths."""
    from eval import SpecDecoder, build_drafter
    from train.loop import decode_walk

    target = load_target(tiny_llama_cfg)
    V, n = target.config.vocab_size, target.config.num_hidden_layers
    if kind == "eagle3":
        head = tiny_eagle3(target, dv=V)
        layers = [*head.config.aux_layers, n]
    else:
        torch.manual_seed(0)
        head = MedusaHead(MedusaConfig.from_target(target.config, HEAD_CFG, V))
        head.set_vocab(torch.zeros(V, dtype=torch.long), torch.ones(V, dtype=torch.bool))
        head.init_from_target(target)
        layers = [n]
    prompt = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ids = target.generate(prompt, max_new_tokens=48, do_sample=False, eos_token_id=[], pad_token_id=0)
        states = capture(target, ids, layers)
    lengths, mask = torch.tensor([ids.shape[1]]), (torch.arange(ids.shape[1]) >= prompt.shape[1])[None].long()
    view = tiny_view(target, head, states)

    def loss():
        if kind == "eagle3":
            return eagle3_loss(head, states[:, :, :-1].flatten(2), ids, lengths, mask, view, 3, 0.8, "assistant")
        return medusa_loss(head, states[:, :, -1], ids, lengths, mask, view, 0.8, "assistant", "kl")

    overfit(head, loss, 25)   # part-way: some passes accept all 3 drafts, some none
    head.eval()
    with torch.no_grad():
        stats = loss()
    (walked,) = decode_walk(stats.correct, stats.weight, 3)
    ecfg = OmegaConf.create({"chain_k": 3, "ngram": {"min": 2, "max": 4, "k": 4}, "medusa_choices": "auto",
                             "tree": {"top_k": 4, "depth": 4, "total_tokens": 10}})
    with torch.inference_mode():
        out = SpecDecoder(target).generate(prompt[0].tolist(), build_drafter(f"{kind}-chain", head, n, ecfg), 48)
    assert out.tokens == ids[0, prompt.shape[1]:].tolist()
    assert len(set(walked)) >= 3, walked   # a mix of accept lengths: the comparison below can fail
    # the decoder's last pass or two may draft past the row's end, which the row cannot score
    assert walked[:-2] == out.accept_lengths[: len(walked) - 2]
    assert abs(len(walked) - len(out.accept_lengths)) <= 2
