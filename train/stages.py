"""Stage registry and the resume rule.

Each stage is a module with one entry function ``run(cfg) -> dict`` that reads its inputs from the
run directory and writes into ``<run_dir>/<stage>/``. When it returns, rank 0 writes
``<run_dir>/<stage>/_complete.json`` with the stage's fingerprint and the identity of its output
(``output_id``, see :data:`OUTPUTS`). The fingerprint hashes the config keys that change the stage's
result (:data:`DEPENDS` minus :data:`IGNORED`) and the OUTPUT identities of its upstream stages (not
their configs): an upstream rerun that writes identical output does not invalidate what follows.
A stage whose marker holds the current fingerprint is skipped; otherwise it runs (and resumes whatever
partial work it finds, e.g. extraction shards, training checkpoints, eval records).
"""

from __future__ import annotations

import fcntl
import gc
import hashlib
import importlib
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext, suppress
from functools import partial
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from data.formats import DataError, fsync_tree, source_files, write_atomic
from train import dist
from train.errors import MissingStageError, UserError
from train.log import log

ORDER = ["data", "extract", "train", "eval", "export", "publish"]
ENTRY = {
    "data": "data.stage",
    "extract": "train.extract",
    "train": "train.loop",
    "eval": "eval.stage",
    "export": "train.export",
    "publish": "train.publish",
}
# Config keys each stage depends on (dotted paths into the composed config). `seed` stays in `data`: the
# data stage uses it (assign_splits' seeded hash of row ids, synth sources without a seed of their own).
# `eval.questions` is there because rows overlapping those prompts are dropped (no other eval key is).
DEPENDS = {
    "data": ["model", "data", "eval.questions", "seed"],  # not head.draft_vocab_size: the train stage builds it
    "extract": ["model", "head.type", "head.aux_layers", "extract"],
    "train": ["head", "train", "seed"],
    "eval": ["eval", "seed", "data.system_prompt", "data.thinking", "dtype", "device"],  # eval.dtype=auto follows dtype
    "export": ["export", "publish.repo_id", "model.hub_id"],  # the model card names the repo and the target
    "publish": ["publish"],
}
# Keys inside DEPENDS that do NOT change a stage's result (where, how fast or how verbosely it runs):
# changing one neither reruns the stage nor invalidates what follows.
IGNORED = {
    "data": ["data.regen.dir", "data.synth_dir", "data.regen.batch_size", "data.regen.refill", "data.num_proc",
             "data.regen.backend", "data.regen.url",
             "data.regen.model", "data.regen.concurrency", "data.regen.timeout_s", "data.regen.retries",
             "data.regen.vllm", "data.regen.dtype"],  # the regeneration cache is keyed by target + sampling, not by
                                                      # the engine or its precision
    "extract": ["extract.disk_margin"],  # not shard_mb: shards are named by index, a fingerprint must tell them apart
    "train": ["train.log_every", "train.num_threads", "train.keep_checkpoints", "train.checkpoint_every",
              "train.prefetch"],
    "eval": ["eval.num_threads", "eval.shared_dir"],
    "publish": ["publish.token"],   # (nor kept in its marker: a secret)
}
# Keys that change how a stage computes, not what: they count in its fingerprint (it reruns), but work written under
# other values is complete (extract's shards are found done), so its output and what follows stay.
# Extract's shards are named by the target's own fingerprint (train.extract.shard_fingerprint): where it loads from
# (a revision pinned to the commit the data came from, a model.path at that snapshot) is how, not what.
HOW = {"extract": ("extract.batch_tokens", "extract.zero_stage", "extract.source", "extract.reuse",
                   "model.revision", "model.path", "model.hub_id")}
# Keys added after runs were made, with the value that reproduces those runs: at that value a key does not
# count, so a finished stage (or a checkpoint) made before the key existed stays valid after an upgrade.
ADDED = {"head.dropout": 0.0, "data.train_rows": None, "head.ttt_reach_topk": 0, "train.autocast": None,
         "train.ema": 0.0, "head.feature_loss": 0.0,
         "head.layer_init_embed": "zero", "data.validation_max_rows": None, "train.optimizer": "adamw",
         "train.muon_lr": 0.02, "dtype": "auto", "device": "auto", "data.regen.top_k": 0,
         "train.loss_norm": "micro_batch", "eval.top_k": 0}
# Keys that rerun the train stage (its result may differ) but keep its checkpoints: the run continues from
# the latest checkpoint with the new value (budgets: a longer train.max_minutes continues training, the
# schedule refitted from the current step; validation settings only change what is measured from now on).
RESUMABLE = {"train": ["train.max_minutes", "train.max_steps", "train.epochs", "train.patience",
                       "train.eval_every", "train.val_tokens", "train.val_steps",
                       "train.loss_norm"]}   # (runs before it: the rest of their steps in the new norm)
# Files whose content is a stage's output identity (hashed into `output_id` of its marker; downstream
# fingerprints use it). Stages not listed use their own fingerprint.
OUTPUTS = {
    "data": ["dataset/*/*.arrow"],  # vocab.safetensors holds counts of these rows
    "extract": ["manifest.json"],
    "train": ["head/*.safetensors", "head/head_config.json"],
}
# Bumped when a stage's output format changes, so older outputs are redone rather than misread.
FORMAT_VERSION = {"data": 2, "extract": 2, "export": 4}  # export 2: vLLM EAGLE-3 layer ids at the top level;
# 3: no d2t/t2d in the vLLM formats of a head over the whole vocabulary (vLLM 0.32 refused the file); 4: the EAGLE-3
# layer ids in both engines' conventions in both folders (vLLM's at the top level, SGLang's in eagle_config)
# Stages that run on every rank (they split their work); the others run on rank 0 while the rest wait
# for the stage's marker file (multi-node runs need the run directory on a shared filesystem).
DISTRIBUTED = {"extract", "train"}
MARKER = "_complete.json"
FORCED = "forced.json"  # in train/checkpoints: the identity force=[train] started over with, until its command ends
FORCE_RECORD = "_forced.json"  # in the run directory: a forcing command's attempt and the forced stages it finished
FAILED = "_failed.json"  # written by rank 0 when a rank-0-only stage raises: the waiting ranks stop too
ALIVE = "_alive"  # heartbeats (a counter rewritten every HEARTBEAT_S): rank 0 in a rank-0-only stage, `_alive.rank<r>`
#                   rank r regenerating its share of the data stage
HEARTBEAT_S, STALE_S = 30.0, 600.0


def stage_dir(cfg: DictConfig, name: str) -> Path:
    return Path(cfg.run_dir) / name


@contextmanager
def exclusive(lock: Path, refuse: Callable[[str], Exception]) -> Iterator[None]:
    """Hold the file ``lock`` alone for the block: while another process holds it, ``refuse(holder)`` is raised at
    once (no wait that could outlast a collective timeout), ``holder`` naming its pid, host and start. The lock ends
    with its process, also on a crash."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a+", encoding="utf-8") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            raise refuse(f"{f.read().strip() or 'holder unknown'}; its lock: {lock}") from None
        except OSError as e:   # a filesystem without flock (Lustre without -o flock, NFS with nolock)
            log(f"warning: {lock} cannot be locked ({e.strerror}): nothing keeps a second run out of it")
        else:
            f.truncate(0)
            f.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
            f.flush()
        yield


def run_dir_lock(cfg: DictConfig):
    """Rank 0 holds the run directory alone (:func:`exclusive`): a second run in it (``make demo`` in two shells, a
    requeued job beside its survivor) would rewrite the same markers and rotate the same training checkpoints."""
    if not dist.is_main():
        return nullcontext()
    return exclusive(Path(cfg.run_dir) / ".lock", lambda holder: UserError(
        f"another run is using {cfg.run_dir} ({holder}): let it finish, or give this one its own run directory "
        "(output_root=..., model.name=... or run_dir=...)"))


UPSTREAM = {"extract": ["data"], "train": ["data", "extract"], "eval": ["train"], "export": ["train", "eval"],
            "publish": ["export"]}


def skipped(cfg: DictConfig) -> set[str]:
    """Stages this config never runs, whatever ``stages`` lists: extract under ``train.online`` (nothing reads its
    shards: a 7-8B pass and ~3 TB per 100M tokens)."""
    return {"extract"} if cfg.train.online else set()


def upstream(cfg: DictConfig, name: str) -> list[str]:
    return [u for u in UPSTREAM.get(name, []) if u not in skipped(cfg)]


def read_marker(cfg: DictConfig, name: str) -> dict | None:
    path = stage_dir(cfg, name) / MARKER
    return json.loads(path.read_text()) if path.exists() else None


def config_parts(cfg: DictConfig, name: str, ignore: tuple[str, ...] = (), legacy: bool = False) -> dict:
    """The resolved values of the keys stage ``name`` depends on, :data:`IGNORED` keys and ``ignore`` removed,
    and :data:`ADDED` keys at the value that reproduces runs made before them."""
    parts = {}
    for key in DEPENDS[name]:
        value = OmegaConf.select(cfg, key)
        parts[key] = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
    ignored = [k for k in IGNORED.get(name, []) if not (legacy and k == "publish.token")]   # (counted before 2026-12-07)
    if name == "eval" and isinstance(parts.get("eval"), dict) and not any(parts["eval"].get("temperatures") or []):
        parts["eval"]["top_p"] = 1.0   # greedy only: the sampling filters change nothing (a preset's Qwen3 settings);
        parts["eval"].pop("top_k", None)   # at their defaults, the fingerprint of the markers made before them
    dropped = [*ignored, *ignore] + [k for k, v in ADDED.items() if OmegaConf.select(cfg, k, default=v) == v]
    for key in dropped:
        dep = next((d for d in DEPENDS[name] if key == d or key.startswith(d + ".")), None)
        if dep is None:  # an ADDED key of another stage
            continue
        if key == dep:
            parts.pop(dep, None)
            continue
        *path, leaf = key[len(dep) + 1:].split(".")
        node = parts[dep]
        for k in path:
            node = node.get(k) or {}
        node.pop(leaf, None)
    if not legacy and name in ("data", "extract") and cfg.model.source == "hf" and cfg.model.path and "model.hub_id" not in ignore:
        parts["model"]["hub_id"] = None  # only names the target in model cards (the export stage's key) when a
        #                                  local copy is what loads: adding it for a card redoes no 7-8B pass
    return parts


def flat_config(cfg: DictConfig, name: str) -> dict:
    """:func:`config_parts` of stage ``name`` by dotted key (groups walked down to their leaves), JSON values."""
    flat = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict) and value:
            for k, v in value.items():
                walk(f"{prefix}.{k}", v)
        else:
            flat[prefix] = value

    for key, value in config_parts(cfg, name).items():
        walk(key, value)
    return json.loads(json.dumps(flat, default=str))


def config_changes(cfg: DictConfig, name: str, marker: dict, ignore: tuple[str, ...] = ()) -> str | None:
    """How this config's keys of stage ``name`` differ from those ``marker`` was made with (``key=old (this
    command: new)``, the first 8; not ``ignore``), "" when none does; None for a marker written before markers kept
    their config."""
    made, now = marker.get("config"), flat_config(cfg, name)
    if made is None:
        return None
    keys = sorted(k for k in made.keys() | now.keys() if made.get(k) != now.get(k) and k not in ignore)
    return ", ".join(f"{k}={made.get(k)!r} (this command: {now.get(k)!r})" for k in keys[:8]) + (
        f" and {len(keys) - 8} more" if len(keys) > 8 else "")


def orphaned_checkpoints(cfg: DictConfig) -> str | None:
    """Why this command would throw the training checkpoints away, else None: a stage before train that reruns for
    a changed key (an override forgotten on a resume) rewrites the data they were made on, and the train stage
    refuses them only after it (hours of regeneration and extraction at 8B, the old outputs then overwritten)."""
    latest = stage_dir(cfg, "train") / "checkpoints" / "latest"
    if "train" not in cfg.stages or "train" in cfg.force or not latest.exists():
        return None
    for name in upstream(cfg, "train"):
        marker = read_marker(cfg, name)
        if name not in cfg.stages or forced(cfg, name, marker) or not marker or marker["fingerprint"] == fingerprint(cfg, name):
            continue
        if changes := config_changes(cfg, name, marker, HOW.get(name, ())):
            return (f"the {name} stage would run again for {changes}, and the training checkpoints in {latest.parent} "
                    f"(latest {latest.read_text().strip()}) were made on its output as it is: set the old value(s) "
                    f"back to resume them, add force=[train] to start over with this command's settings, or "
                    f"force=[{name}] to rebuild it anyway (training resumes if its output comes out the same)")
    try:   # an upstream output changed since (no key did: e.g. `stages=[data] force=[data]` on an edited file) would
        made = json.loads((latest.parent / latest.read_text().strip() / "client.json").read_text())["identity"]
    except (OSError, ValueError, KeyError, TypeError):   # rerun the stages after it for hours, then refuse them in train
        return None
    outputs = upstream_ids(cfg, "train")
    for name in upstream(cfg, "train"):   # up to the first this command reruns (it may bring the output back: train
        marker, key = read_marker(cfg, name), f"upstream {name} output"   # compares once it has)
        if name in cfg.stages and (forced(cfg, name, marker) or not marker or marker["fingerprint"] != fingerprint(cfg, name)):
            break
        if marker and key in made and made[key] != outputs[name]:
            return (f"the {name} stage's output changed since the training checkpoints in {latest.parent} (latest "
                    f"{latest.read_text().strip()}) were made, so they cannot resume on it: add force=[train] to start "
                    f"over on it (the checkpoints are then deleted), or bring the {name} stage's output back as it was")
    return None


def current_marker(cfg: DictConfig, name: str) -> dict | None:
    """The marker of stage ``name`` when what it wrote is of the current config and upstream outputs (its
    fingerprint is today's), else None: e.g. an eval report of a head trained before."""
    marker = read_marker(cfg, name)
    return marker if marker and marker.get("fingerprint") == fingerprint(cfg, name) else None


def upstream_ids(cfg: DictConfig, name: str) -> dict:
    """Each upstream stage's output identity (``output_id`` of its marker; its fingerprint for markers
    written before output ids existed; None when it has not run)."""
    ids = {}
    for u in upstream(cfg, name):
        marker = read_marker(cfg, u) or {}
        ids[u] = marker.get("output_id") or marker.get("fingerprint")
    return ids


def fingerprint(cfg: DictConfig, name: str, ignore: tuple[str, ...] = (), legacy: bool = False) -> str:
    """A hash of what stage ``name``'s result depends on: its config keys (:func:`config_parts`, less
    ``ignore``; ``legacy``: before 2026-12-06, ``model.hub_id`` counted beside a ``model.path``), the upstream
    stages' output ids and its format version."""
    parts = config_parts(cfg, name, ignore, legacy)
    parts["upstream"] = upstream_ids(cfg, name)
    parts["format_version"] = FORMAT_VERSION.get(name, 1)
    return digest(parts)


def output_id(cfg: DictConfig, name: str, fp: str) -> str:
    """A hash of the stage's output files (:data:`OUTPUTS`) and its upstream output ids; ``fp`` for
    stages without such files. Under ``train.online`` the data's also names the target its manifest was made for:
    data not regenerated is the same from another target of the same tokenizer, and online training reads the target
    itself (offline, the extract manifest names it; salting offline ids too would redo the extract of every run made
    before whose data reran the same)."""
    patterns = OUTPUTS.get(name)
    if not patterns:
        return fp
    salt = json.dumps(upstream_ids(cfg, name), sort_keys=True)
    if name == "data" and cfg.train.online and (manifest := stage_dir(cfg, name) / "manifest.json").exists():
        salt += json.loads(manifest.read_text()).get("target_fingerprint", "")
    return files_id(stage_dir(cfg, name), patterns, salt)


def files_id(root: Path, patterns: list[str], salt: str = "") -> str:
    """A hash of the names (relative to ``root``) and contents of the files matching ``patterns``."""
    h = hashlib.sha256(salt.encode())
    for path in sorted({p for pat in patterns for p in root.glob(pat)}):
        h.update(str(path.relative_to(root)).encode() + b"\0")
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                h.update(block)
    return h.hexdigest()[:16]


def digest(parts: dict) -> str:
    """A short stable hash of a JSON-able value (fingerprints, cache keys)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def require(cfg: DictConfig, name: str) -> dict:
    """The marker of an upstream stage, or a clear error saying which stage to run first."""
    marker = read_marker(cfg, name)
    if marker is None:
        raise MissingStageError(
            f"Stage {name!r} has no complete output in {stage_dir(cfg, name)}. Run it first, e.g. "
            f"`python train/run.py stages=[{name}]` with the same model/head/data overrides."
        )
    return marker


def run_stages(cfg: DictConfig) -> dict[str, dict]:
    """Run ``cfg.stages`` in order, skipping those up to date; the stages' outputs (their markers) by name.

    Denormal floats are flushed to zero on the CPU first (x86 FTZ/DAZ), for this thread and the threads
    started from here on: some values of head training fall below 1.2e-38 (where, is open: not its parameters,
    optimizer moments, module outputs or loss probabilities), where each operation takes a slow path; on the
    2-core CPU training ran ~1.8x slower past step ~75 without the flush (README, "Denormals")."""
    import torch

    torch.set_flush_denormal(True)
    unknown = [s for s in list(cfg.stages) + list(cfg.force) if s not in ORDER]
    if unknown:
        raise ValueError(f"Unknown stage(s) {unknown}; valid stages, in order: {ORDER}")
    if dist.is_main():
        migrate_markers(cfg)
        if cfg.force and force_record(cfg) is None:   # this command's first attempt
            write_atomic(Path(cfg.run_dir) / FORCE_RECORD, json.dumps({
                "command": _command(cfg), "attempt": uuid.uuid4().hex[:12], "done": {},
                "started": time.strftime("%Y-%m-%dT%H:%M:%S")}))
    if why := dist.on_main(lambda: orphaned_checkpoints(cfg)):
        raise UserError(why)
    started = dist.on_main(lambda: (force_record(cfg) or {}).get("started")) if cfg.force else None
    results = {}
    for name in [s for s in ORDER if s in cfg.stages]:
        if name in skipped(cfg):
            log(f"[{name}] skipped: train.online=true computes the hidden states during training")
            continue
        # Rank 0 decides for all: ranks that disagreed (a run directory on NFS with stale attributes) would pair
        # the barriers of different stages, or wait for a marker of another fingerprint.
        fp, marker = dist.on_main(partial(_up_to_date, cfg, name))
        if marker and name in cfg.force:
            log(f"[{name}] forced, and finished at {marker['finished_at']} by an earlier attempt of this very command "
                f"(the same stages and force, first run at {started}): "
                f"skipped, not redone. It is forced again once this command has ended (or delete "
                f"{Path(cfg.run_dir) / FORCE_RECORD})")
            results[name] = marker
            continue
        if marker:
            log(f"[{name}] up to date in {stage_dir(cfg, name)}; skipped")
            now = input_files(cfg) if name == "data" and dist.is_main() else None
            seen_then = marker.get("files")   # (a marker made before it kept them: nothing to compare)
            changed = []
            if now is not None and seen_then is not None:
                changed = [f for f, seen in seen_then.items() if now.get(f) != seen]
                if added := [f for f in now if f not in seen_then]:   # (a folder's README or .DS_Store is no input)
                    changed += [f for f in added if f in read_files(cfg)]
            if changed:
                log(f"[data] warning: {len(changed)} input file(s) changed or added since the data stage read them (size or "
                    f"time; the first: {changed[0]}): this run goes on with the rows read then; add force=[data] to "
                    "read them again (answers regenerated before are taken from the cache)")
            results[name] = marker
            continue
        log(f"[{name}] running -> {stage_dir(cfg, name)}")
        start = time.time()
        dist.barrier()  # every rank has compared the old marker before rank 0 removes it
        if dist.is_main():
            stage_dir(cfg, name).mkdir(parents=True, exist_ok=True)
            (stage_dir(cfg, name) / MARKER).unlink(missing_ok=True)
            (stage_dir(cfg, name) / FAILED).unlink(missing_ok=True)
            for beat in stage_dir(cfg, name).glob(ALIVE + "*"):
                beat.unlink()
        dist.barrier()
        if name in DISTRIBUTED:
            out = importlib.import_module(ENTRY[name]).run(cfg)
            dist.barrier()
            marker = _write_marker(cfg, name, fp, start, out)
        elif dist.is_main():
            try:   # the marker too (its output id hashes the data; its outputs are fsynced): beating, its failure told
                with heartbeat(stage_dir(cfg, name) / ALIVE, HEARTBEAT_S) if dist.world_size() > 1 else nullcontext():
                    out = importlib.import_module(ENTRY[name]).run(cfg)
                    marker = _write_marker(cfg, name, fp, start, out)
            except BaseException as e:
                (stage_dir(cfg, name) / FAILED).write_text(json.dumps({"error": repr(e)}))
                raise
        else:  # no collective stays open while rank 0 works alone (hours of regeneration are fine)
            if shares_work(cfg, name):  # this rank's share first (it signals rank 0 by a file), then wait
                with heartbeat(stage_dir(cfg, name) / f"{ALIVE}.rank{dist.rank()}", HEARTBEAT_S):
                    importlib.import_module(ENTRY[name]).run(cfg)
            marker = wait_for_marker(cfg, name, fp)
        if dist.is_main() and name in cfg.force and (record := force_record(cfg)) is not None:
            record["done"][name] = _stamp(marker)   # a repeat of this command after a later crash does not redo it
            write_atomic(Path(cfg.run_dir) / FORCE_RECORD, json.dumps(record))
        release_memory()
        dist.barrier()
        log(f"[{name}] done in {marker['wall_s']} s")
        results[name] = marker
    if dist.is_main() and "train" in cfg.stages:   # a command that trains has done all it was asked (the training
        (stage_dir(cfg, "train") / "checkpoints" / FORCED).unlink(missing_ok=True)   # finished): force starts over again
    if dist.is_main() and force_record(cfg) is not None:   # this command has ended: its force applies anew
        (Path(cfg.run_dir) / FORCE_RECORD).unlink(missing_ok=True)
    return results


def _up_to_date(cfg: DictConfig, name: str) -> tuple[str, dict | None]:
    """(stage ``name``'s fingerprint now, its marker when that is current and the stage is not forced)."""
    fp, marker = fingerprint(cfg, name), read_marker(cfg, name)
    return fp, marker if marker and marker.get("fingerprint") == fp and not forced(cfg, name, marker) else None


def _command(cfg: DictConfig) -> dict:
    return {"stages": list(cfg.stages), "force": sorted(cfg.force)}


def _stamp(marker: dict) -> list:
    return [marker.get("fingerprint"), marker.get("output_id"), marker.get("finished_at")]


def force_record(cfg: DictConfig) -> dict | None:
    """(Rank 0) The record (:data:`FORCE_RECORD`) of this command's force, made by its first attempt, deleted when
    it ends: ``attempt`` (a nonce that tags the forced stages' partial work: extract's shards) and ``done`` (the
    markers of the forced stages it finished). None for another command's record (other stages or force)."""
    try:
        record = json.loads((Path(cfg.run_dir) / FORCE_RECORD).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("command") == _command(cfg) else None


def forced(cfg: DictConfig, name: str, marker: dict | None) -> bool:
    """Whether stage ``name`` runs again for ``force``: named there and not finished (its ``marker``) by an earlier
    attempt of this command. The command a user repeats after a crash in a later stage (a 7-8B run's forced
    extraction of hours, then training failed) does not redo what its force already redid."""
    if name not in cfg.force:
        return False
    record = force_record(cfg)
    if name == "data" and marker and marker.get("files") != input_files(cfg):   # a file edited since (what force=[data]
        return True                                                                # is for): read again
    return not (record and marker and record["done"].get(name) == _stamp(marker))


def release_memory() -> None:
    """Give what a finished stage held (its target, activations) back to the GPU: PyTorch's caching allocator
    keeps freed blocks reserved, the driver counts them as used, and the train stage's memory check reads the
    driver's free memory, so a 7-8B target cached by the data or extract stage would fail it falsely."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def shares_work(cfg: DictConfig, name: str) -> bool:
    """Whether the other ranks also enter the rank-0 stage ``name`` for a part of its work: the data stage's
    ``hf`` regeneration is split across ranks (data/engines.py); they return after their share. A ``synth``
    source too: the ranks write its batches together, each reads them all (data/synth.py)."""
    return (name == "data" and dist.world_size() > 1 and bool(cfg.data.regenerate)
            and cfg.data.regen.get("backend", "hf") == "hf")


def on_stage_main(cfg: DictConfig, name: str, fn: Callable[[], None]) -> None:
    """``fn()`` on rank 0 of the rank-0 stage ``name``; where the other ranks share its work (:func:`shares_work`),
    its error is raised on each of them too (they would wait in a barrier for dist_timeout_minutes where no launcher
    stops them: other nodes)."""
    if shares_work(cfg, name):
        dist.on_main(fn)
    elif dist.is_main():
        fn()


def _write_marker(cfg: DictConfig, name: str, fp: str, start: float, out: dict | None) -> dict:
    """The stage's ``_complete.json`` (written by rank 0, atomically)."""
    marker = {"stage": name, "fingerprint": fp,
              "output_id": output_id(cfg, name, fp) if dist.is_main() else None, "wall_s": round(time.time() - start, 1),
              "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "outputs": out or {},
              "config": flat_config(cfg, name)}   # what it was made with (a later command's differences named)
    if dist.is_main():
        if name == "data":
            marker["files"] = input_files(cfg)
        if name in ("data", "eval", "export"):   # written without fsync (Arrow, safetensors, reports): on disk before the
            fsync_tree(stage_dir(cfg, name), skip=frozenset({"captured"}))   # marker names them (a node's crash)
        _save_marker(cfg, name, marker)
    return marker


def _source_paths(cfg: DictConfig) -> list[Path]:
    """The local paths the data stage reads: ``data.sources`` paths (files, folders, patterns), ``eval.questions``."""
    paths = [Path(str(s.path)) for s in cfg.data.sources if s.get("path")]
    return paths + ([Path(str(cfg.eval.questions))] if cfg.eval.get("questions") else [])


def read_files(cfg: DictConfig) -> set[str]:
    """The files of :func:`_source_paths` the data stage reads rows from (a folder's .jsonl/.json/.parquet files)."""
    out = set()
    for p in _source_paths(cfg):
        with suppress(DataError):
            out.update(map(str, source_files(p)))
    return out


def input_files(cfg: DictConfig) -> dict[str, list[int]]:
    """Path -> [size, mtime_ns] of the local files the data stage reads (``data.sources`` paths, each file of a folder
    of shards, ``eval.questions``): a file edited after the stage ran is named when the stage is skipped (its
    fingerprint holds the config, not the files' contents)."""
    files = []
    for p in _source_paths(cfg):
        with suppress(DataError):   # (a path gone: the data stage names it when it runs)
            files += source_files(p) if not p.is_dir() else [f for f in sorted(p.rglob("*")) if f.is_file()]
    return {str(f): [f.stat().st_size, f.stat().st_mtime_ns] for f in files}


def _save_marker(cfg: DictConfig, name: str, marker: dict) -> None:
    write_atomic(stage_dir(cfg, name) / MARKER, json.dumps(marker, indent=2, default=str))


def migrate_markers(cfg: DictConfig) -> None:
    """(Rank 0) Give the data and extract markers written before 2026-12-06 (``model.hub_id`` counted beside a
    ``model.path``) today's fingerprint where they were current then (the Hub id never changed what they computed):
    the change reruns nothing made before it. Their output ids stay (a marker older than output ids: its old
    fingerprint), and with them the training checkpoints' identity. So the publish marker written before 2026-12-07,
    when ``publish.token`` counted (and was kept in its config: rewritten without it)."""
    for name in ("data", "extract", "publish"):
        marker, fp = read_marker(cfg, name), fingerprint(cfg, name)
        if marker and marker["fingerprint"] != fp and marker["fingerprint"] == fingerprint(cfg, name, legacy=True):
            _save_marker(cfg, name, {**marker, "fingerprint": fp, "config": flat_config(cfg, name),
                                     "output_id": marker.get("output_id") or marker["fingerprint"]})


@contextmanager
def heartbeat(path: Path, every_s: float) -> Iterator[None]:
    """While the block runs, rewrite ``path`` with a rising counter and this process's progress-bar steps
    (``train.log.STEPS``) every ``every_s`` seconds (a daemon thread): the ranks waiting for this one see it is
    alive, and whether it is getting anywhere (:class:`Pulse`)."""
    from train.log import STEPS

    stop = threading.Event()

    def beat() -> None:
        count = 0
        while True:
            count += 1
            tmp = path.with_name(path.name + ".tmp")
            try:
                tmp.write_text(f"{count} {STEPS[0]}")
                os.replace(tmp, path)
            except OSError:   # a network filesystem's moment (EIO, ESTALE): the next beat, not a thread gone for
                pass          # good (the waiting ranks then took this live rank for dead)
            if stop.wait(every_s):
                return

    thread = threading.Thread(target=beat, name="heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        with suppress(OSError):   # (EIO, ESTALE: the stage's outcome, written already, is what counts)
            path.unlink(missing_ok=True)


class Pulse:
    """Whether the process beating ``path`` (:func:`heartbeat`) has stopped (its heartbeat unchanged for
    ``stale_s`` seconds: killed) or hangs (beating, but its progress bars still for ``stall_s`` seconds: a
    stuck GPU, file system or lock), on this process's clock (no clock is shared with the writer, which may be
    on another node)."""

    def __init__(self, path: Path, stale_s: float = STALE_S, stall_s: float | None = None):
        self.path, self.stale_s, self.stall_s = path, stale_s, stall_s
        self.last = self.steps = None
        self.since = self.moved = time.monotonic()

    def problem(self, who: str, what: str) -> str | None:
        """Why to stop waiting for ``who`` (doing ``what``), or None while it is alive and getting anywhere."""
        try:
            beat = self.path.read_text()
        except FileNotFoundError:  # not yet written, or removed as its stage ends
            beat = None
        except OSError:   # a network filesystem's moment (EIO, ESTALE): as it was (not this waiting rank's crash)
            beat = self.last
        now = time.monotonic()
        if beat != self.last:
            self.last, self.since = beat, now
            steps = (beat or "").partition(" ")[2]
            if steps != self.steps:
                self.steps, self.moved = steps, now
        if now - self.since > self.stale_s:
            return (f"{who} stopped {what}: its heartbeat {self.path} has not changed for {self.stale_s:.0f} s "
                    "(killed? out of host memory? see its log and the kernel's); this rank stops too. A rerun resumes")
        if self.stall_s is not None and now - self.moved > self.stall_s:
            return (f"{who} is alive but has made no progress {what} for {self.stall_s:.0f} s "
                    "(hang_minutes): hung on a GPU, a file system or a lock? `py-spy dump --pid <its pid>` shows "
                    "where; this rank stops too. A rerun resumes")
        return None


def rank_pulse(cfg: DictConfig, name: str, rank: int, stale_s: float = STALE_S) -> Pulse:
    """The :class:`Pulse` of rank ``rank`` in stage ``name`` (:data:`ALIVE`: rank 0's heartbeat is the stage's own,
    rank r's ``_alive.rank<r>``), hung after ``hang_minutes`` without progress."""
    return Pulse(stage_dir(cfg, name) / (ALIVE if rank == 0 else f"{ALIVE}.rank{rank}"), stale_s, 60 * cfg.hang_minutes)


def wait_for_marker(cfg: DictConfig, name: str, fp: str, poll_s: float = 2.0, stale_s: float = STALE_S) -> dict:
    """Wait (polling the shared run directory) until rank 0 has finished stage ``name``; raise if it failed, if
    its heartbeat has stopped, or if it beats without progress for ``hang_minutes`` (:class:`Pulse`):
    rank 0 was killed without a word (the kernel's out-of-memory killer, a lost node), which a launcher on
    another node does not see, or hangs, and this rank would wait forever."""
    pulse = rank_pulse(cfg, name, 0, stale_s)
    while True:
        marker = read_marker(cfg, name)
        if marker and marker.get("fingerprint") == fp:
            return marker
        if (stage_dir(cfg, name) / FAILED).exists():
            raise RuntimeError(f"stage {name!r} failed on rank 0 (see its log); this rank stops too")
        if why := pulse.problem("rank 0", f"working on stage {name!r}"):
            raise RuntimeError(why)
        time.sleep(poll_s)
