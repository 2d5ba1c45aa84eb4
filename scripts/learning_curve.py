"""Learning curve: acceptance vs training tokens. Each point trains a head from scratch on a nested, seeded
subset of one finished run's training rows (``train.data_tokens``) for the same number of epochs, scored
on the same held-out prompts: validation simulated tau, and with ``--vllm`` vLLM's acceptance length at
k = 3 for every point's export (``scripts/vllm_check.py``, one engine for all points) next to vLLM's n-gram.

    .venv/bin/python scripts/learning_curve.py --tokens 25000,50000,100000,200000 --epochs 2 --vllm \\
        run_dir=outputs/smollm2-135m/curve "data.sources=[{type:builtin},{type:synth,n:600,split:train}]"

The trailing ``key=value`` arguments compose the source run (its data and extract stages must be done);
every point is a fresh ``train/run.py`` process in ``--out``/tokens-<N> with the data and extract stages
hard-linked from it (copied across filesystems), running ``stages=[train,export]``. Writes
``<figure>.json`` (every figure) and ``<figure>.png`` (the plot) and prints a table. ``--earlier <json>``
keeps the points of an earlier curve (e.g. smaller budgets on a smaller source run) in both; every point
names the source run it was measured on. ``--beside <json>`` (repeatable) draws another curve of this script
beside this one (another config or other epochs on the same data), named by its epochs and ``--train``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from _bench import ROOT, finished_source

from train.stages import stage_dir


def link_or_copy(src: str, dst: str) -> None:
    """Hard link (the shards are large), or copy where ``--out`` is on another filesystem."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def train_point(source: list[str], src_cfg, tokens: int, epochs: int, run_dir: Path, extra: list[str]) -> dict:
    """Train and export one point in ``run_dir`` (a rerun skips what is done); its summary."""
    for stage in ("data", "extract"):
        if not (run_dir / stage).exists():
            shutil.copytree(stage_dir(src_cfg, stage), run_dir / stage, copy_function=link_or_copy)
    overrides = [*(o for o in source if not o.startswith("run_dir=")), f"run_dir={run_dir}", "stages=[train,export]",
                 f"train.data_tokens={tokens}", f"train.epochs={epochs}", "train.max_minutes=null",
                 "train.max_steps=null", "train.patience=1000", *extra]
    subprocess.run([sys.executable, str(ROOT / "train/run.py"), "tracking=none", *overrides], cwd=ROOT, check=True)
    return json.loads((run_dir / "train" / "summary.json").read_text())


def vllm_taus(run_dirs: list[Path]) -> dict[Path, dict]:
    """vLLM's acceptance length of each run's first export and its n-gram drafter's, at k = 3."""
    subprocess.run([sys.executable, str(ROOT / "scripts/vllm_check.py"), *map(str, run_dirs)], cwd=ROOT, check=True)
    out = {}
    for d in run_dirs:
        report = json.loads((d / "export" / "vllm_check.json").read_text())
        first = next(iter(report["exports"].values()))
        out[d] = {"vllm_tau": first["vllm"]["tau"], "ours_chain_tau": first["ours"]["tau"],
                  "ngram_tau": report["ngram"]["tau"], "ngram_tokens_per_pass": report["ngram"]["tokens_per_pass"]}
    return out


def label(curve: dict) -> str:
    """A curve's name in the plot: its epochs and ``--train`` overrides."""
    return " ".join([f"{curve['epochs']} epochs", *curve["train"]])


def plot(curves: list[dict], path: Path, title: str) -> None:
    """Acceptance vs tokens of ``curves`` (results of this script): the first solid, the others dash-dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for i, c in enumerate(curves):
        name, style = f" ({label(c)})" if len(curves) > 1 else "", "-." if i else "-"
        x = [p["tokens"] for p in c["points"]]
        ax.plot(x, [p["sim_tau"] for p in c["points"]], "o" + style, label="validation simulated tau (7 steps)" + name)
        if all("vllm_tau" in p for p in c["points"]):
            ax.plot(x, [p["vllm_tau"] for p in c["points"]], "s" + style, label="vLLM acceptance length, k = 3" + name)
    points = curves[0]["points"]
    if all("vllm_tau" in p for p in points):
        ax.axhline(points[-1]["ngram_tau"], color="grey", ls=":", label="vLLM n-gram, k = 3: per drafted pass")
        ax.axhline(points[-1]["ngram_tokens_per_pass"], color="grey", ls="--",
                   label="vLLM n-gram, k = 3: tokens per target pass")
    x = sorted({p["tokens"] for c in curves for p in c["points"]})
    ax.set_xscale("log")
    ax.set_xticks(x, [f"{t // 1000}k" for t in x])
    ax.minorticks_off()
    ax.set_xlabel("training tokens (prompt + answer)")
    ax.set_ylabel("acceptance length")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="25000,50000,100000,200000", help="comma-separated training-token budgets")
    ap.add_argument("--epochs", type=int, default=2, help="epochs per point (the schedule spans them)")
    ap.add_argument("--vllm", action="store_true", help="also vLLM's acceptance length (needs `make vllm-env`)")
    ap.add_argument("--out", type=Path, default=Path("/tmp/specheads-curve"), help="the points' run directories")
    ap.add_argument("--figure", type=Path, default=ROOT / "scripts/figures/learning_curve",
                    help="writes <figure>.json and <figure>.png")
    ap.add_argument("--train", action="append", default=[], help="extra override of every point (repeatable)")
    ap.add_argument("--earlier", type=Path, help="a curve JSON of this script whose points are kept beside the new "
                    "ones (each point keeps the source run it was measured on)")
    ap.add_argument("--beside", type=Path, action="append", default=[], help="a curve JSON of this script (e.g. "
                    "another config on the same data) drawn beside this one, named by its epochs and --train overrides")
    args, source = ap.parse_known_args()
    src_cfg = finished_source(source, ["data", "extract"])
    points, dirs = [], []
    for tokens in sorted(int(t) for t in args.tokens.split(",")):
        run_dir = (args.out / f"tokens-{tokens}").resolve()
        s = train_point(source, src_cfg, tokens, args.epochs, run_dir, args.train)
        best = s["best"]
        points.append({"tokens": s["data"]["tokens"], "budget": tokens, "rows": s["data"]["rows"], "steps": s["steps"],
                       "train_s": s["wall_s"], "sim_tau": best["sim_tau"], "chain_tau": best["chain_tau"],
                       "decode_tau": best.get("decode_tau"),  # runs trained before it existed: None
                       **{k: best[k] for k in ("acc_0", "acc_1", "acc_2") if k in best}})
        dirs.append(run_dir)
    if args.vllm:
        for p, taus in zip(points, vllm_taus(dirs).values(), strict=True):
            p.update(taus)
    for p in points:
        p["source"] = source
    if args.earlier:
        earlier = json.loads(args.earlier.read_text())
        points = sorted([{"source": earlier["source"], **p} for p in earlier["points"]] + points,
                        key=lambda p: p["tokens"])
    head = src_cfg.head.name
    beside = [json.loads(p.read_text()) for p in args.beside]
    result = {"source": source, "head": head, "epochs": args.epochs, "train": args.train, "points": points,
              "beside": [{k: b[k] for k in ("source", "epochs", "train", "points")} for b in beside]}
    args.figure.parent.mkdir(parents=True, exist_ok=True)
    args.figure.with_suffix(".json").write_text(json.dumps(result, indent=2))
    plot([result, *beside], args.figure.with_suffix(".png"),
         f"{head} on {src_cfg.model.name}: {'' if beside else f'{args.epochs} epochs per point, '}held-out prompts")
    print(f"\n== learning curve: {head}, {args.epochs} epochs per point ==")
    print(f"{'tokens':>8} {'rows':>5} {'steps':>6} {'train s':>8} {'acc_0':>6} {'sim_tau':>8} {'vllm_tau':>9} {'ngram':>6}")
    for p in points:
        print(f"{p['tokens']:>8} {p['rows']:>5} {p['steps']:>6} {p['train_s']:>8.0f} {p.get('acc_0', 0):>6.3f} "
              f"{p['sim_tau']:>8.3f} {p.get('vllm_tau', float('nan')):>9.3f} {p.get('ngram_tau', float('nan')):>6.3f}")
    print(f"wrote {args.figure.with_suffix('.json')} and {args.figure.with_suffix('.png')}")


if __name__ == "__main__":
    main()
