"""Single entry point: ``python train/run.py [group=preset ...] [key=value ...]``.

Runs the stages in ``cfg.stages`` (data -> extract -> train -> eval -> export -> publish) inside the
Hydra run directory; rerunning the same command resumes. Under ``deepspeed``/``torchrun`` every rank
runs this file; extract and train split their work across ranks.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# The deepspeed launcher appends --local_rank=N, which Hydra would reject as an override.
for arg in list(sys.argv[1:]):
    if arg.startswith("--local_rank"):
        os.environ.setdefault("LOCAL_RANK", arg.split("=", 1)[-1])
        sys.argv.remove(arg)

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from train.errors import UserError  # noqa: E402


@hydra.main(config_path="../conf", config_name="config", version_base=None)
def main(cfg: DictConfig) -> None:
    try:
        run(cfg)
    except UserError as e:  # a user's mistake: one line naming the fix, status 1 (bugs keep their traceback)
        if debug(cfg):
            raise
        exit_with(e)


def run(cfg: DictConfig) -> None:
    from train import dist
    from train.checks import preflight, validate
    from train.log import log
    from train.stages import run_dir_lock, run_stages
    from train.target import resolve_device
    from train.tracking import finish

    dist.adopt_scheduler()  # mpirun/srun: their rank variables, before anything asks which rank this is
    validate(cfg, overrides())  # every enum, size, share and added key at once, before any plan, weight or stage
    quiet_libraries()
    if cfg.plan:  # before any process group, weights or stage: rank 0 prints, every rank exits
        from train.plan import print_plan

        if dist.is_main():
            print_plan(cfg)
        return
    preflight(cfg)  # a publish token, a W&B login: what a later stage needs from outside
    with run_dir_lock(cfg):   # (rank 0) before the ranks meet: a second run stops at once, the launcher stops the rest
        dist.init(resolve_device(cfg.device), timeout_minutes=cfg.dist_timeout_minutes)
        log(summary_line(cfg))
        try:
            run_stages(cfg)
        finally:
            finish()
        dist.close()


def overrides() -> list[str]:
    """The command line's overrides (none outside ``@hydra.main``)."""
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def debug(cfg: DictConfig | None = None) -> bool:
    """``SPECHEADS_DEBUG=1`` (or ``+debug=true``): user errors show their traceback too."""
    return os.environ.get("SPECHEADS_DEBUG", "0") not in ("", "0", "false") or bool(cfg and cfg.get("debug"))


def exit_with(error: BaseException) -> None:
    """Print ``error`` as one line on stderr (and into the run's log file), then exit with status 1.
    Every rank exits non-zero; under a launcher the line names the rank."""
    from train import dist

    rank = f" (rank {dist.rank()})" if dist.world_size() > 1 else ""
    line = f"error{rank}: " + " ".join(str(error).split())
    record = logging.LogRecord("specheads", logging.ERROR, __file__, 0, line, None, None)
    for handler in logging.getLogger().handlers:  # Hydra's run-directory log file, not the console
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)
    print(line, file=sys.stderr, flush=True)
    sys.exit(1)


def summary_line(cfg: DictConfig) -> str:
    """One line with the effective budget: what a run of this config will do (``--cfg job`` shows all)."""
    from train.target import resolve_device, resolve_dtype

    t, h = cfg.train, cfg.head
    device = resolve_device(cfg.device)
    budget = f"{t.max_minutes} min" if t.max_minutes else "no time limit"
    steps = f"max_steps {t.max_steps}" if t.max_steps else f"{t.epochs} epochs"
    ttt = f", TTT {h.ttt_steps}" if h.type == "eagle3" else f", {h.num_heads} heads"
    return (f"[run] {cfg.model.name} / {h.name} on {device}: stages {list(cfg.stages)}; "
            f"train in {str(resolve_dtype(cfg.dtype, device)).removeprefix('torch.')}, {budget}, {steps}, "
            f"{t.micro_batch_tokens}-token micro-batches, lr {t.lr}{ttt}, draft vocabulary {h.draft_vocab_size}; "
            f"eval {cfg.eval.limit or 'all'} prompts/dataset -> {cfg.run_dir}")


def quiet_libraries() -> None:
    """Our own progress bars stay; of the libraries', only the loading of a target's weight shards (rank 0:
    minutes for an 8B target) is shown."""
    import datasets
    import transformers

    from train import dist

    datasets.disable_progress_bars()
    if not dist.is_main():
        transformers.utils.logging.disable_progress_bar()


if __name__ == "__main__":
    main()
