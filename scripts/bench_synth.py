"""Prompts written by the target (a ``synth`` source) through the ``hf`` backend: wall time, target passes and
rows per pass, on the default target (or any ``key=value`` overrides), into a fresh cache each run.

    .venv/bin/python scripts/bench_synth.py --n 528            # the demo's synth source
    .venv/bin/python scripts/bench_synth.py --n 96 data.regen.batch_size=128   # rows decoding at once

The target is loaded before the clock starts; the figures are the data stage's own writer
(``data.synth.Synthesizer``), with a forward hook counting passes (prefills and decode steps).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

from _bench import compose


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=528, help="prompts to keep")
    ap.add_argument("--batch-size", type=int, default=32, help="the source's batch_size (prompts per cached batch)")
    ap.add_argument("overrides", nargs="*", help="pipeline overrides, e.g. data.regen.batch_size=128")
    args = ap.parse_args()

    from data.engines import LocalTarget
    from data.synth import Synthesizer
    from train.target import load_tokenizer

    root = Path(tempfile.mkdtemp(prefix="specheads-bench-synth-"))
    try:
        cfg = compose(["tracking=none", f"output_root={root}", f"run_dir={root / 'run'}", *args.overrides])
        target = LocalTarget(cfg)
        rows: list[int] = []  # rows of each decode pass
        passes = [0]

        def count(_, inputs) -> None:
            passes[0] += 1
            if inputs[0].shape[1] == 1:
                rows.append(inputs[0].shape[0])

        target().register_forward_pre_hook(count)
        synth = Synthesizer(cfg, load_tokenizer(cfg), target)
        start = time.time()
        kept = list(synth({"type": "synth", "n": args.n, "batch_size": args.batch_size}, "synth"))
        wall = time.time() - start
        st = synth.stats["synth"]
        print(json.dumps({"prompts": len(kept), "attempts": st["attempts"], "wall_s": round(wall, 1),
                          "prompts_per_s": round(len(kept) / wall, 2), "passes": passes[0], "decode_passes": len(rows),
                          "rows_per_decode_pass": round(sum(rows) / max(len(rows), 1), 1),
                          "distinct_2": st["distinct_2"], "tokens_mean": st["tokens_mean"], "dropped": st["dropped"]}))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
