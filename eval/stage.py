"""Eval stage: the trained head in the built-in speculative decoder, against plain decoding.

Reads ``<run_dir>/train/head/``; writes into ``<run_dir>/eval/``: ``report.json`` (schema in
:func:`run`), ``report.md``, ``records.jsonl`` (one line per prompt x method x temperature) and PNG plots.
Plain decoding and every method run in the same process, prompt by prompt, so machine noise hits
both; at temperature 0 every method must reproduce plain greedy decoding token for token.
"""

from __future__ import annotations

import json
from itertools import chain

import torch
from omegaconf import DictConfig, OmegaConf

from data.template import prompt_ids, with_system
from eval.decoder import Generation, SpecDecoder
from eval.drafters import Drafter, Eagle3Drafter, build_drafter, medusa_choices
from eval.prompts import EvalPrompt, calibration_prompts, load_prompts
from eval.report import aggregate, log_wandb, markdown, plot, recommend
from eval.treesize import acceptance_curve, choose_total_tokens, draft_times, measure_verify_time
from heads.io import head_type, load_head
from train.log import log, progress
from train.stages import require, stage_dir
from train.target import load_target, load_tokenizer


def eos_token_ids(target, tokenizer) -> set[int]:
    """The generation config's EOS id(s) and the tokenizer's."""
    eos = target.generation_config.eos_token_id
    ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return ids | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())


def resolve_methods(methods, kind: str) -> list[str]:
    """``auto`` = plain, ngram and the head's tree, chain and +ngram tree; plain always comes first."""
    if methods == "auto":
        methods = ["ngram", f"{kind}-tree", f"{kind}-chain", f"{kind}+ngram-tree"]
    return ["plain", *[m for m in methods if m != "plain"]]


def converse(decoder: SpecDecoder, drafter: Drafter, tokenizer, prompt: EvalPrompt, cfg: DictConfig,
             temperature: float, seed: int, typical: bool = False) -> list[Generation]:
    """Answer every turn of ``prompt`` in order, feeding back the model's own answers."""
    messages, gens = with_system([], cfg.data.system_prompt), []
    for turn in prompt.turns:
        messages.append({"role": "user", "content": turn})
        gen = decoder.generate(prompt_ids(tokenizer, messages), drafter, cfg.eval.max_new_tokens, temperature,
                               cfg.eval.top_p, seed + len(gens), typical)
        messages.append({"role": "assistant", "content": tokenizer.decode(gen.tokens, skip_special_tokens=True)})
        gens.append(gen)
    return gens


def context_ids(tokenizer, prompts: list[EvalPrompt], length: int) -> list[int]:
    """``length`` tokens of real chat context: the prompts' first turns, templated, one after another."""
    turns = [prompt_ids(tokenizer, [{"role": "user", "content": p.turns[0]}]) for p in prompts]
    return list(chain.from_iterable(turns * (1 + length // sum(map(len, turns)))))[:length]


def size_tree(cfg: DictConfig, decoder: SpecDecoder, head, tokenizer) -> dict:
    """Verify time vs tree tokens on this machine and, with ``tree.total_tokens=auto``, the EAGLE tree
    size with the best predicted speedup from an acceptance curve measured on a few TRAINING prompts
    (never the evaluation prompts)."""
    t, kind = cfg.eval.tree, head_type(head)
    prompts = calibration_prompts(max(t.calibration_prompts, 8))
    context = context_ids(tokenizer, prompts, t.context)
    layers = list(head.config.aux_layers) if kind == "eagle3" else [decoder.target.config.num_hidden_layers]
    sizes = tuple(int(s) for s in t.sizes)
    info = {"top_k": t.top_k, "depth": t.depth, "chain_k": cfg.eval.chain_k,
            "verify_ms": measure_verify_time(decoder, context, sizes, hidden_layers=layers)}
    log("[eval] verify ms vs tree tokens: " + ", ".join(f"{s}: {ms:.0f}" for s, ms in info["verify_ms"].items()))
    if kind == "eagle3" and t.total_tokens == "auto":
        _, _, hidden = decoder.prefill(context[:-1], layers)
        info["draft_ms"] = {s: sum(draft_times(decoder, Eagle3Drafter(head, "tree", t.top_k, t.depth, s), context,
                                               hidden).values()) for s in sizes if s >= 2}
        drafter = Eagle3Drafter(head, "tree", t.top_k, t.depth, max(sizes))
        gens = [g for p in prompts[: t.calibration_prompts]
                for g in converse(decoder, drafter, tokenizer, p, cfg, 0.0, cfg.seed)]
        info["acceptance_curve"] = acceptance_curve(gens, sizes)
        info["total_tokens"], info["predicted_speedup"] = choose_total_tokens(
            info["verify_ms"], info["acceptance_curve"], info["draft_ms"])
        info["total_tokens_source"] = f"auto: best predicted speedup, {len(gens)} calibration decodes"
        log(f"[eval] total_tokens={info['total_tokens']} (predicted speedups {info['predicted_speedup']})")
    else:
        info["total_tokens"], info["total_tokens_source"] = int(t.total_tokens) if kind == "eagle3" else None, "config"
    info["medusa_nodes"] = len(medusa_choices(cfg.eval, head.config.num_heads)) if kind == "medusa" else None
    return info


def evaluate(cfg: DictConfig, decoder: SpecDecoder, drafters: dict[str, Drafter], tokenizer,
             prompts: list[EvalPrompt], temperature: float) -> list[dict]:
    """Per prompt: plain, then every method (rotating their order); the first ``eval.warmup`` prompts are
    decoded once untimed first. Returns one record per prompt x method."""
    methods = [m for m in drafters if m != "plain"]
    typical = {m: bool(cfg.eval.typical_acceptance) and m.startswith("medusa") for m in drafters}
    warm = prompts[: cfg.eval.warmup]
    records = []
    bar = progress(total=(len(warm) + len(prompts)) * len(drafters), desc=f"eval T={temperature}")
    for i, prompt in enumerate(warm + prompts):
        shift = i % max(1, len(methods))
        outputs = {}
        for method in ["plain", *methods[shift:], *methods[:shift]]:
            outputs[method] = converse(decoder, drafters[method], tokenizer, prompt, cfg, temperature,
                                       cfg.seed * 100003 + i, typical[method])
            bar.set_postfix_str(method)
            bar.update()
        if i < len(warm):
            continue
        plain = [g.tokens for g in outputs["plain"]]
        for method, gens in outputs.items():
            records.append({
                "dataset": prompt.dataset, "category": prompt.category, "id": prompt.id, "method": method,
                "temperature": temperature, "turns": len(gens),
                "new_tokens": sum(len(g.tokens) for g in gens), "cycles": sum(g.cycles for g in gens),
                "wall_s": sum(g.wall_s for g in gens), "draft_s": sum(g.draft_s for g in gens),
                "verify_s": sum(g.verify_s for g in gens), "prefill_s": sum(g.prefill_s for g in gens),
                "accept_lengths": [n for g in gens for n in g.accept_lengths],
                "identical": [g.tokens for g in gens] == plain if temperature == 0 else None,
                "acceptance": "typical (lossy)" if typical[method] and temperature > 0 else "exact",
            })
    bar.close()
    return records


def _mb(tensors) -> float:
    return round(sum(t.numel() * t.element_size() for t in tensors) / 2**20, 1)


def run(cfg: DictConfig) -> dict:
    """Writes report.json = {target, head, device, dtype, cpu_threads, head_params, head_extra_memory_mb,
    target_params, target_memory_mb, tree, results: [{dataset, category, method, temperature, n_prompts,
    new_tokens, cycles, tau, tokens_per_s, plain_tokens_per_s, speedup, draft_time_share,
    identical_to_plain, acceptance}], recommendations}, report.md, records.jsonl and plots."""
    require(cfg, "train")
    if cfg.eval.num_threads:
        torch.set_num_threads(cfg.eval.num_threads)
    out = stage_dir(cfg, "eval")
    out.mkdir(parents=True, exist_ok=True)
    target = load_target(cfg)
    tokenizer = load_tokenizer(cfg)
    head = load_head(stage_dir(cfg, "train") / "head", target).to(target.device, target.dtype)
    kind = head_type(head)
    decoder = SpecDecoder(target, eos_token_ids(target, tokenizer))
    prompts = load_prompts(cfg)
    if not prompts:
        raise ValueError("eval: no prompts (check eval.datasets, eval.questions and eval.limit)")
    log(f"[eval] {len(prompts)} prompts, {kind} head, device {target.device}, {target.dtype}")

    tree = size_tree(cfg, decoder, head, tokenizer)
    ecfg = OmegaConf.merge(cfg.eval, {"tree": {"total_tokens": tree["total_tokens"]}})
    methods = resolve_methods(OmegaConf.to_container(cfg.eval.methods) if OmegaConf.is_config(cfg.eval.methods)
                              else cfg.eval.methods, kind)
    drafters = {m: build_drafter(m, head, target.config.num_hidden_layers, ecfg) for m in methods}
    records = [r for temperature in cfg.eval.temperatures
               for r in evaluate(cfg, decoder, drafters, tokenizer, prompts, float(temperature))]
    results = aggregate(records)
    report = {
        "target": cfg.model.name, "head": kind, "device": str(target.device), "dtype": str(target.dtype),
        "cpu_threads": torch.get_num_threads(),
        "head_params": sum(v.numel() for v in head.trained_state_dict().values() if v.is_floating_point()),
        "head_extra_memory_mb": _mb(chain(head.parameters(), head.buffers())),
        "target_params": sum(p.numel() for p in target.parameters()),
        "target_memory_mb": _mb(chain(target.parameters(), target.buffers())),
        "tree": tree, "results": results, "recommendations": recommend(results, cfg.eval.min_speedup),
    }
    (out / "report.json").write_text(json.dumps(report, indent=2))
    (out / "report.md").write_text(markdown(report))
    (out / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    images = plot(results, records, out)
    if cfg.tracking.backend == "wandb":
        log_wandb(cfg, report, images)
    for rec in report["recommendations"]:
        if rec["category"] == "all":
            log(f"[eval] {rec['dataset']} T={rec['temperature']}: {rec['method'] or 'plain decoding'} ({rec['reason']})")
    return {"report": str(out / "report.json"), "recommendations": report["recommendations"]}
