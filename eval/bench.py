"""Random-weight heads for the decode benchmark (scripts/bench_decode.py) and the tests."""

from __future__ import annotations

import torch
from torch import nn

from heads.io import KINDS, build_head


def random_head(kind: str, target, head_cfg, kept: torch.Tensor | None = None, seed: int = 0) -> nn.Module:
    """A head with random weights, started from the target as training starts (embedding, lm_head rows),
    over the draft vocabulary ``kept`` (sorted target ids; default: the first ``head_cfg.draft_vocab_size``)."""
    vocab = target.config.vocab_size
    if kept is None:
        kept = torch.arange(min(head_cfg.draft_vocab_size, vocab))
    torch.manual_seed(seed)
    head = build_head(kind, KINDS[kind][0].from_target(target.config, head_cfg, len(kept)))
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[kept] = True
    head.set_vocab(kept - torch.arange(len(kept)), t2d)
    head.init_from_target(target)
    return head.to(target.device, target.dtype).eval()
