"""Extraction benchmark on the default target (or any ``key=value`` overrides).

Prints extraction tokens/s, the bare forward tokens/s of the same batches without capture or I/O
(goal: extraction >= 90% of it), bytes/token on disk (goal: <= (taps + 1) x hidden x 2 in bf16) and
peak RSS. Needs the data stage of the run it reads (default outputs/smollm2-135m/eagle3).

    .venv/bin/python scripts/bench_extract.py [--rows 120] [head=medusa] [extract.batch_tokens=4096]

``--rows N`` keeps the first N rows of each split of the (scratch copy of the) data stage: a quicker run.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import time

import torch
from _bench import scratch_run


def keep_rows(cfg, rows: int) -> None:
    """Cut the scratch data stage's splits to their first ``rows`` rows (and give it its new ``dataset_id``)."""
    import datasets

    from train.stages import files_id, stage_dir

    data = stage_dir(cfg, "data")
    path = data / "dataset"
    ds = datasets.load_from_disk(str(path))
    cut = datasets.DatasetDict({k: v.select(range(min(rows, len(v)))) for k, v in ds.items()})
    cut.save_to_disk(str(path) + ".cut")
    shutil.rmtree(path)
    (path.parent / "dataset.cut").rename(path)
    manifest = json.loads((data / "manifest.json").read_text())
    manifest["dataset_id"] = files_id(data, ["dataset/*/*.arrow"])
    (data / "manifest.json").write_text(json.dumps(manifest, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=None, help="rows per split (default: all)")
    args, overrides = parser.parse_known_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from data.stage import load_dataset, row_lengths
    from train.extract import batches, padded, plan_shards
    from train.stages import run_stages, stage_dir
    from train.target import load_target

    with scratch_run(overrides, ["data"], ["stages=[extract]"]) as (cfg, _):
        if args.rows:
            keep_rows(cfg, args.rows)
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
                ids, mask = padded([ds[split][r]["input_ids"] for r in batch], 0)
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


if __name__ == "__main__":
    main()
