"""Distributed helpers: one code path for a single process and for N ranks (deepspeed/torchrun).

Under a launcher each rank binds its own GPU (``LOCAL_RANK``) before the process group exists, so NCCL
collectives and object gathers use the rank's device, never all GPU 0. Decisions that must be the
same on every rank (stop now? how many steps fit the budget? is this the best head?) are taken on
rank 0 and broadcast with :func:`broadcast`.
"""

from __future__ import annotations

import os
import pickle
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from train.errors import UserError

# Collectives wait this long (``dist_timeout_minutes``) before failing; rank-0-only stages do not hold
# a collective open (the other ranks wait on the stage's marker file, see train.stages).
DEFAULT_TIMEOUT_MIN = 60
# What a launcher (deepspeed, torchrun) sets, and :func:`init` sets for one process: a child process that
# inherits them would try to join this process group (or bind its rendezvous port).
LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")
# DeepSpeed's shared-memory all-reduce for CPU ranks (``ShareMemCommBuilder.NAME``): built at first use.
SHM_OP = "deepspeed_shm_comm"


# Launchers that start every process themselves (mpirun: OpenMPI, MPICH/Intel MPI; srun) and name it in their own
# variables: (world size, rank, local rank, ranks on this node).
SCHEDULERS = {"mpirun (OpenMPI)": ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK",
                                   "OMPI_COMM_WORLD_LOCAL_SIZE"),
              "mpirun (MPICH, Intel MPI)": ("PMI_SIZE", "PMI_RANK", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
              "srun": ("SLURM_STEP_NUM_TASKS", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_STEP_TASKS_PER_NODE")}


def adopt_scheduler() -> None:
    """Processes started by mpirun or srun (``deepspeed --launcher openmpi|mpich|slurm``, or directly) carry no
    ``RANK``/``WORLD_SIZE``: each would run alone as rank 0, every one on cuda:0 and on the same run directory. Their
    launcher's variables become ours (a launcher counts only where it names the local rank too: ``srun --mpi=pmi2``
    sets PMI_RANK without MPI_LOCALRANKID, and its SLURM_* then say it), with ``MASTER_ADDR``/``MASTER_PORT`` as the
    user exports them (refused without: no launcher of these sets them for torch). Nothing under deepspeed's own
    launcher or torchrun."""
    if "WORLD_SIZE" in os.environ:
        return
    several = [names for names in SCHEDULERS.values() if int(os.environ.get(names[0]) or 1) > 1]
    name = next((name for name, names in SCHEDULERS.items()
                 if names in several and all(v in os.environ for v in names[1:3])), None)
    if name is None:
        if several:   # a launcher of several processes that does not say which one this is
            size, rank_, local, _ = several[0]
            raise UserError(f"{size}={os.environ[size]} processes, but no {rank_} and {local} to tell this one's rank "
                            "and GPU: export RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT to each process, "
                            "or launch with deepspeed or torchrun")
        return
    size, rank_, local, local_size = SCHEDULERS[name]
    n = os.environ[size]
    if not (os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT")):
        raise UserError(f"{n} processes started by {name} ({size}={n}) without MASTER_ADDR and MASTER_PORT, where "
                        "rank 0 listens for the others: export both to every process (mpirun -x MASTER_ADDR=<first "
                        "node> -x MASTER_PORT=29500; srun: export them in the batch script; deepspeed --launcher "
                        "openmpi: put them in .deepspeed_env), or launch with deepspeed's default launcher or torchrun")
    os.environ.update({"WORLD_SIZE": n, "RANK": os.environ[rank_], "LOCAL_RANK": os.environ[local]})
    if per_node := _tasks_here(os.environ.get(local_size, "")):
        os.environ["LOCAL_WORLD_SIZE"] = per_node


def _tasks_here(per_node: str) -> str | None:
    """This node's task count from a launcher's ``per_node``: a number (MPI), or srun's list by node, e.g. "4(x2),2"
    (this node: ``SLURM_NODEID``); None when it does not say."""
    counts = []
    for part in filter(None, per_node.split(",")):
        count, _, times = part.partition("(x")
        if not count.isdigit():
            return None
        counts += [count] * int(times.rstrip(")") or 1)
    node = int(os.environ.get("SLURM_NODEID") or 0) if len(counts) > 1 else 0
    return counts[node] if node < len(counts) else None


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def local_world_size() -> int:
    """Ranks on this machine: torchrun says ``LOCAL_WORLD_SIZE``, DeepSpeed's launcher ``LOCAL_SIZE`` (neither: all of them)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or world_size())


def cpus() -> int:
    """The CPUs this process may run on: its affinity (a Slurm or cgroup allocation), not the host's count."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def is_main() -> bool:
    return rank() == 0


def bind_device(device: torch.device) -> torch.device:
    """This rank's device: ``cuda`` becomes ``cuda:LOCAL_RANK`` and is made current (before any NCCL call).
    Under a launcher DeepSpeed binds each rank's NCCL communicator to ``cuda:LOCAL_RANK`` whatever ``device``
    says, so another index (or a LOCAL_RANK beyond the visible GPUs) is refused before it can hang a collective."""
    if device.type == "cuda":
        if world_size() > 1 and device.index not in (None, local_rank()):
            raise UserError(f"device={device} with {world_size()} ranks: each rank takes the GPU of its LOCAL_RANK "
                            "(DeepSpeed binds NCCL to it); use device=cuda or device=auto, and choose the GPUs "
                            "with the launcher (deepspeed --include localhost:0,1 or CUDA_VISIBLE_DEVICES)")
        index = device.index if device.index is not None else local_rank()
        if index >= torch.cuda.device_count():
            raise UserError(f"rank {rank()} wants cuda:{index} (LOCAL_RANK {local_rank()}) but this process sees "
                            f"{torch.cuda.device_count()} GPU(s): launch at most that many ranks per node "
                            "(deepspeed --num_gpus N), and let every rank of a node see all of its GPUs "
                            "(no per-process CUDA_VISIBLE_DEVICES)")
        device = torch.device("cuda", index)
        torch.cuda.set_device(device)
    return device


def init(device: torch.device, single: bool = False, timeout_minutes: float = DEFAULT_TIMEOUT_MIN) -> None:
    """Join the process group when launched with several ranks (gloo on CPU, nccl on GPU); with
    ``single``, also make a one-process group (DeepSpeed's engine needs one)."""
    if dist.is_initialized() or (world_size() == 1 and not single):
        return
    if world_size() == 1:
        for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                           ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_port()))):
            os.environ.setdefault(key, value)
    import deepspeed

    device = bind_device(device)
    if world_size() == 1 and device.type == "cpu":
        # DeepSpeed's CPU backend compiles its shared-memory all-reduce op (~46 s on a 2-core CPU, once per
        # environment) whatever the world size; one rank has nothing to reduce. The op table is a dict DeepSpeed
        # keeps for such edits (deepspeed/ops/__init__.py); a release without it builds the op as before.
        ops = getattr(deepspeed.ops, "__compatible_ops__", None)
        if isinstance(ops, dict):
            ops[SHM_OP] = False
    timeout = timedelta(minutes=timeout_minutes)
    # DeepSpeed makes its own groups (the gradient all-reduce runs on a clone of the world) without a timeout,
    # and PyTorch gives those its module default (10 minutes on NCCL), not the one passed here.
    c10d.default_pg_timeout = c10d.default_pg_nccl_timeout = timeout
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo", timeout=timeout)


def close() -> None:
    """Leave the process group (NCCL warns about, and some releases stall on, communicators left at exit).
    Only once every rank is past its last collective: after a failure the launcher stops the ranks."""
    if dist.is_initialized():
        dist.destroy_process_group()


def free_port() -> int:
    """A TCP port free on this machine right now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env_without_launcher(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's environment) without :data:`LAUNCHER_VARS`, for child processes."""
    return {k: v for k, v in (os.environ if env is None else env).items() if k not in LAUNCHER_VARS}


def barrier() -> None:
    """Wait for every rank. On NCCL the barrier runs on this rank's own GPU (``bind_device``), not on one
    that NCCL guesses from the global rank (a hang where ranks map to GPUs unevenly)."""
    if dist.is_initialized():
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[torch.cuda.current_device()])
        else:
            dist.barrier()


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """``t`` summed over the ranks, in place (on the bound device under NCCL); ``t`` itself without a process
    group."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t


def all_gather_objects(obj):
    """Every rank's ``obj`` as a list ordered by rank (a one-element list without a process group)."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def on_main(fn):
    """``fn()`` computed on rank 0, its value on every rank; its exception raised on every rank too (rank 0 failing
    alone would leave the others waiting in the broadcast until the timeout)."""
    out = None
    if is_main():
        try:
            out = (fn(), None)
        except Exception as e:
            try:
                pickle.dumps(e)
            except Exception:   # an error that cannot cross to the other ranks: its text does
                e = RuntimeError(f"{type(e).__name__}: {e}")
            out = (None, e)
    value, error = broadcast(out)
    if error is not None:
        raise error
    return value


def broadcast(obj):
    """Rank 0's ``obj`` on every rank (``obj`` itself without a process group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)  # on the current (bound) device under NCCL
    return box[0]
