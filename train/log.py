"""Logging that prints once (rank 0) and lands in the Hydra run directory's log file."""

from __future__ import annotations

import logging

from train import dist

logger = logging.getLogger("specheads")


def log(msg: str, *args) -> None:
    if dist.is_main():
        logger.info(msg, *args)


def progress(iterable=None, **kwargs):
    """A tqdm progress bar shown on rank 0 only."""
    from tqdm.auto import tqdm

    return tqdm(iterable, disable=not dist.is_main(), dynamic_ncols=True, **kwargs)


def peak_rss_gib() -> float:
    """This process's peak resident memory so far, in GiB (``ru_maxrss``: KiB on Linux, bytes on macOS)."""
    import resource
    import sys

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss * (1 if sys.platform == "darwin" else 1024) / 2**30
