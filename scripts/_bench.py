"""Shared set-up of the benchmark scripts: compose the pipeline config and copy finished stages of a
real run into a scratch run directory, so a benchmark never touches the run it reads from."""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return hydra_compose(config_name="config", overrides=["tracking=none", *overrides])


def scratch_run(source_overrides: list[str], stages: list[str], extra: list[str]):
    """(config of a scratch run dir holding copies of ``stages`` from the source run, source config)."""
    from train.stages import read_marker, stage_dir

    source = compose(source_overrides)
    for stage in stages:
        if read_marker(source, stage) is None:
            sys.exit(f"benchmark needs the {stage!r} stage of {source.run_dir}: run "
                     f"`python train/run.py {' '.join(source_overrides)} stages=[{','.join(stages)}]` first")
    scratch = Path(tempfile.mkdtemp(prefix="specheads-bench-"))
    cfg = compose([*source_overrides, f"run_dir={scratch}", *extra])
    for stage in stages:
        shutil.copytree(stage_dir(source, stage), stage_dir(cfg, stage))
    return cfg, source
