"""The reduced draft vocabulary every head carries: buffers ``d2t`` (int64 [draft_vocab], draft id i is
target id i + d2t[i]) and ``t2d`` (bool [vocab], True where a target id is in the draft vocabulary)."""

from __future__ import annotations

import torch
from torch import nn


class DraftVocab(nn.Module):
    def __init__(self, draft_vocab_size: int, vocab_size: int):
        super().__init__()
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(vocab_size, dtype=torch.bool))

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def draft_ids(self) -> torch.Tensor:
        """Target ids of the draft vocabulary, ascending."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t
