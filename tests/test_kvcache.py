"""The KV cache in preallocated buffers (train.kvcache) holds what transformers' DynamicCache holds, through
every operation the decoder and the regeneration use, past its capacity; sliding-window layers are left to
transformers; regeneration with it gives the answers and states of a DynamicCache; continuous batching
(prompts joining a running batch) gives every prompt the answer and states it gets alone."""

from __future__ import annotations

from collections import deque

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM, DynamicCache, Qwen2Config
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

import data.regenerate
from data.regenerate import stream
from tests.conftest import generate
from train.kvcache import BufferLayer, join, kv_cache
from train.target import last_logits_only, load_target


def _same(a: DynamicLayer, b: BufferLayer) -> None:
    assert b.get_seq_length() == a.get_seq_length()
    assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_buffer_layer_follows_a_dynamic_layer():
    """Appends of 5 / 1 / 3 positions from capacity 2 (it grows twice), a crop, in-place writes into the
    kept part (the decoder's accepted tree rows), rows leaving the batch, beams, and appends after each."""
    torch.manual_seed(0)
    ref, buf = DynamicLayer(), BufferLayer(capacity=2)

    def step(n: int, rows: int) -> None:
        k, v = torch.randn(rows, 2, n, 4), torch.randn(rows, 2, n, 4)
        out = buf.update(k, v)
        assert all(torch.equal(x, y) for x, y in zip(ref.update(k, v), out, strict=True))
        _same(ref, buf)

    for n in (5, 1, 3):
        step(n, 3)
    assert buf._k.shape[2] >= 9
    for layer in (ref, buf):
        layer.crop(-2)
        layer.keys[:, :, 5:7] = layer.keys[:, :, [6, 4]]
    _same(ref, buf)
    step(2, 3)
    for layer in (ref, buf):
        layer.batch_select_indices(torch.tensor([2, 0]))
    _same(ref, buf)
    step(1, 2)
    for layer in (ref, buf):
        layer.batch_repeat_interleave(2)
        layer.reorder_cache(torch.tensor([3, 0, 1, 1]))
    _same(ref, buf)
    step(1, 4)
    with pytest.raises(ValueError):
        buf.crop(1)


def test_only_full_attention_layers_get_buffers():
    config = Qwen2Config(num_hidden_layers=4, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                         intermediate_size=64, vocab_size=64, use_sliding_window=True, sliding_window=8,
                         max_window_layers=2)
    kinds = [type(layer) for layer in kv_cache(config, 16).layers]
    want = [BufferLayer if t == "full_attention" else DynamicSlidingWindowLayer for t in config.layer_types]
    assert kinds == want and DynamicSlidingWindowLayer in kinds


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3"])
def test_regeneration_is_the_same_with_a_dynamic_cache(model, monkeypatch, cfg_factory):
    """Batched greedy answers of different lengths (rows leave the batch), their template tails and kept
    states: identical with the buffers and with transformers' DynamicCache."""
    target = load_target(cfg_factory(f"model={model}", "dtype=float32"))
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14, 15]]

    def run() -> list:
        return generate(target, prompts, 12, {3, 4}, 0, layers=[1, 2], tail=lambda row, tokens, hit_eos: [1] * (row + 1))

    mine = run()
    monkeypatch.setattr(data.regenerate, "kv_cache", lambda config, capacity: DynamicCache(config=config))
    theirs = run()
    for a, b in zip(mine, theirs, strict=True):
        assert a.tokens == b.tokens and a.hit_eos == b.hit_eos
        assert torch.equal(a.states, b.states)


PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14, 15], [16] * 9, [17, 18, 19, 20], [21, 22, 23, 24, 25, 26, 27]]


def _continuous(target, monkeypatch, batch_size: int, refill: int, eos: set[int]) -> tuple[dict, list[int]]:
    """Answers of the first five prompts through :func:`stream`, the sixth appended once the first answer is
    done (a conversation's next turn); returns them by index and the batch sizes the joins built."""
    joins: list[int] = []

    def counted(a, mask_a, b, mask_b, room):
        joins.append(mask_a.shape[0] + mask_b.shape[0])
        old = list(a.layers)
        out = join(a, mask_a, b, mask_b, room)
        assert all(layer.keys is None and layer.values is None for layer in old)   # emptied as copied
        return out

    monkeypatch.setattr(data.regenerate, "join", counted)
    queue, got = deque(enumerate(PROMPTS[:5])), {}
    for finished in stream(target, queue, batch_size, refill, 12, eos, 0, layers=[1, 2],
                           tail=lambda job, tokens, hit_eos: [1] * (job % 3)):
        if not got:
            queue.append((5, PROMPTS[5]))
        got.update(finished)
    return got, joins


# EOS ids these twins write at different steps of different prompts (rows end at different steps)
@pytest.mark.parametrize(("model", "eos"), [("tiny-llama", {91, 101, 158, 253}), ("tiny-qwen3", {33, 61, 67, 73})])
def test_continuous_batching_gives_each_prompt_its_answer_alone(model, eos, monkeypatch, cfg_factory):
    """Batches of 3 refilled one row at a time: rows join while others are mid-answer or feeding their template
    tail, at other lengths; each answer, its EOS and its kept states are those of the prompt decoded alone."""
    target = load_target(cfg_factory(f"model={model}", "dtype=float32"))
    got, joins = _continuous(target, monkeypatch, batch_size=3, refill=1, eos=eos)
    assert joins and max(joins) == 3
    assert sorted(got) == list(range(6))
    lengths = set()
    for j, p in enumerate(PROMPTS):
        alone = generate(target, [p], 12, eos, 0, layers=[1, 2], tail=lambda job, tokens, hit_eos, j=j: [1] * (j % 3))[0]
        assert (got[j].tokens, got[j].hit_eos) == (alone.tokens, alone.hit_eos)
        torch.testing.assert_close(got[j].states, alone.states, rtol=1e-5, atol=1e-5)
        lengths.add(len(alone.tokens))
    assert len(lengths) > 2  # rows leave at different steps


def test_sliding_window_targets_fall_back_to_static_batches(monkeypatch):
    """A target with sliding-window layers: its cache does not join, so a new batch starts when the last is
    done; the answers are still each prompt's own."""
    torch.manual_seed(0)
    config = Qwen2Config(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                         intermediate_size=64, vocab_size=64, use_sliding_window=True, sliding_window=4,
                         max_window_layers=1)
    target = AutoModelForCausalLM.from_config(config).eval()
    got, joins = _continuous(target, monkeypatch, batch_size=2, refill=1, eos={3, 4})
    assert not joins and sorted(got) == list(range(6))
    for j, p in enumerate(PROMPTS):
        alone = generate(target, [p], 12, {3, 4}, 0)[0]
        assert (got[j].tokens, got[j].hit_eos) == (alone.tokens, alone.hit_eos)


def test_decode_steps_of_an_unpadded_batch_keep_their_mask_on_the_cpu(cfg_factory, monkeypatch):
    """Rows of one length (no padding): transformers drops a 2D all-ones mask, so SDPA took its grouped-query
    kernel (4x slower a layer on the CPU); the decode steps pass their mask as 4D, each layer's single query
    packed onto the KV heads. Answers and kept states equal the 2D mask's."""
    target = load_target(cfg_factory("model=tiny-llama", "dtype=float32"))
    config = target.config
    assert config.num_key_value_heads < config.num_attention_heads and data.regenerate.masks_single_queries(target)
    prompts, sdpa, calls = [[5, 6, 7], [8, 9, 10], [11, 12, 13]], torch.nn.functional.scaled_dot_product_attention, []

    def spy(query, key, value, attn_mask=None, **kwargs):
        if key.shape[-2] > 3:   # a decode step (past the prompts' 3 positions)
            calls.append((attn_mask is not None, kwargs.get("enable_gqa", False)))
        return sdpa(query, key, value, attn_mask=attn_mask, **kwargs)

    def run() -> list:
        return generate(target, prompts, 6, set(), 0, layers=[1, 2], tail=lambda row, tokens, hit_eos: [1])

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    masked = run()
    assert calls and all(c == (True, False) for c in calls), set(calls)
    calls.clear()
    monkeypatch.setattr(data.regenerate, "masks_single_queries", lambda model: False)
    unmasked = run()
    assert calls and all(c == (False, True) for c in calls), set(calls)   # what the 4D mask avoids
    for a, b in zip(masked, unmasked, strict=True):
        assert a.tokens == b.tokens and len(a.tokens) == 6
        torch.testing.assert_close(a.states, b.states, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tied", [True, False])
def test_last_logits_only_multiplies_the_lm_head_once(tied):
    """A prefill of several rows through ``last_logits_only``: the last position's logits, from one GEMM with the
    lm_head over a contiguous [rows, 1, H]; ``logits_to_keep=1`` makes torch.matmul batch-multiply a per-row copy
    of the frozen lm_head instead (one that requires grad it folds)."""
    torch.manual_seed(0)
    vocab = 96  # no other dimension of the model is 96: a bmm with that last dimension is the lm_head's
    config = Qwen2Config(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                         intermediate_size=64, vocab_size=vocab, tie_word_embeddings=tied)
    target = AutoModelForCausalLM.from_config(config).eval().requires_grad_(False)  # frozen, as load_target leaves it
    ids = torch.randint(0, vocab, (4, 7))

    def run(keep: int | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        seen = []
        hook = target.lm_head.register_forward_pre_hook(lambda _, args: seen.append(args[0]))
        with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            logits = target(ids, logits_to_keep=keep).logits
        hook.remove()
        bmm = sum(e.count for e in prof.key_averages(group_by_input_shape=True)
                  if e.key == "aten::bmm" and e.input_shapes[1][-1] == vocab)
        return logits, seen[0], bmm

    with torch.no_grad():
        want = target(ids).logits[:, -1:]
    logits, h, bmm = run(last_logits_only(ids))
    assert h.shape == (4, 1, 32) and h.is_contiguous() and bmm == 0
    assert logits.shape == (4, 1, vocab) and torch.allclose(logits, want, atol=1e-6)
    assert run(1)[2] > 0, "torch now folds a frozen lm_head's [rows, 1, H] view: last_logits_only can go"
    assert last_logits_only(ids[:, :1]) == 1  # a decode step: the int
