"""Real-engine check of finished exports: vLLM loads each one, must reproduce its own greedy output
without speculation token for token, and should accept about as many draft tokens as our chain decoder.

    .venv/bin/python scripts/vllm_check.py outputs/smollm2-135m/eagle3 outputs/smollm2-135m/medusa

Runs in the project's venv. The engine part re-invokes this file under the vLLM venv (`make vllm-env`)
as ``--engine <spec.json>``; that part imports only the standard library and vLLM. One engine process
per target runs its configurations one after another, in-process (a new LLM costs seconds, a new
process ~45 s): no speculation, every export (EAGLE-3: ``export/vllm`` and ``export/speculators``;
``export/medusa``), then vLLM's n-gram drafter (the zero-cost baseline a trained head must beat).
Meanwhile (after it, where the two copies of the target do not fit in host memory) our chain decoder runs each head
re-imported from that same export folder (``train.export.import_export``), so matching acceptance shows that layer ids, norms and the
vocabulary mapping survived the export. Per run directory the figures go to
``<run_dir>/export/vllm_check.json`` (definitions included); the exit status is 1 when any
speculative output differs from the no-speculation output, vLLM taps other target layers than an EAGLE-3
export names at the top level of its config.json (where vLLM's model runner V2, its GPU default, reads them;
otherwise it takes its defaults without a word), or an engine run failed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from omegaconf import DictConfig

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
# In-process engine core (fast restarts), 1 GiB of KV cache (vLLM's default does not fit), no Hub access.
ENGINE_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
              "OMP_WAIT_POLICY": "PASSIVE"}
METHODS = {"vllm": "eagle3", "speculators": "eagle3", "medusa": "medusa"}   # export folder -> vLLM method
NO_SPEC, NGRAM = "no-spec", "ngram"
COUNTERS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
            "vllm:spec_decode_num_accepted_tokens": "accepted",
            "vllm:spec_decode_num_accepted_tokens_per_pos": "accepted_per_pos"}
DEFINITIONS = {
    "stop": "EOS ignored on both sides (vLLM ignore_eos=True; our decoder gets no EOS ids): every prompt "
            "gets exactly max_tokens new tokens",
    "tau": "mean acceptance length = 1 + accepted / drafts. A draft is one target verify pass of one "
           "request that carried >= 1 drafted token (prefill passes excluded); accepted = drafted tokens the "
           "target confirmed, counted before the cut at max_tokens. vLLM: its spec_decode counters over the "
           "timed generate (warm-up subtracted). Ours: the same from our chain decoder's per-pass accept "
           "lengths; every pass carries k tokens there",
    "ngram_tau": "vLLM counts a draft only when the n-gram lookup found a match, so the n-gram tau is per "
                 "drafted pass (tokens per target pass are lower when it often finds none)",
    "tokens_per_pass": "new tokens per target decode pass (prefill excluded), every pass counted, drafted or "
                       "not: each pass yields its accepted drafted tokens plus one, so passes = decode tokens - "
                       "accepted. The measure that compares a head (it drafts on every pass: equal to its tau) "
                       "with n-gram (it drafts only on a match); `beats_ngram` uses it. vLLM counts accepted "
                       "tokens before the cut at max_tokens, so its figure can be high by < k / max_tokens",
    "tokens_per_s": "vLLM generate throughput, all prompts batched; CPU shared with other work and with our "
                    "decoder: indicative only",
}


# --- engine part: runs under .venv-vllm, standard library + vLLM only -------------------------------

def engine(spec_file: Path) -> None:
    """Run every configuration of the spec in this process, one LLM at a time; write the results JSON."""
    for key, value in ENGINE_ENV.items():
        os.environ.setdefault(key, value)
    import vllm

    spec = json.loads(spec_file.read_text())
    runs = {name: engine_run(spec, config) for name, config in spec["runs"].items()}
    Path(spec["out"]).write_text(json.dumps({"vllm_version": vllm.__version__, "runs": runs}))


def engine_run(spec: dict, speculative_config: dict | None) -> dict:
    """Greedy tokens, spec-decode counters and timings of one configuration, or {"error": traceback}."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = None
    try:
        start = time.perf_counter()
        llm = LLM(model=spec["target"], revision=spec.get("revision"), dtype=spec["dtype"], enforce_eager=True,
                  max_model_len=spec["max_model_len"], seed=0, disable_log_stats=False, speculative_config=speculative_config)
        startup_s = time.perf_counter() - start
        taps = llm.apply_model(aux_layers)[0] if speculative_config and speculative_config["method"] == "eagle3" else None
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in spec["prompts"]]
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        before = spec_counters(llm)
        start = time.perf_counter()
        outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True),
                               use_tqdm=False)
        generate_s = time.perf_counter() - start
        after = spec_counters(llm)
    except Exception:  # recorded: one export that fails to load must not hide the others' results
        return {"config": speculative_config, "error": traceback.format_exc(limit=-8)}
    finally:
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    counts = {key: subtract(value, before.get(key)) for key, value in after.items()}
    return {"config": speculative_config, "tokens": tokens, "aux_layers": taps, "startup_s": round(startup_s, 1),
            "generate_s": round(generate_s, 2), "tokens_per_s": round(sum(map(len, tokens)) / generate_s, 1), **counts}


def aux_layers(model) -> list[int]:
    """The target layers whose entering hidden states vLLM hands the EAGLE-3 draft (what it read from the
    export's config, or its own defaults [2, N//2, N-3] when it found none: no error either way)."""
    return list(getattr(getattr(model, "model", model), "aux_hidden_state_layers", ()))


def spec_counters(llm) -> dict:
    """vLLM's cumulative speculative-decoding counters ({} without speculation)."""
    return {COUNTERS[m.name]: list(m.values) if hasattr(m, "values") else m.value
            for m in llm.get_metrics() if m.name in COUNTERS}


def subtract(after: float | list, before: float | list | None) -> float | list:
    """A counter (or per-position counters) minus its earlier snapshot."""
    if isinstance(after, list):
        return [a - b for a, b in zip(after, before or [0] * len(after), strict=True)]
    return after - (before or 0)


# --- orchestrator: runs in the project's venv ----------------------------------------------------------

@dataclass
class Export:
    run_dir: Path
    fmt: str            # vllm | speculators | medusa (the export folder's name)
    folder: Path
    k: int              # draft tokens per pass (Medusa: its number of heads, which vLLM requires)
    made_of: dict = field(default_factory=dict)   # what its folder holds (the head, the export settings): reported

    @property
    def name(self) -> str:
        return f"{self.run_dir.parent.name}/{self.run_dir.name} {self.fmt}"


def run_config(run_dir: Path) -> DictConfig:
    """The run's config composed like ``train/run.py`` did: with the Hydra overrides it saved in
    ``.hydra/overrides.yaml``, else with the model preset named by the path (<output_root>/<model>/<head>)."""
    from omegaconf import OmegaConf

    from train.config import compose

    saved = run_dir / ".hydra" / "overrides.yaml"
    overrides = [str(o) for o in OmegaConf.load(saved)] if saved.exists() else [f"model={run_dir.parent.name}"]
    cfg = compose(overrides)
    cfg.run_dir = str(run_dir)
    return cfg


def find_exports(run_dir: Path, cfg: DictConfig, k: int) -> list[Export]:
    """The vLLM-loadable export folders of a run whose export stage finished."""
    from train.export import made_of, vllm_method_word
    from train.stages import config_changes, current_marker, require, stage_dir, upstream_ids

    marker = require(cfg, "export")
    if "made_of" not in marker["outputs"] and current_marker(cfg, "export") is None:   # an export made before its
        why = config_changes(cfg, "export", marker) or "the head trained since"   # marker said what it holds: the report
        raise SystemExit(f"{run_dir}: the export folders are not of this run as it is now ({why}): export it again "
                         "first (train/run.py stages=[export] with the run's overrides), then check")   # would credit
    made = marker["outputs"].get("made_of") or made_of(cfg)   # read now: an export rewritten meanwhile is not this one
    if made["train_output"] != upstream_ids(cfg, "export")["train"]:
        print(f"[vllm-check] warning: {run_dir}: the export folders hold the head of an earlier training (trained "
              "since, not exported again): the figures are that head's, and no model card of the head of now takes "
              "them; export again (train/run.py stages=[export]) to check this one", flush=True)
    exports = []
    for fmt in METHODS:
        folder = (stage_dir(cfg, "export") / fmt).resolve()
        if not (folder / "config.json").exists():
            continue
        if fmt == "medusa":
            if word := vllm_method_word(str(folder)):
                raise SystemExit(f"{folder}: vLLM takes a draft path containing {word!r} for another method than "
                                 "Medusa; move the run out of such a directory")
            k = json.loads((folder / "config.json").read_text())["num_heads"]
        exports.append(Export(run_dir, fmt, folder, k, made))
    if not exports:
        raise SystemExit(f"{run_dir}: no export folder vLLM loads ({', '.join(METHODS)}) under export/")
    return exports


def prompt_ids(cfg: DictConfig, tokenizer, n: int) -> list[list[int]]:
    """The first turns of ``n`` built-in validation prompts (spread over categories, as the eval stage
    picks them), rendered with the target's chat template by OUR tokenizer."""
    from omegaconf import OmegaConf

    from data.template import prompt_ids as render_ids
    from data.template import set_thinking, with_system
    from eval.prompts import load_prompts

    set_thinking(cfg.data.get("thinking"))  # as the data stage rendered them

    picked = load_prompts(OmegaConf.merge(cfg, {"eval": {"datasets": ["builtin"], "questions": None, "limit": n}}))
    return [render_ids(tokenizer, with_system([{"role": "user", "content": p.turns[0]}], cfg.data.system_prompt))
            for p in picked]


def acceptance(drafts: int, draft_tokens: int, accepted: int, accepted_per_pos: list[int],
               tokens: list[list[int]]) -> dict:
    """tau and tokens per pass (see DEFINITIONS) and the share of drafts whose token at each position was
    accepted; ``tokens``: the new tokens of each prompt (the first one comes from the prefill)."""
    decode_tokens = sum(len(t) - 1 for t in tokens)
    passes = decode_tokens - accepted
    return {"tau": round(1 + accepted / drafts, 4) if drafts else None, "drafts": drafts,
            "draft_tokens": draft_tokens, "accepted": accepted,
            "tokens_per_pass": round(decode_tokens / passes, 4) if passes > 0 else None,
            "accept_rate_per_pos": [round(a / drafts, 4) for a in accepted_per_pos] if drafts else None}


def our_chain(cfg: DictConfig, target, head, export: Export, prompts: list[list[int]], max_tokens: int) -> dict:
    """Our chain decoder with ``head`` at the export's k on the same prompts, EOS ignored like vLLM's side."""
    import torch
    from omegaconf import OmegaConf

    from eval import SpecDecoder, build_drafter

    kind = "medusa" if export.fmt == "medusa" else "eagle3"
    ecfg = OmegaConf.merge(cfg.eval, {"chain_k": export.k})
    drafter = build_drafter(f"{kind}-chain", head, target.config.num_hidden_layers, ecfg)
    decoder = SpecDecoder(target, eos_token_ids=())
    with torch.inference_mode():
        gens = [decoder.generate(ids, drafter, max_tokens) for ids in prompts]
    lengths = [n for g in gens for n in g.accept_lengths]
    per_pos = [sum(n > i for n in lengths) for i in range(export.k)]
    tokens = [g.tokens for g in gens]
    return {"tokens": tokens, **acceptance(len(lengths), len(lengths) * export.k, sum(lengths), per_pos, tokens)}


def ours_for_exports(cfg: DictConfig, exports: list[Export], prompts: list[list[int]], max_tokens: int) -> list[dict]:
    """Our chain decoder per export, each head re-imported from its export folder."""
    import torch

    from train.export import import_export
    from train.target import load_target

    target = load_target(cfg, torch.device("cpu"), torch.float32)
    results = []
    for e in exports:
        start = time.perf_counter()
        head = import_export(e.folder, e.fmt, target).to(target.device, target.dtype)
        results.append(our_chain(cfg, target, head, e, prompts, max_tokens))
        print(f"[vllm-check] our chain decoder, {e.name}: tau {results[-1]['tau']} "
              f"({time.perf_counter() - start:.0f} s)", flush=True)
    return results


def exported_aux_layers(export: Export) -> list[int] | None:
    """The EAGLE-3 layer ids an export's config.json gives vLLM (None for Medusa)."""
    config = json.loads((export.folder / "config.json").read_text())
    # An export from before the ids moved to the top level: vLLM's model runner V2 ignores them there.
    return None if export.fmt == "medusa" else config.get("eagle_aux_hidden_state_layer_ids", [])


def vllm_figures(run: dict, no_spec: list[list[int]]) -> dict:
    """Identity with the no-speculation output and the acceptance figures of one engine run."""
    if "error" in run:
        return {"identical_to_no_spec": False, "error": run["error"]}
    differ = [i for i, (a, b) in enumerate(zip(run["tokens"], no_spec, strict=True)) if a != b]
    return {"identical_to_no_spec": not differ, "differing_prompts": differ,
            **acceptance(run.get("drafts", 0), run.get("draft_tokens", 0), run.get("accepted", 0),
                         run.get("accepted_per_pos", []), run["tokens"]),
            "tokens_per_s": run["tokens_per_s"], "startup_s": run["startup_s"]}


def engine_spec(target_dir: str, revision: str | None, prompts: list[list[int]], exports: list[Export], args,
                out: Path) -> dict:
    """What the engine process runs. The n-gram run comes last: in vLLM 0.32 any LLM created in the same
    process after an n-gram one fails (its kernel-override scan trips over llvmlite objects numba loaded)."""
    runs = {NO_SPEC: None}
    for e in exports:
        runs[str(e.folder)] = {"method": METHODS[e.fmt], "model": str(e.folder), "num_speculative_tokens": e.k}
    runs[NGRAM] = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    needed = max(map(len, prompts)) + args.max_tokens + max(e.k for e in exports) + 1
    return {"target": target_dir, "revision": revision, "dtype": args.dtype, "max_tokens": args.max_tokens,
            "max_model_len": max(2048, needed), "prompts": prompts, "runs": runs, "out": str(out)}


@dataclass
class TargetCheck:
    """Everything measured for the run directories that share one target."""
    target: str
    prompts: list[list[int]]
    exports: list[Export]
    engine: dict          # the engine process's results: {vllm_version, runs: {name: run}}
    ours: list[dict]      # our chain decoder, one per export
    log: Path


def side_by_side(cfg: DictConfig, dtype: str) -> bool:
    """Whether our decoder's float32 copy of the target fits in host memory beside the engine's (in ``dtype``): then
    it runs meanwhile, else after the engine (an 8B target: 32 + 32 GB in float32, more than many hosts have)."""
    import psutil
    import torch

    from train.plan import shapes
    from train.target import load_config

    params = shapes(cfg, load_config(cfg)).target_params
    engine = getattr(torch, dtype, None)   # (auto, and names vLLM knows but torch does not: as float32)
    need = params * (4 + (engine.itemsize if isinstance(engine, torch.dtype) else 4))
    free = psutil.virtual_memory().available
    if need < 0.8 * free:
        return True
    print(f"[vllm-check] the engine's copy of the target and ours take ~{need / 2**30:.0f} GiB, "
          f"{free / 2**30:.0f} GiB are available: our decoder runs after the engine", flush=True)
    return False


def check_target(target_dir: str, members: list[tuple[Path, DictConfig]], args) -> TargetCheck:
    """Run the engine process on every export of these run directories, and our decoder meanwhile."""
    import torch

    from train.target import load_tokenizer

    cfg = members[0][1]
    exports = [e for run_dir, c in members for e in find_exports(run_dir, c, args.k)]
    prompts = prompt_ids(cfg, load_tokenizer(cfg), args.prompts)
    log = members[0][0] / "export" / "vllm_engine.log"
    print(f"[vllm-check] {target_dir}: vLLM runs {len(exports) + 2} configurations on {len(prompts)} prompts "
          f"x {args.max_tokens} tokens (log: {log})", flush=True)
    with tempfile.TemporaryDirectory(prefix="vllm_check-") as work, open(log, "w") as log_file:
        spec_file, results = Path(work) / "spec.json", Path(work) / "results.json"
        spec_file.write_text(json.dumps(engine_spec(target_dir, cfg.model.get("revision"), prompts, exports, args, results)))
        proc = subprocess.Popen([str(args.vllm_python), str(Path(__file__).resolve()), "--engine", str(spec_file)],
                                env={**os.environ, **ENGINE_ENV}, stdout=log_file, stderr=subprocess.STDOUT)
        ours: list[dict] = []
        try:
            if side_by_side(cfg, args.dtype):
                torch.set_num_threads(1)   # the engine computes on the other core meanwhile
            else:
                proc.wait()
            if proc.poll() in (None, 0):   # (an engine that failed is reported below, before our decoder's minutes)
                ours = ours_for_exports(cfg, exports, prompts, args.max_tokens)
            rc = proc.wait()
        finally:
            if proc.poll() is None:
                proc.kill()
        engine_results = json.loads(results.read_text()) if rc == 0 and results.exists() else None
    if engine_results is None:
        tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
        raise SystemExit(f"the vLLM engine process failed (exit {rc}); last lines of {log}:\n{tail}")
    return TargetCheck(target_dir, prompts, exports, engine_results, ours, log)


def reports(check: TargetCheck, args) -> dict[Path, dict]:
    """One report per run directory of this target."""
    runs = check.engine["runs"]
    if "error" in runs[NO_SPEC]:
        raise SystemExit(f"vLLM without speculation failed:\n{runs[NO_SPEC]['error']}")
    no_spec = runs[NO_SPEC]["tokens"]
    ngram = vllm_figures(runs[NGRAM], no_spec)
    out: dict[Path, dict] = {}
    for e, mine in zip(check.exports, check.ours, strict=True):
        engine_side = vllm_figures(runs[str(e.folder)], no_spec)
        tau, our_tau = engine_side.get("tau"), mine["tau"]
        rel = abs(our_tau - tau) / tau if tau and our_tau else None
        report = out.setdefault(e.run_dir, {
            "engine": f"vllm {check.engine['vllm_version']}", "target": check.target, "dtype": args.dtype,
            "k": args.k, "max_tokens": args.max_tokens, "prompt_ids": check.prompts, "definitions": DEFINITIONS,
            "engine_log": str(check.log), "no_spec": {k: runs[NO_SPEC][k] for k in ("tokens_per_s", "startup_s")},
            "ngram": ngram, "exports": {}, **e.made_of})
        exported = exported_aux_layers(e)
        x = report["exports"][e.fmt] = {
            "folder": str(e.folder), "method": METHODS[e.fmt], "k": e.k, "vllm": engine_side,
            "aux_layers": {"exported": exported, "vllm": runs[str(e.folder)].get("aux_layers"),
                           "match": exported is None or sorted(exported) == runs[str(e.folder)].get("aux_layers")},
            "ours": {key: value for key, value in mine.items() if key != "tokens"},
            "ours_prompts_same_tokens_as_vllm": sum(a == b for a, b in zip(mine["tokens"], no_spec, strict=True)),
            "tau_rel_diff": round(rel, 4) if rel is not None else None,
            "tau_within_tolerance": rel is not None and rel <= args.tau_tolerance,
            "beats_ngram": bool(engine_side.get("tokens_per_pass") and ngram.get("tokens_per_pass")
                                and engine_side["tokens_per_pass"] > ngram["tokens_per_pass"]),
        }
        # This export's verdict (its model card's figures): identical output alone cannot show a draft computed otherwise.
        x["ok"] = engine_side["identical_to_no_spec"] and x["aux_layers"]["match"] and x["tau_within_tolerance"]
    for report in out.values():
        report["ok"] = ngram["identical_to_no_spec"] and all(x["ok"] for x in report["exports"].values())
    return out


def table(all_reports: dict[Path, dict]) -> str:
    """One row per export: identity, both taus, the n-gram baseline (tau per drafted pass | tokens per pass),
    throughput."""
    rows = [("export", "k", "identical", "vLLM tau", "our tau", "diff", "n-gram tau | tok/pass",
             "tok/s spec | no-spec")]
    for run_dir, report in all_reports.items():
        ngram = report["ngram"]
        for fmt, x in report["exports"].items():
            v = x["vllm"]
            diff = f"{x['tau_rel_diff']:.1%}" if x["tau_rel_diff"] is not None else "-"
            rows.append((f"{run_dir.parent.name}/{run_dir.name} {fmt}", str(x["k"]), str(v["identical_to_no_spec"]),
                         str(v.get("tau", "error")), str(x["ours"]["tau"]), diff,
                         f"{ngram.get('tau')} | {ngram.get('tokens_per_pass')}",
                         f"{v.get('tokens_per_s', '-')} | {report['no_spec']['tokens_per_s']}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows)


def check(args) -> int:
    """Check every run directory (one engine process per target); write the reports; 1 on a failure."""
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from data.formats import write_atomic
    from train.target import target_path

    if not args.vllm_python.exists():
        raise SystemExit(f"{args.vllm_python} not found: create the vLLM environment with `make vllm-env`")
    groups: dict[tuple, list[tuple[Path, DictConfig]]] = {}
    for run_dir in args.run_dirs:
        if not run_dir.is_dir():
            raise SystemExit(f"{run_dir}: no such run directory")
        cfg = run_config(run_dir.resolve())
        # one engine process per target as its runs load it (a pinned commit) and render their prompts
        key = (target_path(cfg), cfg.model.get("revision"), cfg.data.get("system_prompt"), cfg.data.get("thinking"))
        groups.setdefault(key, []).append((run_dir.resolve(), cfg))
    all_reports: dict[Path, dict] = {}
    for (target_dir, *_), members in groups.items():
        all_reports.update(reports(check_target(target_dir, members, args), args))
    for run_dir, report in all_reports.items():   # (each with what its folders are made of: the export cards' key)
        write_atomic(run_dir / "export" / "vllm_check.json", json.dumps(report, indent=2))   # read by export, publish
    print(table(all_reports))
    print(f"tau: {DEFINITIONS['tau']}.\nStop: {DEFINITIONS['stop']}. n-gram: {DEFINITIONS['ngram_tau']}.\n"
          f"tok/pass: {DEFINITIONS['tokens_per_pass']}.")
    print("reports: " + ", ".join(str(d / "export" / "vllm_check.json") for d in all_reports))
    failed = [f"{d.parent.name}/{d.name}" for d, r in all_reports.items() if not r["ok"]]
    if failed:
        print(f"FAILED: speculative output differs from vLLM's own no-speculation output, vLLM tapped other layers "
              f"than the export names (aux_layers), vLLM's acceptance differs from our decoder's by more than "
              f"--tau-tolerance (the export loads but drafts otherwise), or an engine run failed, in {failed}; see the "
              "reports", file=sys.stderr)
    return 1 if failed else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dirs", nargs="*", type=Path, help="run directories whose export stage finished")
    p.add_argument("--k", type=int, default=3, help="EAGLE-3 draft tokens per pass (Medusa: its number of heads)")
    p.add_argument("--prompts", type=int, default=8, help="built-in validation prompts (first turns)")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt (EOS ignored)")
    p.add_argument("--dtype", default="float32", help="vLLM dtype (float32: bf16 is 3.5x slower on AVX2 CPUs)")
    p.add_argument("--tau-tolerance", type=float, default=0.10, help="relative |our tau - vLLM tau| flagged as ok")
    p.add_argument("--vllm-python", type=Path, default=VLLM_PYTHON, help="interpreter of the vLLM environment")
    p.add_argument("--engine", type=Path, help=argparse.SUPPRESS)   # internal: run the engine part
    args = p.parse_args(argv)
    if not args.engine and not args.run_dirs:
        p.error("give at least one run directory")
    return args


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.engine:
        engine(arguments.engine)
    else:
        sys.exit(check(arguments))
