"""One validation pass over the composed config, before any stage (and before ``plan=true``).

Data-driven: :data:`ENUMS` lists every key that takes one of a fixed set of values, :data:`NUMBERS` the
sizes and shares with a range. A key absent from the composed config is not checked (``head.loss`` only
exists for Medusa, ``model.arch`` only for the tiny targets, ``tracking.mode`` only for wandb). A list
value is checked element by element; ``a[].b`` checks key ``b`` of every element of list ``a``. Every
problem is collected and reported in one :class:`~train.errors.ConfigError` that names the key, the bad
value and the valid values.
"""

from __future__ import annotations

import difflib
import os
import re

from omegaconf import DictConfig, OmegaConf

from data.engines import BACKENDS
from eval.drafters import METHODS
from heads.eagle3 import EMBED_HALF
from train.errors import ConfigError, UserError
from train.export import FORMATS
from train.losses import OBJECTIVES
from train.stages import ORDER

DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"   # conf/model/smollm2-135m.yaml's original
STAGES = tuple(ORDER)
EXPORTS = FORMATS
SOURCE_KEYS = ("type", "path", "hf", "hf_split", "hf_config", "hf_revision", "hf_data_files", "hf_streaming",
               "format", "prompt_field", "split", "limit", "name",
               # type: synth (data/synth.py)
               "n", "batch_size", "max_new_tokens", "temperature", "top_p", "seed", "hints", "near_duplicate",
               "min_chars", "max_attempts")

# key -> valid values (a callable: computed from the config, e.g. the head's export formats).
ENUMS = {
    "stages": STAGES,
    "force": STAGES,
    "device": ("auto", "cpu", "cuda", "cuda:<N>"),
    "dtype": ("auto", *DTYPES),
    "model.source": ("hf", "gguf_package", "tiny"),
    "model.arch": ("llama", "qwen2", "qwen3"),
    "model.template": ("llama3", "chatml"),
    "head.type": ("eagle3", "medusa"),
    "head.fc_init": ("random", "last_tap"),
    "head.layer_init_embed": EMBED_HALF,
    "head.loss": lambda cfg: (*OBJECTIVES, "ce") if cfg.head.type == "medusa" else OBJECTIVES,
    "data.overflow": ("truncate", "drop"),
    "data.on_error": ("raise", "skip"),
    "data.exclude_eval": ("humaneval",),
    "data.sources[].type": ("builtin", "humaneval", "synth"),
    "data.regen.backend": BACKENDS,
    "data.regen.dtype": ("auto", *DTYPES),
    "data.thinking": (None, True, False),
    "data.sources[].format": ("auto", "sharegpt", "messages", "ultrachat", "turns", "humaneval", "prompts"),
    "data.sources[].split": ("train", "validation", None),
    "extract.dtype": DTYPES,
    "eval.dtype": ("auto", *DTYPES),
    "extract.source": ("auto", "pass", "regen"),
    "extract.zero_stage": (0, 1, 2, 3),
    "train.positions": ("all", "assistant"),
    "train.optimizer": ("adamw", "muon"),
    "train.loss_norm": ("token", "micro_batch"),
    "train.grad_accum_dtype": ("fp32", "bf16", "fp16"),
    "train.autocast": (None, "bfloat16", "float16"),
    "train.zero_stage": (0, 1, 2, 3),  # 3 is refused in problems(), with the reason
    "eval.datasets": ("builtin", "humaneval"),
    "eval.share_baselines": (True, False),
    "eval.methods": ("auto", *METHODS),
    "eval.medusa_choices": lambda cfg: None if OmegaConf.is_list(cfg.eval.medusa_choices) else ("auto", None),
    "export.dtype": DTYPES,
    "export.formats": lambda cfg: ("auto", *EXPORTS.get(cfg.head.type, ())),
    "publish.format": lambda cfg: (None, *EXPORTS.get(cfg.head.type, ())),
    "tracking.backend": ("wandb", "none"),
    "tracking.mode": ("offline", "online", "disabled"),
    "planner.device": ("auto", "gpu", "cpu"),
}
PATTERNS = {"cuda:<N>": re.compile(r"cuda:\d+")}

# key -> (kind, test, what it must be, other values allowed). kind: "int" (an integer) or "num" (a number).
POS_INT = ("int", lambda v: v >= 1, ">= 1", ())
OPT_POS_INT = ("int", lambda v: v >= 1, ">= 1", (None,))
NON_NEG_INT = ("int", lambda v: v >= 0, ">= 0", ())
POS_NUM = ("num", lambda v: v > 0, "> 0", ())
NON_NEG_NUM = ("num", lambda v: v >= 0, ">= 0", ())
SHARE = ("num", lambda v: 0 <= v <= 1, "in [0, 1]", ())
NUMBERS = {
    **dict.fromkeys(["data.max_length", "data.regen.max_new_tokens", "data.regen.batch_size",
                     "extract.batch_tokens", "head.draft_vocab_size", "head.ttt_steps", "head.num_heads",
                     "head.num_layers", "train.epochs", "train.micro_batch_tokens", "train.grad_accum",
                     "train.keep_checkpoints", "train.eval_every", "train.checkpoint_every", "train.log_every", "train.val_steps",
                     "eval.max_new_tokens", "eval.chain_k", "eval.tree.top_k", "eval.tree.depth",
                     "eval.tree.calibration_prompts", "eval.tree.sizes", "export.num_speculative_tokens"], POS_INT),
    **dict.fromkeys(["train.max_steps", "train.val_tokens", "train.data_tokens", "train.num_threads", "eval.num_threads",
                     "eval.limit", "planner.world_size", "train.patience", "data.sources[].limit", "data.train_rows",
                     "data.validation_max_rows"], OPT_POS_INT),
    "eval.tree.total_tokens": ("int", lambda v: v >= 1, ">= 1", ("auto",)),
    **dict.fromkeys(["train.warmup_steps", "train.prefetch", "eval.warmup", "data.regen.seed", "seed",
                     "head.ttt_reach_topk", "data.regen.top_k", "eval.top_k"], NON_NEG_INT),
    **dict.fromkeys(["extract.shard_mb", "train.lr", "train.muon_lr", "dist_timeout_minutes", "hang_minutes",
                     "planner.headroom", "extract.disk_margin", "planner.avg_row_tokens"], POS_NUM),
    **dict.fromkeys(["train.max_minutes", "planner.tokens", "planner.rows"], POS_NUM[:3] + ((None,),)),
    **dict.fromkeys(["data.regen.temperature", "eval.temperatures", "train.weight_decay", "train.grad_clip",
                     "eval.tie_tolerance", "head.tap_noise", "head.feature_loss"], NON_NEG_NUM),
    **dict.fromkeys(["data.regen.top_p", "eval.top_p", "head.ttt_decay", "head.decay", "train.min_lr_ratio"], SHARE),
    **dict.fromkeys(["data.validation_fraction", "head.dropout", "train.ema"], ("num", lambda v: 0 <= v < 1, "in [0, 1)", ())),
    "head.layer_init": ("int", lambda v: True, "(a target layer index, negative from the last)", (None,)),
}
# Keys that take a list: a single value (``force=eval``) reaches the config as a string or a number, which the
# stages would iterate character by character or fail on after hours of work.
LISTS = ("stages", "force", "data.exclude_eval", "eval.datasets", "eval.tree.sizes", "eval.temperatures")
_ABSENT = object()


def _values(cfg: DictConfig, key: str):
    """(dotted name, value) for every place ``key`` names (``a[].b``: key b of each element of list a)."""
    if "[]." not in key:
        value = OmegaConf.select(cfg, key, default=_ABSENT)
        return [] if value is _ABSENT else [(key, value)]
    outer, inner = key.split("[].", 1)
    items = OmegaConf.select(cfg, outer, default=None) or []
    return [(f"{outer}[{i}].{inner}", item[inner]) for i, item in enumerate(items)
            if OmegaConf.is_dict(item) and inner in item]


def _elements(value):
    return list(value) if OmegaConf.is_list(value) or isinstance(value, list | tuple) else [value]


def _enum_ok(value, allowed) -> bool:
    return any(value == a or (a in PATTERNS and isinstance(value, str) and PATTERNS[a].fullmatch(value))
               for a in allowed)


def _number_ok(value, kind, test) -> bool:
    if isinstance(value, bool) or not isinstance(value, int if kind == "int" else int | float):
        return False
    return test(value)


def problems(cfg: DictConfig) -> list[str]:
    """Every invalid value of the config, one sentence each (empty: the config is valid)."""
    out = []
    for key, allowed in ENUMS.items():
        for name, value in _values(cfg, key):
            allowed_now = allowed(cfg) if callable(allowed) else allowed
            if allowed_now is None:
                continue
            for v in _elements(value):
                if not _enum_ok(v, allowed_now):
                    valid = ", ".join("null" if a is None else str(a) for a in allowed_now)
                    near = difflib.get_close_matches(str(v), [str(a) for a in allowed_now], n=1)
                    hint = f" (did you mean {near[0]}?)" if near else ""
                    out.append(f"{name}={v!r} is not valid{hint}; valid values: {valid}")
    for key, (kind, test, what, extra) in NUMBERS.items():
        for name, value in _values(cfg, key):
            for v in _elements(value):
                if not (v in extra and not isinstance(v, bool)) and not _number_ok(v, kind, test):
                    also = "".join(f" or {'null' if e is None else e}" for e in extra)
                    out.append(f"{name}={v!r} must be {'an integer' if kind == 'int' else 'a number'} {what}{also}")
    for key in LISTS:
        for name, value in _values(cfg, key):
            if value is not None and not OmegaConf.is_list(value):
                out.append(f"{name}={value!r} must be a list, e.g. {name}=[{value}]")
    head_name, head_type = OmegaConf.select(cfg, "head.name"), OmegaConf.select(cfg, "head.type")
    if head_name and head_type in ENUMS["head.type"] and head_name != head_type:   # (a typo: refused above)
        out.append(f"head.type={head_type} over the {head_name} head's settings: choose the head with "
                   f"head={head_type} (its config group), not head.type")
    if OmegaConf.select(cfg, "train.zero_stage") == 3:
        out.append("train.zero_stage=3 is not supported: the head would be saved from partitioned (empty) parameters. "
                   "A draft head fits one GPU; use train.zero_stage=1 or 2 to shard its optimizer state")
    methods = OmegaConf.select(cfg, "eval.methods", default=None)
    for method in methods if OmegaConf.is_list(methods) else []:   # a head's methods need that head
        kind = str(method).partition("-")[0].removesuffix("+ngram")
        if kind in ENUMS["head.type"] and kind != head_type:
            out.append(f"eval.methods has {method}, which needs a {kind} head: this run trains a {head_type} head "
                       f"(head={kind}, or drop the method)")
    choices, heads = OmegaConf.select(cfg, "eval.medusa_choices", default=None), OmegaConf.select(cfg, "head.num_heads")
    if head_type == "medusa" and OmegaConf.is_list(choices) and heads:
        if deep := [list(c) for c in choices if len(c) > heads]:
            out.append(f"eval.medusa_choices {deep[0]} reaches depth {len(deep[0])}, but head.num_heads={heads}: "
                       "each path has at most one index per head")
    for i, source in enumerate(OmegaConf.select(cfg, "data.sources", default=None) or []):
        if not OmegaConf.is_dict(source):
            out.append(f"data.sources[{i}]={source!r} must be a mapping like {{path: file.jsonl}}")
            continue
        unknown = sorted(set(source) - set(SOURCE_KEYS))
        if unknown:
            out.append(f"data.sources[{i}] has unknown key(s) {unknown}; valid keys: {', '.join(SOURCE_KEYS)}")
        given = [k for k in ("type", "path", "hf") if source.get(k) is not None]
        if len(given) != 1:
            out.append(f"data.sources[{i}] needs exactly one of type (builtin|humaneval|synth), path or hf, got {given}")
    out += target_problems(cfg) + device_problems(cfg) + autocast_problems(cfg)
    if (OmegaConf.select(cfg, "extract.source") == "regen" and OmegaConf.select(cfg, "data.regen.backend") != "hf"
            and OmegaConf.select(cfg, "data.regenerate")):
        out.append(f"extract.source=regen keeps the hidden states of the hf backend's own passes; "
                   f"data.regen.backend={cfg.data.regen.backend} servers do not return them: use extract.source=auto "
                   "or pass (a separate extraction pass), or data.regen.backend=hf")
    return out


def target_problems(cfg: DictConfig) -> list[str]:
    """A target set by ``model.path`` or ``model.hub_id`` over the default preset: without ``model.source=hf`` the
    path is never read and the embedded 135M target trains; with it, the 8B target would train under the default's
    name (its run directory) and the CPU demo's 9-minute budget. A preset sets all three."""
    mcfg = OmegaConf.select(cfg, "model") or {}
    default = mcfg.get("name") == "smollm2-135m"
    other_hub = default and mcfg.get("hub_id") != DEFAULT_HUB_ID   # (elsewhere: a fine-tune's repo, named in cards)
    if (mcfg.get("path") or other_hub) and mcfg.get("source") != "hf":
        key = f"model.path={mcfg.path}" if mcfg.get("path") else f"model.hub_id={mcfg.hub_id}"
        return [f"{key} is read with model.source=hf only (here model.source={mcfg.source}"
                + (": the embedded SmolLM2-135M would train" + ("" if mcfg.get("path") else ", its exports and cards "
                   "naming that repository") if default else "")
                + "): start from a preset (model=qwen2.5-7b|llama3.1-8b|qwen3-8b) and set "
                + key.split("=")[0] + " there, or add model.source=hf and model.name=<a name for its run directory> "
                "(and train=full)"]
    if default and mcfg.get("source") == "hf" and (mcfg.get("path") or mcfg.hub_id != DEFAULT_HUB_ID):
        return [f"model.source=hf with {'model.path=' + str(mcfg.path) if mcfg.get('path') else 'model.hub_id=' + str(mcfg.hub_id)} "
                "keeps the default target's model.name=smollm2-135m (its run directory) and the CPU demo's train "
                "settings (train.max_minutes=9): start from a preset (model=qwen2.5-7b|llama3.1-8b|qwen3-8b) and set "
                "model.path or model.hub_id there, or set model.name (and train=full) yourself"]
    return []


def device_problems(cfg: DictConfig) -> list[str]:
    """``device=cuda[:N]`` where this process sees no such GPU (a CPU build of torch, CUDA_VISIBLE_DEVICES): refused
    before any stage, not a traceback from the first tensor moved there. A plan (``plan=true``) may be made anywhere."""
    device = str(OmegaConf.select(cfg, "device", default="auto"))
    if not re.fullmatch(r"cuda(:\d+)?", device) or OmegaConf.select(cfg, "plan", default=False):
        return []   # (a malformed device: the enum check names it)
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if int(device.partition(":")[2] or 0) < count:
        return []
    why = (f"torch {torch.__version__} is a CPU build" if torch.version.cuda is None else
           f"this process sees {count} GPU(s) (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
    return [f"device={device}: {why}; install torch's CUDA build (TORCH_SPEC=\"torch --index-url "
            "https://download.pytorch.org/whl/cu128\" bash scripts/setup_env.sh) or use device=auto or cpu"]


def autocast_problems(cfg: DictConfig) -> list[str]:
    """``train.autocast=float16`` but over float16 weights (``dtype=float16``, whose DeepSpeed path scales the loss):
    over bfloat16 or float32 weights nothing scales it, and the float16 backward of every layer under autocast
    underflows the small gradients (a loss averaged over 10^4-10^5 positions) before they reach the weights."""
    if OmegaConf.select(cfg, "train.autocast") != "float16":
        return []
    from train.target import resolve_device, resolve_dtype

    try:
        dtype = resolve_dtype(str(cfg.dtype), resolve_device(str(cfg.device)))
    except (RuntimeError, AttributeError):   # (a malformed device or dtype: named by their own checks)
        return []
    if str(dtype) == "torch.float16":
        return []
    kind = str(dtype).removeprefix("torch.")
    return [f"train.autocast=float16 with weights in {kind} (dtype={cfg.dtype}): nothing scales the loss there, so "
            "the head's float16 gradients would underflow and it would train worse without a word; use "
            "train.autocast=bfloat16 (or null), or dtype=float16 (DeepSpeed scales its loss)"]


def preflight(cfg: DictConfig) -> None:
    """Raise one :class:`~train.errors.UserError` listing what a later stage of this run would refuse after
    hours of work and can be told now: publishing without a token or a valid repo id, tracking online without a
    W&B login. Rank 0 only (the one that tracks and publishes); the launcher stops the others."""
    from train import dist
    from train.publish import settings_problems
    from train.tracking import login_problem

    if not dist.is_main():
        return
    found = settings_problems(cfg) if "publish" in cfg.stages else []
    if "train" in cfg.stages and (problem := login_problem(cfg)):
        found.append(problem)
    if found:
        raise UserError("before any stage: " + "; ".join(found))


def added_key_problems(cfg: DictConfig, overrides: list[str]) -> list[str]:
    """Keys ``+key=value`` added beside a config's own key of a close name: a typo (Hydra suggests the ``+`` for a
    misspelt key: ``+train.lrr`` then trained at the default learning rate, silently). Optional keys the config does
    not list (``+data.sources.0.limit=100``, ``+debug``, a server's environment) are added as asked."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    added = [o.key_or_group for o in OverridesParser.create().parse_overrides(list(overrides)) if o.is_add()]
    out = []
    for key in added:
        parent_key, _, leaf = key.rpartition(".")
        parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
        if key == "debug" or not OmegaConf.is_dict(parent):
            continue
        siblings = [str(k) for k in parent if f"{parent_key}.{k}".lstrip(".") not in added]
        if near := difflib.get_close_matches(leaf, siblings, n=1, cutoff=0.75):
            out.append(f"+{key} adds a key beside {parent_key + '.' if parent_key else ''}{near[0]}: a typo? (set "
                       f"{parent_key + '.' if parent_key else ''}{near[0]}=..., without the +)")
    return out


def validate(cfg: DictConfig, overrides: list[str] = ()) -> None:
    """Raise one :class:`ConfigError` listing every invalid value (the whole config is checked at once); with the
    command line's ``overrides``, also every key a ``+`` adds where the config has its own (a typo)."""
    found = problems(cfg) + added_key_problems(cfg, overrides)
    if found:
        raise ConfigError("invalid config: " + "; ".join(found) + " (fix the override or the YAML in conf/)")
