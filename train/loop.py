"""Train stage: one visible loop over a DeepSpeed engine (1 process or ``deepspeed --num_gpus N``).

Reads the data stage's rows and the extract stage's hidden states (or computes them on the fly with
``train.online=true``), trains the head, validates every ``train.eval_every`` steps and at each epoch
end, keeps the best head by validation simulated tau in ``<run_dir>/train/head/`` and resumable
checkpoints (optimizer, scheduler, RNG, data position) in ``<run_dir>/train/checkpoints/``.

Batching: rows are grouped by length into micro-batches of at most ``train.micro_batch_tokens``
padded tokens; one optimizer step = world_size x grad_accum micro-batches, rank r taking micro-batches
r*G .. r*G+G-1 of each step. So N ranks with accumulation G train exactly like one rank with N*G.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from omegaconf import DictConfig, OmegaConf
from safetensors.torch import load_file

from data.formats import fsync_dir, fsync_tree, write_atomic
from data.stage import load_dataset, row_lengths
from data.vocab import build_vocab, coverage
from heads.frozen import TargetWeights
from heads.io import build_head, head_config, save_head, share_embedding
from train import dist, stages
from train.errors import UserError
from train.extract import Captures, ExtractError, batches, capture, capture_layers, check_data
from train.log import log, peak_rss_gib, progress
from train.losses import StepStats, eagle3_loss, full_argmax, loss_counts, medusa_loss, target_view
from train.plan import check_train_memory
from train.stages import FORCED, RESUMABLE, fingerprint, flat_config, require, stage_dir, upstream_ids
from train.target import (
    load_layer_weights,
    load_target,
    load_tokenizer,
    load_weights,
    resolve_device,
    resolve_dtype,
)
from train.tracking import Tracker

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine


def micro_batches(lengths: list[int], max_tokens: int, seed: int, shuffle: bool = True) -> list[list[int]]:
    """Rows grouped into length-homogeneous micro-batches (rows x longest <= max_tokens), in random order."""
    rng = random.Random(seed)
    rows = list(range(len(lengths)))
    if shuffle:
        rng.shuffle(rows)
    out = []
    for a in range(0, len(rows), 256):  # sort inside windows: little padding, still random
        out += batches(sorted(rows[a: a + 256], key=lambda r: lengths[r]), lengths, max_tokens)
    if shuffle:
        rng.shuffle(out)
    return out


def epoch_order(lengths: list[int], max_tokens: int, seed: int, n: int) -> list[list[int]]:
    """Exactly ``n`` micro-batches for one epoch: grouping after a shuffle can give a few more or fewer
    than planned, so they are cut or cycled (a resumed run counts steps the same way)."""
    order = micro_batches(lengths, max_tokens, seed)
    return (order * (n // len(order) + 1))[:n]


class Batches:
    """Builds padded tensors for a list of rows of one split (from disk captures or the live target).

    Captured hidden states keep their stored dtype (bf16 by default) until the device; on a GPU the
    host tensors are pinned and copied without blocking, so :func:`prefetch` can build the next
    batches on a background thread while the current one trains."""

    def __init__(self, split: str, rows, captures: Captures | None, target, layers: list[int], device: torch.device,
                 index: list[int] | None = None):
        self.split, self.rows, self.captures, self.target, self.layers = split, rows, captures, target, layers
        self.device, self.index = device, index  # batch position -> row of the split (None: the same)
        self.pin = device.type == "cuda"

    def _host(self, *shape: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(*shape, dtype=dtype, pin_memory=self.pin)

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device, non_blocking=self.pin)

    def __call__(self, batch: list[int]) -> dict[str, torch.Tensor]:
        if self.index is not None:
            batch = [self.index[r] for r in batch]
        rows = [self.rows[r] for r in batch]
        lengths = [int(row["length"]) for row in rows]
        B, T = len(batch), max(lengths)
        ids, mask = self._host(B, T, dtype=torch.long), self._host(B, T, dtype=torch.long)
        for j, row in enumerate(rows):
            ids[j, : lengths[j]] = torch.as_tensor(row["input_ids"])
            mask[j, : lengths[j]] = torch.as_tensor(row["loss_mask"])
        ids, mask = self._to_device(ids), self._to_device(mask)
        lengths_t = torch.tensor(lengths, device=self.device)
        if self.captures is not None:
            hidden_size, dtype = self.captures.manifest["hidden_size"], getattr(torch, self.captures.manifest["dtype"])
            states = self._host(B, T, len(self.layers), hidden_size, dtype=dtype)
            argmax = self._host(B, T, dtype=torch.int32)
            for j, r in enumerate(batch):
                states[j, : lengths[j]], argmax[j, : lengths[j]] = self.captures.get(self.split, r)
            states, argmax = self._to_device(states), self._to_device(argmax).long()
        else:  # online: the same capture as the extract stage
            with torch.no_grad():
                attention = (torch.arange(T, device=self.device)[None] < lengths_t[:, None]).long()
                states = capture(self.target, ids, self.layers, attention)
                argmax = full_argmax(states[:, :, -1], self.target.get_output_embeddings().weight)
        return {"input_ids": ids, "loss_mask": mask, "lengths": lengths_t, "states": states, "argmax": argmax,
                "tokens": sum(lengths)}


def prefetch(make: Callable[[list[int]], dict], batches: list[list[int]], depth: int) -> Iterator[dict]:
    """``make(b)`` for each of ``batches`` in order, built up to ``depth`` ahead on a background thread
    (``depth`` 0: inline)."""
    if depth == 0:
        yield from map(make, batches)
        return
    with ThreadPoolExecutor(1) as pool:
        pending = deque(pool.submit(make, b) for b in batches[:depth])
        for b in batches[depth:] + [None] * depth:
            out = pending.popleft().result()
            if b is not None:
                pending.append(pool.submit(make, b))
            yield out


def compute(head, kind: str, batch: dict, draft_rows: torch.Tensor, cfg: DictConfig, positions: str,
            steps: int, autocast: str | None = None, norms: torch.Tensor | None = None) -> StepStats:
    """The head's loss on one batch over ``steps`` TTT steps (EAGLE-3); ``draft_rows`` = the target's lm_head
    rows of the draft vocabulary. ``autocast`` (a dtype name, ``train.autocast``): the head's forward under
    ``torch.autocast`` in that dtype; its weights, and the target's distribution it learns, stay as they are.
    ``norms``: each step's divisor in place of the batch's own count of positions (:func:`train.losses.normalised`)."""
    states = batch["states"]
    dtype = next(p for p in head.parameters() if p.requires_grad).dtype
    last = states[:, :, -1]
    view = target_view(last, draft_rows, head.t2d, batch["argmax"])
    with torch.autocast(last.device.type, getattr(torch, autocast or "bfloat16"), enabled=autocast is not None):
        if kind == "eagle3":
            taps = states[:, :, :-1].flatten(2).to(dtype)
            return eagle3_loss(head, taps, batch["input_ids"], batch["lengths"], batch["loss_mask"], view,
                               steps, cfg.head.ttt_decay, positions, cfg.head.loss, cfg.head.tap_noise,
                               cfg.head.dropout, cfg.head.ttt_reach_topk, cfg.head.feature_loss, last, norms)
        return medusa_loss(head, last.to(dtype), batch["input_ids"], batch["lengths"], batch["loss_mask"], view,
                           cfg.head.decay, positions, cfg.head.loss, cfg.head.dropout, norms)


def tallies(correct: list[torch.Tensor], weight: list[torch.Tensor]) -> torch.Tensor:
    """[steps, 4] float64, per step: its right counted positions, its counted positions, the positions counted
    at step 0 whose steps 0..k are all right, the positions counted at step 0. Sums: those of several batches
    (and ranks) add up to theirs together, which :func:`figures` turns into accuracies and taus."""
    rows, run = [], None
    base = weight[0] > 0
    for c, w in zip(correct, weight, strict=True):
        m = w > 0   # a chain stops where step k is not counted (past the answer's end: a decoder stops at its EOS)
        run = c & m if run is None else run & c & m
        rows.append(torch.stack([(c & m).sum(), m.sum(), (run & base).sum(), base.sum()]))
    return torch.stack(rows).double()


def figures(sums: torch.Tensor) -> dict[str, float]:
    """Per-step accuracy, simulated tau (1 + sum_k prod_{i<=k} acc_i) and the chain tau averaged over
    positions (1 + sum_k share of positions where steps 0..k are all right: every position a root, where a
    decoder roots its passes only past what it accepted; :func:`decode_walk` walks them), from :func:`tallies`."""
    acc = (sums[:, 0] / sums[:, 1].clamp(min=1)).tolist()
    out = {f"acc_{k}": a for k, a in enumerate(acc)}
    out["sim_tau"] = 1 + sum(math.prod(acc[: k + 1]) for k in range(len(acc)))
    out["chain_tau"] = 1 + (sums[:, 2] / sums[:, 3].clamp(min=1)).sum().item()
    return out


def summarise(correct: list[torch.Tensor], weight: list[torch.Tensor]) -> dict[str, float]:
    """:func:`figures` of one batch's (or rows') ``correct`` / ``weight`` per step."""
    return figures(tallies(correct, weight))


def decode_walk(correct: list[torch.Tensor], weight: list[torch.Tensor], k: int) -> list[list[int]]:
    """Per row, the accepted draft tokens of each target pass of a chain decoder drafting ``k`` tokens per
    pass, walked teacher-forced along the row's assistant spans ([B, T] per step, as :func:`compute` returns
    them): the rows are the target's own greedy answers, so this is what decoding their prompts measures. A
    span's first pass is rooted one past its first counted row (that row predicts the target's own first
    answer token, never drafted); a pass rooted at t accepts the run of right steps from step 0 (at most k)
    and the next pass is rooted past what it accepted."""
    ok = torch.stack([c & (w > 0) for c, w in zip(correct[:k], weight[:k], strict=True)])
    walks = []
    for run, counted in zip(ok.int().cumprod(0).sum(0).tolist(), (weight[0] > 0).tolist(), strict=True):
        accepted, t, n = [], 0, len(counted)
        while t < n:
            if not counted[t]:
                t += 1
                continue
            t += 1  # a new span
            while t < n and counted[t]:
                accepted.append(run[t])
                t += run[t] + 1
        walks.append(accepted)
    return walks


def decode_tau(walks: Iterable[list[int]]) -> float:
    """Acceptance length (1 + accepted draft tokens per pass) over the passes of :func:`decode_walk` rows."""
    passes = [a for walk in walks for a in walk]
    return 1 + sum(passes) / max(len(passes), 1)


def decode_k(cfg: DictConfig) -> int:
    """Draft tokens per pass of the served chain: ``export.num_speculative_tokens`` (Medusa: its heads)."""
    return cfg.head.num_heads if cfg.head.type != "eagle3" else min(cfg.export.num_speculative_tokens,
                                                                       _n_steps(cfg, validation=True))


def train_subset(lengths: list[int], max_tokens: int | None, seed: int) -> list[int]:
    """Training rows: all, or a seeded random subset of about ``max_tokens`` tokens (``train.data_tokens``).
    For one seed a smaller budget's rows are a subset of a larger one's: nested learning-curve points."""
    if not max_tokens:
        return list(range(len(lengths)))
    keep, total = [], 0
    for r in torch.randperm(len(lengths), generator=torch.Generator().manual_seed(seed)).tolist():
        if total >= max_tokens:
            break
        keep.append(r)
        total += lengths[r]
    return sorted(keep)


def val_subset(lengths: list[int], max_tokens: int | None) -> list[int]:
    """Validation rows: all, or every k-th row (k fixed) so that about ``max_tokens`` tokens are used."""
    k = math.ceil(sum(lengths) / max_tokens) if max_tokens else 1
    return list(range(0, len(lengths), max(1, k)))


@torch.no_grad()
def validation_rows(head, kind, cfg, batches: Batches, rows: list[int], draft_rows,
                    max_tokens: int) -> tuple[list[torch.Tensor], list[torch.Tensor], dict[int, list[int]]]:
    """The head on ``rows`` of the validation split (assistant tokens): per step, whether each position's
    draft is right and whether it counts (flat, for :func:`summarise`), and per row, the accepted draft
    tokens of each pass of a chain decoder at :func:`decode_k` (:func:`decode_walk`)."""
    head.eval()
    correct, weight, walks, k = [], [], {}, decode_k(cfg)
    lengths = row_lengths(batches.rows)
    for batch in micro_batches([lengths[r] for r in rows], max_tokens, 0, shuffle=False):
        stats = compute(head, kind, batches([rows[i] for i in batch]), draft_rows, cfg, "assistant",
                        _n_steps(cfg, validation=True))
        correct.append([c.flatten() for c in stats.correct])
        weight.append([w.flatten() for w in stats.weight])
        walks.update(zip((rows[i] for i in batch), decode_walk(stats.correct, stats.weight, k), strict=True))
    head.train()
    return [torch.cat(c) for c in zip(*correct, strict=True)], [torch.cat(w) for w in zip(*weight, strict=True)], walks


def validation_share(lengths: list[int], rows: list[int], rank: int, world: int) -> list[int]:
    """The validation rows rank ``rank`` of ``world`` scores: dealt longest first, so the ranks' tokens differ
    by at most about one row."""
    return sorted(sorted(rows, key=lambda r: -lengths[r])[rank::world])


def validate(head, kind, cfg, batches: Batches, rows: list[int], draft_rows, max_tokens: int) -> dict[str, float]:
    """Per-step accuracy, simulated/chain tau and the chain decoder's tau at :func:`decode_k` (``decode_tau``)
    on ``rows`` of the validation split (assistant tokens). On N ranks each scores its
    :func:`validation_share` and every rank gets the figures of all the rows (the same on every rank)."""
    share = validation_share(row_lengths(batches.rows), rows, dist.rank(), dist.world_size())
    correct, weight, walks = validation_rows(head, kind, cfg, batches, share, draft_rows, max_tokens)
    sums = tallies(correct, weight) if correct else torch.zeros(   # (more ranks than rows: none here)
        _n_steps(cfg, validation=True), 4, dtype=torch.float64, device=draft_rows.device)
    sums = dist.all_reduce_sum(sums)
    walks = {row: walk for part in dist.all_gather_objects(walks) for row, walk in part.items()}
    return {**figures(sums), "decode_tau": decode_tau(walks.values()), "decode_k": decode_k(cfg),
            "rows": len(walks), "positions": int(sums[0, 1])}


def lr_lambda(step: int, warmup: int, total: int, min_ratio: float, segment: list | None = None) -> float:
    """Linear warmup, then cosine to ``min_ratio`` at ``total``. ``segment`` = [step0, ratio0] (the plan was
    refitted to the time budget at step0, or a resumed run's budget changed): from step0 the cosine runs
    from ratio0 (the ratio reached) to ``min_ratio`` at the new ``total``, so the learning rate does not jump."""
    if segment is not None and step >= segment[0]:
        progress_ = min(1.0, (step - segment[0]) / max(1, total - segment[0]))
        return min_ratio + (segment[1] - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress_))
    if step < warmup:
        return (step + 1) / warmup
    progress_ = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress_))


def warmup_steps(configured: int, planned: int) -> int:
    """``train.warmup_steps``, at most a tenth of the planned steps: a small dataset on many ranks plans few
    steps (the built-in prompts on 8 GPUs with 8192-token micro-batches: ~2 per epoch), and a warmup longer
    than the run would keep the learning rate near zero throughout."""
    warmup = min(configured, planned // 10)
    if warmup < configured:
        log(f"[train] train.warmup_steps={configured} is more than a tenth of the {planned} steps planned: "
            f"warming up over {warmup}")
    return warmup


def param_groups(head: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups of the trainable parameters: decay on matrices (>= 2-D weights) only, none on norm
    weights and biases (1-D) -- decaying RMSNorm gains towards 0 only hurts."""
    named = [(n, p) for n, p in head.named_parameters() if p.requires_grad]
    groups = [{"params": [p for _, p in named if p.ndim >= 2], "weight_decay": weight_decay},
              {"params": [p for _, p in named if p.ndim < 2], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


class Average:
    """An exponential moving average of the head's trainable parameters (``train.ema``, the decay per
    optimizer step; early steps average with ``(1 + t) / (10 + t)`` where that is smaller, so the average is not
    held at the start). Kept in float32 whatever the weights' dtype; validation and the saved head use it."""

    def __init__(self, model: torch.nn.Module, decay: float):
        self.decay = decay
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.shadow = [p.detach().float().clone() for p in self.params]

    @torch.no_grad()
    def update(self, step: int) -> None:
        """Move the average towards the weights after optimizer step ``step``."""
        weight = 1 - min(self.decay, (1 + step) / (10 + step))
        torch._foreach_lerp_(self.shadow, [p.detach().float() for p in self.params], weight)

    @contextmanager
    @torch.no_grad()
    def swapped_in(self) -> Iterator[None]:
        """The model holds the average inside the block and its own weights again after it."""
        own = [p.detach().clone() for p in self.params]
        for p, a in zip(self.params, self.shadow, strict=True):
            p.copy_(a)
        try:
            yield
        finally:
            for p, w in zip(self.params, own, strict=True):
                p.copy_(w)


def fit_schedule(state: dict, tcfg: DictConfig, step_s: float, elapsed_s: float, planned_steps: int,
                 lr_ratio: float) -> bool:
    """Plan the steps that ``train.max_minutes`` allows at the measured average step time (which includes
    the validations and checkpoints so far; 5% of the budget kept for the last ones), at most
    ``planned_steps``. Called at every step once the warmup is timed, so a first estimate that ran ahead
    (prefetched batches, no validation yet) is corrected: the plan changes when it is more than 2% off, and
    the cosine then continues from ``lr_ratio`` (the ratio reached) to its end at the new total.
    ``elapsed_s`` counts the training time of earlier (resumed) runs too: the budget is for the whole run.
    Returns whether the plan changed."""
    fits = state["step"] + int((0.95 * tcfg.max_minutes * 60 - elapsed_s) / max(step_s, 1e-9))
    total = min(planned_steps, max(state["step"] + 1, fits))
    if abs(total - state["total_steps"]) <= 0.02 * state["total_steps"]:
        return False
    if not state.get("fitted"):
        log(f"[train] {step_s:.2f} s/step: {total} steps fit train.max_minutes={tcfg.max_minutes}; the "
            "learning-rate schedule ends there (refitted as the step time is measured)")
    state.update(total_steps=total, fitted=True, segment=[state["step"], lr_ratio])
    return True


def rng_state() -> dict:
    """This process's generators: CPU, Python, and its own GPU's (not every visible GPU's: a resume that sees
    fewer, another CUDA_VISIBLE_DEVICES, could not restore them)."""
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    cuda = state.get("cuda")
    if cuda is None or not torch.cuda.is_available():
        return
    if isinstance(cuda, (list, tuple)):  # a checkpoint made before: every visible GPU's, this rank's among them
        device = torch.cuda.current_device()
        cuda = cuda[device] if device < len(cuda) else None
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)


def deepspeed_config(tcfg: DictConfig, dtype: torch.dtype) -> dict:
    """DeepSpeed engine settings. In bf16, fp32 gradients (``train.grad_accum_dtype``) exist only in DeepSpeed's
    BF16 optimizer (fp32 master weights and gradients), which is ZeRO stage 1: stage 0 is raised to 1 (one rank:
    the same; N ranks: optimizer states sharded); stage 2 is kept, with a warning (DeepSpeed's stage 2 accumulates
    its gradient partitions in bf16 whatever ``grad_accum_dtype`` says; lowering it would load a stage-2 run's
    checkpoints into another optimizer). The ranks' gradients are all-reduced in fp32 (``communication_data_type``:
    DeepSpeed's default in bf16 is bf16, which rounds every step's gradient on N ranks and not on one)."""
    stage = tcfg.zero_stage
    extra = {}
    if dtype == torch.bfloat16:
        extra["data_types"] = {"grad_accum_dtype": tcfg.grad_accum_dtype}
        if tcfg.grad_accum_dtype == "fp32":
            extra["communication_data_type"] = "fp32"
            if stage == 0:
                stage = 1
                log("[train] bf16 with fp32 gradient accumulation: ZeRO stage 1 (DeepSpeed's BF16 optimizer)")
            elif stage == 2:
                log("[train] warning: train.zero_stage=2 in bf16: DeepSpeed's stage 2 accumulates its gradient "
                    "partitions in bf16 whatever train.grad_accum_dtype says; train.zero_stage=1 keeps fp32 gradients "
                    "(DeepSpeed's BF16 optimizer; sharding a head's gradients saves under 2 GB)")
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": tcfg.grad_accum,
            "gradient_clipping": tcfg.grad_clip, "zero_optimization": {"stage": stage},
            "bf16": {"enabled": dtype == torch.bfloat16}, "fp16": {"enabled": dtype == torch.float16},
            "steps_per_print": 10**9, "wall_clock_breakdown": False, "zero_allow_untested_optimizer": True,
            **extra}


def setup_process(cfg: DictConfig) -> tuple[torch.device, torch.dtype]:
    """Refuse what cannot run (missing upstream stages, a memory estimate above free memory; ZeRO-3 is refused
    before any stage: train.checks), then bind this rank's device, join the process group, set the threads and
    seed. Returns (device, dtype)."""
    tcfg = cfg.train
    require(cfg, "data")
    if not tcfg.online:
        require(cfg, "extract")
    # data (and its states) made with another target or tokenizer: refused by the extract stage, which does not run
    # online, nor for `stages=[train]` with model.path at other weights (their embedding and lm_head over the first
    # target's states, without a word); a Hub repo that moved on is named with the commit to pin
    dist.on_main(lambda: check_data(cfg, load_tokenizer(cfg)))
    device = dist.bind_device(resolve_device(cfg.device))
    dtype = resolve_dtype(cfg.dtype, device)
    dist.init(device, single=True, timeout_minutes=cfg.dist_timeout_minutes)
    check_train_memory(cfg, device)  # before anything is loaded: refuses when the estimate exceeds free memory
    if tcfg.num_threads:
        torch.set_num_threads(tcfg.num_threads)
    elif dist.world_size() > 1:  # the node's cores shared by its ranks (GPU ranks build batches on them)
        torch.set_num_threads(max(1, dist.cpus() // dist.local_world_size()))
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    return device, dtype


def make_head(cfg: DictConfig, weights: TargetWeights, device: torch.device,
              dtype: torch.dtype) -> tuple[torch.nn.Module, torch.Tensor]:
    """The head to train on ``device``, initialised from the target's ``weights``, over the draft vocabulary
    of ``head.draft_vocab_size`` built from the data stage's token counts, and the target's lm_head rows of
    that vocabulary (in ``dtype``)."""
    kind = cfg.head.type
    counts = load_file(str(stage_dir(cfg, "data") / "vocab.safetensors"))
    vocab_size = weights.text_config.vocab_size
    if counts["all_counts"].numel() != vocab_size:
        raise ValueError(f"the data stage counted {counts['all_counts'].numel()} token ids but the target has "
                         f"{vocab_size}: data made for another target; rerun it with force=[data]")
    d2t, t2d = build_vocab(counts["masked_counts"], counts["all_counts"], cfg.head.draft_vocab_size)
    head = build_head(kind, head_config(kind, weights.config, cfg.head, d2t.numel()))
    head.set_vocab(d2t, t2d)
    if "validation_counts" in counts:  # data stages before the vocabulary moved here did not store them
        log(f"[train] draft vocabulary of {d2t.numel()} ids covers "
            f"{coverage(counts['validation_counts'], t2d):.2%} of held-out answer tokens")
    head.init_from_target(weights, cfg.head.get("init_from_target", True))
    if kind == "eagle3" and cfg.head.layer_init is not None:
        skipped = head.init_layer_from_target(load_layer_weights(cfg, cfg.head.layer_init), cfg.head.layer_init_embed)
        log(f"[train] draft layer <- target layer {cfg.head.layer_init}; not copied (the head has none): {skipped}")
    head.to(device)
    if kind == "eagle3" and cfg.head.fc_init == "last_tap":
        head.init_fc_last_tap()
    if kind == "eagle3" and not cfg.head.train_lm_head:
        head.lm_head.requires_grad_(False)  # the target's rows, frozen (EAGLE-1 style; a third less lm_head work)
    return head, weights.lm_head[head.draft_ids().to(weights.lm_head.device)].to(device, dtype)


@dataclass
class Data:
    """The training and validation rows as micro-batch builders, and the length of an epoch."""

    train: Batches
    val: Batches
    val_rows: list[int]     # the validation rows used (``train.val_tokens``)
    lengths: list[int]      # of the training rows
    steps_per_epoch: int    # optimizer steps of ``per_step`` micro-batches each


def load_data(cfg: DictConfig, target, layers: list[int], device: torch.device, per_step: int) -> Data:
    """The data stage's rows with the extract stage's hidden states (or ``target`` computing them, online)."""
    tcfg = cfg.train
    ds = load_dataset(cfg)
    captures = None if tcfg.online else Captures(stage_dir(cfg, "extract"))
    if captures is not None and captures.layers != layers:
        raise ExtractError(f"the extract stage in {stage_dir(cfg, 'extract')} holds layers {captures.layers}, this head "
                           f"reads {layers} (head.aux_layers changed since): run the extract stage again with the same "
                           f"overrides, e.g. stages=[extract,train]")
    all_lengths = row_lengths(ds["train"])
    index = train_subset(all_lengths, tcfg.data_tokens, cfg.seed)
    lengths = [all_lengths[r] for r in index]
    n_micro = len(micro_batches(lengths, tcfg.micro_batch_tokens, 0))
    steps_per_epoch = n_micro // per_step
    if steps_per_epoch == 0:
        raise UserError(f"{len(lengths)} training rows ({sum(lengths)} tokens) make {n_micro} micro-batches of "
                        f"train.micro_batch_tokens={tcfg.micro_batch_tokens}, fewer than one optimizer step takes "
                        f"({per_step}: {per_step // tcfg.grad_accum} rank(s) x train.grad_accum={tcfg.grad_accum}): "
                        "lower train.micro_batch_tokens or train.grad_accum, run on fewer ranks, or train on more "
                        f"data (train.data_tokens={tcfg.data_tokens}, data.sources)")
    return Data(Batches("train", ds["train"], captures, target, layers, device, index),
                Batches("validation", ds["validation"], captures, target, layers, device),
                val_subset(row_lengths(ds["validation"]), tcfg.val_tokens), lengths, steps_per_epoch)


def make_engine(head: torch.nn.Module, tcfg: DictConfig, dtype: torch.dtype, lr_ratio: Callable[[int], float],
                universal: bool = False) -> tuple[DeepSpeedEngine, torch.optim.lr_scheduler.LambdaLR]:
    """The DeepSpeed engine over ``head``, weight decay on matrices only (:func:`param_groups`), learning rates
    x ``lr_ratio(step)``. ``train.optimizer``: ``adamw`` (``train.lr``) or ``muon``, DeepSpeed's Muon
    (``train.muon_lr``) on the hidden matrices with AdamW (``train.lr``) on the lm_head(s) and 1-D weights;
    DeepSpeed tags them (2-D, no "embed"/"lm_head" in the name) and orthogonalises whole matrices under ZeRO
    1/2 too. ``universal``: the checkpoint to resume is a universal one (:func:`to_universal`). Returns (engine,
    scheduler)."""
    import deepspeed

    groups, config = param_groups(head, tcfg.weight_decay), deepspeed_config(tcfg, dtype)
    config["checkpoint"] = {"load_universal": universal}
    if tcfg.optimizer == "muon":
        config["optimizer"] = {"type": "muon", "params": {
            "lr": tcfg.lr, "muon_lr": tcfg.muon_lr, "momentum": 0.95, "betas": [0.9, 0.95],
            "weight_decay": tcfg.weight_decay, "torch_adam": True, "ns_method": "standard"}}
        engine, _, _, scheduler = deepspeed.initialize(
            model=head, model_parameters=groups, config=config,
            lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, lr_ratio))
        return engine, scheduler
    optimizer = torch.optim.AdamW(groups, lr=tcfg.lr, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_ratio)
    engine, _, _, _ = deepspeed.initialize(model=head, optimizer=optimizer, lr_scheduler=scheduler, config=config)
    return engine, scheduler


def run(cfg: DictConfig) -> dict:
    """The train stage: set up, resume the last checkpoint, train until the budget ends, summarise."""
    trainer = Trainer(cfg)
    trainer.resume()
    trainer.train()
    return trainer.finish()


class Trainer:
    """One run of the train stage, its steps in the order :func:`run` calls them. ``state`` is what a
    checkpoint keeps (step, planned steps, best validation tau, early-stopping count, history, schedule
    fit); the other attributes belong to this process (engine, data, clocks and counters of :meth:`train`)."""

    def __init__(self, cfg: DictConfig) -> None:
        """Set up: the process, the head, the data, the optimizer and its schedule in a DeepSpeed engine."""
        self.cfg, self.tcfg, self.kind = cfg, cfg.train, cfg.head.type
        self.out = stage_dir(cfg, "train")
        self.ckpt_dir = self.out / "checkpoints"
        self.device, self.dtype = setup_process(cfg)
        self.world, self.rank = dist.world_size(), dist.rank()
        self.latest = latest_checkpoint(self.ckpt_dir)  # rank 0's (tag, client.json) of the checkpoint to resume
        # rank 0's reading of the upstream markers (another rank's, through a network filesystem's stale cache,
        # could decide the resume otherwise and leave the ranks apart in their next collective)
        self.fingerprint, self.identity = dist.on_main(lambda: (fingerprint(cfg, "train"), checkpoint_identity(cfg)))
        # force=[train] starts over, but for the run it started itself, repeated after a crash: that one resumes
        self.force = "train" in cfg.force and not dist.on_main(lambda: self.forced_resume())
        try:
            self.tcfg, self.universal = self.fit_to_checkpoint()
        except CheckpointMismatchError:   # (alike on every rank: `latest` is rank 0's) a forced run that cannot
            if "train" not in cfg.force:  # resume here (another rank count) starts over, as its force says
                raise
            self.force = True
            self.tcfg, self.universal = self.fit_to_checkpoint()
        self.per_step = self.world * self.tcfg.grad_accum
        # Offline, the head needs three tensors of the target (embedding, lm_head, final norm), read from its
        # files; only online training (hidden states computed on the fly) loads the whole target.
        target = load_target(cfg, self.device) if self.tcfg.online else None
        weights = TargetWeights.of(target) if self.tcfg.online else load_weights(cfg, self.dtype)
        layers = capture_layers(cfg, weights.config)
        head, self.draft_rows = make_head(cfg, weights, self.device, self.dtype)
        if target is not None:   # online: the target's own embedding (1 GB more per GPU at 8B as a copy)
            share_embedding(head, target)
        del weights
        self.data = load_data(cfg, target, layers, self.device, self.per_step)
        self.planned_steps = self.tcfg.max_steps or self.tcfg.epochs * self.data.steps_per_epoch
        self.warmup = warmup_steps(self.tcfg.warmup_steps, self.planned_steps)
        # With a wall-clock budget the schedule is fitted to it from the measured step time once the warmup has
        # been timed (kept in the checkpointed state, so a resumed run follows the same schedule).
        # "run": this run's id (rank 0's, kept in the checkpoints, written beside each best head): a head/ whose id
        # differs is another run's (a forced rerun's predecessor), whatever the files' times say
        self.state = {"step": 0, "best": -1.0, "bad_evals": 0, "history": [], "total_steps": self.planned_steps,
                      "run": dist.on_main(lambda: uuid.uuid4().hex)}
        self.rescore = False  # validation settings changed on resume: validate at the end whatever was validated
        # A lambda, not the bound method: LambdaLR leaves plain functions out of its (checkpointed) state.
        self.engine, self.scheduler = make_engine(head, self.tcfg, self.dtype, lambda s: self.lr_ratio(s),
                                                  self.universal)
        self.model = self.engine.module
        # The head was initialised alike on every rank; from here each rank draws its own tap noise and dropout
        # masks (with one seed the ranks' noise would be the same draws on different rows).
        torch.manual_seed(cfg.seed + self.rank)
        random.seed(cfg.seed + self.rank)
        self.average = Average(self.model, self.tcfg.ema) if self.tcfg.ema else None

    def fit_to_checkpoint(self) -> tuple[DictConfig, bool]:
        """The ``train`` settings to resume the latest checkpoint with, and whether its optimizer shards are loaded
        as a universal checkpoint. Made with other micro-batches per step than world x ``train.grad_accum`` gives
        here (another rank count: a node lost, a job moved, or a run resumed so before), and ``train.grad_accum``
        left as it was, it is resumed with the accumulation that keeps them: the same rows in each step, the same
        schedule and step count. ZeRO optimizer shards split for another rank count are converted to DeepSpeed's
        universal format (:func:`to_universal`). A ``train.grad_accum`` changed on purpose is refused by
        :meth:`resume` (a result key)."""
        tcfg = self.cfg.train
        if self.latest is None or self.force or "world" not in self.latest[1]:  # (made before: as then)
            return tcfg, False
        tag, client = self.latest
        accum = tcfg.grad_accum
        if (checkpoint_per_step(client) != self.world * accum
                and client.get("identity", {}).get("train.grad_accum", accum) == accum):
            accum = resume_accum(client, self.world, self.ckpt_dir)
        shards = dist.on_main(lambda: any((self.ckpt_dir / tag).glob("*optim_states.pt")))
        universal = shards and client["world"] != self.world
        if universal and client.get("identity", {}).get("train.optimizer", tcfg.optimizer) == "muon":
            raise CheckpointMismatchError(
                f"the training checkpoints in {self.ckpt_dir} were made on {client['world']} ranks with "
                "train.optimizer=muon, whose ZeRO shards DeepSpeed's universal conversion cannot read (it knows "
                f"Adam's moments only): resume on {client['world']} ranks, or add force=[train] to start over")
        return (tcfg if accum == tcfg.grad_accum else OmegaConf.merge(tcfg, {"grad_accum": accum})), universal

    def forced_resume(self) -> bool:
        """(Rank 0) Whether ``force=[train]`` resumes: its checkpoints were started over by a force with these very
        settings (:data:`FORCED`) and that run did not finish."""
        try:
            forced = json.loads((self.ckpt_dir / FORCED).read_text())
        except (OSError, ValueError):   # none, or torn by a power loss
            return False
        return (self.latest is not None and forced == self.identity and not checkpoint_changes(self.latest[1], self.identity)
                and self.latest[1].get("dtype") in (None, str(self.dtype).removeprefix("torch.")))

    def start_over(self) -> None:
        """Delete the checkpoints. Under ``force=[train]`` note the settings it started over with (:data:`FORCED`,
        deleted once the command has run every stage: ``train.stages.run_stages``): the same command again after a
        crash, in training or a stage after it, resumes what it started, not deleting hours of it too."""
        if dist.on_main(lambda: self.ckpt_dir.exists()):   # (rank 0's view: one pairing)
            _remove_checkpoints(self.ckpt_dir)
        if "train" in self.cfg.force and dist.is_main():
            self.ckpt_dir.mkdir(parents=True, exist_ok=True)
            write_atomic(self.ckpt_dir / FORCED, json.dumps(self.identity))

    def lr_ratio(self, step: int) -> float:
        """The learning-rate multiplier at ``step`` under the current plan (``state`` changes when refitted)."""
        t, s = self.tcfg, self.state
        return lr_lambda(step, self.warmup, s["total_steps"], t.min_lr_ratio, s.get("segment"))

    def resume(self) -> None:
        """Continue from the latest complete checkpoint. ``force=[train]`` deletes the checkpoints and starts
        over (but for the run it started itself, repeated after a crash: :meth:`forced_resume`); without it, one made with other result keys is refused (:class:`CheckpointMismatchError`); a
        changed budget refits the schedule (:func:`replan`); changed validation settings score from scratch; the
        leftovers of a crash before the first checkpoint are deleted."""
        cfg, state, ckpt_dir = self.cfg, self.state, self.ckpt_dir
        if dist.is_main() and (self.out / "head.old").exists() and not (self.out / "head").exists():
            (self.out / "head.old").rename(self.out / "head")   # a crash inside save_best: the previous best head
        if self.latest is None:
            if ckpt_dir.exists() and any(p.name != FORCED for p in ckpt_dir.iterdir()) and "train" not in cfg.force:
                log(f"[train] {ckpt_dir} holds no complete checkpoint; starting fresh")  # a crash before the first
            self.start_over()
            return
        tag, client = self.latest
        changed = checkpoint_changes(client, self.identity)
        made_in, now = client.get("dtype"), str(self.dtype).removeprefix("torch.")
        if made_in not in (None, now):  # DeepSpeed's optimizer and its shards differ (bf16: its BF16 optimizer)
            changed.append(f"dtype ({made_in} in the checkpoint, {now} now)")
        if checkpoint_per_step(client) == self.per_step:  # another split of the same step (fit_to_checkpoint)
            changed = [k for k in changed if k != "train.grad_accum"]
        blocking = [k for k in changed if k not in RESUMABLE["train"]]
        if self.force:
            log(f"[train] force=[train]: deleting {ckpt_dir} and starting over"
                + (f" ({', '.join(blocking)} changed)" if blocking else ""))
            self.start_over()
            return
        if "train" in cfg.force:
            log(f"[train] force=[train] started these checkpoints over with these very settings and the run did not "
                f"finish: resuming from {tag} (delete {ckpt_dir} to start over once more)")
        if blocking:
            raise CheckpointMismatchError(
                f"the training checkpoints in {ckpt_dir} were made with other settings: {', '.join(blocking)} "
                f"changed. Add force=[train] to start over (the checkpoints are then deleted), or set the "
                f"old value(s) back to resume")
        if self.universal:
            tag = to_universal(ckpt_dir / tag, 60 * cfg.hang_minutes)
        _, client = self.engine.load_checkpoint(str(ckpt_dir), tag=tag, load_module_strict=False)
        dist.barrier()
        if self.universal and dist.is_main():  # a converted copy: the next checkpoint is saved for this rank count;
            shutil.rmtree(ckpt_dir / f"{tag}.old", ignore_errors=True)  # renamed first (an earlier deletion cut
            os.replace(ckpt_dir / tag, ckpt_dir / f"{tag}.old")          # short goes first), a crash while deleting
            shutil.rmtree(ckpt_dir / f"{tag}.old", ignore_errors=True)  # leaves no partial copy a rerun would load
        state.update(client["state"])
        rng = client["rng"]
        if not isinstance(rng, list) or self.rank < len(rng):  # one per rank (a dict: made before); a rank added
            set_rng_state(rng[self.rank] if isinstance(rng, list) else rng)  # since keeps its seed's stream
        if self.average:
            torch._foreach_copy_(self.average.shadow, [t.to(self.device) for t in client["average"]])
        if changed:
            log(f"[train] resuming with changed {', '.join(changed)}")
        # A best head this run saved after the checkpoint (then a crash; this run's id: not the head of a run forced
        # over, nor one of a checkpoint made before run ids): its score stands, or a later, worse head replaces it,
        # and the validations replayed up to its step do not count towards early stopping. Its step may be the
        # checkpoint's own: an epoch's or the run's last validation runs after that step's checkpoint, which the
        # run's last checkpoint then leaves as it is (rewriting it in place could tear it). Rank 0's reading for all:
        # ranks disagreeing would stop apart (a hang).
        saved = self.out / "head" / "metrics.json"
        newer = dist.broadcast(json.loads(saved.read_text()) if dist.is_main() and saved.exists() else None)
        if (newer and newer.get("run") == state["run"] and newer["step"] >= state["step"]
                and newer.get("sim_tau", -1.0) > state["best"]):
            state.update(best=newer["sim_tau"], best_step=newer["step"], bad_evals=0)
            log(f"[train] head/ holds a better head saved at step {newer['step']}, after this checkpoint was (sim_tau "
                f"{newer['sim_tau']:.3f}): kept unless beaten")
        why = None
        if any(k in changed for k in ("train.val_tokens", "train.val_steps")):
            # other rows or another number of draft steps: a score on another scale. Against the old best, a
            # lower val_steps would never improve (head/ kept as it was, early stop after patience validations)
            why = "validation settings changed"
        elif (state.get("best_step", -1) >= 0 and client["state"].get("run")
              and (newer is None or newer.get("run") != state["run"])):
            # this run's best head is gone (head/ deleted, or another run's saved over it): unless a validation beat
            # the checkpoint's score, that head would be the one exported (a checkpoint made before run ids: kept)
            why = "head/ does not hold this run's best head (deleted, or another run's)"
        if why:
            state.update(best=-1.0, bad_evals=0, best_step=-1)
            self.rescore = True
            log(f"[train] {why}: the best score starts over (head/ is replaced at the next validation, at the end at "
                "the latest)")
        if any(k in changed for k in ("train.max_minutes", "train.max_steps", "train.epochs")):
            # the ratio reached is the restored scheduler's (whatever warmup and plan the run had)
            reached = self.scheduler.get_last_lr()[0] / self.scheduler.base_lrs[0]
            ratio = replan(state, self.planned_steps, self.warmup, self.tcfg.min_lr_ratio, reached)
            for group, base in zip(self.scheduler.optimizer.param_groups, self.scheduler.base_lrs, strict=True):
                group["lr"] = base * ratio  # the next step already at the new plan's rate
            log(f"[train] new budget: from step {state['step']} the learning rate is {ratio:.3g} x train.lr, "
                + (f"warming up to step {self.warmup}, then a cosine" if state.get("segment") is None else "a cosine")
                + f" to {self.tcfg.min_lr_ratio:g} x at step {state['total_steps']} (refitted to the time budget as "
                "steps are timed); force=[train] starts over with a fresh schedule")
        log(f"[train] resumed from {self.latest[0]} (step {state['step']}, {state['total_steps']} steps planned)")

    def train(self) -> None:
        """Optimizer steps until the planned steps, ``train.max_minutes`` or early stopping end the run:
        validation every ``train.eval_every`` steps and at each epoch's end, a checkpoint every
        ``train.checkpoint_every`` steps, then a last validation (unless one just ran) and checkpoint."""
        cfg, tcfg, state = self.cfg, self.tcfg, self.state
        self.tracker = Tracker(cfg, "train", self.out / "metrics.jsonl", resume_step=state["step"])
        log(f"[train] {self.kind}: {sum(p.numel() for p in self.model.parameters() if p.requires_grad) / 1e6:.2f}M "
            f"trainable parameters, {len(self.data.lengths)} rows, {sum(self.data.lengths)} tokens/epoch, "
            f"{self.data.steps_per_epoch} steps/epoch, {self.planned_steps} steps planned, "
            f"world {self.world} x accumulation {tcfg.grad_accum}, device {self.device}, {self.dtype}; "
            f"{len(self.data.val_rows)} validation rows, shared by the ranks")
        if not self.data.val_rows:
            log("[train] warning: no validation rows (data.validation_fraction=0, or every row's split is train): "
                "nothing measures the head while it trains, so the last head is kept (saved at each validation "
                "point and at the end) and early stopping is off; hold rows out (data.validation_fraction > 0) to "
                "keep the best head instead")
        self.run_start = time.time()  # this process (throughputs)
        self.start = self.run_start - state.get("train_s", 0.0)  # the whole run: the budget counts earlier runs too
        self.side_s = 0.0  # time spent validating and checkpointing (excluded from the training throughput)
        self.tokens_seen, self.last_log = 0, (time.time(), 0)  # tokens of this process; (time, tokens) at the last log
        self.bar = progress(total=state["total_steps"], initial=state["step"], desc=f"train {self.kind}", unit="step")
        self.timed_from = (state["step"], time.time())  # the schedule is fitted to the budget from these steps' time
        stop = False
        while not stop and state["step"] < state["total_steps"]:
            epoch, offset = divmod(state["step"], self.data.steps_per_epoch)
            stream = prefetch(self.data.train, self.epoch_batches(epoch, offset), 0 if tcfg.online else tcfg.prefetch)
            for _ in range(offset, self.data.steps_per_epoch):
                stats = self.step(islice(stream, tcfg.grad_accum))
                timed_out = self.fit_to_budget()
                if state["step"] % tcfg.log_every == 0 or state["step"] == state["total_steps"]:
                    self.log_step(stats, epoch)
                if state["step"] % tcfg.eval_every == 0:
                    self.evaluate("every")
                if state["step"] % tcfg.checkpoint_every == 0:
                    self.checkpoint()
                stop = self.should_stop(timed_out)
                if stop or state["step"] >= state["total_steps"]:
                    break
            stream.close()
            if not stop and state["step"] % self.data.steps_per_epoch == 0 and state["step"] % tcfg.eval_every != 0:
                self.evaluate("epoch")
        self.bar.close()
        if self.rescore or not state["history"] or state["history"][-1]["step"] != state["step"]:
            self.evaluate("end")
        self.checkpoint()

    def epoch_batches(self, epoch: int, offset: int) -> list[list[int]]:
        """This rank's micro-batches of steps ``offset`` .. the end of ``epoch``: rank r takes micro-batches
        r*G .. r*G+G-1 of each step (G = ``train.grad_accum``)."""
        n, G = self.data.steps_per_epoch, self.tcfg.grad_accum
        order = epoch_order(self.data.lengths, self.tcfg.micro_batch_tokens, self.cfg.seed * 1000 + epoch,
                            n * self.per_step)
        return [order[s * self.per_step + self.rank * G + g] for s in range(offset, n) for g in range(G)]

    def step(self, batches: Iterable[dict]) -> list[StepStats]:
        """One optimizer step: forward, backward and the engine's step on each of this rank's micro-batches
        (DeepSpeed steps the optimizer after the last of them)."""
        stats, norms = [], None
        reach = self.kind == "eagle3" and self.cfg.head.ttt_reach_topk > 0   # its counts are taken before the mask
        if self.tcfg.loss_norm == "token" and (self.per_step > 1 or reach):   # (only then all built before the first)
            batches = list(batches)
            norms = self.loss_norms(batches)
        for batch in batches:
            stats.append(compute(self.model, self.kind, batch, self.draft_rows, self.cfg, self.tcfg.positions,
                                 _n_steps(self.cfg), self.tcfg.autocast, norms))
            self.engine.backward(stats[-1].loss)
            self.engine.step()
            self.tokens_seen += batch["tokens"]
        self.state["step"] += 1
        if self.average:
            self.average.update(self.state["step"])
        self.bar.update(1)
        return stats

    def loss_norms(self, batches: list[dict]) -> torch.Tensor:
        """``train.loss_norm=token``: each draft step's positions in this optimizer step's micro-batches on every
        rank (one all-reduce), per micro-batch. DeepSpeed averages the micro-batches' gradients; with each one's
        loss a sum over its positions divided by this, every position of the step weighs the same, whatever
        micro-batch and rank it trained in: the step's gradient is that of its rows in one batch. (A step of one
        micro-batch, its own mean: the same, and not computed, but with GRIFFIN's reach mask, which the counts
        precede: steps k >= 1 are then sums over the reached rows divided by all rows, on any split.)"""
        counts = sum(loss_counts(self.model.t2d, batch, _n_steps(self.cfg), self.tcfg.positions,
                                 self.kind == "medusa" and self.cfg.head.loss == "ce") for batch in batches)
        return dist.all_reduce_sum(counts) / self.per_step

    def fit_to_budget(self) -> bool:
        """With ``train.max_minutes``: whether the budget is spent and, once the warmup steps are timed, the
        schedule fitted to what is left (:func:`fit_schedule`). Rank 0's clock decides, so every rank plans
        the same steps and stops after the same step."""
        tcfg, state = self.tcfg, self.state
        if not tcfg.max_minutes:
            return False
        elapsed_s, timed_s = dist.broadcast((time.time() - self.start, time.time() - self.timed_from[1]))
        timed = state["step"] - self.timed_from[0]
        if timed >= max(1, self.warmup) and fit_schedule(state, tcfg, timed_s / timed, elapsed_s,
                                                                 self.planned_steps, self.lr_ratio(state["step"])):
            self.bar.total = state["total_steps"]
        return elapsed_s / 60 >= tcfg.max_minutes

    def log_step(self, stats: list[StepStats], epoch: int) -> None:
        """The last step's losses, accuracies and simulated tau (of its micro-batches on every rank: one
        all-reduce), the learning rate and the throughput since the last log (all ranks' tokens), to the tracker
        and the progress bar."""
        n = _n_steps(self.cfg)
        sums = sum(tallies(s.correct, s.weight) for s in stats)
        loss_sums = torch.stack([sum(s.losses[k] for s in stats) for k in range(n)]).to(sums)
        extra = sums.new_tensor([len(stats), self.tokens_seen - self.last_log[1]])
        sums = dist.all_reduce_sum(torch.cat([sums.flatten(), loss_sums, extra]))
        metrics = figures(sums[:4 * n].view(n, 4))
        *loss_sums, batches, tokens = sums[4 * n:].tolist()
        mean_losses = [v / batches for v in loss_sums]
        now = time.time()
        rate = tokens / max(now - self.last_log[0], 1e-9)
        self.last_log = (now, self.tokens_seen)
        record = {"train/loss": sum(cfg_decay(self.cfg) ** k * v for k, v in enumerate(mean_losses)),
                  **{f"train/loss_{k}": v for k, v in enumerate(mean_losses)},
                  **{f"train/{k}": v for k, v in metrics.items()},
                  "lr": self.scheduler.get_last_lr()[0], "tokens_per_s": rate, "epoch": epoch}
        self.tracker.log(record, step=self.state["step"])
        self.bar.set_postfix(loss=f"{record['train/loss']:.3f}", acc0=f"{metrics['acc_0']:.2f}", tok_s=f"{rate:.0f}")

    def evaluate(self, reason: str) -> None:
        """Validate (the weights' average with ``train.ema``; the rows shared among the ranks, :func:`validate`);
        the figures, the same on every rank, decide whether the head is the best so far (then saved to
        ``<out>/head``) and count towards early stopping."""
        t0 = time.time()
        state = self.state
        if not self.data.val_rows:   # nothing to score (every figure would be 1.0, the first head "best" for good,
            with self.average.swapped_in() if self.average else nullcontext():   # then an early stop): the last
                self.save_best({"rows": 0})                                     # head is kept
            state["history"].append({"step": state["step"], "reason": reason, "rows": 0})
            self.side_s += time.time() - t0
            return
        with self.average.swapped_in() if self.average else nullcontext():
            metrics = validate(self.model, self.kind, self.cfg, self.data.val, self.data.val_rows, self.draft_rows,
                               max(self.tcfg.micro_batch_tokens, 2048))
            improved = metrics["sim_tau"] > state["best"] + 1e-4
            if improved:
                state.update(best=metrics["sim_tau"], best_step=state["step"], bad_evals=0)
                self.save_best(metrics)
        if not improved and state["step"] > state.get("best_step", -1):  # not a replay up to a head kept (resume)
            state["bad_evals"] += 1
        state["history"].append({"step": state["step"], "reason": reason, **metrics})
        self.tracker.log({f"val/{k}": v for k, v in metrics.items()}, step=state["step"])
        log(f"[train] step {state['step']} validation ({reason}): sim_tau {metrics['sim_tau']:.3f}, chain_tau "
            f"{metrics['chain_tau']:.3f}, decode_tau {metrics['decode_tau']:.3f} (k={metrics['decode_k']}), acc "
            + " ".join(f"{metrics[f'acc_{k}']:.2f}" for k in range(_n_steps(self.cfg, validation=True)))
            + (" *best*" if improved else ""))
        self.side_s += time.time() - t0

    def save_best(self, metrics: dict[str, float]) -> None:
        """Rank 0 replaces ``<out>/head`` with the current head and its validation ``metrics.json`` (the old head
        renamed aside first: a crash in between leaves one of the two, ``head`` or ``head.old``, complete)."""
        if dist.is_main():
            tmp, head, old = self.out / "head.tmp", self.out / "head", self.out / "head.old"
            shutil.rmtree(tmp, ignore_errors=True)
            save_head(self.model, tmp)
            (tmp / "metrics.json").write_text(json.dumps({"step": self.state["step"], "run": self.state["run"],
                                                          **metrics}, indent=2))
            fsync_tree(tmp)   # on disk before the renames: a node crash must not leave a torn head as the best
            if head.exists():
                shutil.rmtree(old, ignore_errors=True)
                head.rename(old)
            tmp.rename(head)
            fsync_dir(self.out)
            shutil.rmtree(old, ignore_errors=True)

    def checkpoint(self) -> None:
        """Save ``step<N>`` (DeepSpeed's engine, optimizer and scheduler; ``state``, each rank's RNG and the run's
        training time as client state; not the frozen weights, e.g. the target's embedding, 1 GB at 8B) and keep
        the newest ``train.keep_checkpoints``."""
        t0 = time.time()
        state, ckpt_dir = self.state, self.ckpt_dir
        tag = f"step{state['step']:07d}"
        latest = ckpt_dir / "latest"
        if dist.on_main(lambda: latest.exists() and latest.read_text().strip() == tag):
            return  # saved at this step already (a run ending on a checkpoint step, a resume with nothing to train):
            #         rewritten in place, a crash mid-save would tear the one checkpoint `latest` names
        if dist.is_main():
            # a folder of this tag is a save a crash cut short (`latest` never named it): its shards, of another
            # rank count maybe, would mix with this save's (a universal conversion counts the ranks by the files)
            shutil.rmtree(ckpt_dir / tag, ignore_errors=True)
            (ckpt_dir / tag).mkdir(parents=True, exist_ok=True)
            write_atomic(ckpt_dir / tag / "client.json", json.dumps({
                "fingerprint": self.fingerprint, "world": self.world, "per_step": self.per_step, "step": state["step"],
                "identity": self.identity, "dtype": str(self.dtype).removeprefix("torch.")}))
        state["train_s"] = time.time() - self.start
        client = {"state": state, "rng": dist.all_gather_objects(rng_state()),  # saved by rank 0 only: every rank's
                  "average": self.average.shadow if self.average else None}
        self.engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state=client, save_latest=False,
                                    exclude_frozen_parameters=True)
        dist.barrier()  # every rank's shards written: only now may `latest` name this tag (DeepSpeed's own `latest`
        #                 is written by rank 0 before the other ranks have finished theirs), once they are on disk:
        if dist.local_rank() == 0:   # DeepSpeed writes without fsync (after a node crash `latest` could name empty
            fsync_tree(ckpt_dir / tag)   # files); one process a node syncs what its ranks wrote (the node's cache)
        dist.barrier()
        if dist.is_main():
            write_atomic(ckpt_dir / "latest", tag)
            # the newest up to this one; a tag past it is a save a crash cut short (this run resumed before it):
            # kept by name, it would outrank this one and the rotation would delete the checkpoint `latest` names
            tags = sorted(p.name for p in ckpt_dir.iterdir() if p.is_dir() and p.name.startswith("step"))
            kept = [t for t in tags if t <= tag][-self.tcfg.keep_checkpoints:]
            for old in [*(set(tags) - set(kept)), *(p.name for p in ckpt_dir.glob("universal-*"))]:
                shutil.rmtree(ckpt_dir / old, ignore_errors=True)  # (a conversion a crash left: to_universal)
            for old in ckpt_dir.glob("universal.failed.*"):
                old.unlink(missing_ok=True)
        dist.barrier()
        self.side_s += time.time() - t0

    def should_stop(self, timed_out: bool) -> bool:
        """Early stopping (``train.patience`` validations without improvement; null: none) or the time budget spent."""
        stop = False
        if self.tcfg.patience is not None and self.state["bad_evals"] >= self.tcfg.patience:
            log(f"[train] early stop: no validation improvement in {self.tcfg.patience} evaluations")
            stop = True
        if timed_out:
            log(f"[train] stopping at train.max_minutes={self.tcfg.max_minutes}")
            stop = True
        return stop

    def finish(self) -> dict:
        """Check that every rank ran the same steps, write ``summary.json`` and return the best head's figures."""
        state, out = self.state, self.out
        elapsed, own = time.time() - self.start, time.time() - self.run_start  # the whole run's / this process's
        best = dist.on_main(lambda: json.loads((out / "head" / "metrics.json").read_text()))
        steps_per_rank = dist.all_gather_objects(state["step"])
        if len(set(steps_per_rank)) != 1:
            raise RuntimeError(f"ranks ran different step counts {steps_per_rank}: a rank-local decision (bug)")
        tokens = self.tokens_seen * self.world
        summary = {"steps": state["step"], "steps_per_rank": steps_per_rank, "best": best, "wall_s": round(elapsed, 1),
                   "tokens_per_s": round(tokens / max(own, 1e-9), 1),
                   "train_tokens_per_s": round(tokens / max(own - self.side_s, 1e-9), 1),
                   "validation_checkpoint_s": round(self.side_s, 1),
                   "data": {"rows": len(self.data.lengths), "tokens": sum(self.data.lengths)},  # the training rows used
                   "draft_vocab_size": self.model.d2t.numel(),
                   "peak_rss_gib": round(peak_rss_gib(), 2), "history": state["history"],
                   "config": OmegaConf.to_container(self.tcfg, resolve=True)}
        if dist.is_main():
            (out / "summary.json").write_text(json.dumps(summary, indent=2))
        self.tracker.summary({f"best/{k}": v for k, v in best.items() if isinstance(v, (int, float))})
        kept = (f"best validation sim_tau {best['sim_tau']:.3f}" if "sim_tau" in best else
                "no validation rows: the last head")
        log(f"[train] done: {state['step']} steps in {elapsed / 60:.1f} min, {summary['tokens_per_s']} tok/s; "
            f"{kept} (step {best['step']}) -> {out / 'head'}")
        return {"head": str(out / "head"), "best": best, "steps": state["step"], "tokens_per_s": summary["tokens_per_s"]}


class CheckpointMismatchError(UserError):
    """The train stage's checkpoints were made with settings that change the result (names the keys)."""


def checkpoint_identity(cfg: DictConfig) -> dict:
    """What a training checkpoint depends on, by dotted key: the train stage's config keys (bookkeeping
    keys of train.stages.IGNORED left out) and the upstream stages' output ids."""
    upstream = {f"upstream {name} output": oid for name, oid in upstream_ids(cfg, "train").items()}
    return {**flat_config(cfg, "train"), **upstream}   # (JSON values: output ids are strings or None)


def checkpoint_changes(client: dict, identity: dict) -> list[str]:
    """Keys whose value differs between a checkpoint's ``client.json`` and ``identity`` (a checkpoint
    written before identities were stored: ``the checkpoint format``)."""
    old = client.get("identity")
    if old is None:
        return ["the checkpoint format (written by an older version)"]
    return sorted(k for k in old.keys() | identity.keys() if old.get(k) != identity.get(k))


def replan(state: dict, planned_steps: int, warmup: int, min_ratio: float, reached: float) -> float:
    """A resumed run whose budget (max_minutes / max_steps / epochs) changed: the planned steps are those of the
    new budget, fitted again to train.max_minutes once steps are timed. The cosine continues from ``reached``, the
    learning-rate ratio the run had, to its end at the new total (:func:`lr_lambda`): no jump. A run still inside
    the new plan's ``warmup`` and below its ramp (a short run extended: a smoke test's run directory reused for the
    real run, annealed to min_lr_ratio) warms up on instead: continued from its annealed ratio, the whole real run
    would train at a tenth of the rate. Returns the ratio at the current step."""
    step = state["step"]
    state.update(total_steps=max(planned_steps, step), fitted=False)
    state["segment"] = None if step < warmup and reached < (step + 1) / warmup else [step, reached]
    return lr_lambda(step, warmup, state["total_steps"], min_ratio, state["segment"])


def latest_checkpoint(ckpt_dir: Path) -> tuple[str, dict] | None:
    """(tag, ``client.json``) of the checkpoint ``<ckpt_dir>/latest`` names, as rank 0 reads them (every rank
    decides alike); None when there is no complete one. When that tag is gone (deleted by hand) or its
    ``client.json`` torn, the newest tag before it: complete, as ``latest`` named it before (a tag after it may be
    a save a crash cut short)."""
    return dist.on_main(lambda: _newest_complete(ckpt_dir))


def _newest_complete(ckpt_dir: Path) -> tuple[str, dict] | None:
    """:func:`latest_checkpoint` as rank 0 finds it."""
    found = None
    if (ckpt_dir / "latest").exists():
        named = (ckpt_dir / "latest").read_text().strip()
        tags = sorted(p.parent.name for p in ckpt_dir.glob("step*/client.json") if p.parent.name <= named)
        for tag in reversed(tags):
            try:   # torn: a save before checkpoints were fsynced, cut by a node crash
                found = (tag, json.loads((ckpt_dir / tag / "client.json").read_text()))
                break
            except (json.JSONDecodeError, UnicodeDecodeError):
                log(f"[train] {ckpt_dir / tag / 'client.json'} does not parse (torn by a crash?): not resumed from")
        if found and found[0] != named:   # `latest` names it again (a save of the gone tag's step is no rewrite)
            log(f"[train] {ckpt_dir / named}, which `latest` names, is gone or torn: resuming from {found[0]}, the "
                "newest checkpoint before it")
            write_atomic(ckpt_dir / "latest", found[0])
    return found


def checkpoint_per_step(client: dict) -> int:
    """Micro-batches per optimizer step of a checkpoint (its ``client.json``): world x accumulation."""
    return client.get("per_step") or client.get("world", 1) * client.get("identity", {}).get("train.grad_accum", 1)


def resume_accum(client: dict, world: int, ckpt_dir: Path) -> int:
    """The accumulation with which ``world`` ranks resume a checkpoint (its ``client.json``) made on another rank
    count: its micro-batches per step shared equally (:class:`CheckpointMismatchError` when they cannot be)."""
    per_step, made_on = checkpoint_per_step(client), client["world"]
    if per_step % world:
        fits = ", ".join(str(n) for n in range(1, per_step + 1) if per_step % n == 0)
        raise CheckpointMismatchError(
            f"the training checkpoints in {ckpt_dir} were made on {made_on} ranks with {per_step} micro-batches per "
            f"step, which {world} ranks cannot share equally. Resume on {fits} ranks (each accumulating "
            f"{per_step} / ranks), or add force=[train] to start over (the checkpoints are then deleted)")
    log(f"[train] the checkpoints were made with {per_step} micro-batches per step ({made_on} ranks): on {world} "
        f"ranks each accumulates {per_step // world} (train.grad_accum), the same rows per step")
    return per_step // world


def to_universal(ckpt: Path, timeout_s: float) -> str:
    """Rank 0 converts checkpoint ``ckpt``, whose ZeRO optimizer shards are split for another rank count, into
    DeepSpeed's universal format beside it (``universal-<tag>``; DeepSpeed's ``ds_to_universal``, its log in
    ``universal.log``), which any rank count loads; returns its tag. The other ranks poll for it, no collective
    held open (minutes at 8B on a shared file system), and stop with rank 0: its failure file, or its heartbeat
    gone still (:class:`train.stages.Pulse`); both named for this attempt, so an earlier attempt's are never read.
    A conversion past ``timeout_s`` (``hang_minutes``) is stopped as hung."""
    root = ckpt.parent
    out, tmp = root / f"universal-{ckpt.name}", root / f"universal-{ckpt.name}.tmp"
    attempt = dist.on_main(lambda: uuid.uuid4().hex[:12])
    failed, alive = root / f"universal.failed.{attempt}", root / f"universal.alive.{attempt}"
    if dist.is_main() and not out.exists():
        with stages.heartbeat(alive, stages.HEARTBEAT_S):
            try:
                for old in root.glob("universal.failed.*"):
                    old.unlink(missing_ok=True)
                shutil.rmtree(tmp, ignore_errors=True)  # a conversion a crash cut short
                convert_to_universal(ckpt, tmp, timeout_s)
                os.replace(tmp, out)
            except Exception as e:
                shutil.rmtree(tmp, ignore_errors=True)  # its fragments: twice the optimizer shards
                failed.write_text(str(e))
                raise
    pulse = stages.Pulse(alive)
    while not out.exists():
        if failed.exists():
            raise RuntimeError(f"rank 0 failed to convert {ckpt} (see its log); this rank stops too")
        if why := pulse.problem("rank 0", f"converting {ckpt}"):
            raise RuntimeError(why)
        time.sleep(2.0)
    dist.barrier()
    return out.name


def convert_to_universal(ckpt: Path, out: Path, timeout_s: float) -> None:
    """DeepSpeed's ``ds_to_universal`` on ``ckpt`` into ``out`` (a subprocess: its worker pool forks), after a
    check that the disk holds its fragments and result (~twice the optimizer shards)."""
    shards = sum(f.stat().st_size for f in ckpt.iterdir() if f.name.endswith("optim_states.pt"))
    need, free = 2 * shards + sum(f.stat().st_size for f in ckpt.glob("*model_states.pt")), shutil.disk_usage(ckpt).free
    if free < need:
        raise CheckpointMismatchError(
            f"converting {ckpt} for another rank count needs ~{need / 2**30:.1f} GiB free beside it and "
            f"{free / 2**30:.1f} GiB are: free some, or resume on the rank count it was made on")
    log(f"[train] converting {ckpt} to a universal checkpoint (its optimizer shards were split for another rank "
        f"count; ~{need / 2**30:.1f} GiB)")
    with open(ckpt.parent / "universal.log", "w") as logfile:
        try:
            done = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                                   str(ckpt), "--output_folder", str(out), "--inject_missing_state"], stdout=logfile,
                                  stderr=subprocess.STDOUT, env=dist.env_without_launcher(), check=False,
                                  timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"DeepSpeed's ds_to_universal on {ckpt} ran past hang_minutes ({timeout_s / 60:g}): hung "
                               f"(log: {ckpt.parent / 'universal.log'}); raise hang_minutes for a slow file system, or "
                               "resume on the rank count the checkpoint was made on") from None
    (ckpt.parent / "latest_universal").unlink(missing_ok=True)  # the converter's; `latest` stays ours
    if done.returncode:
        raise RuntimeError(f"DeepSpeed's ds_to_universal failed on {ckpt} (log: {ckpt.parent / 'universal.log'}); "
                           "resume on the rank count the checkpoint was made on, or add force=[train]")


def _remove_checkpoints(ckpt_dir) -> None:
    dist.barrier()
    if dist.is_main():
        shutil.rmtree(ckpt_dir)
    dist.barrier()


def _n_steps(cfg: DictConfig, validation: bool = False) -> int:
    """Draft steps trained (TTT steps) or validated (``train.val_steps``: comparable across TTT depths)."""
    if cfg.head.type != "eagle3":
        return cfg.head.num_heads
    return cfg.train.val_steps if validation else cfg.head.ttt_steps


def cfg_decay(cfg: DictConfig) -> float:
    return cfg.head.ttt_decay if cfg.head.type == "eagle3" else cfg.head.decay

