"""Reduced draft vocabulary: the target ids a draft head can propose.

Ranked by count at loss-mask (assistant) positions, ties broken by count over all positions, then by
id; the top ``size`` ids are kept and sorted ascending. ``d2t[i] = kept[i] - i`` (int64 offsets: draft
id i is target id i + d2t[i]) and ``t2d`` is a bool mask over the target vocabulary.
"""

from __future__ import annotations

import torch


def build_vocab(masked_counts: torch.Tensor, all_counts: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) for a draft vocabulary of ``size`` ids (at most the target's vocabulary)."""
    vocab = masked_counts.numel()
    size = min(size, vocab)
    # Lexicographic rank: masked count, then all-position count, then lower id first (stable sorts,
    # least significant key first; vectorised: 150k-token vocabularies).
    order = torch.argsort(all_counts, descending=True, stable=True)
    order = order[torch.argsort(masked_counts[order], descending=True, stable=True)]
    kept = order[:size].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[kept] = True
    return kept - torch.arange(size), t2d


def coverage(counts: torch.Tensor, t2d: torch.Tensor) -> float:
    """Share of the counted tokens that the draft vocabulary contains."""
    total = counts.sum().item()
    return counts[t2d].sum().item() / total if total else 0.0


def coverage_curve(train_counts: torch.Tensor, eval_counts: torch.Tensor, all_counts: torch.Tensor,
                   sizes=(1024, 2048, 4096, 8192, 16384, 32768)) -> dict[int, float]:
    """Held-out coverage (``eval_counts``) of vocabularies of several sizes built from ``train_counts``."""
    return {s: round(coverage(eval_counts, build_vocab(train_counts, all_counts, s)[1]), 5)
            for s in sizes if s < train_counts.numel()}
