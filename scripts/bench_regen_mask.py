"""Regeneration's decode steps on an unpadded batch (every row one length), their mask passed 4D (what
``data.regenerate.stream`` does where :func:`train.target.masks_single_queries` says so) against 2D (which
transformers drops, leaving SDPA its grouped-query kernel), the modes alternating in one process.

    .venv/bin/python scripts/bench_regen_mask.py                      # default target, 64 x 100 tokens, 48 new
    .venv/bin/python scripts/bench_regen_mask.py --rows 16 --prompt 300 --new 64 --rounds 4

Prints each round's seconds per mode, the best tok/s, and how many greedy answers the two modes share (bf16
near-ties of random-token prompts may part).
"""

from __future__ import annotations

import argparse
import time
from collections import deque

import torch
from _bench import compose

import data.regenerate as regen
from data.engines import LocalTarget


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=100, help="prompt tokens per row")
    ap.add_argument("--new", type=int, default=48, help="new tokens per row (no EOS)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("overrides", nargs="*", help="pipeline config overrides (model=...)")
    args = ap.parse_args()
    model = LocalTarget(compose(["tracking=none", *args.overrides]))()
    if not regen.masks_single_queries(model):
        raise SystemExit(f"{model.device} / {model.config._attn_implementation}: this target's decode steps keep a 2D mask")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, model.config.vocab_size // 2, (args.prompt,), generator=g).tolist()
               for _ in range(args.rows)]
    rule, seconds, answers = regen.masks_single_queries, {"4D": [], "2D": []}, {}
    try:
        for r in range(args.rounds):
            for mode in ("4D", "2D") if r % 2 == 0 else ("2D", "4D"):
                regen.masks_single_queries = rule if mode == "4D" else (lambda m: False)
                start, got = time.perf_counter(), {}
                for finished in regen.stream(model, deque(enumerate(prompts)), args.rows, args.rows, args.new, set(), 0):
                    got.update(finished)
                seconds[mode].append(time.perf_counter() - start)
                answers[mode] = [got[j].tokens for j in range(args.rows)]
            print(f"round {r}: " + ", ".join(f"{m} {s[-1]:.2f} s" for m, s in seconds.items()), flush=True)
    finally:
        regen.masks_single_queries = rule
    same = sum(a == b for a, b in zip(answers["4D"], answers["2D"], strict=True))
    print(f"{model.dtype}, {args.rows} rows x {args.prompt} tokens, {args.new} new: "
          + ", ".join(f"{m} best {args.rows * args.new / min(s):.0f} tok/s" for m, s in seconds.items())
          + f"; answers identical {same}/{args.rows}")


if __name__ == "__main__":
    main()
