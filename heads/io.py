"""Saving and loading trained heads: ``<dir>/head_config.json`` + ``<dir>/model.safetensors``.

``head_config.json`` = {"type": "eagle3" | "medusa", "config": {...dataclass fields...}}. The tensors are
the head's ``trained_state_dict()`` (EAGLE-3's frozen embedding is not stored: it is the target's and
is copied back from the target on load).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from heads.eagle3 import Eagle3Config, Eagle3Head
from heads.frozen import TargetWeights
from heads.medusa import MedusaConfig, MedusaHead

KINDS = {"eagle3": (Eagle3Config, Eagle3Head), "medusa": (MedusaConfig, MedusaHead)}


def head_type(head: nn.Module) -> str:
    return next(name for name, (_, cls) in KINDS.items() if isinstance(head, cls))


def head_config(kind: str, target_config, head_cfg, draft_vocab_size: int):
    """The head's config for this target: target defaults, overridden by non-null ``head_cfg`` keys."""
    if kind not in KINDS:
        raise ValueError(f"head.type must be one of {sorted(KINDS)}, got {kind!r}")
    return KINDS[kind][0].from_target(target_config, head_cfg, draft_vocab_size)


def build_head(kind: str, config) -> nn.Module:
    return KINDS[kind][1](config)


def save_head(head: nn.Module, path: str | Path) -> None:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in head.trained_state_dict().items()}
    save_file(tensors, str(path / "model.safetensors.tmp"))
    os.replace(path / "model.safetensors.tmp", path / "model.safetensors")
    meta = {"type": head_type(head), "config": head.config.to_dict()}
    (path / "head_config.json").write_text(json.dumps(meta, indent=2))


def load_head_config(path: str | Path) -> tuple[str, Eagle3Config | MedusaConfig]:
    """(type, config) of the head saved in ``path``, without its weights."""
    meta = json.loads((Path(path) / "head_config.json").read_text())
    return meta["type"], KINDS[meta["type"]][0](**meta["config"])


def share_embedding(head: nn.Module, model: nn.Module) -> None:
    """An EAGLE-3 head embeds tokens with the loaded target ``model``'s own (frozen) embedding parameter, not a
    copy of it (1 GB at 8B in bf16); nothing for a Medusa head."""
    if isinstance(head, Eagle3Head):
        head.embed_tokens.weight = model.get_input_embeddings().weight


def load_head(path: str | Path, target: nn.Module | TargetWeights | None = None) -> nn.Module:
    """Rebuild a saved head; with ``target``, an EAGLE-3 head gets the target's embedding: a loaded model's own
    parameter, shared (a second copy is 1 GB at 8B in bf16), or a copy of :class:`TargetWeights`'."""
    path = Path(path)
    with torch.device("meta"):   # built without values: a random float32 embedding is 2.2 GB at 8B, then replaced
        head = build_head(*load_head_config(path))
    head = head.to_empty(device="cpu")
    missing, unexpected = head.load_state_dict(load_file(str(path / "model.safetensors")), strict=False)
    missing = [k for k in missing if not k.startswith("embed_tokens.")]
    if missing or unexpected:
        raise ValueError(f"{path}: head checkpoint does not match its config: missing={missing}, unexpected={unexpected}")
    if isinstance(target, nn.Module):
        share_embedding(head, target)
    elif isinstance(head, Eagle3Head):
        with torch.no_grad():
            if target is not None:
                head.embed_tokens.weight.copy_(target.embed)
            else:   # no target to embed with: initialised as built
                nn.init.normal_(head.embed_tokens.weight)
    return head.eval()
