"""Stage registry and the resume rule.

Each stage is a module with one entry function ``run(cfg) -> dict`` that reads its inputs from the
run directory and writes into ``<run_dir>/<stage>/``. When it returns, rank 0 writes
``<run_dir>/<stage>/_complete.json`` with the stage's fingerprint (a hash of the config keys it
depends on and of its upstream stages' fingerprints) and what the stage reported. A stage whose
marker holds the current fingerprint is skipped; otherwise it runs (and resumes whatever partial
work it finds, e.g. extraction shards or training checkpoints).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from train import dist
from train.errors import MissingStageError
from train.log import log

ORDER = ["data", "extract", "train", "eval", "export", "publish"]
ENTRY = {
    "data": "data.stage",
    "extract": "train.extract",
    "train": "train.loop",
    "eval": "eval.stage",
    "export": "train.export",
    "publish": "train.publish",
}
# Config keys each stage depends on (dotted paths into the composed config).
DEPENDS = {
    "data": ["model", "data", "head.draft_vocab_size", "eval.questions", "seed"],
    "extract": ["model", "head.type", "head.aux_layers", "extract"],
    "train": ["head", "train", "seed"],
    "eval": ["eval", "seed"],
    "export": ["export"],
    "publish": ["publish"],
}
# Bumped when a stage's output format changes, so older outputs are redone rather than misread.
FORMAT_VERSION = {"extract": 2}
# Stages that run on every rank (they split their work); the others run on rank 0 while the rest wait
# for the stage's marker file (multi-node runs need the run directory on a shared filesystem).
DISTRIBUTED = {"extract", "train"}
MARKER = "_complete.json"
FAILED = "_failed.json"  # written by rank 0 when a rank-0-only stage raises: the waiting ranks stop too


def stage_dir(cfg: DictConfig, name: str) -> Path:
    return Path(cfg.run_dir) / name


def upstream(cfg: DictConfig, name: str) -> list[str]:
    if name == "train":
        return ["data"] if cfg.train.online else ["data", "extract"]
    return {"extract": ["data"], "eval": ["train"], "export": ["train", "eval"], "publish": ["export"]}.get(
        name, []
    )


def read_marker(cfg: DictConfig, name: str) -> dict | None:
    path = stage_dir(cfg, name) / MARKER
    return json.loads(path.read_text()) if path.exists() else None


def fingerprint(cfg: DictConfig, name: str) -> str:
    parts = {}
    for key in DEPENDS[name]:
        value = OmegaConf.select(cfg, key)
        parts[key] = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
    parts["upstream"] = {u: (read_marker(cfg, u) or {}).get("fingerprint") for u in upstream(cfg, name)}
    parts["format_version"] = FORMAT_VERSION.get(name, 1)
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def require(cfg: DictConfig, name: str) -> dict:
    """The marker of an upstream stage, or a clear error saying which stage to run first."""
    marker = read_marker(cfg, name)
    if marker is None:
        raise MissingStageError(
            f"Stage {name!r} has no complete output in {stage_dir(cfg, name)}. Run it first, e.g. "
            f"`python train/run.py stages=[{name}]` with the same model/head/data overrides."
        )
    return marker


def run_stages(cfg: DictConfig) -> dict[str, dict]:
    unknown = [s for s in list(cfg.stages) + list(cfg.force) if s not in ORDER]
    if unknown:
        raise ValueError(f"Unknown stage(s) {unknown}; valid stages, in order: {ORDER}")
    results = {}
    for name in [s for s in ORDER if s in cfg.stages]:
        fp = fingerprint(cfg, name)
        marker = read_marker(cfg, name)
        if marker and marker.get("fingerprint") == fp and name not in cfg.force:
            log(f"[{name}] up to date in {stage_dir(cfg, name)}; skipped")
            results[name] = marker
            continue
        log(f"[{name}] running -> {stage_dir(cfg, name)}")
        start = time.time()
        dist.barrier()  # every rank has compared the old marker before rank 0 removes it
        if dist.is_main():
            stage_dir(cfg, name).mkdir(parents=True, exist_ok=True)
            (stage_dir(cfg, name) / MARKER).unlink(missing_ok=True)
            (stage_dir(cfg, name) / FAILED).unlink(missing_ok=True)
        dist.barrier()
        if name in DISTRIBUTED:
            out = importlib.import_module(ENTRY[name]).run(cfg)
            dist.barrier()
            marker = _write_marker(cfg, name, fp, start, out)
        elif dist.is_main():
            try:
                out = importlib.import_module(ENTRY[name]).run(cfg)
            except BaseException as e:
                (stage_dir(cfg, name) / FAILED).write_text(json.dumps({"error": repr(e)}))
                raise
            marker = _write_marker(cfg, name, fp, start, out)
        else:  # no collective stays open while rank 0 works alone (hours of regeneration are fine)
            if shares_work(cfg, name):  # this rank's share first (it signals rank 0 by a file), then wait
                importlib.import_module(ENTRY[name]).run(cfg)
            marker = wait_for_marker(cfg, name, fp)
        dist.barrier()
        log(f"[{name}] done in {marker['wall_s']} s")
        results[name] = marker
    return results


def shares_work(cfg: DictConfig, name: str) -> bool:
    """Whether the other ranks also enter the rank-0 stage ``name`` for a part of its work: the data stage's
    ``hf`` regeneration is split across ranks (data/engines.py); they return after their share. Not with a
    ``synth`` source: its prompts are generated (and cached) by rank 0 alone, so rank 0 also regenerates."""
    return (name == "data" and dist.world_size() > 1 and bool(cfg.data.regenerate)
            and cfg.data.regen.get("backend", "hf") == "hf"
            and not any(s.get("type") == "synth" for s in cfg.data.sources))


def _write_marker(cfg: DictConfig, name: str, fp: str, start: float, out: dict | None) -> dict:
    """The stage's ``_complete.json`` (written by rank 0, atomically)."""
    marker = {"stage": name, "fingerprint": fp, "wall_s": round(time.time() - start, 1),
              "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "outputs": out or {}}
    if dist.is_main():
        tmp = stage_dir(cfg, name) / (MARKER + ".tmp")
        tmp.write_text(json.dumps(marker, indent=2, default=str))
        os.replace(tmp, stage_dir(cfg, name) / MARKER)
    return marker


def wait_for_marker(cfg: DictConfig, name: str, fp: str, poll_s: float = 2.0) -> dict:
    """Wait (polling the shared run directory) until rank 0 has finished stage ``name``; raise if it failed."""
    while True:
        marker = read_marker(cfg, name)
        if marker and marker.get("fingerprint") == fp:
            return marker
        if (stage_dir(cfg, name) / FAILED).exists():
            raise RuntimeError(f"stage {name!r} failed on rank 0 (see its log); this rank stops too")
        time.sleep(poll_s)
