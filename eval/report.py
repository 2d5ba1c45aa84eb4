"""Aggregating per-prompt decode records into the eval report: results, recommendations, Markdown, plots.

Greedy losslessness is reported, not assumed: per method the share of prompts whose output departs from
plain decoding, where (tokens matched first), and how many of those first divergences the float32
target calls a near-tie (numerical: bf16 rounding, measured there, flipped an argmax) or a real mismatch (a
decoder bug, which excludes the method from the recommendations)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from eval.drafters import METHODS

RESULT_KEYS = ("dataset", "category", "method", "temperature", "n_prompts", "new_tokens", "cycles", "tau", "accept_len",
               "tokens_per_s", "plain_tokens_per_s", "speedup", "draft_time_share", "identical_to_plain",
               "divergence_rate", "divergence_position", "ties", "mismatches")


def divergence_stats(records: list[dict]) -> dict:
    """Over greedy records: identical_to_plain, divergence_rate (share of prompts that diverged),
    divergence_position (mean tokens matched before the first divergence; None without any), ties and
    mismatches (counts of first divergences by their fp32 kind). All None for sampled records."""
    if records[0]["temperature"] != 0:
        return dict.fromkeys(("identical_to_plain", "divergence_rate", "divergence_position", "ties", "mismatches"))
    divs = [r["divergence"] for r in records if r["divergence"]]
    kinds = [d["kind"] for d in divs]
    return {"identical_to_plain": not divs, "divergence_rate": len(divs) / len(records),
            "divergence_position": sum(d["position"] for d in divs) / len(divs) if divs else None,
            "ties": kinds.count("tie"), "mismatches": kinds.count("mismatch")}


def aggregate(records: list[dict]) -> list[dict]:
    """One row per dataset x category (and "all") x method x temperature. Records are per prompt:
    dataset, category, method, temperature, new_tokens, cycles, wall_s, draft_s, divergence (None or
    {position, kind, ...}; greedy only), acceptance."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        for category in (r["category"], "all"):
            groups[(r["dataset"], category, r["method"], r["temperature"])].append(r)
    rows = []
    datasets = list(dict.fromkeys(r["dataset"] for r in records))
    categories = ["all", *dict.fromkeys(r["category"] for r in records)]
    order = {m: i for i, m in enumerate(METHODS)}
    for (dataset, category, method, temperature), rs in sorted(groups.items(), key=lambda kv: (
            datasets.index(kv[0][0]), kv[0][3], categories.index(kv[0][1]), order[kv[0][2]])):
        plain = groups[(dataset, category, "plain", temperature)]
        tokens, wall = sum(r["new_tokens"] for r in rs), sum(r["wall_s"] for r in rs)
        tps = tokens / wall
        plain_tps = sum(r["new_tokens"] for r in plain) / sum(r["wall_s"] for r in plain)
        # accept_len: per verify pass, the prefill's pass and token left out (what vLLM and the EAGLE papers call the
        # mean acceptance length, accepted drafts + 1); tau counts every pass, the prefill's too
        cycles, turns = sum(r["cycles"] for r in rs), sum(r.get("turns", 1) for r in rs)
        verifies = cycles - turns
        rows.append({
            "dataset": dataset, "category": category, "method": method, "temperature": temperature,
            "n_prompts": len(rs), "new_tokens": tokens, "cycles": cycles, "tau": tokens / cycles,
            "accept_len": (tokens - turns) / verifies if verifies else None,
            "tokens_per_s": tps, "plain_tokens_per_s": plain_tps, "speedup": tps / plain_tps,
            "draft_time_share": sum(r["draft_s"] for r in rs) / wall, **divergence_stats(rs),
            "acceptance": rs[0]["acceptance"],
        })
    return rows


def recommend(results: list[dict], min_speedup: float) -> list[dict]:
    """Per dataset x category x temperature: the fastest lossless method when it beats plain decoding by
    at least ``min_speedup``, else none (deploy plain decoding). Lossless = exact acceptance and, at
    temperature 0, no real mismatch with plain decoding: identical, or diverging only at fp32 near-ties
    (then the reason states the share of prompts that diverged). Methods with mismatches are named."""
    candidates: dict[tuple, list[dict]] = {}
    bugs: dict[tuple, list[str]] = defaultdict(list)
    for r in results:
        key = (r["dataset"], r["category"], r["temperature"])
        group = candidates.setdefault(key, [])
        if r["mismatches"]:
            bugs[key].append(r["method"])
        elif r["method"] != "plain" and r["acceptance"] == "exact":
            group.append(r)
    out = []
    for key, rows in candidates.items():
        dataset, category, temperature = key
        best = max(rows, key=lambda r: r["speedup"], default=None)
        good = best is not None and best["speedup"] >= min_speedup
        reason = (f"{best['speedup']:.2f}x over plain" if good else f"nothing beats plain decoding by {min_speedup:.2f}x"
                  + (f" (best: {best['method']} {best['speedup']:.2f}x)" if best else ""))
        if good and best["divergence_rate"]:
            reason += (f"; lossless up to low-precision near-ties: {best['divergence_rate']:.1%} of prompts "
                       "diverged from plain decoding at an fp32 near-tie")
        if bugs[key]:
            reason += f"; EXCLUDED as decoder bugs (real mismatches with plain decoding): {', '.join(bugs[key])}"
        out.append({"dataset": dataset, "category": category, "temperature": temperature,
                    "method": best["method"] if good else None, "speedup": best["speedup"] if best else None,
                    "tau": best["tau"] if best else None, "reason": reason})
    return out


def decoder_bugs(results: list[dict]) -> list[dict]:
    """The (dataset, method, temperature) rows over all categories with real mismatches."""
    return [{k: r[k] for k in ("dataset", "method", "temperature", "n_prompts", "mismatches", "divergence_position")}
            for r in results if r["category"] == "all" and r["mismatches"]]


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def _table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in rows]


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{method} {n} prompt records" for method, n in counts.items())


def markdown(report: dict) -> str:
    """The report a person reads: what speculation costs, how fast each method is, what to deploy."""
    tree = report["tree"]
    shared = report.get("baselines") or {}
    timed = ("the same process, prompt by prompt" if not shared.get("reused") else
             f"another process for the reused records ({_counts(shared['reused'])} from `{shared['file']}`: "
             "an earlier eval of this target on this machine; `eval.share_baselines=false` times them here)")
    choice = report.get("dtype_choice")
    chosen = "" if not choice else (f" (`eval.dtype=auto`, one verify pass at {', '.join(map(str, choice['sizes']))} "
                                    "tree tokens summed: " + ", ".join(f"{d} {ms:.0f} ms" for d, ms in
                                                                         choice["verify_ms"].items()) + ")")
    lines = [f"# Speculative decoding eval: {report['target']} + {report['head']} head", "",
             f"Device {report['device']} ({report['cpu_threads']} CPU threads), {report['dtype']}{chosen}. Speedup = tokens/s "
             f"over plain decoding measured in {timed}. tau = new tokens / target forward passes (prefill included); "
             "acc. length = tokens per verify pass (the prefill's left out: accepted drafts + 1, as vLLM reports it).",
             "", "## What speculation costs", ""]
    lines += _table(["", "parameters", "memory (MB)"], [
        ["target", f"{report['target_params']:,}", report["target_memory_mb"]],
        [f"{report['head']} head", f"{report['head_params']:,}", report["head_extra_memory_mb"]],
    ])
    lines += ["", "Head parameters are the trained ones; its memory counts every tensor it holds but the target's "
              "input embedding, which an EAGLE-3 head shares with the target.", "", "## Tree", ""]
    if report["head"] == "eagle3":
        lines.append(f"- EAGLE-2 tree: top_k {tree['top_k']}, depth {tree['depth']}, total_tokens "
                     f"{tree['total_tokens']} ({tree['total_tokens_source']})")
        if tree.get("calibration"):
            lines.append(f"- tau measured on {tree['calibration']}")
    else:
        source = f" ({tree['total_tokens_source']})" if tree.get("total_tokens") else ""
        lines.append(f"- Medusa tree: {tree['medusa_nodes']} nodes{source}")
        if tree.get("calibration"):
            lines.append(f"- tau measured on {tree['calibration']}")
    lines += [f"- chains: {tree['chain_k']} draft tokens; verify time of the target vs tree tokens on this machine:", ""]
    sizes = list(tree["verify_ms"])
    rows = [["verify ms", *[tree["verify_ms"][s] for s in sizes]]]
    drafted = f"draft ms ({'EAGLE' if report['head'] == 'eagle3' else 'Medusa'} tree)"
    for key, label in (("draft_ms", drafted), ("acceptance_curve", "tau (measured)"),
                       ("predicted_speedup", "predicted speedup")):
        if tree.get(key):
            rows.append([label, *[tree[key].get(s) for s in sizes]])
    lines += _table(["tree tokens", *map(str, sizes)], rows) + [""]
    lines += ["## Results", ""]
    for (dataset, temperature) in dict.fromkeys((r["dataset"], r["temperature"]) for r in report["results"]):
        lines += [f"### {dataset}, temperature {temperature}", ""]
        rows = [[r["category"], r["method"] + ("" if r["acceptance"] == "exact" else " (LOSSY)"), r["n_prompts"],
                 r["tau"], r["accept_len"], r["tokens_per_s"], r["plain_tokens_per_s"], r["speedup"],
                 r["draft_time_share"],
                 None if r["divergence_rate"] is None else f"{r['divergence_rate']:.1%}",
                 r["divergence_position"], r["ties"], r["mismatches"]]
                for r in report["results"] if r["dataset"] == dataset and r["temperature"] == temperature]
        lines += _table(["category", "method", "prompts", "tau", "acc. length", "tok/s", "plain tok/s", "speedup", "draft share",
                         "diverged", "tokens before", "ties", "mismatches"], rows) + [""]
    lines += ["Greedy only: diverged = share of prompts whose output departs from plain decoding; tokens before = "
              "mean tokens matched before the first divergence; the target re-scores that position in float32: a "
              "tie is a numerical near-tie (the two tokens' float32 logits are within eval.tie_tolerance plus the "
              "decoding precision's measured logit error there: low precision flipped an argmax), a mismatch a "
              "decoder bug.", ""]
    if report.get("decoder_bugs"):
        lines += ["## DECODER BUGS", "", "**These methods depart from plain greedy decoding where the float32 target "
                  "has a clear argmax: not lossless, excluded from the recommendations.**", ""]
        lines += [f"- {b['dataset']} / T={b['temperature']}: **{b['method']}**, {b['mismatches']} of {b['n_prompts']} "
                  f"prompts" for b in report["decoder_bugs"]] + [""]
    lines += ["## Recommendation", ""]
    for rec in report["recommendations"]:
        verdict = f"deploy **{rec['method']}**" if rec["method"] else "**plain decoding** (no speculation)"
        lines.append(f"- {rec['dataset']} / {rec['category']} / T={rec['temperature']}: {verdict} -- {rec['reason']}")
    return "\n".join(lines) + "\n"


def plot(results: list[dict], records: list[dict], out: Path) -> list[Path]:
    """Per temperature: speedup and tau per category per method (a row per dataset), and histograms of
    per-cycle accepted lengths per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    for temperature in dict.fromkeys(r["temperature"] for r in results):
        rows = [r for r in results if r["temperature"] == temperature]
        datasets = list(dict.fromkeys(r["dataset"] for r in rows))
        methods = list(dict.fromkeys(r["method"] for r in rows))
        width = 0.8 / len(methods)
        fig, axes = plt.subplots(len(datasets), 2, figsize=(14, 3.5 * len(datasets)), squeeze=False)
        for (ax_speed, ax_tau), dataset in zip(axes, datasets, strict=True):
            cats = list(dict.fromkeys(r["category"] for r in rows if r["dataset"] == dataset))
            for ax, key in ((ax_speed, "speedup"), (ax_tau, "tau")):
                value = {(r["category"], r["method"]): r[key] for r in rows if r["dataset"] == dataset}
                for j, m in enumerate(methods):
                    ax.bar([i + j * width for i in range(len(cats))], [value.get((c, m), 0) for c in cats],
                           width, label=m)
                ax.axhline(1.0, color="black", lw=0.8)
                ax.set_title(f"{dataset}: {key}, temperature {temperature}")
                ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cats))], cats, rotation=30, ha="right")
        axes[0, 0].legend(fontsize=7, ncol=2)
        fig.tight_layout()
        files.append(out / f"speedup_T{temperature}.png")
        fig.savefig(files[-1], dpi=100)
        plt.close(fig)
    for temperature in dict.fromkeys(r["temperature"] for r in records):
        lengths: dict[str, list[int]] = defaultdict(list)
        for r in sorted(records, key=lambda r: METHODS.index(r["method"])):
            if r["temperature"] == temperature and r["method"] != "plain":
                lengths[r["method"]] += r["accept_lengths"]
        if not lengths:
            continue
        top = max(max(v, default=0) for v in lengths.values())
        fig, ax = plt.subplots(figsize=(7, 4))
        for m, v in lengths.items():
            ax.hist(v, bins=[b - 0.5 for b in range(top + 2)], density=True, histtype="step", lw=1.5, label=m)
        ax.set_xlabel("drafted tokens accepted per cycle (tokens per cycle - 1)")
        ax.set_ylabel("share of cycles")
        ax.set_title(f"accepted lengths, temperature {temperature}")
        ax.legend(fontsize=7)
        fig.tight_layout()
        files.append(out / f"accept_hist_T{temperature}.png")
        fig.savefig(files[-1], dpi=100)
        plt.close(fig)
    return files


def log_wandb(cfg, report: dict, images: list[Path]) -> None:
    """Log the results table (and plots) into the active W&B run, or into a new offline one."""
    import wandb

    own = wandb.run is None
    run = wandb.init(project=cfg.tracking.project, entity=cfg.tracking.entity, name=cfg.tracking.name,
                     dir=str(cfg.run_dir), mode=cfg.tracking.mode, job_type="eval") if own else wandb.run
    columns = list(RESULT_KEYS)
    run.log({"eval/results": wandb.Table(columns=columns, data=[[r[c] for c in columns] for r in report["results"]]),
             **{f"eval/{p.stem}": wandb.Image(str(p)) for p in images}})
    for rec in report["recommendations"]:
        run.summary[f"eval/speedup/{rec['dataset']}/{rec['category']}/T{rec['temperature']}"] = rec["speedup"]
    if own:
        run.finish()
