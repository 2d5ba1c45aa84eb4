"""Losses of the heads, from the target's frozen outputs.

Shapes: B rows of padded length T; ``lengths`` [B]; ``loss_mask`` [B, T] (1 = the token at that
position is an assistant token); ``last`` [B, T, H] the target's final (post-norm) hidden state.
Row t of step k predicts token x[t+2+k] and its target distribution is the target's own at position
t+1+k, restricted (and renormalised) to the draft vocabulary. With ``positions="assistant"`` a position
counts only when the predicted token is an assistant token. The loss leaves out the positions where the
target's full-vocabulary argmax is outside the draft vocabulary (nothing there to learn); the accuracy
counts them as misses (what a decoder gets there), so vocabularies of different sizes compare fairly.

What the draft distribution q is fitted to the target's p with (``head.loss``, :func:`objective`): the
acceptance probability of a drafted token is alpha = sum_v min(p_v, q_v) = 1 - TV(p, q), so ``tv`` and the
LK losses (Samarin et al., arXiv 2602.23881) aim at acceptance itself, where ``kl`` is a proxy with the
same optimum that a small draft does not reach.
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
    """The target's own next-token argmax over its full vocabulary, [...] from last [..., H] (chunked, on
    ``lm_head``'s device; the result on ``last``'s).

    ``max(-1).indices`` (the first maximal index, as ``argmax``): on a CPU ``argmax`` over bf16 logits costs as
    much as the GEMM before it, ``max`` a third of that (``scripts/bench_data.py``'s README row)."""
    flat = last.reshape(-1, last.shape[-1])
    out = [(flat[a: a + chunk].to(lm_head.device, lm_head.dtype) @ lm_head.T).max(-1).indices
           for a in range(0, flat.shape[0], chunk)]
    return torch.cat(out).view(last.shape[:-1]).to(last.device)


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


def counted(lengths: torch.Tensor, loss_mask: torch.Tensor, k: int, positions: str) -> torch.Tensor:
    """[B, T] bool: row t at step/head k predicts a token of the sequence (and, with ``positions="assistant"``,
    an assistant token)."""
    t = torch.arange(loss_mask.shape[1], device=lengths.device)
    c = t[None] + 2 + k < lengths[:, None]
    return c & shift(loss_mask.bool(), 2 + k, False) if positions == "assistant" else c


def weights(in_vocab: torch.Tensor, lengths: torch.Tensor, loss_mask: torch.Tensor, k: int, positions: str,
            data_in_vocab: torch.Tensor | None = None) -> torch.Tensor:
    """[B, T] float loss weight of row t at step/head k: counted, and the target's argmax is in the draft vocabulary
    (``in_vocab`` [B, T], :attr:`TargetView.in_vocab`); with ``data_in_vocab`` [B, T] (Medusa's ``ce``: whether
    each data token is in it) also the token row t learns, x[t+2+k]."""
    w = counted(lengths, loss_mask, k, positions) & shift(in_vocab, 1 + k, False)
    if data_in_vocab is not None:
        w = w & shift(data_in_vocab, 2 + k, False)
    return w.float()


def loss_counts(t2d: torch.Tensor, batch: dict, steps: int, positions: str, data_tokens: bool = False) -> torch.Tensor:
    """[steps] the positions each draft step's (Medusa: head's) loss averages over in ``batch`` (a micro-batch:
    ``input_ids``, ``lengths``, ``loss_mask``, the target's full-vocabulary ``argmax``), before GRIFFIN's reach mask;
    ``data_tokens``: Medusa's ``ce`` (:func:`weights`' ``data_in_vocab``). Summed over an optimizer step's
    micro-batches, what ``train.loss_norm=token`` divides by."""
    in_vocab, data = t2d[batch["argmax"]], t2d[batch["input_ids"]] if data_tokens else None
    return torch.stack([weights(in_vocab, batch["lengths"], batch["loss_mask"], k, positions, data).sum()
                        for k in range(steps)])


def normalised(loss_k: torch.Tensor, w: torch.Tensor, norms: torch.Tensor | None, k: int) -> torch.Tensor:
    """Step k's loss, a mean over this micro-batch's positions (weights ``w``), as its sum divided by ``norms[k]``
    instead (``train.loss_norm=token``: the step's mean count of positions per micro-batch); None: as it is."""
    if norms is None:
        return loss_k
    return loss_k * w.sum().clamp(min=1.0) / norms[k].clamp(min=1e-6)


@dataclass
class StepStats:
    loss: torch.Tensor                 # weighted sum over steps (what is optimised)
    losses: list[torch.Tensor]         # per step, detached (read at logging: no host sync per step)
    correct: list[torch.Tensor]        # per step, [B, T] bool: the draft's argmax is the target's (full vocabulary)
    weight: list[torch.Tensor]         # per step, [B, T] float: the positions the accuracy counts (:func:`counted`)


def hits(log_q: torch.Tensor, view: TargetView, k: int) -> torch.Tensor:
    """[B, T] bool: step/head k's argmax is the target's next token (never where that is outside the draft
    vocabulary)."""
    return (log_q.argmax(-1) == shift(view.argmax, 1 + k)) & shift(view.in_vocab, 1 + k, False)


def reached(log_q: torch.Tensor, view: TargetView, k: int, topk: int) -> torch.Tensor:
    """[B, T] bool: step k's ``topk`` likeliest draft tokens at row t hold the target's next token (a tree
    drafting ``topk`` children per node goes on to step k + 1 there; ``topk`` 1: :func:`hits`)."""
    top = log_q.topk(min(topk, log_q.shape[-1]), -1).indices
    return (top == shift(view.argmax, 1 + k)[..., None]).any(-1) & shift(view.in_vocab, 1 + k, False)


def soft_ce(log_q: torch.Tensor, log_p: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    ce = -(log_p.exp() * log_q).sum(-1)
    return (ce * w).sum() / w.sum().clamp(min=1.0)


OBJECTIVES = ("kl", "kl_topk", "kl_mix", "tv", "lk_alpha", "lk_lambda")  # head.loss of both heads (Medusa also has ce)
LK_ETA = 3.0  # LK-lambda's decay: the paper's best, the default of SpecForge, speculators and ModelOpt
TOPK = 10     # kl_topk: HASS's top-K distillation, its K and weight 1 (arXiv 2408.15766; its reference trainer)


def objective(kind: str, log_q: torch.Tensor, log_p: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Position-weighted mean (weights ``w`` [B, T]) of the draft's loss against the target, from log q and
    log p [B, T, V] over the draft vocabulary; alpha = sum_v min(p_v, q_v) is the acceptance probability.

    - ``kl``: soft cross-entropy -sum_v p_v log q_v (KL(p||q) plus the target's entropy: the same gradient).
    - ``kl_topk``: ``kl`` plus the same sum over the target's ``TOPK`` likeliest tokens only (HASS's harmonized
      objective distillation): the ranking of the tokens a tree drafts weighs twice.
    - ``kl_mix``: (KL(p||q) + KL(q||p)) / 2: the forward KL spreads q over all of p's mass, the reverse one
      (mode-seeking) keeps q's mass where p's is, which is what greedy acceptance rewards.
    - ``tv``: 1 - alpha, the total variation: maximises acceptance directly; its gradient vanishes while
      the two distributions barely overlap.
    - ``lk_alpha``: -log alpha (LK-alpha): the same optimum as ``tv``, gradient scaled by 1 / alpha.
    - ``lk_lambda``: lam * KL(p||q) + (1 - lam) * (1 - alpha), lam = exp(-LK_ETA * mean alpha), the mean
      over this call's positions and not differentiated (LK-lambda): KL while the draft is far, TV near.
    """
    if kind == "kl":
        return soft_ce(log_q, log_p, w)
    if kind not in OBJECTIVES:
        raise ValueError(f"head.loss must be one of {OBJECTIVES} (Medusa: or ce), got {kind!r}")

    def mean(x: torch.Tensor) -> torch.Tensor:
        return (x * w).sum() / w.sum().clamp(min=1.0)

    if kind == "kl_topk":
        top = log_p.topk(min(TOPK, log_p.shape[-1]), -1).indices
        return soft_ce(log_q, log_p, w) + mean(-(log_p.gather(-1, top).exp() * log_q.gather(-1, top)).sum(-1))
    p = log_p.exp()
    if kind == "kl_mix":
        return 0.5 * mean(((p - log_q.exp()) * (log_p - log_q)).sum(-1))  # the two KLs in one sum
    alpha = torch.minimum(p, log_q.exp()).sum(-1)
    if kind == "tv":
        return mean(1 - alpha)
    if kind == "lk_alpha":
        return mean(-alpha.clamp(min=1e-6).log())
    lam = torch.exp(-LK_ETA * mean(alpha).detach())
    return lam * mean((p * (log_p - log_q)).sum(-1)) + (1 - lam) * mean(1 - alpha)


def with_tap_noise(taps: torch.Tensor, std: float, n_taps: int) -> torch.Tensor:
    """``taps`` [..., n_taps * H] plus Gaussian noise whose std is ``std`` times each tap's RMS at that
    position: a relative scale, the same for every layer and target (residual streams differ in scale by
    orders of magnitude across layers, targets and tokens)."""
    x = taps.unflatten(-1, (n_taps, -1))
    rms = x.float().pow(2).mean(-1, keepdim=True).sqrt().to(x.dtype)
    return (x + std * rms * torch.randn_like(x)).flatten(-2)


def feature_error(out: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """[B, T] relative squared error |out - last|^2 / |last|^2 of the draft's normed features ``out`` against
    the target's final (post-norm) hidden states ``last`` (both [B, T, H]), in fp32."""
    err = (out.float() - last.float()).pow(2).sum(-1)
    return err / last.float().pow(2).sum(-1).clamp(min=1e-6)


def eagle3_loss(head: Eagle3Head, taps: torch.Tensor, input_ids: torch.Tensor, lengths: torch.Tensor,
                loss_mask: torch.Tensor, view: TargetView, steps: int, decay: float, positions: str,
                loss: str = "kl", tap_noise: float = 0.0, dropout: float = 0.0, reach_topk: int = 0,
                feature_loss: float = 0.0, last: torch.Tensor | None = None,
                norms: torch.Tensor | None = None) -> StepStats:
    """Training-time test: ``steps`` unrolled draft steps, each fed its own previous feature and the
    ground-truth next token; attention across steps as in :class:`heads.eagle3.TTTCache`. ``loss``: see
    :func:`objective`; while the head is training, ``tap_noise`` (:func:`with_tap_noise`) and ``dropout``
    on the taps. ``reach_topk`` > 0: step k >= 1 learns only at the rows a decoder reaches, where every
    earlier step's ``reach_topk`` likeliest tokens held the target's next token (:func:`reached`; GRIFFIN's
    loss mask, arXiv 2502.11018); the accuracies still count every row. ``feature_loss`` > 0 adds that weight
    times :func:`feature_error` of each step's normed feature against the target's final hidden state ``last``
    at the position it stands for (row t of step k: t + 1 + k), EAGLE-1's feature regression: the lm_head's
    input distilled in all H directions, not only through the draft vocabulary's softmax. ``norms`` [steps]: each
    step's objective summed over positions and divided by ``norms[k]`` (:func:`normalised`), not averaged over this
    micro-batch's (the feature term stays a mean)."""
    B, T = input_ids.shape
    if tap_noise and head.training:
        taps = with_tap_noise(taps, tap_noise, len(head.config.aux_layers))
    if dropout and head.training:
        taps = F.dropout(taps, dropout)
    hidden = head.project(taps)
    cache = TTTCache()
    pos = torch.arange(T, device=input_ids.device)[None].expand(B, T)
    total, losses, correct, ws = 0.0, [], [], []
    reach = torch.ones(B, T, dtype=torch.bool, device=input_ids.device)
    for k in range(steps):
        hidden = head(hidden, shift(input_ids, 1 + k), pos + k, cache)
        log_q = torch.log_softmax(head.logits(hidden).float(), -1)
        w = weights(view.in_vocab, lengths, loss_mask, k, positions) * reach
        c = counted(lengths, loss_mask, k, positions).float()
        loss_k = objective(loss, log_q, shift(view.log_p, 1 + k), w)
        term = normalised(loss_k, w, norms, k)
        if feature_loss:
            err = feature_error(head.norm(hidden), shift(last, 1 + k))
            feature = feature_loss * (err * c).sum() / c.sum().clamp(min=1.0)
            loss_k, term = loss_k + feature, term + feature
        if reach_topk and k + 1 < steps:   # the last step's reach would mask nothing
            reach = reach & reached(log_q.detach(), view, k, reach_topk)
        total = total + decay**k * term
        losses.append(loss_k.detach())
        correct.append(hits(log_q, view, k))
        ws.append(c)
    return StepStats(total, losses, correct, ws)


def medusa_loss(head: MedusaHead, last: torch.Tensor, input_ids: torch.Tensor, lengths: torch.Tensor,
                loss_mask: torch.Tensor, view: TargetView, decay: float, positions: str, kind: str,
                dropout: float = 0.0, norms: torch.Tensor | None = None) -> StepStats:
    """Head k against the data token at t+2+k (``ce``) or the target's distribution there (any other
    ``kind``: :func:`objective`); ``dropout`` on ``last`` while the head is training; ``norms`` as
    :func:`eagle3_loss`'s."""
    t2d, draft_ids = head.t2d, head.draft_ids()
    if dropout and head.training:
        last = F.dropout(last, dropout)
    total, losses, correct, ws = 0.0, [], [], []
    for k, log_q in enumerate(torch.log_softmax(head(last).float(), -1)):
        w = weights(view.in_vocab, lengths, loss_mask, k, positions, t2d[input_ids] if kind == "ce" else None)
        if kind == "ce":
            token = shift(input_ids, 2 + k)
            draft = torch.searchsorted(draft_ids, token).clamp(max=draft_ids.numel() - 1)
            loss_k = (F.nll_loss(log_q.transpose(1, 2), draft, reduction="none") * w).sum() / w.sum().clamp(min=1.0)
        else:
            loss_k = objective(kind, log_q, shift(view.log_p, 1 + k), w)
        losses.append(loss_k.detach())
        total = total + decay**k * normalised(loss_k, w, norms, k)
        correct.append(hits(log_q, view, k))
        ws.append(counted(lengths, loss_mask, k, positions).float())
    return StepStats(total, losses, correct, ws)
