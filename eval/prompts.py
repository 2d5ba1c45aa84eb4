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


def load_prompts(cfg: DictConfig) -> list[EvalPrompt]:
    """``eval.datasets`` (builtin | humaneval) plus ``eval.questions`` (named after the file), each cut to
    ``eval.limit`` prompts spread over its categories."""
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
    return [p for s in sets for p in spread(s, ecfg.limit)]


def calibration_prompts(limit: int) -> list[EvalPrompt]:
    """Built-in TRAIN-split prompts for sizing the tree, so no evaluation prompt is seen beforehand."""
    return spread(_read("calibration", {"type": "builtin"}, None, False, "train"), limit)
