"""Extraction benchmark on the default target (or any ``key=value`` overrides).

Prints extraction tokens/s, the bare forward tokens/s of the same batches without capture or I/O
(goal: extraction >= 90% of it), bytes/token on disk (goal: <= (taps + 1) x hidden x 2 in bf16) and
peak RSS. Needs the data stage of the run it reads (default outputs/smollm2-135m/eagle3).

    .venv/bin/python scripts/bench_extract.py [head=medusa] [extract.batch_tokens=4096]
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
import time

import torch
from _bench import scratch_run


def main(overrides: list[str]) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from data.stage import load_dataset, row_lengths
    from train.extract import batches, plan_shards
    from train.stages import run_stages, stage_dir
    from train.target import load_target

    cfg, _ = scratch_run(overrides, ["data"], ["stages=[extract]"])
    try:
        start = time.time()
        out = run_stages(cfg)["extract"]["outputs"]
        wall = time.time() - start
        manifest = json.loads((stage_dir(cfg, "extract") / "manifest.json").read_text())
        n_layers, hidden = len(manifest["layers"]), manifest["hidden_size"]
        # The same batches again, bare forward: no hidden-state capture, no copies, no disk.
        model = load_target(cfg)
        ds = load_dataset(cfg)
        lengths = {s: row_lengths(ds[s]) for s in ("train", "validation")}
        forward_s, tokens = 0.0, 0
        for shard in plan_shards(lengths, n_layers * hidden * 2, cfg.extract.shard_mb):
            split = shard["split"]
            for batch in batches(shard["rows"], lengths[split], cfg.extract.batch_tokens):
                width = max(lengths[split][r] for r in batch)
                ids = torch.zeros(len(batch), width, dtype=torch.long)
                mask = torch.zeros(len(batch), width, dtype=torch.long)
                for j, r in enumerate(batch):
                    row = torch.as_tensor(ds[split][r]["input_ids"])
                    ids[j, : len(row)], mask[j, : len(row)] = row, 1
                t0 = time.time()
                with torch.inference_mode():
                    model.get_decoder()(input_ids=ids, attention_mask=mask)
                forward_s += time.time() - t0
                tokens += sum(lengths[split][r] for r in batch)
        bare = tokens / forward_s
        print(f"\n== extraction benchmark: {cfg.model.name}, head {cfg.head.type}, {out['tokens']} tokens ==")
        print(f"extraction stage (load + capture + I/O): {out['tokens'] / wall:7.0f} tok/s ({wall:.1f} s wall)")
        print(f"extraction loop (rank 0):                {out['tokens_per_s_rank0']:7.0f} tok/s")
        print(f"bare forward, same batches:              {bare:7.0f} tok/s -> extraction at "
              f"{out['tokens_per_s_rank0'] / bare:.0%} of it (goal >= 90%)")
        print(f"bytes/token on disk:                     {out['bytes_per_token']:7.1f} (goal <= {n_layers * hidden * 2}"
              f" = {n_layers} layers x {hidden} x 2 bytes)")
        print(f"peak RSS:                                {out['peak_rss_gib']:7.2f} GiB")
    finally:
        shutil.rmtree(cfg.run_dir, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1:])
