"""Evaluation prompts: built-in validation prompts, HumanEval, and MT-bench / Spec-Bench style question files."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from itertools import zip_longest
from pathlib import Path

from omegaconf import DictConfig

from data.formats import read_source


@dataclass
class EvalPrompt:
    dataset: str
    category: str
    id: str
    turns: list[str]    # user turns, answered in order (the model's own answers are fed back)


def spread(prompts: list[EvalPrompt], limit: int | None) -> list[EvalPrompt]:
    """Up to ``limit`` prompts taken round-robin over categories (in order of first appearance)."""
    groups: dict[str, list[EvalPrompt]] = {}
    for p in prompts:
        groups.setdefault(p.category, []).append(p)
    mixed = [p for row in zip_longest(*groups.values()) for p in row if p is not None]
    return mixed if limit is None else mixed[:limit]


def _read(dataset: str, source: dict, category: str | None, all_turns: bool, split: str | None) -> list[EvalPrompt]:
    out = []
    for conv in read_source(source, "raise", Counter()):
        if split is not None and conv["split"] != split:
            continue
        turns = [m["content"] for m in conv["messages"] if m["role"] == "user"]
        out.append(EvalPrompt(dataset, category or conv["category"], conv["id"], turns if all_turns else turns[:1]))
    return out


def prompt_sets(cfg: DictConfig) -> list[list[EvalPrompt]]:
    """Every prompt of each evaluation dataset (``eval.datasets``, then ``eval.questions`` named after the
    file), each spread over its categories (:func:`spread`), uncut."""
    ecfg = cfg.eval
    sets = []
    for name in ecfg.datasets:
        if name == "builtin":
            sets.append(_read("builtin", {"type": "builtin"}, None, ecfg.all_turns, "validation"))
        elif name == "humaneval":
            sets.append(_read("humaneval", {"type": "humaneval"}, "code", ecfg.all_turns, None))
        else:
            raise ValueError(f"eval.datasets: unknown dataset {name!r} (builtin | humaneval; a question file "
                             "goes in eval.questions=<path.jsonl>)")
    if ecfg.questions:
        sets.append(_read(Path(ecfg.questions).stem, {"path": str(ecfg.questions)}, None, ecfg.all_turns, None))
    return [spread(s, None) for s in sets]


def load_prompts(cfg: DictConfig) -> list[EvalPrompt]:
    """The timed prompts: each dataset of :func:`prompt_sets` cut to ``eval.limit`` prompts."""
    return [p for s in prompt_sets(cfg) for p in s[:cfg.eval.limit]]


def calibration_prompts(cfg: DictConfig, n: int) -> tuple[list[EvalPrompt], str]:
    """Up to ``n`` HELD-OUT prompts (first turns) for sizing the tree, and a sentence saying which: those
    of the evaluation datasets that ``eval.limit`` leaves out (never timed; never trained on: the built-in
    set's validation split, HumanEval and ``eval.questions`` are excluded from training), round-robin over
    the datasets. Only when no dataset has any left (``eval.limit`` null or >= its size) the built-in
    TRAINING prompts are used, and the sentence says their tau is optimistic."""
    rest = [s[cfg.eval.limit:] for s in prompt_sets(cfg)] if cfg.eval.limit is not None else []
    picked = [p for row in zip_longest(*rest) for p in row if p is not None][:n]
    if picked:
        source = "held-out prompts beyond eval.limit (never timed, never trained on)"
    else:
        picked = spread(_read("calibration", {"type": "builtin"}, None, False, "train"), n)
        source = ("built-in TRAINING prompts (no evaluation prompt is left beyond eval.limit): the measured tau is "
                  "optimistic")
    return [EvalPrompt(p.dataset, p.category, p.id, p.turns[:1]) for p in picked], source
