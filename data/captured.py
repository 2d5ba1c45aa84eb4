"""Hidden states kept while regenerating (``extract.source: regen``), for the extract stage to use.

With the ``hf`` backend the target's generating passes already compute every hidden state the head needs:
the prompt's in the prefill, each new token's in the step that feeds it, and the tokens the chat template
puts after an answer (end of turn) are fed as one more step or two (:func:`data.regenerate.stream`).
The data stage keeps them, for the LAST turn of each conversation (its prefill covers every earlier turn),
in ``<run_dir>/data/captured/``, one file per generated batch (and rank):

- ``part-<time>-<pid>.safetensors``: ``hidden`` [tokens, n_layers, H] (extract.dtype), ``argmax`` [tokens]
  (int32, the target's full-vocabulary next-token argmax), ``ids`` [tokens] (int32, the token ids the states
  belong to), ``offsets`` [rows + 1]; metadata ``keys`` (JSON list of prompt keys, one per row),
  ``layers``, ``dtype``, ``target`` (fingerprint). Written under a temporary name, fsynced and renamed (a
  part torn all the same, by a crash before 2026-12-07, is skipped: its rows are computed again).

The extract stage takes a row's states from here when the row's ``input_ids`` are a prefix of the captured
``ids`` (same layers, dtype and target), runs its forward pass for the other rows, and deletes the directory
once its shards are written (:mod:`train.extract`). Where the disk cannot hold the shards of every row beside
these files, it first deletes the newest parts (:func:`train.extract.make_room`).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections import OrderedDict
from concurrent import futures
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from data.formats import durable_replace
from train import dist
from train.log import log


def keeps_states(cfg) -> bool:
    """``extract.source`` resolved: whether the data stage keeps the states it generates for extract
    (``regen``; ``auto``: when the ``hf`` backend regenerates; never for ``train.online``, which has no extract)."""
    source = cfg.extract.get("source", "pass")
    if cfg.train.online or source == "pass":
        return False
    return source == "regen" or (bool(cfg.data.regenerate) and cfg.data.regen.get("backend", "hf") == "hf")


class CaptureWriter:
    """Appends captured conversations to ``directory`` (see the module docstring), while the disk has room for them
    and for the extract stage's shards of every row (28.7 KB per token at 7B: TBs for a ShareGPT-sized set); then it
    keeps no more, and the extract stage computes the other rows. ``rows``: the conversations of the whole data
    stage (every rank's), whose shards the extract stage writes while these files still exist; ``margin``: the
    extract stage's ``extract.disk_margin``. A file is written by a thread of its own while the target generates on
    (GBs a batch at 7-8B: seconds the GPU idled, thousands of times), one at a time, so up to three batches' states
    are held in host memory (the one written, its joined copy, the next: ~7.5 GB a rank at 7B, 64 conversations of
    ~1,350 tokens); :meth:`wait` for it to be done (its rows counted: before reading ``rows``)."""

    def __init__(self, directory: Path, layers: list[int], dtype: str, target: str, rows: int = 0,
                 margin: float = 1.0, keep_free: int = 2**30):
        self.dir = Path(directory)
        self.meta = {"layers": json.dumps(layers), "dtype": dtype, "target": target}
        self.layers, self.dtype, self.keep_free = layers, getattr(torch, dtype), keep_free
        self.expected_rows, self.margin = rows, margin
        self.rows = self.tokens = self.bytes = 0
        self.full = False
        self._writer = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="capture-writer")
        self._pending: futures.Future | None = None

    def write(self, keys: list[str], ids: list[list[int]], hidden: list[torch.Tensor], argmax: list[torch.Tensor]) -> None:
        """One file with the rows ``keys``: token ids, states [len(ids), n_layers, H] and argmax per row (on the CPU:
        written meanwhile; the previous file is waited for first)."""
        self.wait()
        if not keys or self.full:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        lengths = [len(i) for i in ids]
        nbytes = sum(h.numel() for h in hidden) * self.dtype.itemsize + 12 * sum(lengths)
        free = shutil.disk_usage(self.dir).free
        kept = (self.bytes + nbytes) * dist.world_size()  # every rank keeps its share here
        # The extract stage's shards of every row, these files still on disk: the rows' mean so far times all rows
        # (room for a copy of the kept ones alone left the extract stage refusing for the others' shards).
        shards = max(kept, (self.bytes + nbytes) / (self.rows + len(keys)) * self.expected_rows) * self.margin
        if free - nbytes < shards + self.keep_free:
            self.full = True
            log(f"[data] keeping no more hidden states: {free / 2**30:.1f} GiB free in {self.dir}, and the extract "
                f"stage's shards of every row take ~{shards / 2**30:.1f} GiB; it computes the rows not kept "
                "(extract.source=pass keeps none)")
            return
        self._pending = self._writer.submit(self._save, keys, ids, hidden, argmax, nbytes)

    def wait(self) -> None:
        """Until the file being written is on disk (its rows counted, or the writer full after a failure)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def _save(self, keys: list[str], ids: list[list[int]], hidden: list[torch.Tensor], argmax: list[torch.Tensor],
              nbytes: int) -> None:
        lengths = [len(i) for i in ids]
        name = f"part-{time.time_ns()}-{os.getpid()}.safetensors"
        tmp = self.dir / f".{name}.tmp"
        try:
            save_file({"hidden": torch.cat([h.to("cpu", self.dtype) for h in hidden]).contiguous(),
                       "argmax": torch.cat([a.to("cpu", torch.int32) for a in argmax]).contiguous(),
                       "ids": torch.tensor([t for i in ids for t in i], dtype=torch.int32),
                       "offsets": torch.tensor([0, *lengths]).cumsum(0)},
                      str(tmp), metadata={**self.meta, "keys": json.dumps(keys)})
            durable_replace(tmp, self.dir / name)
        except (OSError, SafetensorError) as e:   # a quota the free space did not show (NFS, Lustre), a failing disk:
            tmp.unlink(missing_ok=True)           # regeneration goes on (it stopped, and every rerun again)
            self.full = True
            log(f"[data] keeping no more hidden states: writing them to {self.dir} failed ({e}); the extract stage "
                "computes the rows not kept")
            return
        self.rows += len(keys)
        self.tokens += sum(lengths)
        self.bytes += nbytes


class OpenShards:
    """``safe_open`` handles of the safetensors files in ``directory``, at most ``limit`` at once (the least
    recently used one is dropped first). An open handle, and every tensor read from it, maps its whole file:
    Linux allows a process ``vm.max_map_count`` (65,530 by default) mappings, an 8B run's extract stage writes
    ~60k shards, and a rank that kept them all open would die mid-epoch, and again after each resume."""

    def __init__(self, directory: Path, limit: int = 256):
        self.dir, self.limit = Path(directory), limit
        self._open: OrderedDict[str, object] = OrderedDict()

    def __call__(self, file: str):
        handle = self._open.pop(file, None)
        self._open[file] = handle = handle if handle is not None else safe_open(str(self.dir / file), framework="pt")
        while len(self._open) > self.limit:
            self._open.popitem(last=False)
        return handle


class CapturedStates:
    """Read access: the states of a conversation by prompt key, for rows whose tokens they cover."""

    def __init__(self, directory: Path, layers: list[int], dtype: str, target: str):
        self.dir = Path(directory)
        self.index: dict[str, tuple[str, int, int]] = {}  # key -> (file, start, end); a later file wins
        self.files = OpenShards(self.dir)
        files = sorted(self.dir.glob("part-*.safetensors"), key=lambda p: p.name) if self.dir.is_dir() else []
        for path in files:
            try:
                with safe_open(str(path), framework="pt") as f:
                    meta = f.metadata() or {}
                    offsets = f.get_tensor("offsets").tolist()
            except (OSError, SafetensorError) as e:  # torn by a node's crash (parts before 2026-12-07 were not fsynced)
                log(f"[extract] {path} cannot be read ({e}): its rows' states are computed again")
                continue
            if (json.loads(meta.get("layers", "null")), meta.get("dtype"), meta.get("target")) != (layers, dtype, target):
                continue  # captured for another head, dtype or target
            for j, key in enumerate(json.loads(meta["keys"])):
                self.index[key] = (path.name, offsets[j], offsets[j + 1])

    def __len__(self) -> int:
        return len(self.index)

    def covers(self, key: str, input_ids) -> bool:
        """Whether the captured tokens of ``key`` start with ``input_ids`` (the data stage's row)."""
        if key not in self.index:
            return False
        file, a, b = self.index[key]
        n = len(input_ids)
        return n <= b - a and np.array_equal(self.files(file).get_slice("ids")[a: a + n].numpy(),
                                             np.asarray(input_ids, dtype=np.int32))

    def get(self, key: str, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden [length, n_layers, H], argmax [length] int32) of the first ``length`` captured tokens."""
        file, a, _ = self.index[key]
        f = self.files(file)
        return f.get_slice("hidden")[a: a + length], f.get_slice("argmax")[a: a + length]
