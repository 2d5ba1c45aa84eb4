"""How big a draft tree pays off on the machine at hand.

speedup(T) ~= tau(T) * t_verify(1) / (t_verify(T) + t_draft(T)): the target's verify time grows with the
number of tree tokens T (slowly on a GPU, quickly on a CPU) while the accepted length tau(T) saturates.
All three are measured: the verify time with the decoder's own verify pass on a real context, the draft
time with the drafter itself, tau(T) from greedy decodes with the largest tree (EAGLE trees are
returned in score order, and Medusa's default tree adds its likeliest paths first, so the tree of T tokens
is the first T - 1 nodes of a bigger one).
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

import torch

from eval.decoder import Generation, SpecDecoder
from eval.drafters import Drafter
from eval.sampling import Sampling
from eval.tree import DraftTree

if TYPE_CHECKING:
    from tqdm import tqdm

SIZES = (1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64)


@torch.inference_mode()
def measure_verify_time(decoder: SpecDecoder, context: list[int], sizes: tuple[int, ...] = SIZES, repeats: int = 4,
                        hidden_layers: list[int] | None = None, bar: tqdm | None = None) -> dict[int, float]:
    """Ms of one verify pass over ``T`` tree tokens (root + a chain of T - 1 nodes, taken from ``context``
    itself) after ``context`` is cached, for each T in ``sizes``: the median 1-token pass times T's median
    cost relative to it. Each T is timed right beside a 1-token pass (the pair's order and the sizes' order
    reversed every round, after a warm-up round), so the two see the same machine: a VM whose speed swings
    within seconds moves both (on the Intel VM, four measurements each way: unpaired medians of 4 rounds put a
    16-token pass at 1.0-1.6x one token, paired ones at 1.1-1.2x). ``bar`` (a progress bar) advances by one
    per size, in the last round."""
    layers = hidden_layers or []
    cache, _, _ = decoder.prefill(context[:-1], layers)
    past = cache.get_seq_length()
    trees = {size: DraftTree.chain(context[:size - 1]) for size in {1, *sizes}}

    def timed(size: int) -> float:
        start = decoder.clock()
        decoder.verify(cache, context[-1], trees[size], layers)
        elapsed = decoder.clock() - start
        cache.crop(-(cache.get_seq_length() - past))
        return elapsed

    ones: list[float] = []
    ratios: dict[int, list[float]] = {size: [] for size in sizes}
    for round_ in range(repeats + 1):
        forward = round_ % 2 == 0
        for size in sizes if forward else sizes[::-1]:
            if forward:
                one, other = timed(1), timed(size)
            else:
                other, one = timed(size), timed(1)
            if round_:   # the first round warms up
                ones.append(one)
                ratios[size].append(other / one)
            if bar is not None and round_ == repeats:
                bar.update()
    return {size: 1e3 * statistics.median(ones) * (1.0 if size == 1 else statistics.median(ratios[size]))
            for size in sizes}


@torch.inference_mode()
def draft_times(decoder: SpecDecoder, drafter: Drafter, context: list[int], hidden, new_rows: int = 3,
                repeats: int = 5) -> dict[str, float]:
    """Median ms of a drafter's ``update`` with ``new_rows`` freshly cached rows (what a cycle that
    accepted ``new_rows - 1`` tokens commits) and of its ``propose`` (greedy). ``hidden``: the target's
    hidden_states over ``context[:-1]`` (``decoder.prefill``) with the drafter's layers."""
    layers = drafter.hidden_layers
    old = {layer: hidden[layer][:, :-new_rows] for layer in layers}
    new = {layer: hidden[layer][:, -new_rows:] for layer in layers}
    times: dict[str, list[float]] = {"update": [], "propose": []}
    for _ in range(repeats + 1):   # the first round warms up
        drafter.reset(Sampling())
        drafter.update(context[:-new_rows], old)
        start = decoder.clock()
        drafter.update(context, new)
        times["update"].append(decoder.clock() - start)
        start = decoder.clock()
        drafter.propose(context)
        times["propose"].append(decoder.clock() - start)
    return {k: 1e3 * statistics.median(v[1:]) for k, v in times.items()}


def acceptance_curve(generations: list[Generation], sizes: tuple[int, ...],
                     order: list[int] | None = None) -> dict[int, float]:
    """Expected tokens per cycle (accepted + bonus) had the tree held only ``T`` tokens, for T in
    ``sizes``, from greedy generations with a larger tree whose nodes entered it in ``order`` (node -> its
    1-based place; default: the node's own number, as in EAGLE's score-ordered tree): a path's nodes placed
    below T stay (a parent is placed before its children, so they are the path's first nodes)."""
    paths = [p for g in generations for p in g.paths]
    if not paths:
        return {size: 1.0 for size in sizes}
    place = (lambda node: node) if order is None else order.__getitem__
    return {size: 1.0 + sum(sum(place(node) < size for node in p) for p in paths) / len(paths) for size in sizes}


def monotone(curve: dict[int, float]) -> dict[int, float]:
    """The least-squares non-decreasing fit of a cost per tree size (pool adjacent violators): more tree tokens
    never take less time, so a size timed below a smaller one is noise (the AMD VM: 12 tokens 113 ms, 16 tokens
    109). Pooled, a noisy flat stretch (a GPU's verify pass below its knee) stays flat and the larger tree's tau
    decides, not which size the noise favoured."""
    blocks: list[tuple[float, int]] = []   # (mean, sizes pooled)
    for size in sorted(curve):
        mean, n = curve[size], 1
        while blocks and blocks[-1][0] > mean:
            prev, m = blocks.pop()
            mean, n = (prev * m + mean * n) / (m + n), m + n
        blocks.append((mean, n))
    return dict(zip(sorted(curve), (mean for mean, n in blocks for _ in range(n)), strict=True))


def choose_total_tokens(verify_ms: dict[int, float], tau: dict[int, float],
                        draft_ms: dict[int, float]) -> tuple[int, dict[int, float]]:
    """The tree size (2 tokens or more: the root alone is plain decoding) with the best predicted speedup
    tau(T) * verify(1) / (verify(T) + draft(T)), and the prediction for every size; the trees' verify and draft
    times fitted :func:`monotone` first (verify(1), the median of every paired pass, is kept as measured: a
    tree's fitted time stays at or above it)."""
    sizes = sorted(t for t in set(verify_ms) & set(tau) & set(draft_ms) if t >= 2)
    one = verify_ms[1]
    verify = {t: max(ms, one) for t, ms in monotone({t: verify_ms[t] for t in sizes}).items()}
    draft = monotone({t: draft_ms[t] for t in sizes})
    predicted = {t: tau[t] * one / (verify[t] + draft[t]) for t in sizes}
    return max(predicted, key=predicted.get), predicted
