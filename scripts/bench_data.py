"""Data tokens per second end to end (regeneration + extraction): ``hf`` regeneration then a separate
extraction pass, ``hf`` keeping the hidden states while it regenerates (``extract.source``), and with
``--vllm`` the ``vllm`` backend then the pass; the same prompts, fresh caches.

    .venv/bin/python scripts/bench_data.py                        # default target, 32 built-in prompts
    .venv/bin/python scripts/bench_data.py --limit 8 model=tiny-llama   # a smoke run

Each mode runs ``stages=[data,extract]`` in its own scratch output root (nothing cached) in a child process;
the figures are the stages' wall times from their markers (vLLM's server start included). Prints a table
how close the two hf modes' shards are (max |difference| of the stored states, share of equal argmax) and,
with ``--vllm``, how many rows the vllm and hf backends regenerated token-identically.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from datasets import load_from_disk
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from train.config import compose  # noqa: E402
from train.stages import read_marker, stage_dir  # noqa: E402


def shards(cfg) -> dict:
    """(split, row) -> (hidden, argmax) over every extract shard of ``cfg``'s run."""
    out = {}
    for shard in json.loads((stage_dir(cfg, "extract") / "manifest.json").read_text())["shards"]:
        t = load_file(str(stage_dir(cfg, "extract") / shard["file"]))
        for j, r in enumerate(t["row_index"].tolist()):
            a, b = t["offsets"][j], t["offsets"][j + 1]
            out[shard["split"], r] = (t["hidden"][a:b].float(), t["argmax"][a:b])
    return out


def rows_by_key(cfg) -> dict[tuple[str, str], list[int]]:
    """Every row's token ids of ``cfg``'s dataset, by (split, prompt key)."""
    dataset = load_from_disk(str(stage_dir(cfg, "data") / "dataset"))
    return {(split, r["key"]): r["input_ids"] for split in dataset for r in dataset[split]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=32, help="built-in prompts")
    ap.add_argument("--vllm", action="store_true", help="also data.regen.backend=vllm (needs `make vllm-env`)")
    ap.add_argument("--synth", type=int, default=0, help="also this many prompts written by the target (a synth "
                    "source: through the server with --vllm's mode)")
    ap.add_argument("overrides", nargs="*", help="pipeline overrides, e.g. model=tiny-llama")
    args = ap.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="specheads-bench-data-"))
    sources = f"{{type:builtin,limit:{args.limit}}}" + (f",{{type:synth,n:{args.synth}}}" if args.synth else "")
    common = ["tracking=none", "stages=[data,extract]", f"data.sources=[{sources}]", *args.overrides]
    modes = {"hf+pass": ["extract.source=pass"], "hf+kept": ["extract.source=regen"]}
    if args.vllm:
        modes["vllm+pass"] = ["extract.source=pass", "data.regen.backend=vllm", "data.regen.vllm.max_model_len=4096"]
    rows, cfgs, synths = [], {}, []
    for source, extra in modes.items():
        overrides = [*common, *extra, f"output_root={scratch / source}"]
        subprocess.run([sys.executable, str(ROOT / "train/run.py"), *overrides], cwd=ROOT, check=True)
        cfg = cfgs[source] = compose(overrides)
        data, extract = read_marker(cfg, "data"), read_marker(cfg, "extract")
        stats = json.loads((stage_dir(cfg, "data") / "stats.json").read_text())
        manifest = json.loads((stage_dir(cfg, "extract") / "manifest.json").read_text())
        provenance = json.loads((stage_dir(cfg, "extract") / "provenance.json").read_text())
        tokens = manifest["tokens"]
        wall = data["wall_s"] + extract["wall_s"]
        regen = stats["regeneration"]
        if args.synth:
            st = stats["synth"]["synth"]
            synths.append((source, st["kept"], st["attempts"], st["seconds"], st["kept"] / max(st["seconds"], 1e-9)))
        rows.append((source, regen["new_tokens"], regen["tokens_per_s"], tokens, data["wall_s"], extract["wall_s"],
                     wall, tokens / wall, provenance.get("from_regeneration", {}).get("rows", 0),
                     sum(manifest["rows"].values())))
    print(f"\n{'mode':10} {'new tok':>8} {'regen tok/s':>11} {'tokens':>7} {'data s':>7} {'extract s':>9} "
          f"{'total s':>8} {'tok/s':>7} {'kept rows':>10}")
    for source, new, regen_rate, tokens, d, e, w, rate, kept, total in rows:
        print(f"{source:10} {new:>8} {regen_rate:>11} {tokens:>7} {d:>7.1f} {e:>9.1f} {w:>8.1f} {rate:>7.1f} "
              f"{kept:>5}/{total}")
    print(f"end-to-end speed-up hf+kept / hf+pass: {rows[1][7] / rows[0][7]:.2f}x")
    if synths:
        print(f"\n{'mode':10} {'prompts':>8} {'attempts':>8} {'synth s':>8} {'prompts/s':>9}  (vllm: server start "
              "included)")
        for source, kept, attempts, seconds, rate in synths:
            print(f"{source:10} {kept:>8} {attempts:>8} {seconds:>8.1f} {rate:>9.2f}")
    if args.vllm:
        hf, vl = (rows_by_key(cfgs[m]) for m in ("hf+pass", "vllm+pass"))
        common = [k for k in hf if k in vl]  # synth prompts differ by backend (each samples with its own seeds)
        same = sum(hf[k] == vl[k] for k in common)
        print(f"hf / vllm answers: {same}/{len(common)} rows of the same prompts token-identical (prompt + answers)")
    a, b = shards(cfgs["hf+kept"]), shards(cfgs["hf+pass"])
    same = [k for k in a if k in b and a[k][0].shape == b[k][0].shape]
    diff = max((a[k][0] - b[k][0]).abs().max().item() for k in same)
    agree = torch.cat([a[k][1] == b[k][1] for k in same]).float().mean().item()
    print(f"shards: {len(same)}/{len(b)} rows comparable; max |state difference| {diff:.3g}; argmax agreement "
          f"{agree:.4f}")
    shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
