"""Shared fixtures: composed configs for the tiny random targets and for the embedded default target."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_SILENT", "true")
# Materialised targets (the dequantised default, the tiny twins) go to a cache inside the checkout, not the
# user's ~/.cache/specheads (set SPECHEADS_CACHE to share one).
os.environ.setdefault("SPECHEADS_CACHE", str(ROOT / ".cache" / "specheads"))


def load_script(name: str):
    """``scripts/<name>.py`` as a module (scripts are not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module   # (its dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


def child_env(**extra: str) -> dict[str, str]:
    """The environment for a subprocess of the pipeline: this one, offline, without the launcher variables
    that in-process runs set here (train.dist.init makes a one-process group)."""
    from train.dist import env_without_launcher

    return {**env_without_launcher(), "HF_HUB_OFFLINE": "1", **extra}


class LoggedRun(subprocess.Popen):
    """A child process whose stdout and stderr go to the file ``log``, never to a pipe nobody drains (a
    full pipe blocks the child); :meth:`output` waits for it and returns what it printed."""

    def __init__(self, cmd: list[str], log: Path, **kwargs):
        self.log = log
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as out:
            super().__init__(cmd, stdout=out, stderr=subprocess.STDOUT, text=True, **kwargs)

    def output(self, timeout: float | None = None) -> str:
        self.wait(timeout=timeout)
        return self.log.read_text(errors="replace")


KILL_AFTER = """\
import importlib, os, runpy, signal, sys
module, attr, calls = sys.argv[1:4]
sys.argv = sys.argv[4:]
owner = importlib.import_module(module)
*path, name = attr.split(".")
for part in path:
    owner = getattr(owner, part)
real, count = getattr(owner, name), [0]
def wrapper(*args, **kwargs):
    out = real(*args, **kwargs)
    count[0] += 1
    if count[0] == int(calls):
        os.kill(os.getpid(), signal.SIGKILL)
    return out
setattr(owner, name, wrapper)
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def killed_after(target: str, calls: int = 1) -> list[str]:
    """A launcher (for :class:`LoggedRun`) whose process SIGKILLs itself, no cleanup, right after the ``calls``-th
    return of ``target`` ("module:Class.method" or "module:function", as the code calls it): a crash at a chosen
    point, where killing it from outside raced the child (a few tenths of a second late, the point had passed)."""
    module, attr = target.split(":")
    return [sys.executable, "-c", KILL_AFTER, module, attr, str(calls)]


def generate(model, prompts: list[list[int]], max_new_tokens: int, eos_ids: set[int], pad_id: int,
             temperature: float = 0.0, top_p: float = 1.0, generator=None, layers: list[int] | None = None,
             tail=None) -> list:
    """The answers (``data.regenerate.Answer``) to ``prompts``, generated as one batch by
    ``data.regenerate.stream`` (all rows at once, none joining later; ``tail`` gets the prompt's index)."""
    from collections import deque

    from data.regenerate import stream

    answers = {}
    for finished in stream(model, deque(enumerate(prompts)), len(prompts), len(prompts), max_new_tokens, eos_ids,
                           pad_id, temperature, top_p, generator, layers, tail):
        answers.update(finished)
    return [answers[j] for j in range(len(prompts))]


def make_cfg(overrides: list[str], tmp: Path | None = None):
    """Compose ``conf/config.yaml`` with overrides, as ``train/run.py`` would (no Hydra run dir)."""
    from train.config import compose

    extra = [f"output_root={tmp}"] if tmp is not None else []
    return compose(["tracking=none", *extra, *overrides])


@pytest.fixture(scope="session")
def vllm_env() -> None:
    """The vLLM environment (`.venv-vllm`); created (`make vllm-env`) when missing, skipped only when that fails (the
    first test asking for it, in any order or tier, builds it)."""
    if (ROOT / ".venv-vllm" / "bin" / "python").exists():
        return
    proc = subprocess.run([str(ROOT / "scripts" / "setup_vllm_env.sh")], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0 or not (ROOT / ".venv-vllm" / "bin" / "python").exists():
        pytest.skip(f".venv-vllm is missing and could not be created (scripts/setup_vllm_env.sh exit "
                    f"{proc.returncode}):\n{(proc.stdout + proc.stderr)[-2000:]}")


@pytest.fixture
def cfg_factory(tmp_path):
    return lambda *overrides: make_cfg(list(overrides), tmp_path)


@pytest.fixture(scope="session")
def tiny_llama_cfg():
    return make_cfg(["model=tiny-llama"])


@pytest.fixture(scope="session")
def tiny_qwen2_cfg():
    return make_cfg(["model=tiny-qwen2"])


@pytest.fixture(scope="session")
def default_cfg():
    """The embedded SmolLM2-135M-Instruct (dequantised once into the cache dir)."""
    return make_cfg([])
