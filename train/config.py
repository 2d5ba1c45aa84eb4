"""The pipeline's config outside ``train/run.py`` (tests, scripts): ``conf/config.yaml`` composed with
Hydra overrides, as ``@hydra.main`` composes it but without a Hydra run directory."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from omegaconf import DictConfig

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


def compose(overrides: Iterable[str] = ()) -> DictConfig:
    """``conf/config.yaml`` with ``overrides`` (``group=preset``, ``key=value``) applied in order."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return hydra_compose(config_name="config", overrides=list(overrides))
