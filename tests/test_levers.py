"""Training levers aimed at acceptance (issue "heads that beat n-gram"): the draft layer started from a
target layer (``head.layer_init``), the objectives (``head.loss``: TV, LK-alpha, LK-lambda, HASS's top-K,
forward + reverse KL), relative tap noise (``head.tap_noise``), dropout (``head.dropout``), the reach mask
of the training-time test (``head.ttt_reach_topk``), the feature regression (``head.feature_loss``), the forward under bf16 autocast (``train.autocast``) and
the lever table of scripts/bench_levers.py."""

from __future__ import annotations

import importlib
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from heads import Eagle3Config, Eagle3Head, MedusaConfig, MedusaHead
from heads.eagle3 import TTTCache
from tests.conftest import make_cfg
from tests.test_heads import HEAD_CFG, tiny_batch, tiny_eagle3, tiny_view
from train.extract import capture
from train.losses import (
    OBJECTIVES,
    counted,
    eagle3_loss,
    feature_error,
    full_argmax,
    hits,
    medusa_loss,
    objective,
    reached,
    shift,
    weights,
    with_tap_noise,
)
from train.target import load_layer_weights, load_target

ROOT = Path(__file__).resolve().parents[1]

# --- head.layer_init


@pytest.mark.parametrize(("model", "not_copied"), [
    ("tiny-llama", []),
    ("tiny-qwen2", ["self_attn.k_proj.bias", "self_attn.q_proj.bias", "self_attn.v_proj.bias"]),
    ("tiny-qwen3", ["self_attn.k_norm.weight", "self_attn.q_norm.weight"]),
])
def test_layer_init_reads_one_target_layer_into_the_draft_layer(model, not_copied):
    """The layer's tensors as the model holds them (GQA, biases, q/k norms, explicit head_dim); q/k/v on
    the hidden-state half, zeros on the embedding half; the norms mapped; what the head lacks reported."""
    cfg = make_cfg([f"model={model}"])
    target = load_target(cfg)
    n = target.config.num_hidden_layers
    layer = load_layer_weights(cfg, -3)
    assert layer.keys() == target.model.layers[n - 3].state_dict().keys()
    assert all(torch.equal(v, target.model.layers[n - 3].state_dict()[k]) for k, v in layer.items())
    head = tiny_eagle3(target)
    H = target.config.hidden_size
    assert head.init_layer_from_target(layer) == not_copied
    mid = head.midlayer
    for p in "qkv":
        weight = getattr(mid.self_attn, f"{p}_proj").weight
        assert torch.equal(weight[:, H:], layer[f"self_attn.{p}_proj.weight"])
        assert torch.count_nonzero(weight[:, :H]) == 0
    assert torch.equal(mid.self_attn.o_proj.weight, layer["self_attn.o_proj.weight"])
    assert all(torch.equal(getattr(mid.mlp, f"{p}_proj").weight, layer[f"mlp.{p}_proj.weight"]) for p in ("gate", "up", "down"))
    assert torch.equal(mid.hidden_norm.weight, layer["input_layernorm.weight"])
    assert torch.equal(mid.post_attention_layernorm.weight, layer["post_attention_layernorm.weight"])
    assert torch.equal(mid.input_layernorm.weight, torch.ones(H))  # the token path's own


def test_layer_init_with_last_tap_fc_starts_as_the_target_layer():
    """fc_init=last_tap + layer_init = the layer the last tap enters: the first draft step outputs the
    target's next residual state, whatever the token (plain RoPE: Llama without rope scaling)."""
    cfg = make_cfg(["model=tiny-llama", "model.rope_scaling=null"])
    target = load_target(cfg)
    head = tiny_eagle3(target).double()
    last = head.config.aux_layers[-1]
    assert head.init_layer_from_target(load_layer_weights(cfg, last, torch.float64)) == []
    head.init_fc_last_tap()
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        states = capture(target.double(), ids, [*head.config.aux_layers, last + 1])
        out = head(head.project(states[:, :, :3].flatten(2)), torch.randint(0, 256, (2, 12)),
                   torch.arange(12)[None].expand(2, 12), TTTCache())
    torch.testing.assert_close(out, states[:, :, 3], rtol=1e-9, atol=1e-9)


def test_layer_init_embed_copy_gives_the_token_the_layers_own_qkv():
    """``embed_half="copy"``: q/k/v read the normed next-token embedding with the layer's own weights (and its
    input norm), so the first step depends on the token from the start, where "zero" ignores it; anything else
    is refused."""
    cfg = make_cfg(["model=tiny-llama"])
    target = load_target(cfg)
    layer = load_layer_weights(cfg, -3)
    H = target.config.hidden_size
    outs = {}
    for mode in ("zero", "copy"):
        head = tiny_eagle3(target)
        head.init_layer_from_target(layer, mode)
        head.init_fc_last_tap()
        mid = head.midlayer
        if mode == "copy":
            for p in "qkv":
                weight = getattr(mid.self_attn, f"{p}_proj").weight
                assert torch.equal(weight[:, :H], layer[f"self_attn.{p}_proj.weight"])
                assert torch.equal(weight[:, H:], layer[f"self_attn.{p}_proj.weight"])
            assert torch.equal(mid.input_layernorm.weight, layer["input_layernorm.weight"])
        torch.manual_seed(0)
        feats, pos = torch.randn(1, 6, H), torch.arange(6)[None]
        with torch.no_grad():
            outs[mode] = [head(feats, torch.full((1, 6), t), pos, TTTCache()) for t in (3, 7)]
    assert torch.equal(*outs["zero"])
    assert not torch.allclose(*outs["copy"])
    with pytest.raises(ValueError, match="head.layer_init_embed must be zero or copy"):
        tiny_eagle3(target).init_layer_from_target(layer, "random")


def test_layer_init_refuses_what_does_not_fit():
    cfg = make_cfg(["model=tiny-llama"])
    target = load_target(cfg)
    with pytest.raises(ValueError, match="head.layer_init=8: the target has 8 decoder layers"):
        load_layer_weights(cfg, 8)
    narrow = OmegaConf.merge(HEAD_CFG, {"intermediate_size": 32})
    head = Eagle3Head(Eagle3Config.from_target(target.config, narrow, 48))
    with pytest.raises(ValueError, match=r"mlp.gate_proj.weight \(128, 64\) vs \(32, 64\)"):
        head.init_layer_from_target(load_layer_weights(cfg, 0))


# --- head.loss


def test_objectives_are_total_variation_and_the_lk_losses():
    torch.manual_seed(0)
    logits = (2 * torch.randn(1, 5, 11, dtype=torch.float64)).requires_grad_()  # the draft's, 5 positions
    log_q, log_p = torch.log_softmax(logits, -1), torch.log_softmax(2 * torch.randn(1, 5, 11, dtype=torch.float64), -1)
    p, q, w = log_p.exp(), log_q.exp(), torch.ones(1, 5, dtype=torch.float64)
    alpha = torch.minimum(p, q).sum(-1)
    torch.testing.assert_close((q * (p / q).clamp(max=1)).sum(-1), alpha)  # E_{x~q} min(1, p/q): acceptance
    tv = 0.5 * (p - q).abs().sum(-1)
    torch.testing.assert_close(objective("tv", log_q, log_p, w), tv.mean())
    torch.testing.assert_close(1 - alpha, tv)
    torch.testing.assert_close(objective("kl", log_q, log_p, w), -(p * log_q).sum(-1).mean())
    # kl_topk: the soft cross-entropy plus its terms over the target's 10 likeliest of 11 tokens (HASS)
    top = p.argsort(-1, descending=True)[..., :10]
    torch.testing.assert_close(objective("kl_topk", log_q, log_p, w),
                               -(p * log_q).sum(-1).mean() - (p.gather(-1, top) * log_q.gather(-1, top)).sum(-1).mean())
    # kl_mix: the forward and reverse KL, halves
    torch.testing.assert_close(objective("kl_mix", log_q, log_p, w),
                               0.5 * ((p * (log_p - log_q)).sum(-1) + (q * (log_q - log_p)).sum(-1)).mean())
    torch.testing.assert_close(objective("lk_alpha", log_q, log_p, w), -alpha.log().mean())
    lam = math.exp(-3.0 * alpha.mean().item())  # a constant: alpha in the blend weight is not differentiated
    reference = lam * (p * (log_p - log_q)).sum(-1).mean() + (1 - lam) * tv.mean()
    lk = objective("lk_lambda", log_q, log_p, w)
    torch.testing.assert_close(lk, reference)
    torch.testing.assert_close(*(torch.autograd.grad(x, logits, retain_graph=True)[0] for x in (lk, reference)))
    # LK-alpha's gradient is TV's scaled by 1 / alpha (one position: its weight alone)
    one = torch.tensor([[1.0, 0, 0, 0, 0]], dtype=torch.float64)
    g_alpha = torch.autograd.grad(objective("lk_alpha", log_q, log_p, one), logits, retain_graph=True)[0]
    g_tv = torch.autograd.grad(objective("tv", log_q, log_p, one), logits, retain_graph=True)[0]
    torch.testing.assert_close(g_alpha, g_tv / alpha[0, 0])
    # the draft equal to the target: acceptance 1, nothing left to learn
    for kind in ("kl_mix", "tv", "lk_alpha", "lk_lambda"):
        assert abs(objective(kind, log_p, log_p, w).item()) < 1e-12
    with pytest.raises(ValueError, match="head.loss must be one of"):
        objective("rkl", log_q, log_p, w)


def test_positions_outside_the_draft_vocabulary_count_as_misses(tiny_llama_cfg):
    """The loss leaves them out; the accuracy counts them, as misses: a smaller vocabulary is not scored on
    easier positions only."""
    from dataclasses import replace

    from train.loop import summarise

    target = load_target(tiny_llama_cfg)
    head = tiny_eagle3(target, dv=target.config.vocab_size)
    ids, states, lengths, mask = tiny_batch(target, [*head.config.aux_layers, target.config.num_hidden_layers])
    view, taps = tiny_view(target, head, states), states[:, :, :-1].flatten(2)
    view.argmax = shift(ids, 1)  # the data's next token is the target's argmax ...
    head.logits = lambda h: 50.0 * F.one_hot(shift(ids, 2), target.config.vocab_size).float()  # ... and the draft's
    full = eagle3_loss(head, taps, ids, lengths, mask, view, 1, 0.8, "all")
    outside = view.in_vocab.clone()
    outside[:, 1::2] = False
    part_view = replace(view, in_vocab=outside)
    part = eagle3_loss(head, taps, ids, lengths, mask, part_view, 1, 0.8, "all")
    assert torch.equal(part.weight[0], full.weight[0])  # the same positions counted
    assert summarise(full.correct, full.weight)["acc_0"] == 1.0
    assert summarise(part.correct, part.weight)["acc_0"] == pytest.approx(0.5, abs=0.03)
    assert torch.equal(weights(part_view.in_vocab, lengths, mask, 0, "all").bool(), part.weight[0].bool() & shift(outside, 1, False))


def acceptance(head, taps, ids, view, lengths, mask) -> float:
    """Mean acceptance probability sum_v min(p_v, q_v) of the first draft step over its weighted positions."""
    with torch.no_grad():
        log_q = torch.log_softmax(head.logits(head(head.project(taps), shift(ids, 1),
                                                   torch.arange(ids.shape[1])[None], TTTCache())), -1)
    w = weights(view.in_vocab, lengths, mask, 0, "all")
    alpha = torch.minimum(log_q.exp(), shift(view.log_p, 1).exp()).sum(-1)
    return ((alpha * w).sum() / w.sum()).item()


def tiny_head_and_batch(target, head_type: str) -> tuple[torch.nn.Module, tuple]:
    """A tiny random head of ``head_type`` over the target's whole vocabulary, and :func:`tiny_batch`'s ids,
    states, lengths and mask with the states it reads (EAGLE-3: its taps, then the last layer; Medusa: the last)."""
    V, n = target.config.vocab_size, target.config.num_hidden_layers
    if head_type == "eagle3":
        head = tiny_eagle3(target, dv=V)
        return head, tiny_batch(target, [*head.config.aux_layers, n])
    head = MedusaHead(MedusaConfig.from_target(target.config, HEAD_CFG, V))
    head.set_vocab(torch.zeros(V, dtype=torch.long), torch.ones(V, dtype=torch.bool))
    return head, tiny_batch(target, [n])


@pytest.mark.parametrize("kind", OBJECTIVES)
def test_every_objective_raises_acceptance(tiny_llama_cfg, kind):
    target = load_target(tiny_llama_cfg)
    head = tiny_eagle3(target, dv=target.config.vocab_size)
    ids, states, lengths, mask = tiny_batch(target, [*head.config.aux_layers, target.config.num_hidden_layers])
    view, taps = tiny_view(target, head, states), states[:, :, :-1].flatten(2)
    before = acceptance(head, taps, ids, view, lengths, mask)
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(25):
        stats = eagle3_loss(head, taps, ids, lengths, mask, view, 2, 0.8, "all", kind)
        opt.zero_grad()
        stats.loss.backward()
        opt.step()
    assert acceptance(head, taps, ids, view, lengths, mask) > before + 0.1


def test_medusa_takes_the_acceptance_objectives(tiny_llama_cfg):
    target = load_target(tiny_llama_cfg)
    head, (ids, states, lengths, mask) = tiny_head_and_batch(target, "medusa")
    view = tiny_view(target, head, states)
    losses = {}
    for kind in OBJECTIVES:
        head.zero_grad(set_to_none=True)
        stats = medusa_loss(head, states[:, :, -1], ids, lengths, mask, view, 0.8, "all", kind)
        stats.loss.backward()
        assert stats.loss.isfinite() and head.blocks[0].layers[0].weight.grad.abs().sum() > 0, kind
        losses[kind] = round(stats.loss.item(), 6)
    assert len(set(losses.values())) == len(OBJECTIVES), losses  # each objective its own (not kl six times)


# --- head.tap_noise


def test_tap_noise_is_relative_to_each_taps_rms():
    torch.manual_seed(0)
    scale = torch.tensor([0.1, 1.0, 100.0]).repeat_interleave(256)  # three taps of very different scale
    taps = torch.randn(64, 32, 3 * 256) * scale
    noise = (with_tap_noise(taps, 0.05, 3) - taps).unflatten(-1, (3, 256))
    rms = taps.unflatten(-1, (3, 256)).pow(2).mean(-1, keepdim=True).sqrt()
    ratio = (noise / rms).std(dim=(0, 1, 3))
    torch.testing.assert_close(ratio, torch.full((3,), 0.05), rtol=0.02, atol=0)


def test_tap_noise_only_while_training(tiny_llama_cfg):
    target = load_target(tiny_llama_cfg)
    head = tiny_eagle3(target, dv=target.config.vocab_size)
    ids, states, lengths, mask = tiny_batch(target, [*head.config.aux_layers, target.config.num_hidden_layers])
    view, taps = tiny_view(target, head, states), states[:, :, :-1].flatten(2)

    def loss(noise: float) -> float:
        with torch.no_grad():
            return eagle3_loss(head, taps, ids, lengths, mask, view, 1, 0.8, "all", "kl", noise).loss.item()

    rng = torch.get_rng_state()
    clean = loss(0.0)
    assert torch.equal(torch.get_rng_state(), rng)  # no noise drawn when off: runs stay reproducible
    assert loss(0.1) != clean
    head.eval()
    assert loss(0.1) == clean


# --- head.dropout


@pytest.mark.parametrize("head_type", ["eagle3", "medusa"])
def test_dropout_only_while_training(tiny_llama_cfg, head_type):
    """Dropout on the head's input (EAGLE-3: the taps; Medusa: the last hidden state) changes the loss while
    training, never in eval mode, and draws nothing when off."""
    target = load_target(tiny_llama_cfg)
    head, (ids, states, lengths, mask) = tiny_head_and_batch(target, head_type)
    view = tiny_view(target, head, states)

    def loss(p: float) -> float:
        with torch.no_grad():
            if head_type == "eagle3":
                taps = states[:, :, :-1].flatten(2)
                return eagle3_loss(head, taps, ids, lengths, mask, view, 1, 0.8, "all", "kl", 0.0, p).loss.item()
            return medusa_loss(head, states[:, :, -1], ids, lengths, mask, view, 0.8, "all", "kl", p).loss.item()

    rng = torch.get_rng_state()
    clean = loss(0.0)
    assert torch.equal(torch.get_rng_state(), rng)
    assert loss(0.3) != clean
    head.eval()
    assert loss(0.3) == clean


# --- head.ttt_reach_topk


def test_reach_mask_trains_later_steps_only_where_a_decoder_gets_to(tiny_llama_cfg):
    """With ``reach_topk`` K, step 1's loss is its objective over the rows where step 0's top K held the
    target's next token (the same two steps unrolled by hand); step 0's loss and every accuracy are unchanged;
    K = 1 is :func:`hits`."""
    target = load_target(tiny_llama_cfg)
    V = target.config.vocab_size
    head = tiny_eagle3(target, dv=V)
    ids, states, lengths, mask = tiny_batch(target, [*head.config.aux_layers, target.config.num_hidden_layers])
    view, taps = tiny_view(target, head, states), states[:, :, :-1].flatten(2)
    K = V // 2
    with torch.no_grad():
        cache, pos = TTTCache(), torch.arange(ids.shape[1])[None].expand(len(ids), -1)
        h0 = head(head.project(taps), shift(ids, 1), pos, cache)
        log_q0 = torch.log_softmax(head.logits(h0), -1)
        log_q1 = torch.log_softmax(head.logits(head(h0, shift(ids, 2), pos + 1, cache)), -1)
        reach = reached(log_q0, view, 0, K)
        w1 = weights(view.in_vocab, lengths, mask, 1, "all")
        assert 0.2 < (reach * w1).sum() / w1.sum() < 0.8   # the mask keeps some counted rows, not all
        assert torch.equal(reached(log_q0, view, 0, 1), hits(log_q0, view, 0))
        every = eagle3_loss(head, taps, ids, lengths, mask, view, 2, 0.8, "all", "kl")
        masked = eagle3_loss(head, taps, ids, lengths, mask, view, 2, 0.8, "all", "kl", reach_topk=K)
    assert masked.losses[0].item() == every.losses[0].item()
    assert masked.losses[1].item() == pytest.approx(objective("kl", log_q1, shift(view.log_p, 2), w1 * reach).item(), rel=1e-5)
    assert masked.losses[1].item() != pytest.approx(every.losses[1].item(), rel=1e-3)
    assert all(torch.equal(a, b) for a, b in zip(masked.correct + masked.weight, every.correct + every.weight, strict=True))


# --- head.feature_loss


def test_feature_loss_adds_each_steps_feature_error_against_the_target_state_it_stands_for(tiny_llama_cfg):
    """Step k's loss gains ``feature_loss`` x the counted rows' mean relative squared error of the normed
    feature at row t against the target's final state at t + 1 + k (two steps unrolled by hand); the gradient
    reaches the layer; at 0 nothing changes; the accuracies never do."""
    target = load_target(tiny_llama_cfg)
    head = tiny_eagle3(target)
    ids, states, lengths, mask = tiny_batch(target, [*head.config.aux_layers, target.config.num_hidden_layers])
    view, taps, last = tiny_view(target, head, states), states[:, :, :-1].flatten(2), states[:, :, -1]
    with torch.no_grad():
        cache, pos = TTTCache(), torch.arange(ids.shape[1])[None].expand(len(ids), -1)
        h0 = head(head.project(taps), shift(ids, 1), pos, cache)
        h1 = head(h0, shift(ids, 2), pos + 1, cache)
        plain = eagle3_loss(head, taps, ids, lengths, mask, view, 2, 0.8, "all", "kl", last=last)
        both = eagle3_loss(head, taps, ids, lengths, mask, view, 2, 0.8, "all", "kl", feature_loss=0.5, last=last)
    for k, h in enumerate([h0, h1]):
        c = counted(lengths, mask, k, "all").float()
        err = ((head.norm(h) - shift(last, 1 + k)).pow(2).sum(-1) / shift(last, 1 + k).pow(2).sum(-1).clamp(min=1e-6))
        assert torch.allclose(feature_error(head.norm(h), shift(last, 1 + k)), err)
        expected = plain.losses[k].item() + 0.5 * ((err * c).sum() / c.sum()).item()
        assert both.losses[k].item() == pytest.approx(expected, rel=1e-5)
        assert both.losses[k] > plain.losses[k] + 1e-3
    assert all(torch.equal(a, b) for a, b in zip(both.correct + both.weight, plain.correct + plain.weight, strict=True))
    head.zero_grad()
    eagle3_loss(head, taps, ids, lengths, mask, view, 2, 0.8, "all", "kl", feature_loss=0.0, last=last).loss.backward()
    g0 = head.midlayer.mlp.down_proj.weight.grad.clone()
    head.zero_grad()
    eagle3_loss(head, taps, ids, lengths, mask, view, 2, 0.8, "all", "kl", feature_loss=0.5, last=last).loss.backward()
    assert not torch.allclose(head.midlayer.mlp.down_proj.weight.grad, g0)


# --- train.autocast


@pytest.mark.parametrize("head_type", ["eagle3", "medusa"])
def test_autocast_runs_the_heads_forward_in_bf16_and_keeps_fp32_weights(tiny_llama_cfg, head_type, monkeypatch):
    """``train.autocast=bfloat16``: the head's layers compute in bf16 (the loss moves by bf16 rounding only),
    its weights and their gradients stay float32, and the target's distribution it learns is the same."""
    import train.loop
    from train.loop import compute

    views, real_view = [], train.loop.target_view

    def spy_view(*args):  # whether autocast was on where the target's distribution was computed, and it
        views.append((torch.is_autocast_enabled(args[0].device.type), real_view(*args)))
        return views[-1][1]

    monkeypatch.setattr(train.loop, "target_view", spy_view)
    cfg = make_cfg(["model=tiny-llama", f"head={head_type}"])
    target = load_target(tiny_llama_cfg)
    head, (ids, states, lengths, mask) = tiny_head_and_batch(target, head_type)
    lm_head = target.get_output_embeddings().weight.detach()
    batch = {"input_ids": ids, "loss_mask": mask, "lengths": lengths, "states": states,
             "argmax": full_argmax(states[:, :, -1], lm_head)}
    dtypes = []
    first = next(m for m in head.modules() if isinstance(m, torch.nn.Linear))
    first.register_forward_hook(lambda m, i, o: dtypes.append(o.dtype))

    def loss(autocast: str | None) -> tuple[float, list[torch.Tensor]]:
        head.zero_grad()
        stats = compute(head, head_type, batch, lm_head[head.draft_ids()], cfg, "all", 2, autocast)
        stats.loss.backward()
        return stats.loss.item(), [p.grad for p in head.parameters() if p.requires_grad]

    exact, grads = loss(None)
    assert set(dtypes) == {torch.float32}
    dtypes.clear()
    mixed, mixed_grads = loss("bfloat16")
    assert set(dtypes) == {torch.bfloat16}
    assert mixed != exact and mixed == pytest.approx(exact, rel=2e-2)
    assert all(p.dtype == torch.float32 for p in head.parameters())
    assert all(g.dtype == torch.float32 and g.abs().sum() > 0 for g in mixed_grads)
    cos = F.cosine_similarity(torch.cat([g.flatten() for g in grads]), torch.cat([g.flatten() for g in mixed_grads]), 0)
    assert cos > 0.99
    (exact_autocast, exact_view), (mixed_autocast, mixed_view) = views  # the target's side: outside autocast, equal
    assert not exact_autocast and not mixed_autocast and mixed_view.log_p.dtype == torch.float32
    assert torch.equal(exact_view.log_p, mixed_view.log_p)


# --- train.ema


def test_average_follows_the_weights_and_is_swapped_in_only_inside_the_block():
    """``train.ema``: after each step the float32 average moves towards the weights by 1 - min(decay,
    (1 + t) / (10 + t)); inside ``swapped_in`` the model holds it, after it its own weights again, exactly."""
    from train.loop import Average

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3)).to(torch.bfloat16)
    model[1].bias.requires_grad_(False)
    average = Average(model, decay=0.6)
    expected = [p.detach().float().clone() for p in model.parameters() if p.requires_grad]
    assert len(average.shadow) == 3 and all(a.dtype == torch.float32 for a in average.shadow)
    for step in (1, 2, 3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        average.update(step)
        decay = min(0.6, (1 + step) / (10 + step))  # 2/11, 3/12, 0.6
        expected = [decay * e + (1 - decay) * p.detach().float()
                    for e, p in zip(expected, (p for p in model.parameters() if p.requires_grad), strict=True)]
    torch.testing.assert_close(average.shadow, expected)
    own = [p.detach().clone() for p in model.parameters()]
    with average.swapped_in():
        inside = [p.detach().clone() for p in model.parameters() if p.requires_grad]
        assert model[1].bias.equal(own[3])  # a frozen tensor is not averaged
    torch.testing.assert_close(inside, [e.to(torch.bfloat16) for e in expected])
    assert not inside[0].equal(own[0])
    assert all(p.equal(o) for p, o in zip(model.parameters(), own, strict=True))


# --- scripts/bench_levers.py: one row per lever


@pytest.mark.parametrize("head", ["eagle3", "medusa"])
def test_every_lever_row_composes_and_changes_its_key(head, monkeypatch):
    """Every default row of the lever table is a valid override (no typo'd key) that changes the config."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    variants = importlib.import_module("bench_levers").VARIANTS[head]
    base = make_cfg(["model=tiny-llama", f"head={head}"])
    assert variants[0] == "default:"
    for spec in variants[1:]:
        overrides = spec.partition(":")[2].split(",")
        cfg = make_cfg(["model=tiny-llama", f"head={head}", *overrides])
        for key in (o.split("=")[0] for o in overrides):
            assert OmegaConf.select(cfg, key) != OmegaConf.select(base, key), spec
