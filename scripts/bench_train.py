"""Training benchmark on the default target: tokens/s and peak memory for EAGLE-3 and Medusa.

Trains ``--steps`` optimizer steps in a scratch copy of a finished run's data + extract stages and
prints the measured throughput (tokens of training data per second; EAGLE-3 at several TTT depths,
the public trainer ran at ~340-450 tokens/s here at 3 TTT steps) and peak RSS.

    .venv/bin/python scripts/bench_train.py [--steps 30] [--ttt 3 7] [--heads eagle3 medusa] [key=value ...]

Extra ``key=value`` arguments are Hydra overrides of the run read (and of the scratch runs), e.g.
``model=tiny-llama output_root=/tmp/x`` (the smoke test in tests/test_scripts.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
from concurrent.futures import ProcessPoolExecutor

from _bench import scratch_run


def bench(head: str, steps: int, extra: list[str], overrides: list[str]) -> dict:
    from train.log import peak_rss_gib
    from train.stages import run_stages, stage_dir

    with scratch_run([f"head={head}", *overrides], ["data", "extract"],
                     ["stages=[train]", f"train.max_steps={steps}", "train.eval_every=1000000",
                      "train.checkpoint_every=1000000", "train.warmup_steps=5", *extra]) as (cfg, _):
        run_stages(cfg)
        summary = json.loads((stage_dir(cfg, "train") / "summary.json").read_text())
        return {"model": cfg.model.name, "tokens_per_s": summary["train_tokens_per_s"], "wall_s": summary["wall_s"],
                "peak_rss_gib": peak_rss_gib()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--ttt", type=int, nargs="+", default=[3, 7])
    parser.add_argument("--micro-batch-tokens", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--heads", nargs="+", default=["eagle3", "medusa"], choices=["eagle3", "medusa"])
    args, overrides = parser.parse_known_args()
    logging.basicConfig(level=logging.WARNING)
    jobs = [(f"eagle3 TTT {k}, {mb} tok", "eagle3", [f"head.ttt_steps={k}", f"train.micro_batch_tokens={mb}"])
            for mb in args.micro_batch_tokens for k in args.ttt] * ("eagle3" in args.heads)
    jobs += [(f"medusa 3 heads, {mb} tok", "medusa", [f"train.micro_batch_tokens={mb}"])
             for mb in args.micro_batch_tokens] * ("medusa" in args.heads)
    rows = []
    for name, head, extra in jobs:  # one fresh process each, so peak RSS is that benchmark's own
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            rows.append((name, pool.submit(bench, head, args.steps, extra, overrides).result()))
    print(f"\n== training benchmark: {rows[0][1]['model']}, {args.steps} steps each ==")
    print(f"{'head, micro-batch':<26} {'tokens/s':>9} {'wall s':>8} {'peak RSS GiB':>13}")
    for name, r in rows:
        print(f"{name:<26} {r['tokens_per_s']:9.0f} {r['wall_s']:8.1f} {r['peak_rss_gib']:13.2f}")


if __name__ == "__main__":
    main()
