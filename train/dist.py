"""Distributed helpers: one code path for a single process and for N ranks (deepspeed/torchrun)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def is_main() -> bool:
    return rank() == 0


def init(device: torch.device, single: bool = False) -> None:
    """Join the process group when launched with several ranks (gloo on CPU, nccl on GPU); with
    ``single``, also make a one-process group (DeepSpeed's engine needs one)."""
    if dist.is_initialized() or (world_size() == 1 and not single):
        return
    if world_size() == 1:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                           ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port))):
            os.environ.setdefault(key, value)
    import deepspeed

    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_gather_objects(obj):
    """Every rank's ``obj`` as a list ordered by rank (a one-element list without a process group)."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
