"""Eval work that does not depend on the head, done once per target and machine and shared by every head.

Under ``eval.shared_dir`` (default ``${output_root}/${model.name}/eval_shared``, next to the regeneration
cache):

- ``baselines-<hash>.jsonl``: the per-prompt records (tokens per turn and timings) of the head-independent
  methods (:data:`SHARED_METHODS`: plain decoding and n-gram prompt lookup). The file is keyed by
  :func:`target_identity` (target files, EOS ids, machine: host, platform, CPUs, torch threads, device, dtype,
  library versions; the decoder's timing version) and :func:`baseline_settings` (max_new_tokens, top_p,
  top_k, n-gram settings, system prompt, thinking); a record by the prompt's turns, the method, the temperature
  and (sampling only) its seed. ``baselines-<hash>.key.json`` shows the key. The first head's eval writes
  the records as it decodes them (interleaved with its own methods, as always); the next head's eval reads
  them instead of decoding plain and n-gram again (``eval.share_baselines=false`` decodes them in its own
  process).
- ``sizing/<hash>.json``: tree sizing measurements (:class:`JsonCache`): the target's verify time vs tree
  tokens (per target + machine, shared by the heads) and each head's acceptance curve and draft times
  (keyed by the head's identity, the train stage's output id).

A torn line or file (a crash) is ignored; ``force=[eval]`` reads none of it and writes fresh values
(the last record of a key wins).
"""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

import torch
import transformers
from omegaconf import DictConfig, OmegaConf

from data.formats import appending, read_jsonl, write_atomic
from eval.decoder import DECODER_VERSION
from train.stages import digest

SHARED_METHODS = ("plain", "ngram")
T = TypeVar("T")


def machine(target) -> dict:
    """What timings depend on besides the target's weights: the platform, CPUs, torch threads (as set now; on
    the CPU only: a GPU's timings do not follow them, and an eval after training inherits the threads training
    set per rank, which a rerun of eval alone does not) and OpenMP's wait policy (PASSIVE: a verify pass of 2+
    tokens took 1.6-2.1x as long on the 2-core CPU), device, dtype, the torch / transformers versions, and the host
    (the nodes of a cluster share an image, a GPU model and an output_root: another node's plain decoding timed
    its speedups while the report said "this machine")."""
    weight = next(target.parameters())
    cpu = weight.device.type == "cpu"
    threads = torch.get_num_threads() if cpu else None
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "threads": threads, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY") if cpu
            else None, "device": str(weight.device),
            "gpu": torch.cuda.get_device_name(weight.device) if weight.device.type == "cuda" else None,
            "dtype": str(weight.dtype), "torch": torch.__version__, "transformers": transformers.__version__,
            "host": platform.node()}


def target_identity(target_fp: str, eos: Iterable[int], target) -> dict:
    """The target's files (``train.target.target_fingerprint``), its EOS ids, the machine and the decoder's
    timing version (records and verify times measured by an older decoder are not reused)."""
    return {"target": target_fp, "eos": sorted(eos), "machine": machine(target), "decoder": DECODER_VERSION}


def baseline_settings(cfg: DictConfig) -> dict:
    """The eval settings that change plain and n-gram outputs (temperature and seed are per record)."""
    return {"max_new_tokens": cfg.eval.max_new_tokens, "top_p": cfg.eval.top_p, "top_k": cfg.eval.get("top_k", 0),
            "ngram": OmegaConf.to_container(cfg.eval.ngram, resolve=True),
            "system_prompt": cfg.data.system_prompt, "thinking": cfg.data.get("thinking"),
            "version": 2}   # 2: n-gram lookup prefers an occurrence k tokens follow


class JsonCache:
    """One JSON file per key (the key, with ``identity`` folded in, hashed into its name) under
    ``directory``; ``fresh`` reads nothing (but writes); no directory: nothing is read or written."""

    def __init__(self, directory: Path | str | None, identity: dict | None = None, fresh: bool = False):
        self.dir = None if directory is None else Path(directory)
        self.identity, self.fresh = identity or {}, fresh

    def _path(self, key: dict) -> Path:
        return self.dir / f"{digest({**self.identity, **key})}.json"

    def get(self, key: dict):
        """The value stored for ``key``; None when absent, unreadable, fresh or without a directory."""
        if self.dir is None or self.fresh or not self._path(key).exists():
            return None
        try:
            return json.loads(self._path(key).read_text())["value"]
        except (json.JSONDecodeError, KeyError):
            return None

    def put(self, key: dict, value: T) -> T:
        """Store ``value`` (atomically); returns it as read back (JSON: dict keys become strings)."""
        text = json.dumps({"key": {**self.identity, **key}, "value": value}, default=str)
        if self.dir is not None:
            write_atomic(self._path(key), text)
        return json.loads(text)["value"]

    def get_or(self, key: dict, make: Callable[[], T]) -> T:
        """The stored value, else ``make()`` stored."""
        found = self.get(key)
        return self.put(key, make()) if found is None else found


def record_key(turns: list[str], method: str, temperature: float, seed: int) -> str:
    """A shared record's identity within its file: the prompt's turns, the method, the temperature and, when
    sampling, the seed (greedy outputs do not depend on it)."""
    return digest([list(turns), method, float(temperature), seed if temperature else 0])


class Baselines:
    """The shared records of :data:`SHARED_METHODS` for one target, machine and decode setting (``key``)."""

    def __init__(self, directory: Path | str, key: dict, fresh: bool = False):
        name = f"baselines-{digest(key)}"
        self.path = Path(directory) / f"{name}.jsonl"
        if not (Path(directory) / f"{name}.key.json").exists():
            write_atomic(Path(directory) / f"{name}.key.json", json.dumps(key, indent=2, default=str))
        self.found = {} if fresh else {r["key"]: r for r in read_jsonl(self.path) if "key" in r}

    def find(self, turns: list[str], methods: Iterable[str], temperature: float, seed: int) -> dict[str, dict]:
        """The stored records (method -> record, ``reused`` set) of ``methods`` for this prompt."""
        found = {m: self.found.get(record_key(turns, m, temperature, seed)) for m in methods}
        return {m: {**{k: v for k, v in r.items() if k != "key"}, "reused": True}
                for m, r in found.items() if r is not None}

    def add(self, turns: list[str], records: list[dict]) -> None:
        """Append the records of one prompt (flushed, fsync'ed: one write, so concurrent evals of the same
        target only ever tear a line, which readers skip)."""
        rows = [{**r, "key": record_key(turns, r["method"], r["temperature"], r["seed"])} for r in records]
        if not rows:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with appending(self.path) as f:
            f.write("".join(json.dumps(r) + "\n" for r in rows))
            f.flush()
            os.fsync(f.fileno())
        self.found.update((r["key"], r) for r in rows)


def baseline_summary(records: list[dict], baselines: Baselines | None) -> dict:
    """The report's ``baselines`` field: whether head-independent records are shared, the file, how many
    prompt records of each method were reused from an earlier eval process / decoded here, and a note on
    what that means for the speedups."""
    reused: dict[str, int] = {}
    for r in records:
        if r.get("reused"):
            reused[r["method"]] = reused.get(r["method"], 0) + 1
    note = ("every method was decoded and timed in this process, prompt by prompt" if not reused else
            "plain/n-gram records of an earlier eval process of the same target on this machine were reused "
            "(tokens and timings): speedups compare timings taken in different processes, so machine noise "
            "does not hit both alike (eval.share_baselines=false decodes them in this process)")
    return {"shared": baselines is not None, "file": str(baselines.path) if baselines else None,
            "reused": reused, "note": note}
