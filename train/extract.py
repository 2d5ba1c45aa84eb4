"""Extract stage: the frozen target's hidden states at the layers the head declares.

Layer ids follow ONE convention everywhere in this project: the index into Hugging Face's
``hidden_states`` (index i = the residual stream entering decoder layer i; index N = the final hidden
state after the final norm). EAGLE-3 captures its three taps plus N; Medusa captures N. Target
logits are not stored: training recomputes them from the stored final hidden state with the
target's frozen lm_head.

Output ``<run_dir>/extract/``:
- ``{split}-{i:05d}.safetensors``: ``hidden`` [tokens, n_layers, H] (extract.dtype), ``argmax`` [tokens]
  (int32: the target's full-vocabulary next-token argmax, so training needs only the draft
  vocabulary's rows of the lm_head), ``row_index`` [rows] (row of the data split), ``offsets``
  [rows + 1] (row r is hidden[offsets[r]:offsets[r+1]]);
  written (by a writer thread, while the next shard is computed) under a temporary name, fsynced and renamed, so
  a file that exists is complete; partial files of a killed run are deleted when the stage starts again.
- ``index.json`` (rank 0): shard file -> [its ``row_index``, its ``offsets``], so that every rank of the train
  stage reads one file rather than every shard's header.
- ``manifest.json`` (rank 0, after all ranks finished): what the shards hold -- layers, dtype, hidden size,
  shards, token counts, bytes, fingerprints of the target, the tokenizer and the data. It is the stage's output
  identity (downstream stages and training checkpoints follow its hash), so it holds nothing of how it was made;
- ``provenance.json``: how it was made -- ranks (``world_size``); of the shards this run wrote, the rows whose
  states were kept while regenerating (``from_regeneration``) or copied from a sibling run (``from_run``).

Rows are sorted by length and cut into shards of about ``extract.shard_mb``; the shards still to write (each
rank judges its turn's files, the verdicts gathered) are dealt to the ranks in turn; inside a shard, batches of at most
``extract.batch_tokens`` padded tokens. ``force=[extract]`` writes every shard again (once: the forcing command
repeated after a crash keeps the shards its earlier attempt wrote, :func:`train.stages.forced`).
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import time
from collections.abc import Iterator
from concurrent import futures
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch
from omegaconf import DictConfig
from safetensors import safe_open
from safetensors.torch import save_file

from data.captured import CapturedStates, OpenShards, keeps_states
from data.formats import durable_replace, write_atomic
from data.stage import load_dataset, row_lengths
from heads.io import head_config
from train import dist
from train.errors import UserError
from train.log import log, peak_rss_gib, progress
from train.losses import full_argmax
from train.stages import HOW, MARKER, digest, fingerprint, force_record, require, stage_dir
from train.target import (
    load_config,
    load_target,
    load_tokenizer,
    resolve_device,
    resolve_dtype,
    target_fingerprints,
    target_snapshot,
    tokenizer_fingerprint,
)

SPLITS = ("train", "validation")
INDEX = "index.json"  # shard file -> [its rows, their offsets] (README, "Files between stages")


class ExtractError(UserError, RuntimeError):
    pass


def capture_layers(cfg: DictConfig, target_config) -> list[int]:
    """HF hidden_states indices the head needs (see the module docstring)."""
    n = getattr(target_config, "text_config", target_config).num_hidden_layers
    hcfg = head_config(cfg.head.type, target_config, cfg.head, cfg.head.draft_vocab_size)
    return [*hcfg.aux_layers, n] if cfg.head.type == "eagle3" else [n]


def capture(model, input_ids: torch.Tensor, layers: list[int], attention_mask=None, **kwargs) -> torch.Tensor:
    """[B, T, len(layers), H]: the selected hidden states of one forward pass (no lm_head)."""
    out = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                               output_hidden_states=list(layers), **kwargs)
    return torch.stack([out.hidden_states[i] for i in layers], 2)


def check_data(cfg: DictConfig, tokenizer) -> dict:
    """The data stage's manifest, refusing data made with another target or tokenizer."""
    manifest = json.loads((stage_dir(cfg, "data") / "manifest.json").read_text())
    for key, accepted in (("tokenizer_fingerprint", [tokenizer_fingerprint(tokenizer)]),
                          ("target_fingerprint", target_fingerprints(cfg))):   # (data made before 2026-12-07 too)
        if manifest[key] not in accepted:
            made, now = manifest.get("target_snapshot"), target_snapshot(cfg)
            if made and now and made.split("@")[0] == now.split("@")[0] and made != now:
                raise ExtractError(
                    f"the data in {stage_dir(cfg, 'data')} was made from {made}, and this run loads {now}: the "
                    f"repository resolved to another commit (model.revision is {cfg.model.revision}). To keep the "
                    f"regenerated answers, pin the commit they came from: model.revision={made.split('@')[1]} (in your "
                    "model config; the data and extract stages then rerun from the cached answers, nothing is "
                    "regenerated). To regenerate them with the new commit instead: force=[data].")
            raise ExtractError(
                f"the data in {stage_dir(cfg, 'data')} was made with another target/tokenizer ({key} "
                f"{manifest[key]} != {accepted[0]} of model={cfg.model.name}). Rerun the data stage for this "
                "target: add force=[data] (or use another run_dir)."
            )
    return manifest


def shard_fingerprint(cfg: DictConfig, target: str, dtype: torch.dtype) -> str:
    """What a shard's states depend on: the extract stage's keys less :data:`HOW` (which holds where the target is
    loaded from: ``model.revision``, ``path``, ``hub_id``), the target's own fingerprint ``target`` (the data
    manifest's: its files) and the precision of the passes ``dtype`` (resolved: ``dtype=auto`` and ``bfloat16`` on a
    GPU are the same passes). Pinning ``model.revision`` to the commit the data came from, as :func:`check_data` asks,
    or pointing ``model.path`` at the same snapshot keeps every finished shard; an extraction resumed in another
    precision redoes the shards of the first (its states are not mixed)."""
    return digest({"config": fingerprint(cfg, "extract", ignore=HOW["extract"]), "target": target, "dtype": str(dtype)})


BEFORE_LOCATION = tuple(k for k in HOW["extract"] if not k.startswith("model."))   # HOW before 2026-12-07


def plan_shards(lengths: dict[str, list[int]], bytes_per_token: int, shard_mb: float) -> list[dict]:
    """Deterministic shard plan: rows sorted by length, cut every ~shard_mb."""
    budget = max(1, int(shard_mb * 2**20 / bytes_per_token))
    shards = []
    for split in SPLITS:
        order = sorted(range(len(lengths[split])), key=lambda r: (lengths[split][r], r))
        rows, tokens = [], 0
        for r in order:
            rows.append(r)
            tokens += lengths[split][r]
            if tokens >= budget:
                shards.append({"split": split, "rows": rows, "tokens": tokens})
                rows, tokens = [], 0
        if rows:
            shards.append({"split": split, "rows": rows, "tokens": tokens})
    for i, s in enumerate(shards):
        s["file"] = f"{s['split']}-{i:05d}.safetensors"
    return shards


def batches(rows: list[int], lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Consecutive rows of similar length, padded size (rows x longest) <= batch_tokens."""
    out, cur = [], []
    for r in rows:
        if cur and (len(cur) + 1) * max(lengths[r], max(lengths[c] for c in cur)) > batch_tokens:
            out.append(cur)
            cur = []
        cur.append(r)
    return out + ([cur] if cur else [])


def padded(rows: list, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask) [len(rows), longest]: the token rows right-padded with ``pad_id``."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for j, row in enumerate(rows):
        ids[j, : len(row)] = torch.as_tensor(row)
        mask[j, : len(row)] = 1
    return ids, mask


def _complete(path: Path, fps: set[str], attempt: str | None = None) -> bool:
    """A shard from this very configuration, one of fingerprints ``fps`` (an older one, from other settings, is
    redone; so is one a crash or power loss left torn or empty, which safetensors cannot open), and written by the
    forcing command's ``attempt`` when one is given."""
    if not path.exists():
        return False
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            return meta.get("fingerprint") in fps and attempt in (None, meta.get("attempt"))
    except Exception:  # safetensors' SafetensorError (header too small, file not fully covered), OSError
        return False


def check_disk(path: Path, needed: int, margin: float, free: int | None = None) -> None:
    """Refuse unless ``path`` has room for ``needed`` bytes x ``margin`` (``free``: as measured by the caller)."""
    free = shutil.disk_usage(path).free if free is None else free
    log(f"[extract] needs about {needed / 2**30:.2f} GiB on disk; {free / 2**30:.2f} GiB free at {path}")
    if free < needed * margin:
        raise ExtractError(
            f"not enough free disk at {path}: the extraction needs about {needed / 2**30:.2f} GiB "
            f"(x{margin} margin) but only {free / 2**30:.2f} GiB are free. Free space, point run_dir elsewhere, "
            "or use extract.dtype=float16/bfloat16 or train.online=true (no disk)."
        )


def make_room(kept: Path, out: Path, short: int) -> int:
    """(Rank 0) Free ``short`` bytes for the shards at ``out`` by deleting the last parts of the states kept while
    regenerating (``kept``, on the same filesystem): their rows go through the forward pass instead. Returns the
    bytes deleted: none where deleting them all would not free ``short`` (the disk check refuses then, and the states
    stay for the rerun after the user has made room)."""
    if short <= 0 or not kept.is_dir() or os.stat(kept).st_dev != os.stat(out).st_dev:
        return 0
    parts, deleted, freed = sorted(kept.glob("part-*.safetensors"), reverse=True), 0, 0   # part-<time_ns>-<pid>
    if sum(part.stat().st_size for part in parts) < short:
        return 0
    for part in parts:   # newest first
        if freed >= short:
            break
        freed += part.stat().st_size
        part.unlink()
        deleted += 1
    log(f"[extract] deleted {deleted} of the {len(parts)} files of states kept while regenerating ({freed / 2**30:.2f} "
        f"GiB): the shards of every row fit only without them; their rows go through the forward pass")
    return freed


@contextmanager
def _loaded_target(cfg: DictConfig, device: torch.device):
    """The target for the forward passes; under ZeRO-3 (``extract.zero_stage=3``) partitioned by DeepSpeed and
    released on exit: DeepSpeed keeps the module in a global stack and its hooks on it, so without the release the
    partitioned target (its share of every rank's memory: 17 GiB per GPU for 70B in bf16 on 8) stays into the
    train stage."""
    if cfg.extract.zero_stage != 3:
        yield load_target(cfg, device)
        return
    import deepspeed
    from deepspeed.runtime.zero import parameter_offload
    from transformers.integrations import HfDeepSpeedConfig

    dist.init(device, single=True, timeout_minutes=cfg.dist_timeout_minutes)  # DeepSpeed needs a group, even for one rank
    dtype = resolve_dtype(cfg.dtype, device)   # as without ZeRO-3: a resumed extraction with zero_stage changed
                                               # (a "how" key) never mixes states computed at two precisions
    ds_config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
                 "bf16": {"enabled": dtype == torch.bfloat16}, "fp16": {"enabled": dtype == torch.float16}}
    partitioned = HfDeepSpeedConfig(ds_config)  # transformers partitions what it loads while this object lives
    engine = deepspeed.initialize(model=load_target(cfg, device, dtype), config=ds_config)[0]
    del partitioned
    model = engine.module
    try:
        yield model
    finally:
        engine.destroy()  # its hooks on every module
        # What DeepSpeed keeps for the life of the process: the module on its global stack, and the engine's ZeRO-3
        # state (its local autograd Function classes are never freed), which holds the module and every submodule.
        stack = parameter_offload.FWD_MODULE_STACK
        stack[:] = [m for m in stack if m is not model]
        vars(engine.optimizer).clear()  # the stage runner then frees the target (release_memory)


def _full_weight(param: torch.Tensor, zero_stage: int) -> torch.Tensor:
    """The whole tensor of a (possibly ZeRO-3-partitioned) parameter: a gathered copy under ZeRO-3."""
    if zero_stage != 3:
        return param
    import deepspeed

    with deepspeed.zero.GatheredParameters([param]):
        return param.detach().clone()


class ExtractMemoryError(UserError):
    """The target ran out of device memory in the extract stage (names the fix)."""


@contextmanager
def _names_the_fix_when_out_of_memory(cfg: DictConfig) -> Iterator[None]:
    """Out of device memory loading the target or in a forward pass: one line saying what to change (the shards
    written so far are complete files; a rerun continues after them)."""
    try:
        yield
    except torch.OutOfMemoryError as e:
        tokens, zero3 = cfg.extract.batch_tokens, cfg.extract.zero_stage == 3
        held = "its ZeRO-3 share of the target and the gathered lm_head" if zero3 else "the whole target"
        raise ExtractMemoryError(
            f"out of device memory in the extract stage: each rank holds {held} and passes "
            f"extract.batch_tokens={tokens} tokens at a time. Lower it, e.g. extract.batch_tokens={max(1, tokens // 2)}"
            + ("" if zero3 else ", or, where the target's weights alone nearly fill a GPU, set extract.zero_stage=3 "
               "(the weights partitioned across the ranks)")
            + "; `plan=true` prints the estimate. A rerun keeps the shards written so far.") from e


def _offsets(rows: list[int], lengths: list[int]) -> list[int]:
    """Where each of ``rows`` starts in its shard, and where the last ends."""
    return [0, *itertools.accumulate(lengths[r] for r in rows)]


def _write_shard(path: Path, pieces: dict[int, tuple[torch.Tensor, torch.Tensor]], rows: list[int],
                 lengths: list[int], metadata: dict[str, str]) -> None:
    """One shard of ``rows`` (``pieces``: row -> its states and argmax), written whole, then renamed into place."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    save_file({"hidden": torch.cat([pieces[r][0] for r in rows]).contiguous(),
               "argmax": torch.cat([pieces[r][1] for r in rows]).contiguous(),
               "row_index": torch.tensor(rows, dtype=torch.long),
               "offsets": torch.tensor(_offsets(rows, lengths))}, str(tmp), metadata=metadata)
    durable_replace(tmp, path)


@torch.inference_mode()
def run(cfg: DictConfig) -> dict:
    require(cfg, "data")
    out = stage_dir(cfg, "extract")
    device = dist.bind_device(resolve_device(cfg.device))  # before the barrier: NCCL needs this rank's GPU
    if dist.is_main():  # partial files of a killed run (safetensors itself writes through a `.tmpXXXXXX`), and of a
        #                 data stage killed while it kept states (GBs per rank, counted as used by every disk check)
        for partial in [*out.glob(".*tmp*"), *(stage_dir(cfg, "data") / "captured").glob(".part-*.tmp")]:
            partial.unlink()
    dist.barrier()
    tokenizer = load_tokenizer(cfg)
    data_manifest = check_data(cfg, tokenizer)
    tcfg = load_config(cfg)
    layers = capture_layers(cfg, tcfg)
    hidden = getattr(tcfg, "text_config", tcfg).hidden_size
    dtype = getattr(torch, cfg.extract.dtype)
    bytes_per_token = len(layers) * hidden * dtype.itemsize
    ds = load_dataset(cfg)
    lengths = {s: row_lengths(ds[s]) for s in SPLITS}
    shards = plan_shards(lengths, bytes_per_token, cfg.extract.shard_mb)
    fp = shard_fingerprint(cfg, data_manifest["target_fingerprint"], resolve_dtype(cfg.dtype, device))
    dataset_id = data_manifest["dataset_id"]
    world, rank = dist.world_size(), dist.rank()
    kept = stage_dir(cfg, "data") / "captured"
    uses_kept = dist.on_main(lambda: reads_kept(cfg))   # one decision for every rank
    if dist.is_main():  # shards of an earlier plan (another shard_mb, other rows) would never be overwritten
        for f in set(out.glob("*.safetensors")) - {out / s["file"] for s in shards}:
            f.unlink()
        if not uses_kept and kept.is_dir() and cfg.extract.get("source") == "pass":
            # set since they were kept: nothing reads them, and the disk check below counts their room as free
            log(f"[extract] deleting the hidden states kept while regenerating ({kept}): extract.source=pass")
            shutil.rmtree(kept, ignore_errors=True)
    # force: every shard again, not only the missing ones; but those its own earlier attempt wrote (the forcing
    # command repeated after a crash): they carry its nonce
    attempt = dist.on_main(lambda: (force_record(cfg) or {}).get("attempt", "")) if "extract" in cfg.force else None
    fps = {fp, fingerprint(cfg, "extract", ignore=BEFORE_LOCATION),   # (shards made before 2026-12-07, late)
           fingerprint(cfg, "extract", ignore=BEFORE_LOCATION, legacy=True)}  # (shards made before 2026-12-06)
    # Which shards are left, each judged by one rank (~60k shards at 8B x 1B tokens: rank 0 reading every header
    # alone kept the others in a collective for minutes on a network filesystem), gathered: one view on every rank
    # (ranks reading the same files could disagree on a shared filesystem, and ZeRO-3's passes must match). What is
    # left is dealt anew, so a rerun after one rank's crash uses every rank.
    left = {s["file"]: (out / s["file"]).stat().st_size if (out / s["file"]).exists() else 0
            for s in shards[rank::world] if not _complete(out / s["file"], fps, attempt)}
    left = {f: size for part in dist.all_gather_objects(left) for f, size in part.items()}
    todo = set(left)
    needed = sum(s["tokens"] for s in shards if s["file"] in todo) * (bytes_per_token + 4) - sum(left.values())
    verdict = None   # rank 0 judges the disk for all (ranks apart would see other free space; one refusing alone hangs
    if dist.is_main():   # the others in the next collective), and its error reaches every rank
        try:
            free = shutil.disk_usage(out).free
            if uses_kept:   # kept states stay on disk until copied: where the shards of every row do not fit beside
                # them (the data stage's estimate of the rows to come fell short), fewer are kept; a filesystem that
                # frees space late (ZFS, a network client's cache) is counted as freed
                free = max(shutil.disk_usage(out).free,
                           free + make_room(kept, out, int(needed * cfg.extract.disk_margin) - free))
            check_disk(out, needed, cfg.extract.disk_margin, free)
        except (ExtractError, OSError) as e:
            verdict = str(e) if isinstance(e, ExtractError) else f"{type(e).__name__}: {e}"
    if verdict := dist.broadcast(verdict):
        raise ExtractError(verdict)
    pending = [s for s in shards if s["file"] in todo]
    mine = pending[rank::world]
    ready = ReadyStates(cfg, ds, lengths, layers, data_manifest["target_fingerprint"], dataset_id, uses_kept,
                        {split: [r for s in mine if s["split"] == split for r in s["rows"]] for split in SPLITS})
    # ZeRO-3 gathers parameters collectively: every rank must run the same number of forward passes, the most any
    # rank needs, each rank counting its own (the kept states each rank found could differ on a shared filesystem
    # whose nodes cache it apart: counts made from one view would then disagree, and the ranks wait on each other).
    n_passes = sum(len(batches([row for row in s["rows"] if row not in ready.rows[s["split"]]], lengths[s["split"]],
                               cfg.extract.batch_tokens)) for s in mine)
    if cfg.extract.zero_stage == 3:
        n_passes = max(dist.all_gather_objects(n_passes))
    with ExitStack() as target:
        target.enter_context(_names_the_fix_when_out_of_memory(cfg))
        # A shard is joined, written and fsynced by one thread while the next shard's passes run (the device would
        # otherwise idle through ~256 MB of disk writes per shard); one shard at a time, its error raised here.
        writer = target.enter_context(futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-writer"))
        written: futures.Future | None = None
        if n_passes:  # every row ready: the target is not even loaded
            model = target.enter_context(_loaded_target(cfg, device))
            lm_head = _full_weight(model.get_output_embeddings().weight, cfg.extract.zero_stage)
        bar = progress(total=sum(s["tokens"] for s in mine), desc="extract", unit="tok", unit_scale=True)
        start, done_passes, forward_s = time.time(), 0, 0.0
        for shard in mine:
            split = shard["split"]
            pieces = {r: ready.get(split, r) for r in shard["rows"] if r in ready.rows[split]}
            bar.update(sum(lengths[split][r] for r in pieces))
            for batch in batches([r for r in shard["rows"] if r not in pieces], lengths[split], cfg.extract.batch_tokens):
                ids, mask = padded([ds[split][r]["input_ids"] for r in batch], tokenizer.pad_token_id)
                t0 = time.time()
                states = capture(model, ids.to(device), layers, mask.to(device))
                argmax = full_argmax(states[:, :, -1], lm_head).to("cpu", torch.int32)
                states = states.to("cpu", dtype)
                forward_s += time.time() - t0
                done_passes += 1
                for j, r in enumerate(batch):
                    pieces[r] = (states[j, : lengths[split][r]], argmax[j, : lengths[split][r]])
                bar.update(sum(lengths[split][r] for r in batch))
            if written is not None:
                written.result()
            written = writer.submit(_write_shard, out / shard["file"], pieces, shard["rows"], lengths[split],
                                    {"layers": json.dumps(layers), "split": split, "fingerprint": fp,
                                     **({"attempt": attempt} if attempt else {})})
        if written is not None:
            written.result()
        dummy = torch.full((1, 1), tokenizer.pad_token_id, dtype=torch.long, device=device)
        for _ in range(n_passes - done_passes):  # keep ZeRO-3 ranks in step
            capture(model, dummy, layers)
        bar.close()
    elapsed = time.time() - start
    peak_rss = max(dist.all_gather_objects(peak_rss_gib()))
    dist.barrier()

    total_bytes = sum(dist.all_gather_objects(sum((out / s["file"]).stat().st_size for s in shards[rank::world])))
    tokens = sum(s["tokens"] for s in shards)
    manifest = {
        "layers": layers, "dtype": cfg.extract.dtype, "hidden_size": hidden,
        "target_fingerprint": data_manifest["target_fingerprint"],
        "tokenizer_fingerprint": data_manifest["tokenizer_fingerprint"],
        "data_tokens": data_manifest["tokens"],
        "shards": [{"file": s["file"], "split": s["split"], "rows": len(s["rows"]), "tokens": s["tokens"]} for s in shards],
        "rows": {s: len(lengths[s]) for s in SPLITS}, "tokens": tokens, "bytes": total_bytes,
        "bytes_per_token": round(total_bytes / max(tokens, 1), 1), "dataset_id": dataset_id,
    }
    provenance = {"world_size": world, **ready.summary()}   # every rank's rows
    if dist.is_main():
        write_atomic(out / INDEX, json.dumps({s["file"]: [s["rows"], _offsets(s["rows"], lengths[s["split"]])]
                                              for s in shards}))
        write_atomic(out / "manifest.json", json.dumps(manifest, indent=2))
        write_atomic(out / "provenance.json", json.dumps(provenance, indent=2))
        if ready.captured is not None:  # now copied into the shards
            shutil.rmtree(ready.captured.dir, ignore_errors=True)
    rate = sum(s["tokens"] for s in mine) / max(elapsed, 1e-9)
    log(f"[extract] {tokens} tokens, {total_bytes / 2**20:.1f} MiB, {manifest['bytes_per_token']} bytes/token; "
        f"rank 0: {rate:.0f} tok/s ({forward_s / max(elapsed, 1e-9):.0%} of the time in forward), "
        f"peak RSS {peak_rss:.2f} GiB")
    return {"tokens": tokens, "bytes": total_bytes, "bytes_per_token": manifest["bytes_per_token"],
            "tokens_per_s_rank0": round(rate, 1), "peak_rss_gib": round(peak_rss, 2)}


def reads_kept(cfg: DictConfig) -> bool:
    """Whether the extract stage reads the states kept while regenerating: ``extract.source: regen`` (``auto`` with
    the hf backend), and under ``auto`` also when the backend has changed since they were kept (the data stage
    ignores it): the files say whose states they are and covers() checks each row's tokens."""
    return keeps_states(cfg) or (cfg.extract.get("source", "pass") == "auto" and (stage_dir(cfg, "data") / "captured").is_dir())


class ReadyStates:
    """Rows whose states exist already, so the forward pass skips them; each rank judges only the rows of its own
    shards (``wanted``: checking every row's kept tokens on every rank read them 8 times over at 8 ranks):

    - ``extract.source: regen`` (``auto`` with the hf backend): kept while the data stage regenerated
      (:mod:`data.captured`), for rows whose tokens they cover;
    - ``extract.reuse``: the extract shards of another run of the same target next to this one
      (``<run_dir>/../*/extract``), built from an identical dataset (same ``dataset_id``, rows and tokens) and
      dtype with a superset of the layers, e.g. the EAGLE-3 run's shards hold the final state a Medusa run needs.
    """

    def __init__(self, cfg: DictConfig, ds, lengths: dict[str, list[int]], layers: list[int], target: str,
                 dataset_id: str, uses_kept: bool, wanted: dict[str, list[int]]):
        self.ds, self.lengths = ds, lengths
        self.rows: dict[str, dict[int, str]] = {s: {} for s in SPLITS}  # split -> row -> "regeneration" | "run"
        self.captured = self.sibling = None
        if uses_kept:   # :func:`reads_kept`
            self.captured = CapturedStates(stage_dir(cfg, "data") / "captured", layers, cfg.extract.dtype, target)
            for split in SPLITS:
                keys = ds[split]["key"]
                for r in wanted[split]:
                    if keys[r] in self.captured.index and self.captured.covers(keys[r], ds[split][r]["input_ids"]):
                        self.rows[split][r] = "regeneration"
        if cfg.extract.get("reuse", True):  # rank 0's choice (a sibling finishing now: ranks could see different ones)
            found = dist.on_main(lambda: _sibling(cfg, layers, target, dataset_id, lengths))
            self.sibling = None if found is None else (Captures(found[0]), found[1])
        if self.sibling is not None:
            for split in SPLITS:
                for r in wanted[split]:
                    if r in self.sibling[0].index[split]:
                        self.rows[split].setdefault(r, "run")
        sibling = f" and {self.count('run')} in the run {self.sibling[0].dir.parent}" if self.sibling else ""
        log(f"[extract] of the {sum(map(len, wanted.values()))} rows left to this rank, {self.count('regeneration')} "
            f"have states kept while regenerating{sibling}; the others go through the forward pass")

    def count(self, origin: str) -> int:
        return sum(o == origin for rows in self.rows.values() for o in rows.values())

    def get(self, split: str, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden [length, n_layers, H], argmax [length] int32) of a ready row."""
        if self.rows[split][row] == "regeneration":
            return self.captured.get(self.ds[split][row]["key"], self.lengths[split][row])
        captures, pick = self.sibling
        hidden, argmax = captures.get(split, row)
        return hidden[:, pick], argmax

    def summary(self) -> dict:
        """Provenance entries: how many rows and tokens of the shards written now came from where, over every rank
        (a collective: every rank calls it)."""
        mine = {origin: [(s, r) for s in SPLITS for r, o in self.rows[s].items() if o == origin]
                for origin in ("regeneration", "run")}
        counts = dist.all_gather_objects({o: (len(rows), sum(self.lengths[s][r] for s, r in rows))
                                          for o, rows in mine.items()})
        out = {}
        for origin, key in (("regeneration", "from_regeneration"), ("run", "from_run")):
            rows, tokens = (sum(part[origin][i] for part in counts) for i in (0, 1))
            if rows or (origin == "regeneration" and self.captured is not None):
                out[key] = {"rows": rows, "tokens": tokens}
        if self.sibling is not None:  # found, if no row needed it (every row kept while regenerating): 0 rows
            out.setdefault("from_run", {"rows": 0, "tokens": 0})["run"] = str(self.sibling[0].dir.parent)
        return out


def _sibling(cfg: DictConfig, layers: list[int], target: str, dataset_id: str,
             lengths: dict[str, list[int]]) -> tuple[Path, list[int]] | None:
    """(the extract directory of another finished run that holds this run's states, indices of our layers in
    theirs).
    Its row counts and tokens must also match ours: a dataset edited in place keeps its old id."""
    rows, tokens = {s: len(v) for s, v in lengths.items()}, sum(map(sum, lengths.values()))
    here = Path(cfg.run_dir).resolve()
    for path in sorted(here.parent.glob(f"*/extract/{MARKER}")):
        run = path.parent.parent
        manifest = run / "extract" / "manifest.json"
        if run.resolve() == here or not manifest.exists():
            continue
        m = json.loads(manifest.read_text())
        if (m.get("dataset_id"), m["dtype"], m["target_fingerprint"]) == (dataset_id, cfg.extract.dtype, target) \
                and set(layers) <= set(m["layers"]) and (m["rows"], m["tokens"]) == (rows, tokens):
            return run / "extract", [m["layers"].index(i) for i in layers]
    return None


class Captures:
    """Read access to the extract stage's shards: per split, row -> [length, n_layers, H] tensor."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        self.manifest = json.loads((self.dir / "manifest.json").read_text())
        self.layers = self.manifest["layers"]
        self.index: dict[str, dict[int, tuple[str, int, int]]] = {s: {} for s in SPLITS}
        # where each row is, from one file (every rank opening every shard's header: ~200k shards at 8B on a
        # network filesystem, minutes before the first step); from the headers for shards of an older extract
        located = json.loads((self.dir / INDEX).read_text()) if (self.dir / INDEX).exists() else {}
        for shard in self.manifest["shards"]:
            rows, offsets = located.get(shard["file"], ([], [0]))
            if (len(rows), offsets[-1]) != (shard["rows"], shard["tokens"]):   # not the manifest's shard as planned
                with safe_open(str(self.dir / shard["file"]), framework="pt") as f:
                    rows, offsets = f.get_tensor("row_index").tolist(), f.get_tensor("offsets").tolist()
            for j, r in enumerate(rows):
                self.index[shard["split"]][r] = (shard["file"], offsets[j], offsets[j + 1])
        self.files = OpenShards(self.dir)

    def get(self, split: str, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden [length, n_layers, H], full-vocabulary target argmax [length]) of one row."""
        file, a, b = self.index[split][row]
        f = self.files(file)
        return f.get_slice("hidden")[a:b], f.get_slice("argmax")[a:b]
