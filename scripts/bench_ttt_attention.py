"""TTT attention memory: peak memory and time of one forward+backward of a TTT unroll (step 0 plus
``--steps`` steps) through ``TTTCache.attend``, the reference implementation (``ReferenceTTTCache``, the
one before chunking: full [B, heads, T, T] scores per step) against the current one.

    .venv/bin/python scripts/bench_ttt_attention.py [--T 2048 8192] [--steps 3] [--heads 32 --kv-heads 8 --head-dim 128]

CUDA (when present): bf16, peak = torch.cuda.max_memory_allocated above the inputs, time per call after a
warm-up. CPU: fp32, peak = bytes of live tensor storages allocated during the call (a TorchDispatchMode),
one timed call. The reference runs only up to ``--old-max-T`` (default 2048 on CPU, all on CUDA); above
it, its peak is extrapolated ~T^2 from the largest measured T and marked "est.". ``ReferenceTTTCache``
is also the reference of tests/test_heads.py.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from heads.eagle3 import TTTCache  # noqa: E402
from train.plan import peak_tensor_memory  # noqa: E402


class ReferenceTTTCache:
    """TTT attention as it was before chunking (same math, O(T^2) scores per step k > 0)."""

    def __init__(self):
        self.k0 = self.v0 = None
        self.diag: list[tuple[torch.Tensor, torch.Tensor]] = []

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.k0 is None:
            self.k0, self.v0 = k, v
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        self.diag.append((k, v))
        groups = q.shape[1] // k.shape[1]
        k0, v0 = self.k0.repeat_interleave(groups, 1), self.v0.repeat_interleave(groups, 1)
        scale = 1.0 / math.sqrt(q.shape[-1])
        T = q.shape[2]
        causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        s0 = (q @ k0.transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))
        sd = torch.stack([(q * kj.repeat_interleave(groups, 1)).sum(-1) for kj, _ in self.diag], -1) * scale
        scores = torch.cat([s0, sd], -1)
        p = torch.softmax(scores, -1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(q.dtype)
        out = p[..., :T] @ v0
        for j, (_, vj) in enumerate(self.diag):
            out = out + p[..., T + j, None] * vj.repeat_interleave(groups, 1)
        return out


def unroll(cls, q, k, v, grads) -> None:
    """Forward of steps 0..n through one cache, then backward of all outputs."""
    cache = cls()
    outs = [cache.attend(qi, ki, vi) for qi, ki, vi in zip(q, k, v, strict=True)]
    torch.autograd.backward(outs, grads)


def measure(cls, T: int, args, device: torch.device, dtype: torch.dtype) -> tuple[float, float]:
    """(peak bytes above the inputs, seconds per forward+backward)."""
    n, shape_q, shape_kv = args.steps + 1, (1, args.heads, T, args.head_dim), (1, args.kv_heads, T, args.head_dim)
    make = lambda shape: torch.randn(shape, device=device, dtype=dtype, requires_grad=True)  # noqa: E731
    q, k, v = ([make(shape) for _ in range(n)] for shape in (shape_q, shape_kv, shape_kv))
    grads = [torch.randn(shape_q, device=device, dtype=dtype) for _ in range(n)]
    if device.type == "cuda":
        unroll(cls, q, k, v, grads)  # warm-up
        for t in q + k + v:
            t.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        start = time.perf_counter()
        for _ in range(args.iters):
            unroll(cls, q, k, v, grads)
            for t in q + k + v:
                t.grad = None
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base, (time.perf_counter() - start) / args.iters
    start = time.perf_counter()
    with peak_tensor_memory("cpu") as memory:
        unroll(cls, q, k, v, grads)
    return memory.peak, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--T", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--steps", type=int, default=3, help="TTT steps after step 0")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--iters", type=int, default=3, help="timed calls (CUDA)")
    parser.add_argument("--old-max-T", type=int, default=None)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device, dtype = (torch.device("cuda"), torch.bfloat16) if cuda else (torch.device("cpu"), torch.float32)
    old_max = args.old_max_T or (max(args.T) if cuda else 2048)
    print(f"TTT attention, {device.type} {str(dtype)[6:]}, B=1, heads {args.heads}/{args.kv_heads} kv, "
          f"head_dim {args.head_dim}, step 0 + {args.steps} TTT steps, one forward+backward; "
          f"peak = {'cuda max_memory_allocated' if cuda else 'live tensor storage'} above the inputs")
    print(f"{'T':>6} {'impl':>5} {'peak GiB':>10} {'s/call':>8}")
    ref: tuple[int, float] | None = None
    for T in args.T:
        for name, cls in (("old", ReferenceTTTCache), ("new", TTTCache)):
            if name == "old" and T > old_max:
                est = f"{ref[1] * (T / ref[0]) ** 2 / 2**30:9.2f}*" if ref else "-"
                print(f"{T:>6} {name:>5} {est:>10} {'-':>8}   (* est. ~T^2 from T={ref[0] if ref else '-'}; not run)")
                continue
            try:
                peak, secs = measure(cls, T, args, device, dtype)
            except torch.OutOfMemoryError:
                print(f"{T:>6} {name:>5} {'OOM':>10} {'-':>8}")
                torch.cuda.empty_cache()
                continue
            if name == "old":
                ref = (T, peak)
            print(f"{T:>6} {name:>5} {peak / 2**30:10.2f} {secs:8.3f}", flush=True)


if __name__ == "__main__":
    main()
