"""Eval stage: the trained head in the built-in speculative decoder, against plain decoding.

Reads ``<run_dir>/train/head/``; writes into ``<run_dir>/eval/``: ``report.json`` (schema in
:func:`run`), ``report.md``, ``records.jsonl`` (one line per prompt x method x temperature) and PNG plots.
Resumable: the records of each prompt are appended to ``records.jsonl`` (flushed, fsync'ed) as soon as
it is decoded, and ``progress.json`` keeps the eval fingerprint (with the machine and the decoder's timing
version: ``eval.shared.target_identity``) and the tree sizing result; a rerun with the same fingerprint (after a
crash) keeps them and decodes only the prompts whose records are missing (``force=[eval]``, another fingerprint,
machine or decoder version starts over, so one report never mixes timings of two).
Plain decoding and every method run in the same process, prompt by prompt, so machine noise hits
both. Plain and n-gram decoding do not depend on the head: with ``eval.share_baselines`` (default) their
records (tokens and timings) are kept per target, machine and decode setting under ``eval.shared_dir``
(eval/shared.py) and the next head's eval reuses them instead of decoding again; the report's ``baselines``
field says how many were reused (their timings come from another process). The tree sizing's
measurements are cached there too. At temperature 0 every method must reproduce plain greedy decoding
token for token (reused plain tokens included). Where it does not (in bf16 a tree verify and a one-token
step round differently, so near-tie argmaxes can flip), the first divergence is re-scored by the target in
float32 and in the decoding precision: a "tie" is numerical (within the rounding measured there), a
"mismatch" a decoder bug.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import chain
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch
from omegaconf import DictConfig, OmegaConf

from data.formats import read_jsonl, rewrite_jsonl, write_atomic
from data.regenerate import eos_ids
from data.template import prompt_ids, set_thinking, with_system
from eval.decoder import Generation, SpecDecoder
from eval.drafters import Drafter, Eagle3Drafter, MedusaDrafter, build_drafter, medusa_choices
from eval.prompts import EvalPrompt, calibration_prompts, load_prompts
from eval.report import aggregate, decoder_bugs, log_wandb, markdown, plot, recommend
from eval.shared import (
    SHARED_METHODS,
    Baselines,
    JsonCache,
    baseline_settings,
    baseline_summary,
    digest,
    target_identity,
)
from eval.tree import choice_order, default_medusa_choices
from eval.treesize import acceptance_curve, choose_total_tokens, draft_times, measure_verify_time
from heads.io import head_type, load_head
from train import dist
from train.log import log, progress
from train.stages import fingerprint, force_record, require, stage_dir, upstream_ids
from train.target import (
    cpu_has_bf16,
    last_logits_only,
    load_target,
    load_tokenizer,
    resolve_device,
    resolve_dtype,
    stored_dtypes,
    target_fingerprint,
)

if TYPE_CHECKING:
    from tqdm import tqdm


def eos_token_ids(target, tokenizer) -> set[int]:
    """The generation config's EOS id(s) and the tokenizer's (as regeneration stops)."""
    return eos_ids(tokenizer, target.generation_config)


def resolve_methods(methods, kind: str) -> list[str]:
    """``auto`` = plain, ngram and the head's tree, chain and +ngram tree; plain always comes first."""
    if methods == "auto":
        methods = ["ngram", f"{kind}-tree", f"{kind}-chain", f"{kind}+ngram-tree"]
    return ["plain", *[m for m in methods if m != "plain"]]


def turn_prompt(tokenizer, prompt: EvalPrompt, cfg: DictConfig, answers: list[list[int]]) -> list[int]:
    """Token ids that turn ``len(answers)`` of ``prompt`` continues: the system prompt, the earlier user
    turns each followed by its answer (decoded), the next user turn and the assistant header."""
    messages = with_system([], cfg.data.system_prompt)
    for turn, answer in zip(prompt.turns, answers, strict=False):
        messages = [*messages, {"role": "user", "content": turn},
                    {"role": "assistant", "content": tokenizer.decode(answer, skip_special_tokens=True)}]
    return prompt_ids(tokenizer, [*messages, {"role": "user", "content": prompt.turns[len(answers)]}])


def converse(decoder: SpecDecoder, drafter: Drafter, tokenizer, prompt: EvalPrompt, cfg: DictConfig,
             temperature: float, seed: int, typical: bool = False) -> list[Generation]:
    """Answer every turn of ``prompt`` in order, feeding back the model's own answers."""
    gens: list[Generation] = []
    for _ in prompt.turns:
        gens.append(decoder.generate(turn_prompt(tokenizer, prompt, cfg, [g.tokens for g in gens]), drafter,
                                     cfg.eval.max_new_tokens, temperature, cfg.eval.top_p, seed + len(gens), typical,
                                     cfg.eval.get("top_k", 0)))
    return gens


def first_divergence(plain: list[list[int]], other: list[list[int]]) -> tuple[int, int, int] | None:
    """Where ``other`` (tokens per turn) first departs from ``plain``: (turn, index in that turn, index in
    the whole output = tokens matched before it); None when identical. One output ending before the other
    diverges at the shorter one's length."""
    offset = 0
    for turn, (a, b) in enumerate(zip(plain, other, strict=True)):
        i = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        if i < max(len(a), len(b)):
            return turn, i, offset + i
        offset += len(a)
    return None


def classify_divergence(logits: torch.Tensor, plain_token: int | None, method_token: int | None,
                        tolerance: float, error: torch.Tensor | None = None) -> tuple[str, float | None]:
    """Judge a divergence from the target's float32 next-token ``logits`` at its position: returns (kind,
    gap), gap = logit[plain_token] - logit[method_token]. ``tie`` (numerical: a low-precision argmax may
    flip) when |gap| <= tolerance * max(1, |logit[plain_token]|, |logit[method_token]|) + the spread of
    ``error`` (the decoding precision's logits minus the float32 ones there; None in float32), else
    ``mismatch`` (a decoder bug); a length difference (a token is None) is always a mismatch."""
    if plain_token is None or method_token is None:
        return "mismatch", None
    a, b = float(logits[plain_token]), float(logits[method_token])
    margin = tolerance * max(1.0, abs(a), abs(b)) + precision_spread(logits, error, plain_token, method_token)
    return ("tie" if abs(a - b) <= margin else "mismatch"), a - b


# The float32 top tokens over which the decoding precision's logit error is spread (plus the two diverging).
SPREAD_TOP = 10


def precision_spread(logits: torch.Tensor, error: torch.Tensor | None, *tokens: int) -> float:
    """How far rounding moved the target's logits apart at one position: max - min of ``error`` (low-precision
    minus float32 logits) over the float32 top ``SPREAD_TOP`` and ``tokens``; 0.0 without an error (float32).
    Two tokens whose float32 logits differ by less than this can swap places in another low-precision pass."""
    if error is None:
        return 0.0
    idx = torch.cat([logits.topk(SPREAD_TOP).indices, torch.tensor(tokens, device=logits.device)])
    return float(error[idx].max() - error[idx].min())


class Fp32Scorer:
    """The target's float32 next-token logits after a token prefix, and the decoding precision's error there.
    ``target`` decodes (any precision); ``fp32``, the float32 target when the caller holds one (its weights as
    loaded). Else, for a target decoding in the precision its files store (a 7-8B target's bf16) whose floating
    buffers are float32 (RoPE's; not Gemma's bf16 embedding scale), the target itself computes in float32 one
    module at a time (:func:`float32_weights`: exactly the float32 target; at 8B ~3 GB more for a 2k-token prefix:
    the float32 embedding or lm_head, one layer, the activations, instead of a 32 GB copy); otherwise (the default
    target stored in float32 and decoding in bf16; that pass out of memory), a float32 copy is loaded from its
    files on the first call (only divergences pay for it), on the target's device when it has room, else on the
    CPU."""

    def __init__(self, target, cfg: DictConfig, fp32=None):
        self.target, self.cfg, self.model = target, cfg, fp32

    @staticmethod
    @torch.inference_mode()
    def _logits(model, ids: list[int]) -> torch.Tensor:
        ids_t = torch.tensor([ids], device=next(model.parameters()).device)
        return model(ids_t, logits_to_keep=last_logits_only(ids_t), use_cache=False).logits[0, -1].float()

    def __call__(self, ids: list[int]) -> torch.Tensor:
        if self.model is None:
            upcast = stored_dtypes(self.cfg) == {self.target.dtype} and all(
                b.dtype == torch.float32 for b in self.target.buffers() if b.is_floating_point())
            self.model = self.target if upcast else self._load()
        if self.model is self.target and self.target.dtype != torch.float32:
            try:
                with float32_weights(self.target):
                    return self._logits(self.target, ids)
            except torch.OutOfMemoryError:   # loaded below, once the failed pass's tensors are released with it
                pass
            log("[eval] out of device memory computing the target in float32 one module at a time: judging "
                "divergences with a float32 copy of it (on the CPU when the device has no room)")
            self.model = self._load()
        return self._logits(self.model, ids)

    def _load(self):
        """The float32 target from its files, where :func:`scorer_device` finds room."""
        device = scorer_device(self.target)
        if device.type == "cpu" and next(self.target.parameters()).device.type == "cuda":
            # a launcher's OMP_NUM_THREADS=1: minutes per 8B pass; the cores this rank may use, not the host's
            torch.set_num_threads(dist.cpus())
        return self.target if self.target.dtype == torch.float32 else load_target(self.cfg, device, torch.float32)

    def error(self, ids: list[int], logits: torch.Tensor) -> torch.Tensor | None:
        """The decoding precision's next-token logits after ``ids`` minus their float32 ``logits`` (None when
        the target decodes in float32)."""
        return None if self.target.dtype == torch.float32 else self._logits(self.target, ids).to(logits.device) - logits


@contextmanager
def float32_weights(model: torch.nn.Module) -> Iterator[None]:
    """``model``'s forwards compute in float32 one module at a time: each module's own parameters get a float32 copy
    of their weights as its forward starts and their own tensors back as it ends, so the activations stay float32
    from the embedding on and no more than one layer's (or the lm_head's) float32 copy exists at once. From a
    checkpoint stored in the model's dtype this is exactly the float32 model; buffers (RoPE's inv_freq) are left
    alone, and the weights are the same tensors afterwards."""
    own = {p: p.data for p in model.parameters()}

    def weights(module: torch.nn.Module, to_float32: bool) -> None:
        for p in module.parameters(recurse=False):
            p.data = own[p].float() if to_float32 else own[p]

    owners = [m for m in model.modules() if next(m.parameters(recurse=False), None) is not None]
    hooks = [h for m in owners for h in (m.register_forward_pre_hook(lambda m, _: weights(m, True)),
                                         m.register_forward_hook(lambda m, _, __: weights(m, False)))]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()
        for m in owners:   # a forward stopped by an error leaves its module's float32 copy
            weights(m, False)


def scorer_device(target) -> torch.device:
    """Where a float32 copy of ``target`` goes: its own device when that has 1.2x the copy's size free (blocks the
    allocator caches but does not use given back first), else the CPU."""
    device = next(target.parameters()).device
    if device.type != "cuda":
        return device
    torch.cuda.empty_cache()
    need = 1.2 * 4 * sum(p.numel() for p in target.parameters())
    return device if torch.cuda.mem_get_info(device)[0] >= need else torch.device("cpu")


def divergence(scorer: Fp32Scorer, tokenizer, prompt: EvalPrompt, cfg: DictConfig, plain: list[list[int]],
               other: list[list[int]]) -> dict | None:
    """None when ``other`` reproduces ``plain`` (tokens per turn); else its first divergence: {position
    (tokens matched before it), turn, plain_token, method_token, fp32_gap, precision_spread (None in
    float32), kind: tie | mismatch}, judged by :func:`classify_divergence` on one fp32 forward of the common
    prefix and, when the target decodes in lower precision, one forward of it there."""
    where = first_divergence(plain, other)
    if where is None:
        return None
    turn, i, position = where
    context = turn_prompt(tokenizer, prompt, cfg, plain[:turn]) + plain[turn][:i]
    tokens = [seq[turn][i] if i < len(seq[turn]) else None for seq in (plain, other)]
    logits = scorer(context)
    error = scorer.error(context, logits)
    kind, gap = classify_divergence(logits, *tokens, cfg.eval.tie_tolerance, error)
    spread = None if error is None or None in tokens else precision_spread(logits, error, *tokens)
    return {"position": position, "turn": turn, "plain_token": tokens[0], "method_token": tokens[1],
            "fp32_gap": gap, "precision_spread": spread, "kind": kind}


def context_ids(tokenizer, prompts: list[EvalPrompt], length: int) -> list[int]:
    """``length`` tokens of real chat context: the prompts' first turns, templated, one after another."""
    turns = [prompt_ids(tokenizer, [{"role": "user", "content": p.turns[0]}]) for p in prompts]
    return list(chain.from_iterable(turns * (1 + length // sum(map(len, turns)))))[:length]


def _ints(curve: dict) -> dict[int, float]:
    """A size -> value curve with integer sizes again (JSON stores keys as strings)."""
    return {int(k): v for k, v in curve.items()}


def measure_acceptance(cfg: DictConfig, decoder: SpecDecoder, head, tokenizer, prompts: list[EvalPrompt],
                       context: list[int], sizes: tuple[int, ...], bar: tqdm | None = None) -> dict:
    """A head's draft ms per tree size (``context`` cached) and its acceptance curve tau(T) from greedy decodes of
    ``prompts`` with the largest tree: EAGLE-3's dynamic tree (its T - 1 best-scored nodes), Medusa's default tree
    (its first T - 1 paths); ``bar`` advances per size and per prompt."""
    t, layers = cfg.eval.tree, decoder.target.config.num_hidden_layers
    eagle = head_type(head) == "eagle3"
    paths = None if eagle else default_medusa_choices(head.config.num_heads, max(sizes) - 1)  # likeliest first

    def tree(size: int) -> Eagle3Drafter | MedusaDrafter:
        if eagle:
            return Eagle3Drafter(head, "tree", t.top_k, t.depth, size)
        return MedusaDrafter(head, layers, paths[:size - 1])   # = default_medusa_choices(heads, size - 1)

    largest = tree(max(sizes))
    _, _, hidden = decoder.prefill(context[:-1], largest.hidden_layers)
    draft_ms = {}
    for s in (s for s in sizes if s >= 2):
        draft_ms[s] = sum(draft_times(decoder, tree(s), context, hidden).values())
        bar and bar.update()
    gens = []
    for p in prompts:
        gens += converse(decoder, largest, tokenizer, p, cfg, 0.0, cfg.seed)
        bar and bar.update()
    order = None if eagle else choice_order(paths)
    return {"draft_ms": draft_ms, "acceptance_curve": acceptance_curve(gens, sizes, order), "decodes": len(gens)}


def size_tree(cfg: DictConfig, decoder: SpecDecoder, head, tokenizer, cache: JsonCache | None = None,
              head_id: str | None = None) -> dict:
    """Verify time vs tree tokens on this machine and, with ``tree.total_tokens=auto``, the tree size (EAGLE's, or
    Medusa's default tree with ``medusa_choices=auto``) with the best predicted speedup from an acceptance curve
    measured on HELD-OUT prompts
    (:func:`eval.prompts.calibration_prompts`: never timed, never trained on; ``calibration`` says which).
    With a ``cache`` the verify curve (per target + machine: every head's eval shares it) and, given the
    head's identity ``head_id``, its draft times and acceptance curve are read from it, else measured and
    stored there."""
    t, kind = cfg.eval.tree, head_type(head)
    cache = cache or JsonCache(None)
    prompts, source = calibration_prompts(cfg, max(t.calibration_prompts, 8))
    context = context_ids(tokenizer, prompts, t.context)
    sizes = tuple(sorted({1, *(int(s) for s in t.sizes)}))   # 1: every prediction is relative to plain decoding's pass
    grown = kind == "eagle3" or cfg.eval.medusa_choices in (None, "auto")   # a tree whose size total_tokens sets
    auto = grown and t.total_tokens == "auto"
    calibration = prompts[: t.calibration_prompts]
    vkey = {"verify_ms": sizes, "context": digest(context), "timing": "paired with 1-token passes"}
    akey = {"acceptance": head_id, "context": digest(context), "prompts": digest([p.turns for p in calibration]),
            "sizes": sizes, "top_k": t.top_k, "depth": t.depth,
            "tree": kind if kind == "eagle3" else digest(default_medusa_choices(head.config.num_heads, max(sizes) - 1)),
            "max_new_tokens": cfg.eval.max_new_tokens,
            "seed": cfg.seed, "system_prompt": cfg.data.system_prompt, "thinking": cfg.data.get("thinking")}
    acache = cache if head_id else JsonCache(None)
    verify, accept = cache.get(vkey), acache.get(akey) if auto else None
    steps = (verify is None) * len(sizes) + (auto and accept is None) * (sum(s >= 2 for s in sizes) + len(calibration))
    bar = progress(total=steps, desc="eval tree sizing") if steps else None
    if verify is None:
        verify = cache.put(vkey, measure_verify_time(decoder, context, sizes, bar=bar))
    info = {"top_k": t.top_k, "depth": t.depth, "chain_k": cfg.eval.chain_k, "verify_ms": _ints(verify)}
    log("[eval] verify ms vs tree tokens: " + ", ".join(f"{s}: {ms:.0f}" for s, ms in info["verify_ms"].items()))
    if auto:
        if accept is None:
            accept = acache.put(akey, measure_acceptance(cfg, decoder, head, tokenizer, calibration, context, sizes, bar))
        info["draft_ms"], info["acceptance_curve"] = _ints(accept["draft_ms"]), _ints(accept["acceptance_curve"])
        info["total_tokens"], info["predicted_speedup"] = choose_total_tokens(
            info["verify_ms"], info["acceptance_curve"], info["draft_ms"])
        info["total_tokens_source"] = f"auto: best predicted speedup, {accept['decodes']} calibration decodes"
        info["calibration"] = f"{source}: {', '.join(f'{p.dataset}/{p.id}' for p in calibration)}"
        log(f"[eval] total_tokens={info['total_tokens']} (predicted speedups {info['predicted_speedup']}; "
            f"tau measured on {info['calibration']})")
    else:
        info["total_tokens"], info["total_tokens_source"] = int(t.total_tokens) if grown else None, "config"
    if bar is not None:
        bar.close()
    info["medusa_nodes"] = None if kind != "medusa" else len(medusa_choices(sized(cfg.eval, info),
                                                                            head.config.num_heads))
    return info


def sized(ecfg: DictConfig, tree: dict) -> DictConfig:
    """``eval`` with the tree :func:`size_tree` chose: ``tree.total_tokens`` resolved. A Medusa tree kept by an
    eval from before Medusa's tree was sized has none: its node count gives the same default tree."""
    total = tree["total_tokens"]
    if total is None and tree.get("medusa_nodes"):
        total = tree["medusa_nodes"] + 1
    return OmegaConf.merge(ecfg, {"tree": {"total_tokens": total}})


# Tree tokens whose verify times (summed) choose the precision of eval.dtype=auto: plain decoding, a chain, a tree.
DTYPE_SIZES = (1, 4, 8)


class EvalTarget(NamedTuple):
    model: torch.nn.Module              # the target in the precision the eval decodes in
    fp32: torch.nn.Module | None        # the float32 target, when eval.dtype=auto loaded one (Fp32Scorer uses it)
    choice: dict | None                 # what eval.dtype=auto measured: {"sizes", "verify_ms": {dtype: ms}, "chosen"}


def eval_target(cfg: DictConfig, tokenizer, cache_dir: Path | None = None, fresh: bool = False) -> EvalTarget:
    """The target in the precision the eval decodes in (``eval.dtype``), and what chose it. ``auto`` is the run's
    dtype, except on a CPU that multiplies bf16 natively (:func:`train.target.cpu_has_bf16`) while ``dtype`` is
    auto: there float32 and bfloat16 copies verify ``DTYPE_SIZES`` tree tokens after ``eval.tree.context``
    tokens, alternating twice, and the precision with the smaller summed time (min over the rounds) decodes
    everything, plain decoding included (on an AMD Zen 4 bf16 verified 1.7x faster and flat up to 16 tokens,
    on an Intel Sapphire Rapids batch-1 bf16 was slower: README, "bf16 on a CPU"). Kept under
    ``cache_dir`` (a :class:`JsonCache` keyed by the float32 target and machine; ``fresh`` measures again), so
    every head's eval of the target decodes in the same precision and shares its plain and n-gram records."""
    name, device = cfg.eval.get("dtype", "auto"), resolve_device(cfg.device)
    if name != "auto" or cfg.dtype != "auto" or device.type != "cpu" or not cpu_has_bf16():
        return EvalTarget(load_target(cfg, device, resolve_dtype(cfg.dtype if name == "auto" else name, device)),
                          None, None)
    fp32 = load_target(cfg, device, torch.float32)
    models = {"float32": fp32, "bfloat16": None}      # the bf16 copy is made when measured or chosen
    prompts, _ = calibration_prompts(cfg, max(cfg.eval.tree.calibration_prompts, 8))
    context = context_ids(tokenizer, prompts, cfg.eval.tree.context)
    cache = JsonCache(cache_dir, target_identity(target_fingerprint(cfg), [], fp32), fresh)
    key = {"dtype_choice": DTYPE_SIZES, "context": digest(context)}
    ms = cache.get(key)
    if ms is None:
        models["bfloat16"] = copy.deepcopy(fp32).to(torch.bfloat16)
        ms = dict.fromkeys(models, float("inf"))
        for _ in range(2):
            for dtype, model in models.items():
                ms[dtype] = min(ms[dtype], sum(measure_verify_time(SpecDecoder(model), context, DTYPE_SIZES).values()))
        ms = cache.put(key, ms)
    chosen = min(ms, key=ms.get)
    if models[chosen] is None:
        models[chosen] = copy.deepcopy(fp32).to(torch.bfloat16)
    log(f"[eval] eval.dtype=auto: {chosen} (one verify pass at {', '.join(map(str, DTYPE_SIZES))} tree tokens: "
        + ", ".join(f"{d} {v:.0f} ms" for d, v in ms.items()) + " summed)")
    return EvalTarget(models[chosen], fp32, {"sizes": list(DTYPE_SIZES), "verify_ms": ms, "chosen": chosen})


def record_key(record: dict) -> tuple:
    """What identifies a record within one eval fingerprint."""
    return record["dataset"], str(record["id"]), record["method"], float(record["temperature"])


class Records:
    """``records.jsonl`` written as the evaluation goes: each prompt's records (all its methods) appended
    together, flushed and fsync'ed. ``done`` holds the records kept from an earlier run with the same
    fingerprint (``progress.json``): complete prompts only, a torn or partial tail is dropped. ``fresh``
    (``force=[eval]``) keeps none, but those of its own ``attempt`` (the forcing command repeated after a crash)."""

    def __init__(self, out: Path, fp: str, methods: list[str], fresh: bool, attempt: str | None = None):
        self.path, self.meta = out / "records.jsonl", out / "progress.json"
        try:
            meta = json.loads(self.meta.read_text()) if self.meta.exists() else {}
        except ValueError:   # torn (written atomically since; a full disk): nothing kept
            meta = {}
        if fresh and (attempt is None or meta.get("attempt") != attempt):
            meta = {}
        self.done: dict[tuple, dict] = {}
        self.tree = None
        if meta.get("fingerprint") == fp and self.path.exists():
            self.tree = meta.get("tree")
            groups: dict[tuple, list[dict]] = {}
            for r in read_jsonl(self.path):  # a line torn by a crash is skipped
                dataset, prompt, _, temperature = record_key(r)
                groups.setdefault((dataset, prompt, temperature), []).append(r)
            for group in groups.values():
                if {r["method"] for r in group} == set(methods):
                    self.done.update((record_key(r), r) for r in group)
        rewrite_jsonl(self.path, self.done.values())  # only the complete prompts stay in the file
        self.fp, self.attempt = fp, attempt
        self.keep_tree(self.tree)

    def keep_tree(self, tree: dict | None) -> None:
        self.tree = tree
        write_atomic(self.meta, json.dumps({"fingerprint": self.fp, "tree": tree, "attempt": self.attempt}))

    def add(self, records: list[dict]) -> None:
        with open(self.path, "a") as f:
            f.write("".join(json.dumps(r) + "\n" for r in records))
            f.flush()
            os.fsync(f.fileno())
        self.done.update((record_key(r), r) for r in records)


def decode_record(prompt: EvalPrompt, method: str, temperature: float, seed: int, gens: list[Generation],
                  typical: bool) -> dict:
    """A prompt's record for one method: its tokens per turn, counts and timings (no divergence yet)."""
    return {
        "dataset": prompt.dataset, "category": prompt.category, "id": prompt.id, "method": method,
        "temperature": temperature, "seed": seed, "turns": len(gens), "tokens": [g.tokens for g in gens],
        "new_tokens": sum(len(g.tokens) for g in gens), "cycles": sum(g.cycles for g in gens),
        "wall_s": sum(g.wall_s for g in gens), "draft_s": sum(g.draft_s for g in gens),
        "verify_s": sum(g.verify_s for g in gens), "prefill_s": sum(g.prefill_s for g in gens),
        "accept_lengths": [n for g in gens for n in g.accept_lengths],
        "acceptance": "typical (lossy)" if typical and temperature > 0 else "exact", "reused": False,
    }


def judge(scorer: Fp32Scorer, tokenizer, prompt: EvalPrompt, cfg: DictConfig, record: dict,
          plain: list[list[int]]) -> dict:
    """``record`` with ``identical`` and ``divergence`` against plain decoding's tokens ``plain`` (greedy
    only; None when sampling); a real mismatch is logged as a decoder bug."""
    greedy = record["temperature"] == 0
    div = divergence(scorer, tokenizer, prompt, cfg, plain, record["tokens"]) if greedy else None
    if div and div["kind"] == "mismatch":
        log(f"[eval] DECODER BUG: {record['method']} departs from plain decoding on {prompt.dataset}/{prompt.id} "
            f"after {div['position']} tokens: {div['method_token']} instead of {div['plain_token']} "
            f"(fp32 logit gap {div['fp32_gap']}, low-precision spread {div['precision_spread']})")
    return {**record, "identical": div is None if greedy else None, "divergence": div}


def evaluate(cfg: DictConfig, decoder: SpecDecoder, drafters: dict[str, Drafter], tokenizer,
             prompts: list[EvalPrompt], temperature: float, scorer: Fp32Scorer | None = None,
             store: Records | None = None, baselines: Baselines | None = None) -> list[dict]:
    """Per prompt: plain, then every method (rotating their order); the first ``eval.warmup`` prompts are
    decoded once untimed first. Returns one record per prompt x method (:func:`decode_record`), judged
    against plain decoding's tokens (:func:`judge`). With a ``store``, prompts whose records it holds are
    not decoded again (their records are returned; a prompt keeps its index, hence its seed) and the new
    ones are added to it as each prompt finishes. With ``baselines``, the records of plain and n-gram found
    there (another head's eval, an earlier run) are reused (``reused``: tokens and timings from that
    process) and those decoded here are added to it."""
    scorer = scorer or Fp32Scorer(decoder.target, cfg)
    methods = [m for m in drafters if m != "plain"]
    typical = {m: bool(cfg.eval.typical_acceptance) and m.startswith("medusa") for m in drafters}
    done = store.done if store is not None else {}
    shared = [m for m in SHARED_METHODS if m in drafters]
    n_warm, base = min(cfg.eval.warmup, len(prompts)), cfg.seed * 100003

    def kept(prompt: EvalPrompt) -> list[dict] | None:
        found = [done.get((prompt.dataset, str(prompt.id), m, temperature)) for m in drafters]
        return None if None in found else found

    def order(i: int, skip: dict) -> list[str]:   # plain first, the others rotated by the prompt's index
        shift = i % max(1, len(methods))
        return [m for m in ["plain", *methods[shift:], *methods[:shift]] if m not in skip]

    old = {j: k for j, p in enumerate(prompts) if (k := kept(p)) is not None}
    reuse = {j: baselines.find(p.turns, shared, temperature, base + n_warm + j) if baselines else {}
             for j, p in enumerate(prompts) if j not in old}
    decoded = {m for j, have in reuse.items() for m in order(n_warm + j, have)}
    warm = [m for m in drafters if m in decoded]   # nothing left to time: no warmup either
    todo = sum(len(order(n_warm + j, have)) for j, have in reuse.items())
    if store is not None and old:
        log(f"[eval] T={temperature}: {len(old)} prompts kept from an earlier run, {len(reuse)} to decode")
    if any(reuse.values()):
        log(f"[eval] T={temperature}: {sum(map(len, reuse.values()))} plain/n-gram prompt records reused from "
            f"{baselines.path} (decoded by an earlier eval process of this target on this machine)")
    bar = progress(total=n_warm * len(warm) + todo, desc=f"eval T={temperature}")

    def decode(prompt: EvalPrompt, i: int, which: list[str]) -> dict[str, list[Generation]]:
        outputs = {}
        for method in which:
            outputs[method] = converse(decoder, drafters[method], tokenizer, prompt, cfg, temperature, base + i,
                                       typical[method])
            bar.set_postfix_str(method)
            bar.update()
        return outputs

    for i, prompt in enumerate(prompts[:n_warm] if warm else []):
        decode(prompt, i, warm)
    records = []
    for j, prompt in enumerate(prompts):
        if j in old:
            records.extend(old[j])
            continue
        i, have = n_warm + j, reuse[j]
        fresh = {m: decode_record(prompt, m, temperature, base + i, gens, typical[m])
                 for m, gens in decode(prompt, i, order(i, have)).items()}
        found = {**fresh, **{m: {**r, "dataset": prompt.dataset, "category": prompt.category, "id": prompt.id}
                             for m, r in have.items()}}
        mine = [judge(scorer, tokenizer, prompt, cfg, found[m], found["plain"]["tokens"]) for m in drafters]
        records.extend(mine)
        if store is not None:
            store.add(mine)
        if baselines is not None:
            baselines.add(prompt.turns, [fresh[m] for m in shared if m in fresh])
    bar.close()
    return records


def _mb(tensors) -> float:
    return round(sum(t.numel() * t.element_size() for t in tensors) / 2**20, 1)


def run(cfg: DictConfig) -> dict:
    """Writes report.json = {target, head, device, dtype, dtype_choice (eval_target), cpu_threads, head_params,
    head_extra_memory_mb, target_params, target_memory_mb, tree, baselines (eval.shared.baseline_summary), results: [{dataset,
    category, method, temperature, n_prompts, new_tokens, cycles, tau, tokens_per_s, plain_tokens_per_s,
    speedup, draft_time_share, identical_to_plain, divergence_rate, divergence_position, ties, mismatches,
    acceptance}],
    recommendations, decoder_bugs}, report.md, records.jsonl and plots (fields: eval/report.py)."""
    require(cfg, "train")
    set_thinking(cfg.data.get("thinking"))  # prompts rendered as the data stage rendered them
    if cfg.eval.num_threads:
        torch.set_num_threads(cfg.eval.num_threads)
    threads = torch.get_num_threads()   # the decodes' (a float32 judge on the CPU may take more cores later)
    out = stage_dir(cfg, "eval")
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(cfg)
    shared_dir = Path(cfg.eval.shared_dir)
    fresh = "eval" in cfg.force
    target, fp32, dtype_choice = eval_target(cfg, tokenizer, shared_dir / "sizing", fresh)
    head = load_head(stage_dir(cfg, "train") / "head", target).to(target.device, target.dtype)
    kind = head_type(head)
    decoder = SpecDecoder(target, eos_token_ids(target, tokenizer))
    prompts = load_prompts(cfg)
    if not prompts:
        raise ValueError("eval: no prompts (check eval.datasets, eval.questions and eval.limit)")
    log(f"[eval] {len(prompts)} prompts, {kind} head, device {target.device}, {target.dtype}")
    if target.device.type == "cpu" and os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE":
        log("[eval] warning: OMP_WAIT_POLICY=PASSIVE: OpenMP threads sleep between the target's GEMMs, and its verify "
            "passes of 2+ tokens take ~2x as long (1.6-2.1x on a 2-core CPU): the speedups measured here understate "
            "what the heads do; unset it for the eval")

    methods = resolve_methods(OmegaConf.to_container(cfg.eval.methods) if OmegaConf.is_config(cfg.eval.methods)
                              else cfg.eval.methods, kind)
    identity = target_identity(target_fingerprint(cfg), decoder.eos, target)
    # Records timed on another machine or by another decoder version are not mixed with this run's.
    # (eval.min_speedup changes the recommendation only: the decodes are kept)
    store = Records(out, digest([fingerprint(cfg, "eval", ignore=("eval.min_speedup",)), identity]), methods, fresh,
                    (force_record(cfg) or {}).get("attempt"))
    baselines = (Baselines(shared_dir, {**identity, **baseline_settings(cfg)}, fresh) if cfg.eval.share_baselines
                 else None)
    if store.tree is not None:
        tree = store.tree
        log(f"[eval] resuming: tree sizing and {len(store.done)} records kept from an earlier run")
    else:
        tree = size_tree(cfg, decoder, head, tokenizer, JsonCache(shared_dir / "sizing", identity, fresh),
                         upstream_ids(cfg, "eval")["train"])
        store.keep_tree(tree)
    drafters = {m: build_drafter(m, head, target.config.num_hidden_layers, sized(cfg.eval, tree)) for m in methods}
    scorer = Fp32Scorer(target, cfg, fp32)
    records = [r for temperature in cfg.eval.temperatures
               for r in evaluate(cfg, decoder, drafters, tokenizer, prompts, float(temperature), scorer, store,
                                 baselines)]
    results = aggregate(records)
    report = {
        "target": cfg.model.name, "head": kind, "device": str(target.device), "dtype": str(target.dtype),
        "dtype_choice": dtype_choice, "cpu_threads": threads,
        "head_params": sum(v.numel() for v in head.trained_state_dict().values() if v.is_floating_point()),
        "head_extra_memory_mb": _mb(t for t in chain(head.parameters(), head.buffers())   # not the target's embedding
                                    if all(t is not p for p in target.get_input_embeddings().parameters())),
        "target_params": sum(p.numel() for p in target.parameters()),
        "target_memory_mb": _mb(chain(target.parameters(), target.buffers())),
        "tree": tree, "baselines": baseline_summary(records, baselines), "results": results,
        # rows -> the GEMM layout this process's decoder timed faster (SpecDecoder.logits, SpecDecoder.verify)
        "gemm_layouts": {name: {str(rows): layout for rows, layout in sorted(chosen.items())}
                         for name, chosen in (("lm_head", decoder.layouts), ("layers", decoder.pass_layouts))},
        "recommendations": recommend(results, cfg.eval.min_speedup), "decoder_bugs": decoder_bugs(results),
    }
    (out / "report.json").write_text(json.dumps(report, indent=2))
    (out / "report.md").write_text(markdown(report))
    tmp = out / "records.jsonl.tmp"  # the same records, in the order of a straight run
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    os.replace(tmp, out / "records.jsonl")
    images = plot(results, records, out)
    if cfg.tracking.backend == "wandb":
        log_wandb(cfg, report, images)
    for bug in report["decoder_bugs"]:
        log(f"[eval] DECODER BUG: {bug['method']} on {bug['dataset']}: {bug['mismatches']} of {bug['n_prompts']} "
            "prompts depart from plain decoding where fp32 is not a near-tie; excluded from recommendations")
    for rec in report["recommendations"]:
        if rec["category"] == "all":
            log(f"[eval] {rec['dataset']} T={rec['temperature']}: {rec['method'] or 'plain decoding'} ({rec['reason']})")
    return {"report": str(out / "report.json"), "recommendations": report["recommendations"]}
