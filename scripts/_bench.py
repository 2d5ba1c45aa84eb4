"""Shared set-up of the benchmark scripts: compose the pipeline config and copy finished stages of a
real run into a scratch run directory, so a benchmark never touches the run it reads from."""

from __future__ import annotations

import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from train.config import compose  # noqa: E402


def finished_source(source_overrides: list[str], stages: list[str]):
    """The source run's config; exits naming the command to run when one of its ``stages`` is not done."""
    from train.stages import read_marker

    source = compose(["tracking=none", *source_overrides])
    for stage in stages:
        if read_marker(source, stage) is None:
            sys.exit(f"benchmark needs the {stage!r} stage of {source.run_dir}: run "
                     f"`python train/run.py {' '.join(source_overrides)} stages=[{','.join(stages)}]` first")
    return source


@contextmanager
def scratch_run(source_overrides: list[str], stages: list[str], extra: list[str]) -> Iterator[tuple]:
    """(config of a scratch run dir holding copies of ``stages`` from the source run, source config); the
    scratch dir is removed on exit. It sits alone in a fresh temporary folder: stages that look at sibling
    runs (``extract.reuse``) never see another benchmark's scratch run, even one a killed process left."""
    from train.stages import stage_dir

    source = finished_source(source_overrides, stages)
    parent = Path(tempfile.mkdtemp(prefix="specheads-bench-"))
    try:
        cfg = compose(["tracking=none", *source_overrides, f"run_dir={parent / 'run'}", *extra])
        for stage in stages:
            shutil.copytree(stage_dir(source, stage), stage_dir(cfg, stage))
        yield cfg, source
    finally:
        shutil.rmtree(parent, ignore_errors=True)
