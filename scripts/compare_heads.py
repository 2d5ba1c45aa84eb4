"""Is one trained head better than another, or is it the prompts? Both are scored row by row on the same
validation rows, and the difference comes with a paired bootstrap interval over those rows.

    .venv/bin/python scripts/compare_heads.py HEAD_A HEAD_B [--samples 2000] [key=value ...]

HEAD_A / HEAD_B: saved heads (``<run_dir>/train/head``) of one type, trained on the same target. The rows
are the validation split of the run the ``key=value`` Hydra overrides name (its data and extract stages,
e.g. ``run_dir=outputs/smollm2-135m/eagle3``; default: the default run). Per head: simulated tau and
``decode_tau``, the acceptance length of a chain decoder drafting ``export.num_speculative_tokens`` tokens
per pass (Medusa: its heads) walked along the rows (the target's greedy answers): what
``scripts/vllm_check.py`` measures in vLLM, on every validation row instead of 8-16 prompts. The interval
resamples rows (prompts), the unit a set of prompts varies by.

An EAGLE-3 head tapping other layers than the run's extract holds (``head.aux_layers``) reads them from
its own run (the folder above ``train/head``), whose data stage must have written the run's data.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from heads.io import head_type, load_head  # noqa: E402
from train.config import compose  # noqa: E402
from train.extract import capture_layers  # noqa: E402
from train.loop import Batches, Data, decode_k, decode_tau, load_data, summarise, validation_rows  # noqa: E402
from train.stages import upstream_ids  # noqa: E402
from train.target import load_weights  # noqa: E402


def paired_interval(a: list[list[int]], b: list[list[int]], samples: int, seed: int = 0) -> tuple[float, float]:
    """95% bootstrap interval of tau(a) - tau(b), rows resampled together; tau = 1 + accepted / passes
    over the rows drawn (each row: its accepted draft tokens per pass)."""
    acc_a, acc_b = torch.tensor([float(sum(r)) for r in a]), torch.tensor([float(sum(r)) for r in b])
    n_a, n_b = torch.tensor([float(len(r)) for r in a]), torch.tensor([float(len(r)) for r in b])
    idx = torch.randint(len(a), (samples, len(a)), generator=torch.Generator().manual_seed(seed))
    diff = acc_a[idx].sum(1) / n_a[idx].sum(1).clamp(min=1) - acc_b[idx].sum(1) / n_b[idx].sum(1).clamp(min=1)
    low, high = torch.quantile(diff, torch.tensor([0.025, 0.975])).tolist()
    return low, high


def own_rows(path: Path, head, cfg, data: Data, overrides: list[str], target_config) -> Batches:
    """The validation rows with the hidden states ``head`` reads: the run's, or (an EAGLE-3 head tapping
    other layers) its own run's, refused unless that run's data stage wrote the same rows (its output id)."""
    if cfg.head.type != "eagle3" or capture_layers(cfg, target_config)[:-1] == head.config.aux_layers:
        return data.val
    taps = head.config.aux_layers
    run = path.resolve().parents[1]
    own = compose(["tracking=none", *overrides, f"run_dir={run}", f"head.aux_layers=[{','.join(map(str, taps))}]"])
    if upstream_ids(own, "extract")["data"] != upstream_ids(cfg, "extract")["data"]:
        sys.exit(f"compare_heads: {path} taps layers {taps}, which {cfg.run_dir} did not extract, and its own run "
                 f"{run} holds other data: compare heads trained on the same data")
    return load_data(own, None, capture_layers(own, target_config), torch.device("cpu"), 1).val


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("heads", nargs=2, type=Path, help="two saved heads (<run_dir>/train/head)")
    parser.add_argument("--samples", type=int, default=2000, help="bootstrap resamples")
    args, overrides = parser.parse_known_args()
    logging.basicConfig(level=logging.WARNING)
    cfg = compose(["tracking=none", *overrides])
    weights = load_weights(cfg, torch.float32)
    heads = [load_head(path, weights) for path in args.heads]
    kinds = {head_type(h) for h in heads}
    if kinds != {cfg.head.type}:
        sys.exit(f"compare_heads: the heads are {sorted(kinds)}, the run read is {cfg.head.type}: name a run of "
                 f"their type (head={'|'.join(sorted(kinds))} or run_dir=...)")
    data = load_data(cfg, None, capture_layers(cfg, weights.config), torch.device("cpu"), 1)
    scores = []
    for path, head in zip(args.heads, heads, strict=True):
        rows = weights.lm_head[head.draft_ids()]
        val = own_rows(path, head, cfg, data, overrides, weights.config)
        correct, weight, walks = validation_rows(head, cfg.head.type, cfg, val, data.val_rows, rows,
                                                 max(cfg.train.micro_batch_tokens, 2048))
        passes = sum(map(len, walks.values()))
        scores.append((summarise(correct, weight)["sim_tau"], decode_tau(walks.values()), passes, walks))
    (sim_a, tau_a, _, walks_a), (sim_b, tau_b, _, walks_b) = scores
    order = sorted(walks_a)
    low, high = paired_interval([walks_a[r] for r in order], [walks_b[r] for r in order], args.samples)
    print(f"\n== two heads on {len(order)} validation rows of {cfg.run_dir}, chain decoder at k = {decode_k(cfg)} ==")
    print(f"{'head':<56} {'sim_tau':>8} {'decode_tau':>10} {'passes':>7}")
    for path, (sim, tau, n, _) in zip(args.heads, scores, strict=True):
        print(f"{str(path):<56} {sim:8.3f} {tau:10.3f} {n:7d}")
    print(f"decode_tau, first - second: {tau_a - tau_b:+.3f}, 95% interval over rows [{low:+.3f}, {high:+.3f}] "
          f"(paired bootstrap, {args.samples} samples)")


if __name__ == "__main__":
    main()
