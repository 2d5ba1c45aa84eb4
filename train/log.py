"""Logging that prints once (rank 0) and lands in the Hydra run directory's log file."""

from __future__ import annotations

import logging

from train import dist

logger = logging.getLogger("specheads")


def log(msg: str, *args) -> None:
    if dist.is_main():
        logger.info(msg, *args)


# Steps of every progress bar of this process, shown or not: what its heartbeat reports (train.stages.heartbeat),
# so that a rank waiting on this one tells a hung process (beating, no progress) from a busy one.
STEPS = [0]


def progress(iterable=None, **kwargs):
    """A tqdm progress bar shown on rank 0 only; every rank's bars count into :data:`STEPS`."""
    from tqdm.auto import tqdm

    class Bar(tqdm):
        def update(self, n=1):
            STEPS[0] += 1
            return super().update(n)

        def __iter__(self):
            for item in super().__iter__():
                STEPS[0] += 1
                yield item

    return Bar(iterable, disable=not dist.is_main(), dynamic_ncols=True, **kwargs)


def peak_rss_gib() -> float:
    """This process's peak resident memory so far, in GiB (``ru_maxrss``: KiB on Linux, bytes on macOS)."""
    import resource
    import sys

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss * (1 if sys.platform == "darwin" else 1024) / 2**30
