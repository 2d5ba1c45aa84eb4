"""Medusa heads (names = vLLM's Medusa checkpoint keys).

Head k (0-based) reads the target's last hidden state AFTER its final norm at position t and predicts
the token at t + 2 + k (the target itself predicts t + 1):
    blocks.{k}: x <- x + SiLU(W_l x + b_l) for each layer l (W zero-initialised: starts as identity)
    lm_heads.{k}: logits over the draft vocabulary (draft id i -> target id i + d2t[i])
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from heads.frozen import TargetWeights
from heads.vocab import DraftVocab


@dataclass
class MedusaConfig:
    hidden_size: int
    vocab_size: int              # the target's
    draft_vocab_size: int
    num_heads: int = 3
    num_layers: int = 1

    @classmethod
    def from_target(cls, tcfg, head_cfg, draft_vocab_size: int) -> MedusaConfig:
        tcfg = getattr(tcfg, "text_config", tcfg)
        return cls(hidden_size=tcfg.hidden_size, vocab_size=tcfg.vocab_size, draft_vocab_size=draft_vocab_size,
                   num_heads=head_cfg.num_heads, num_layers=head_cfg.num_layers)

    def to_dict(self) -> dict:
        return asdict(self)


class ResidualBlock(nn.Module):
    def __init__(self, hidden_size: int, num_layers: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden_size, hidden_size, bias=True) for _ in range(num_layers))
        for layer in self.layers:
            nn.init.zeros_(layer.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + F.silu(layer(x))
        return x


class MedusaHead(DraftVocab):
    def __init__(self, cfg: MedusaConfig):
        super().__init__(cfg.draft_vocab_size, cfg.vocab_size)
        self.config = cfg
        self.blocks = nn.ModuleList(ResidualBlock(cfg.hidden_size, cfg.num_layers) for _ in range(cfg.num_heads))
        self.lm_heads = nn.ModuleList(
            nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False) for _ in range(cfg.num_heads)
        )

    @torch.no_grad()
    def init_from_target(self, target, from_lm_head: bool = True) -> None:
        """Each lm_head starts as the target's head restricted to the draft vocabulary."""
        if from_lm_head:
            lm_head = TargetWeights.of(target).lm_head
            rows = lm_head[self.draft_ids().to(lm_head.device)]
            for head in self.lm_heads:
                head.weight.copy_(rows)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] post-norm target hidden states -> [num_heads, ..., draft_vocab] logits."""
        return torch.stack([lm(block(hidden)) for block, lm in zip(self.blocks, self.lm_heads, strict=True)])

    def trained_state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.state_dict())
