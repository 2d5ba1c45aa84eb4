"""The frozen target tensors a head starts from and decodes with: nothing else of the target.

A head needs the target's input embedding (EAGLE-3 embeds tokens with it), its lm_head (the rows of the
draft vocabulary start the head's own lm_head and give the training targets) and its final norm. The
train and export stages read just these from the checkpoint files (``train.target.load_weights``): an
8B target is ~16 GB, these three ~2 GB. Code holding a whole model wraps it with :meth:`TargetWeights.of`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class TargetWeights:
    config: Any                 # the target's transformers config
    embed: torch.Tensor         # [vocab_size, H] input embedding
    lm_head: torch.Tensor       # [vocab_size, H] output embedding (the same tensor when tied)
    norm: torch.Tensor          # [H] final norm weight

    @classmethod
    def of(cls, target) -> TargetWeights:
        """The tensors of a loaded model (a ``TargetWeights`` is returned as it is)."""
        if isinstance(target, TargetWeights):
            return target
        return cls(target.config, target.get_input_embeddings().weight.detach(),
                   target.get_output_embeddings().weight.detach(), target.get_decoder().norm.weight.detach())

    @property
    def text_config(self):
        return getattr(self.config, "text_config", self.config)
