"""Losses of the heads, from the target's frozen outputs.

Shapes: B rows of padded length T; ``lengths`` [B]; ``loss_mask`` [B, T] (1 = the token at that
position is an assistant token); ``last`` [B, T, H] the target's final (post-norm) hidden state.
Row t of step k predicts token x[t+2+k] and its target distribution is the target's own at position
t+1+k, restricted (and renormalised) to the draft vocabulary. A position counts only when
the target's full-vocabulary argmax there is in the draft vocabulary, and, with
``positions="assistant"``, when the predicted token is an assistant token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from heads.eagle3 import Eagle3Head, TTTCache
from heads.medusa import MedusaHead


@dataclass
class TargetView:
    """The target's distribution at each position, restricted to the draft vocabulary."""

    log_p: torch.Tensor        # [B, T, draft_vocab] log-probabilities over the draft vocabulary
    argmax: torch.Tensor       # [B, T] draft id of the target's argmax over the draft vocabulary
    in_vocab: torch.Tensor     # [B, T] bool: the full-vocabulary argmax is in the draft vocabulary


@torch.no_grad()
def full_argmax(last: torch.Tensor, lm_head: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """The target's own next-token argmax over its full vocabulary, [...] from last [..., H] (chunked)."""
    flat = last.reshape(-1, last.shape[-1])
    out = [(flat[a: a + chunk].to(lm_head.dtype) @ lm_head.T).argmax(-1) for a in range(0, flat.shape[0], chunk)]
    return torch.cat(out).view(last.shape[:-1])


@torch.no_grad()
def target_view(last: torch.Tensor, draft_rows: torch.Tensor, t2d: torch.Tensor, argmax: torch.Tensor) -> TargetView:
    """The target's distribution over the draft vocabulary, from its final hidden state ``last`` [B, T, H],
    the lm_head rows of the draft vocabulary ``draft_rows`` [draft_vocab, H], and the full-vocabulary
    ``argmax`` [B, T] (stored by the extract stage, or :func:`full_argmax`)."""
    restricted = (last.to(draft_rows.dtype) @ draft_rows.T).float()
    return TargetView(torch.log_softmax(restricted, -1), restricted.argmax(-1), t2d[argmax])


def shift(x: torch.Tensor, k: int, fill=0) -> torch.Tensor:
    """x[:, t + k] at row t (rows past the end filled), keeping the length T."""
    if k == 0:
        return x
    pad = torch.full_like(x[:, :k], fill)
    return torch.cat([x[:, k:], pad], 1)


def weights(view: TargetView, lengths: torch.Tensor, loss_mask: torch.Tensor, k: int, positions: str) -> torch.Tensor:
    """[B, T] float weight of row t at step/head k (see the module docstring)."""
    T = loss_mask.shape[1]
    t = torch.arange(T, device=lengths.device)
    w = (t[None] + 2 + k < lengths[:, None]) & shift(view.in_vocab, 1 + k, False)
    if positions == "assistant":
        w = w & shift(loss_mask.bool(), 2 + k, False)
    return w.float()


@dataclass
class StepStats:
    loss: torch.Tensor                 # weighted sum over steps (what is optimised)
    losses: list[float]                # per step
    correct: list[torch.Tensor]        # per step, [B, T] bool (argmax agreement)
    weight: list[torch.Tensor]         # per step, [B, T] float


def soft_ce(log_q: torch.Tensor, log_p: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    ce = -(log_p.exp() * log_q).sum(-1)
    return (ce * w).sum() / w.sum().clamp(min=1.0)


def eagle3_loss(head: Eagle3Head, taps: torch.Tensor, input_ids: torch.Tensor, lengths: torch.Tensor,
                loss_mask: torch.Tensor, view: TargetView, steps: int, decay: float, positions: str) -> StepStats:
    """Training-time test: ``steps`` unrolled draft steps, each fed its own previous feature and the
    ground-truth next token; attention across steps as in :class:`heads.eagle3.TTTCache`."""
    B, T = input_ids.shape
    hidden = head.project(taps)
    cache = TTTCache()
    pos = torch.arange(T, device=input_ids.device)[None].expand(B, T)
    total, losses, correct, ws = 0.0, [], [], []
    for k in range(steps):
        hidden = head(hidden, shift(input_ids, 1 + k), pos + k, cache)
        log_q = torch.log_softmax(head.logits(hidden).float(), -1)
        w = weights(view, lengths, loss_mask, k, positions)
        loss_k = soft_ce(log_q, shift(view.log_p, 1 + k), w)
        total = total + decay**k * loss_k
        losses.append(loss_k.item())
        correct.append(log_q.argmax(-1) == shift(view.argmax, 1 + k))
        ws.append(w)
    return StepStats(total, losses, correct, ws)


def medusa_loss(head: MedusaHead, last: torch.Tensor, input_ids: torch.Tensor, lengths: torch.Tensor,
                loss_mask: torch.Tensor, view: TargetView, decay: float, positions: str, kind: str) -> StepStats:
    """Head k against the target's distribution (``kl``) or the data token (``ce``) at t+2+k."""
    t2d, draft_ids = head.t2d, head.draft_ids()
    total, losses, correct, ws = 0.0, [], [], []
    for k, log_q in enumerate(torch.log_softmax(head(last).float(), -1)):
        w = weights(view, lengths, loss_mask, k, positions)
        if kind == "kl":
            loss_k = soft_ce(log_q, shift(view.log_p, 1 + k), w)
        else:
            token = shift(input_ids, 2 + k)
            w = w * t2d[token].float()
            draft = torch.searchsorted(draft_ids, token).clamp(max=draft_ids.numel() - 1)
            loss_k = (F.nll_loss(log_q.transpose(1, 2), draft, reduction="none") * w).sum() / w.sum().clamp(min=1.0)
        total = total + decay**k * loss_k
        losses.append(loss_k.item())
        correct.append(log_q.argmax(-1) == shift(view.argmax, 1 + k))
        ws.append(w)
    return StepStats(total, losses, correct, ws)
