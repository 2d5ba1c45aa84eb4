"""Experiment tracking: Weights & Biases (offline by default, the run lives in <run_dir>/wandb) or none,
plus a local ``metrics.jsonl`` (one record per logged step) whatever the backend.

One W&B run per pipeline invocation, shared by the stages of that process (rank 0 only).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from data.formats import read_jsonl, rewrite_jsonl
from train import dist


class Tracker:
    def __init__(self, cfg: DictConfig, stage: str, jsonl: Path | None = None, resume_step: int | None = None):
        """``jsonl``: local metrics file; records after ``resume_step`` (from a crashed run) are dropped."""
        self.run = None
        self.jsonl = jsonl if dist.is_main() else None
        if self.jsonl is not None:
            kept = [] if resume_step is None else [r for r in read_jsonl(self.jsonl)   # (a torn line: skipped)
                                                   if (r.get("step") or 0) <= resume_step]
            rewrite_jsonl(self.jsonl, kept)
        tcfg = cfg.tracking
        if tcfg.backend != "wandb" or tcfg.get("mode") == "disabled" or not dist.is_main():
            return
        import wandb

        os.environ.setdefault("WANDB_SILENT", "true")
        self.run = wandb.run or wandb.init(
            project=tcfg.project, entity=tcfg.entity, name=tcfg.name, mode=tcfg.mode, dir=str(cfg.run_dir),
            config=shareable(cfg), tags=[stage],
        )

    def log(self, metrics: dict, step: int | None = None) -> None:
        if self.jsonl is not None:
            with open(self.jsonl, "a") as f:
                f.write(json.dumps({"step": step, **metrics}) + "\n")
        if self.run is not None:
            self.run.log(metrics, step=step)

    def summary(self, values: dict) -> None:
        if self.run is not None:
            self.run.summary.update(values)


def login_problem(cfg: DictConfig) -> str | None:
    """Why ``tracking.mode=online`` cannot start its W&B run on this machine (no API key in WANDB_API_KEY, the
    netrc or wandb's settings; read, not sent), else None: the run starts in the train stage, after the data and
    extract stages' hours."""
    tcfg = cfg.tracking
    if tcfg.backend != "wandb" or tcfg.get("mode") != "online":
        return None
    import wandb

    os.environ.setdefault("WANDB_SILENT", "true")
    try:
        if wandb.login(prompt=False, verify=False):
            return None
        why = "needs a W&B login on this machine"
    except wandb.errors.Error as e:   # a malformed key (WANDB_API_KEY, the netrc)
        why = f"cannot log in to W&B ({' '.join(str(e).split())})"
    return (f"tracking.mode=online {why}: run `wandb login` (or set WANDB_API_KEY), or track offline "
            "(tracking.mode=offline) and upload later with `wandb sync <run_dir>/wandb`")


def finish() -> None:
    """Close the W&B run of this process, if any (flushes the offline run directory)."""
    import sys

    if "wandb" in sys.modules:
        import wandb

        if wandb.run is not None:
            wandb.finish()


def shareable(cfg: DictConfig) -> dict:
    """The resolved config without secrets (``publish.token``), for a tracker that sends it off this machine."""
    config = OmegaConf.to_container(cfg, resolve=True)
    if (config.get("publish") or {}).get("token"):
        config["publish"]["token"] = "<redacted>"
    return config
