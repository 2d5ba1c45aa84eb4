"""Resume that never throws work away: fingerprints that count only what changes a stage's result and
chain stages by their upstream's OUTPUT identity; training checkpoints refused (never deleted silently)
when a result-changing key differs, continued when only a budget/bookkeeping key did (a longer
train.max_minutes continues the run); eval resumes from its per-prompt records; the data stage's
regeneration survives a real SIGKILL."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import signal
import sys
import time
import types
from functools import partial
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

import train.loop
import train.stages as stages
from tests.conftest import killed_after, make_cfg
from tests.test_pipeline import BASE, cli, fresh_run
from tests.test_pipeline import prepared as prepared  # noqa: F401  (a module fixture, re-exported)
from train.errors import UserError
from train.stages import fingerprint, read_marker, run_stages, stage_dir


def fp(name: str, *overrides: str, tmp: Path) -> str:
    return fingerprint(make_cfg([*BASE, *overrides], tmp), name)


# ---------------------------------------------------------------------------------------------------
# Fingerprints


@pytest.mark.parametrize(("stage", "override", "counts"), [
    ("data", "eval.limit=3", False),
    ("data", "eval.temperatures=[0.0,1.0]", False),
    ("data", "eval.questions=q.jsonl", True),           # rows overlapping those prompts are dropped
    ("data", "data.regen.batch_size=3", False),
    ("data", "data.regen.backend=openai", False),
    ("data", "data.regen.dtype=bfloat16", False),       # the cache is keyed by target + sampling, not precision
    ("data", "~data.regen.dtype", False),               # a run made before the key: auto reproduces it
    ("data", "data.regen.max_new_tokens=7", True),
    ("data", "train.lr=1e-5", False),
    ("data", "head.draft_vocab_size=32", False),        # the train stage builds the vocabulary from counts
    ("extract", "head.draft_vocab_size=32", False),
    ("train", "head.draft_vocab_size=32", True),
    ("extract", "extract.disk_margin=2", False),
    ("extract", "extract.dtype=bfloat16", True),
    ("extract", "seed=5", False),
    ("train", "train.log_every=7", False),
    ("train", "train.num_threads=2", False),
    ("train", "train.keep_checkpoints=5", False),
    ("train", "train.checkpoint_every=9", False),
    ("train", "train.prefetch=0", False),
    ("train", "dist_timeout_minutes=5", False),
    ("train", "tracking=wandb", False),
    ("train", "planner.enforce=false", False),
    ("train", "eval.limit=3", False),
    ("train", "train.max_minutes=3", True),             # reruns the stage, but resumes its checkpoints
    ("train", "train.lr=1e-5", True),
    ("train", "head.dropout=0.1", True),
    ("train", "~head.dropout", False),                  # a run made before the key existed: 0.0 reproduces it
    ("train", "train.loss_norm=micro_batch", True),
    ("train", "~train.loss_norm", True),                # runs before the key averaged each micro-batch: not today's token
    ("data", "data.train_rows=3", True),
    ("data", "data.regen.refill=0.5", False),           # how the hf backend batches (as data.regen.batch_size)
    ("data", "data.regen.top_k=20", True),
    ("data", "~data.regen.top_k", False),               # 0 (off) reproduces the runs made before the key
    ("data", "data.num_proc=2", False),
    ("eval", "dtype=float32", True),                     # eval.dtype=auto follows it
    ("eval", "eval.min_speedup=1.5", True),              # the report's recommendation (its decodes are kept)
    ("eval", "eval.num_threads=1", False),
    ("eval", "eval.limit=3", True),
    ("eval", "eval.top_k=20", False),                    # greedy only (the default): no sampling filter applies
    ("eval", "eval.top_p=0.9", False),
    ("export", "publish.repo_id=me/heads", True),       # the model card's serve commands name the repo
    ("export", "model.hub_id=org/target", True),        # and the target
    ("export", "publish.private=true", False),
    ("publish", "publish.token=hf_secret", False),      # a rotated token uploads nothing again (nor is it in the marker)
    ("publish", "publish.repo_id=me/heads", True),
])
def test_fingerprints_count_only_what_changes_the_result(tmp_path, stage, override, counts):
    assert (fp(stage, override, tmp=tmp_path) != fp(stage, tmp=tmp_path)) is counts


def test_sampling_filters_count_where_the_eval_samples(tmp_path):
    from train.stages import flat_config

    # greedy: at their defaults (an eval marker made before the rule keeps its fingerprint)
    flat = flat_config(make_cfg([*BASE, "eval.top_p=0.9", "eval.top_k=20"], tmp_path), "eval")
    assert flat["eval.top_p"] == 1.0 and "eval.top_k" not in flat
    sampled = "eval.temperatures=[0.0,0.7]"
    assert fp("eval", sampled, "eval.top_k=20", tmp=tmp_path) != fp("eval", sampled, tmp=tmp_path)
    assert fp("eval", sampled, "eval.top_p=0.9", tmp=tmp_path) != fp("eval", sampled, tmp=tmp_path)


def test_a_shard_is_the_same_wherever_its_target_loads_from_and_another_in_another_precision(tmp_path):
    """Extract's shards are named by the target's own fingerprint, not by where it loads from: the Hub repo pinned
    to the commit the data came from, or a model.path at that snapshot, keeps them. The passes' precision counts
    resolved (dtype=auto is float32 on this CPU)."""
    import torch

    from train.extract import shard_fingerprint

    def shard(*overrides: str, dtype: torch.dtype = torch.float32) -> str:
        return shard_fingerprint(make_cfg([*BASE, "model=qwen2.5-7b", *overrides], tmp_path), "t", dtype)

    hub = shard()
    assert shard("model.revision=0123abcd") == shard(f"model.path={tmp_path / 'snapshot'}") == hub
    assert shard("dtype=float32") == hub != shard(dtype=torch.bfloat16)
    assert shard_fingerprint(make_cfg([*BASE, "model=qwen2.5-7b"], tmp_path), "other", torch.float32) != hub
    assert shard("extract.dtype=bfloat16") != hub   # what the shards store still counts


@pytest.mark.parametrize("stage", ["data", "extract"])
def test_a_hub_id_naming_a_local_target_redoes_no_pass_over_it(tmp_path, stage):
    """With model.path set the Hub id only names the target in model cards: setting it for the card (the export
    stage's note asks for it) reruns export alone, not the data and extract passes over a 7-8B target."""
    qwen, other = ["model=qwen2.5-7b"], "model.hub_id=org/target"
    local = [*qwen, f"model.path={tmp_path / 'qwen'}"]
    assert fp(stage, *local, other, tmp=tmp_path) == fp(stage, *local, tmp=tmp_path)
    assert fp("export", *local, other, tmp=tmp_path) != fp("export", *local, tmp=tmp_path)
    assert fp(stage, *qwen, other, tmp=tmp_path) != fp(stage, *qwen, tmp=tmp_path)  # the Hub id loads it
    assert fp(stage, *local, tmp=tmp_path) != fp(stage, *local[:1], f"model.path={tmp_path / 'b'}", tmp=tmp_path)


def test_a_data_run_made_before_train_rows_stays_valid(tmp_path):
    """data.train_rows=null (all rows) reproduces runs made before the key (Hydra cannot delete a null key)."""
    cfg = make_cfg(BASE, tmp_path)
    before = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "data"])
    before.data = OmegaConf.masked_copy(cfg.data, [k for k in cfg.data if k != "train_rows"])
    assert "train_rows" not in before.data and fingerprint(before, "data") == fingerprint(cfg, "data")


def test_a_train_run_made_before_the_optimizer_keys_stays_valid(tmp_path):
    """train.optimizer=adamw and train.muon_lr (added later) at their defaults leave the train stage's
    fingerprint and its checkpoints' identity as they were: an upgrade reruns nothing."""
    cfg = make_cfg(BASE, tmp_path)
    before = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "train"])
    before.train = OmegaConf.masked_copy(cfg.train, [k for k in cfg.train if k not in ("optimizer", "muon_lr")])
    assert fingerprint(before, "train") == fingerprint(cfg, "train")
    identity = train.loop.checkpoint_identity(before)
    assert train.loop.checkpoint_changes({"identity": identity}, train.loop.checkpoint_identity(cfg)) == []
    muon = make_cfg([*BASE, "train.optimizer=muon"], tmp_path)
    assert train.loop.checkpoint_changes({"identity": identity}, train.loop.checkpoint_identity(muon)) == [
        "train.optimizer"]


def test_an_identical_upstream_rerun_keeps_downstream(prepared, tmp_path, monkeypatch):
    """force=[data] rewrites the same rows: extract and train stay up to date (upstream OUTPUT identity)."""
    cfg = fresh_run(prepared, tmp_path, "stages=[data,extract,train]", "train.max_steps=2")
    run_stages(cfg)
    before = {s: read_marker(cfg, s) for s in ("data", "extract", "train")}
    ran = []
    for name in ("data", "extract", "train"):  # which stages run again
        real = importlib.import_module(stages.ENTRY[name])
        monkeypatch.setitem(sys.modules, f"spy_{name}", types.SimpleNamespace(
            run=lambda c, real=real, name=name: (ran.append(name), real.run(c))[1]))
        monkeypatch.setitem(stages.ENTRY, name, f"spy_{name}")
    run_stages(make_cfg([*BASE, f"output_root={tmp_path}", "stages=[data,extract,train]", "train.max_steps=2",
                         "force=[data]"]))
    after = {s: read_marker(cfg, s) for s in ("data", "extract", "train")}
    assert ran == ["data"]
    assert after["data"]["output_id"] == before["data"]["output_id"]
    assert after["extract"] == before["extract"] and after["train"] == before["train"]
    # Rows that do change (fewer prompts) reach the downstream fingerprints.
    other = make_cfg([*BASE, f"output_root={tmp_path}", "data.sources=[{type:builtin,limit:20}]", "stages=[data]"])
    run_stages(other)
    assert read_marker(cfg, "data")["output_id"] != before["data"]["output_id"]
    assert fingerprint(other, "extract") != before["extract"]["fingerprint"]


def test_an_online_head_follows_its_target_where_the_data_is_the_same(tmp_path):
    """Data not regenerated is the same from another target of the same tokenizer (a fine-tune; another seed of a
    twin here): train.online trains against the target itself, so its head is not up to date. The data rebuilt
    (force=[data]) came out the same, and the train stage was skipped, keeping the other target's head; now its
    checkpoints are refused, and force=[train] trains the head again."""
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"conversations": [{"from": "human", "value": f"Tell me about {t}."},
                                                           {"from": "gpt", "value": f"{t} is nice, said the {u}."}]})
                             + "\n" for t in ("tea", "rust", "rain", "maps", "cats", "jazz") for u in ("fox", "owl")))
    base = [*BASE, f"output_root={tmp_path}", f"data.sources=[{{path:'{chats}'}}]", "data.regenerate=false",
            "train.online=true", "stages=[data,train]", "train.max_steps=2"]
    cfg = make_cfg(base)
    run_stages(cfg)
    before = {s: read_marker(cfg, s) for s in ("data", "train")}
    dataset_id = json.loads((stage_dir(cfg, "data") / "manifest.json").read_text())["dataset_id"]
    other = [*base, "model.init_seed=1"]
    with pytest.raises(train.loop.CheckpointMismatchError, match="upstream data output changed"):
        run_stages(make_cfg([*other, "force=[data]"]))
    assert json.loads((stage_dir(cfg, "data") / "manifest.json").read_text())["dataset_id"] == dataset_id
    assert read_marker(cfg, "data")["output_id"] != before["data"]["output_id"]
    run_stages(make_cfg([*other, "force=[train]"]))
    assert read_marker(cfg, "train")["fingerprint"] != before["train"]["fingerprint"]


# ---------------------------------------------------------------------------------------------------
# Training checkpoints


def logged(monkeypatch) -> list[str]:
    lines: list[str] = []
    real = train.loop.log
    monkeypatch.setattr(train.loop, "log", lambda msg, *a: (lines.append(msg), real(msg, *a)))
    return lines


def train_metrics(cfg) -> list[dict]:
    lines = (stage_dir(cfg, "train") / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if "train/loss" in line]


def test_changed_result_key_refuses_and_force_starts_over(prepared, tmp_path, monkeypatch):
    cfg = fresh_run(prepared, tmp_path, "stages=[train]")
    run_stages(cfg)
    ckpt = stage_dir(cfg, "train") / "checkpoints"
    tags = sorted(p.name for p in ckpt.iterdir() if p.is_dir())
    (stage_dir(cfg, "train") / stages.MARKER).unlink()  # as after a crash at the end
    changed = make_cfg([*BASE, f"output_root={tmp_path}", "stages=[train]", "train.lr=1e-4", "head.ttt_decay=0.5"])
    with pytest.raises(UserError, match=r"head\.ttt_decay, train\.lr changed.*force=\[train\]") as err:
        run_stages(changed)
    assert isinstance(err.value, train.loop.CheckpointMismatchError)
    # the precision the run computes in (top-level dtype, not a train.* key): another DeepSpeed optimizer and shards
    other_dtype = make_cfg([*BASE, f"output_root={tmp_path}", "stages=[train]", "dtype=bfloat16"])
    with pytest.raises(train.loop.CheckpointMismatchError, match=r"dtype \(float32 in the checkpoint, bfloat16 now\)"):
        run_stages(other_dtype)
    assert sorted(p.name for p in ckpt.iterdir() if p.is_dir()) == tags  # nothing deleted
    lines = logged(monkeypatch)
    changed.force = ["train"]
    run_stages(changed)
    assert any("deleting" in line and "train.lr" in line for line in lines)
    assert [m["step"] for m in train_metrics(changed)][-6:] == list(range(1, 7))  # trained from step 0
    client = json.loads((ckpt / (ckpt / "latest").read_text().strip() / "client.json").read_text())
    assert client["identity"]["train.lr"] == 1e-4
    run_stages(changed)  # nothing changed: force=[train] still trains again from step 0 (it once resumed at the end)
    assert [m["step"] for m in train_metrics(changed)][-6:] == list(range(1, 7))
    assert sum("starting over" in line for line in lines) == 2


def test_a_forced_run_repeated_after_a_crash_resumes_what_it_started(prepared, tmp_path, monkeypatch):
    """The command that starts over with force=[train] (as the refusal of old checkpoints says) is what a user
    repeats after a crash: it resumes the run the force started instead of deleting it too; once that run has
    finished, force=[train] starts over again."""
    forced = fresh_run(prepared, tmp_path, "stages=[train]", "force=[train]")
    ckpt = stage_dir(forced, "train") / "checkpoints"
    real = train.loop.Trainer.finish
    monkeypatch.setattr(train.loop.Trainer, "finish", lambda self: (_ for _ in ()).throw(RuntimeError("crash")))
    with pytest.raises(RuntimeError, match="crash"):
        run_stages(forced)
    assert (ckpt / train.loop.FORCED).exists() and (ckpt / "latest").read_text() == "step0000006"
    monkeypatch.setattr(train.loop.Trainer, "finish", real)
    run_stages(make_cfg([*BASE, f"output_root={tmp_path}", "stages=[data]"]))   # another command between: it stays
    assert (ckpt / train.loop.FORCED).exists()
    lines = logged(monkeypatch)
    run_stages(forced)
    assert any("did not finish: resuming from step0000006" in line for line in lines), lines
    assert not any("deleting" in line for line in lines) and not (ckpt / train.loop.FORCED).exists()
    assert [m["step"] for m in train_metrics(forced)] == list(range(1, 7))   # trained once
    run_stages(forced)   # finished: force=[train] starts over
    assert any("deleting" in line for line in lines)
    assert [m["step"] for m in train_metrics(forced)][-6:] == list(range(1, 7))
    # a forced run that crashed, finished by a command without force: the next force=[train] starts over too
    monkeypatch.setattr(train.loop.Trainer, "finish", lambda self: (_ for _ in ()).throw(RuntimeError("crash")))
    with pytest.raises(RuntimeError, match="crash"):
        run_stages(forced)
    monkeypatch.setattr(train.loop.Trainer, "finish", real)
    run_stages(make_cfg([*BASE, f"output_root={tmp_path}", "stages=[train]"]))
    assert not (ckpt / train.loop.FORCED).exists()


def test_another_rank_count_resumes_with_the_same_micro_batches_per_step(tmp_path):
    """A checkpoint made on 8 ranks x accumulation 1 resumes on 4 x 2, 2 x 4 or 1 x 8 (the same rows in each step,
    the same schedule); 3 ranks cannot share its 8 micro-batches: refused, naming the rank counts that can and
    force. A checkpoint written before `per_step` was stored counts its world x train.grad_accum. (End to end, ZeRO
    shards included: tests/test_pipeline.py::test_a_run_resumes_on_another_rank_count.)"""
    client = {"world": 8, "per_step": 8}
    assert [train.loop.resume_accum(client, n, tmp_path) for n in (1, 2, 4, 8)] == [8, 4, 2, 1]
    with pytest.raises(train.loop.CheckpointMismatchError,
                       match=r"made on 8 ranks with 8 micro-batches per step, which 3 ranks cannot share equally\. "
                             r"Resume on 1, 2, 4, 8 ranks.*force=\[train\]"):
        train.loop.resume_accum(client, 3, tmp_path)
    assert train.loop.resume_accum({"world": 4, "identity": {"train.grad_accum": 3}}, 6, tmp_path) == 2


def test_muon_shards_of_another_rank_count_are_refused_and_kept(prepared, tmp_path):
    """DeepSpeed's universal conversion knows Adam's moments only: ZeRO shards of a Muon run made on another rank
    count are refused before any work, naming the rank count and force; nothing is deleted."""
    cfg = fresh_run(prepared, tmp_path, "stages=[train]", "train.zero_stage=1", "train.optimizer=muon",
                    "train.max_steps=3")
    run_stages(cfg)
    ckpt = stage_dir(cfg, "train") / "checkpoints"
    meta = ckpt / (ckpt / "latest").read_text().strip() / "client.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "world": 2, "per_step": 2}))  # as if made on 2 ranks
    (stage_dir(cfg, "train") / stages.MARKER).unlink()
    tags = sorted(p.name for p in ckpt.iterdir())
    with pytest.raises(train.loop.CheckpointMismatchError, match=r"made on 2 ranks with train.optimizer=muon.*resume "
                                                                r"on 2 ranks, or add force=\[train\]"):
        run_stages(make_cfg([*BASE, f"output_root={tmp_path}", "stages=[train]", "train.zero_stage=1",
                             "train.optimizer=muon", "train.max_steps=6"]))
    assert sorted(p.name for p in ckpt.iterdir()) == tags


def test_a_conversion_for_another_rank_count_that_cannot_run_says_why(prepared, tmp_path, monkeypatch):
    """Converting ZeRO shards of another rank count: refused before any work when the disk cannot hold its
    fragments and result (naming the GiB and the way out); stopped as hung past hang_minutes; a converter failure
    names its log, leaves the failure file the other ranks poll for, and no universal copy a rerun would load."""
    base = ["stages=[train]", "train.zero_stage=1"]
    cfg = fresh_run(prepared, tmp_path, *base, "train.max_steps=3")
    run_stages(cfg)
    ckpt = stage_dir(cfg, "train") / "checkpoints"
    tag = ckpt / (ckpt / "latest").read_text().strip()
    (tag / "client.json").write_text(json.dumps({**json.loads((tag / "client.json").read_text()), "world": 2,
                                                 "per_step": 2}))  # as if made on 2 ranks x 1
    (stage_dir(cfg, "train") / stages.MARKER).unlink()
    again = make_cfg([*BASE, f"output_root={tmp_path}", *base, "train.max_steps=6"])
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=1024))
    with pytest.raises(train.loop.CheckpointMismatchError, match=r"needs ~0\.\d GiB free beside it and 0\.0 GiB are"):
        run_stages(again)
    monkeypatch.setattr(shutil, "disk_usage", real)
    assert not list(ckpt.glob("universal-*")) and len(list(ckpt.glob("universal.failed.*"))) == 1  # the others stop
    with pytest.raises(RuntimeError, match=r"ds_to_universal .* ran past hang_minutes \(1e-05\): hung"):
        run_stages(make_cfg([*BASE, f"output_root={tmp_path}", *base, "train.max_steps=6", "hang_minutes=0.00001"]))
    assert not list(ckpt.glob("universal-*"))
    next(tag.glob("*optim_states.pt")).write_bytes(b"torn")
    with pytest.raises(RuntimeError, match=r"ds_to_universal failed .*universal\.log"):
        run_stages(again)
    assert len(list(ckpt.glob("universal.failed.*"))) == 1 and not list(ckpt.glob("universal-*"))  # no .tmp left


def test_checkpoints_made_before_loss_norm_continue_under_the_token_default(prepared, tmp_path):
    """train.loss_norm (2026-12-07) reruns the train stage but keeps its checkpoints: a run made before the key (each
    micro-batch's own mean) continues from them under the token default instead of being refused or started over
    (one micro-batch per step trains the same either way)."""
    cfg = fresh_run(prepared, tmp_path, "stages=[train]", "train.max_steps=3", "train.loss_norm=micro_batch")
    run_stages(cfg)
    ckpt = stage_dir(cfg, "train") / "checkpoints"

    def latest_state() -> dict:
        tag = ckpt / (ckpt / "latest").read_text().strip()
        return torch.load(tag / "mp_rank_00_model_states.pt", weights_only=False)["state"]

    first = latest_state()
    run_stages(make_cfg([*BASE, f"output_root={tmp_path}", "stages=[train]", "train.max_steps=5"]))
    last = latest_state()
    assert (first["step"], last["step"]) == (3, 5) and last["run"] == first["run"]   # the same run, continued


def test_latest_names_a_checkpoint_only_once_every_rank_has_written_it(prepared, tmp_path, monkeypatch):
    """A crash while a checkpoint is being written (another rank still writing its optimizer shard) leaves
    `latest` on the previous, complete one: the run resumes from it. Its save at the torn one's step starts from an
    empty folder: a shard the torn save left (of 8 ranks, say, resumed on 1) would mix with its own."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    real, calls = DeepSpeedEngine.save_checkpoint, []

    def crash_after_the_second(self, save_dir, tag=None, **kwargs):
        calls.append(tag)
        real(self, save_dir, tag=tag, **kwargs)
        if len(calls) == 2:
            raise KeyboardInterrupt("killed before the other ranks finished writing")

    monkeypatch.setattr(DeepSpeedEngine, "save_checkpoint", crash_after_the_second)
    cfg = fresh_run(prepared, tmp_path, "stages=[train]")
    with pytest.raises(KeyboardInterrupt):
        run_stages(cfg)
    ckpt = stage_dir(cfg, "train") / "checkpoints"
    assert calls == ["step0000003", "step0000006"]
    assert (ckpt / "latest").read_text().strip() == "step0000003"
    stray = ckpt / "step0000006" / "bf16_zero_pp_rank_7_mp_rank_00_optim_states.pt"
    stray.write_bytes(b"rank 7 of the torn save")
    monkeypatch.setattr(DeepSpeedEngine, "save_checkpoint", real)
    lines = logged(monkeypatch)
    run_stages(cfg)
    assert any("resumed from step0000003" in line for line in lines)
    assert not stray.exists()


def test_bookkeeping_keys_skip_or_resume(prepared, tmp_path, monkeypatch):
    cfg = fresh_run(prepared, tmp_path, "stages=[train]")
    run_stages(cfg)
    marker = read_marker(cfg, "train")
    head = load_file(str(stage_dir(cfg, "train") / "head/model.safetensors"))
    # Pure bookkeeping: the stage stays up to date.
    run_stages(make_cfg([*BASE, f"output_root={tmp_path}", "stages=[train]", "train.log_every=5",
                         "train.keep_checkpoints=3", "train.num_threads=2", "dist_timeout_minutes=9"]))
    assert read_marker(cfg, "train") == marker
    # A validation setting: the stage reruns, resumes its last checkpoint, trains nothing again, and leaves that
    # checkpoint as it was (rewritten in place, a crash mid-save would tear the one `latest` names).
    saved = {f: f.stat().st_mtime_ns for f in (stage_dir(cfg, "train") / "checkpoints").rglob("*") if f.is_file()}
    lines = logged(monkeypatch)
    run_stages(make_cfg([*BASE, f"output_root={tmp_path}", "stages=[train]", "train.eval_every=2"]))
    assert any("resuming with changed train.eval_every" in line for line in lines)
    assert any("resumed from step0000006" in line for line in lines)
    assert {f: f.stat().st_mtime_ns for f in saved} == saved
    assert [m["step"] for m in train_metrics(cfg)] == list(range(1, 7))
    torch.testing.assert_close(load_file(str(stage_dir(cfg, "train") / "head/model.safetensors")), head)


def test_changed_validation_settings_score_from_scratch(prepared, tmp_path, monkeypatch):
    """train.val_steps changed on resume: sim tau sums val_steps terms, so the old best is on another scale. Fewer
    steps used to never "improve" on it: head/ stayed the first run's and early stopping counted every validation."""
    base = ["stages=[train]", "train.eval_every=2", "train.checkpoint_every=2", "train.val_steps=3"]
    cfg = fresh_run(prepared, tmp_path, *base, "train.max_steps=4")
    run_stages(cfg)
    first = json.loads((stage_dir(cfg, "train") / "summary.json").read_text())["best"]
    lines = logged(monkeypatch)
    run_stages(make_cfg([*BASE, f"output_root={tmp_path}", *base, "train.max_steps=6", "train.val_steps=1"]))
    best = json.loads((stage_dir(cfg, "train") / "summary.json").read_text())["best"]
    assert any("the best score starts over" in line for line in lines)
    assert best["step"] == 6 and best["sim_tau"] < first["sim_tau"]  # scored with 1 draft step, saved at step 6
    assert "acc_1" not in best
    # a finished run (nothing left to train) is scored again at its end: head/ was left with the old scale's figures
    run_stages(make_cfg([*BASE, f"output_root={tmp_path}", *base, "train.max_steps=6", "train.val_steps=2"]))
    best = json.loads((stage_dir(cfg, "train") / "summary.json").read_text())["best"]
    assert best["step"] == 6 and "acc_1" in best


def test_a_save_cut_short_by_a_crash_never_outranks_the_checkpoint_latest_names(prepared, tmp_path):
    """A crash inside the save of step 8 left a partial step0000008 while `latest` named step 4; the resumed run
    stops at step 6: its rotation (keep 1) must keep step 6, which `latest` names, not the partial 8 (a third run
    then found no checkpoint and started over, deleting the first two runs' work)."""
    base = ["stages=[train]", "train.checkpoint_every=2", "train.keep_checkpoints=1"]
    cfg = fresh_run(prepared, tmp_path, *base, "train.max_steps=4")
    run_stages(cfg)
    ckpt = stage_dir(cfg, "train") / "checkpoints"
    (ckpt / "step0000008").mkdir()
    run_stages(make_cfg([*BASE, f"output_root={tmp_path}", *base, "train.max_steps=6"]))
    assert (ckpt / "latest").read_text() == "step0000006" and (ckpt / "step0000006" / "client.json").exists()
    assert sorted(p.name for p in ckpt.iterdir() if p.is_dir()) == ["step0000006"]


@pytest.mark.parametrize("damage", ["deleted", "torn"])
def test_a_checkpoint_deleted_by_hand_resumes_from_the_one_before(prepared, tmp_path, monkeypatch, damage):
    """`latest` names a tag that is gone, or whose client.json a node crash left empty (saved before checkpoints
    were fsynced): the run resumes from the newest checkpoint before it (complete: `latest` named it before), not
    from scratch deleting every checkpoint, nor failing on every rerun."""
    base = ["stages=[train]", "train.checkpoint_every=2", "train.keep_checkpoints=3", "train.max_steps=6"]
    cfg = fresh_run(prepared, tmp_path, *base)
    run_stages(cfg)
    ckpt = stage_dir(cfg, "train") / "checkpoints"
    if damage == "deleted":
        shutil.rmtree(ckpt / "step0000006")
    else:
        (ckpt / "step0000006" / "client.json").write_bytes(b"")
    lines = logged(monkeypatch)
    run_stages(make_cfg([*BASE, f"output_root={tmp_path}", *base, "train.eval_every=100"]))
    assert any("resuming from step0000004" in line for line in lines), lines
    assert not any("starting fresh" in line for line in lines)
    assert sorted(p.name for p in ckpt.iterdir() if p.is_dir()) == ["step0000002", "step0000004", "step0000006"]


@pytest.fixture
def synced(monkeypatch) -> list[str]:
    """The paths fsynced from here on, in order."""
    paths, real = [], os.fsync

    def recording(fd: int) -> None:
        paths.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", recording)
    return paths


def test_the_data_stages_outputs_are_on_disk_before_its_marker(tmp_path, synced):
    """Arrow, safetensors and the reports are written without fsync: after a node's crash a marker (fsynced) could
    name a dataset of empty files, and the next run skip the stage and train on it (eval and export: the same path)."""
    cfg = make_cfg([*BASE, f"output_root={tmp_path}", "stages=[data]"])
    run_stages(cfg)
    out = stage_dir(cfg, "data")
    marker = next(i for i, p in enumerate(synced) if Path(p).parent == out and Path(p).name.startswith("_complete.json"))
    outputs = {str(p) for p in (out / "dataset").rglob("*") if p.is_file()} | {str(out / "stats.json")}
    assert outputs and outputs <= set(synced[:marker]), outputs - set(synced[:marker])


def test_checkpoints_and_the_best_head_are_on_disk_before_anything_names_them(prepared, tmp_path, synced):
    """DeepSpeed and safetensors write without fsync: after a node crash `latest` (fsynced) could name a checkpoint
    of empty files, and the renamed head be torn. Every file of each is fsynced before `latest` names it, or before
    the head's folder is renamed into place."""
    cfg = fresh_run(prepared, tmp_path, "stages=[train]", "train.checkpoint_every=2", "train.max_steps=4",
                    "train.eval_every=2")
    run_stages(cfg)
    out = stage_dir(cfg, "train")
    latest = [i for i, p in enumerate(synced) if Path(p).name.startswith("latest.")]
    for tag, named in zip(("step0000002", "step0000004"), latest, strict=True):
        files = {str(p) for p in (out / "checkpoints" / tag).rglob("*") if p.is_file()}
        assert len(files) >= 2 and files <= set(synced[:named]), files - set(synced[:named])
    head = {f"{out}/head.tmp/{p.name}" for p in (out / "head").iterdir()}
    assert {"model.safetensors", "metrics.json", "head_config.json"} <= {Path(p).name for p in head}
    assert head <= set(synced)


def test_a_forgotten_data_override_is_refused_before_it_overwrites_what_the_checkpoints_were_made_on(prepared,
                                                                                                    tmp_path):
    """A resume without an override the data (or extract) stage was made with would rerun it, overwrite its output
    and only then find the training checkpoints refused: refused before any stage, naming the key; force=[train]
    (start over) or force=[data] (rebuild it anyway) go on."""
    cfg = fresh_run(prepared, tmp_path, "stages=[train]", "train.max_steps=3")
    run_stages(cfg)
    data_marker = read_marker(cfg, "data")
    forgot = [*BASE, f"output_root={tmp_path}", "data.max_length=512"]   # stages: all
    with pytest.raises(UserError, match=r"the data stage would run again for data.max_length=2048 \(this command: "
                                        r"512\).*checkpoints.*step0000003.*force=\[train\]"):
        run_stages(make_cfg(forgot))
    assert read_marker(cfg, "data") == data_marker      # nothing ran
    assert stages.orphaned_checkpoints(make_cfg([*BASE, f"output_root={tmp_path}", "extract.dtype=bfloat16"]))
    for ok in ("force=[train]", "force=[data]", "stages=[train]"):   # (train alone: its data stays as it is)
        assert stages.orphaned_checkpoints(make_cfg([*forgot, ok])) is None, ok
    # extract reruns for how it computes (extract.batch_tokens) but finds its shards done: nothing at stake
    assert stages.orphaned_checkpoints(make_cfg([*BASE, f"output_root={tmp_path}", "extract.batch_tokens=999"])) is None
    # the target pinned to the commit its data came from (extract asks for it): data is refused (naming force=[data],
    # which regenerates nothing), extract then reruns finding its shards done, not refused naming force=[extract]
    pinned = [*BASE, f"output_root={tmp_path}", "model.revision=0123abcd"]
    assert "the data stage would run again for model.revision" in stages.orphaned_checkpoints(make_cfg(pinned))
    assert stages.orphaned_checkpoints(make_cfg([*pinned, "force=[data]"])) is None
    # the data rebuilt since without a key changed (`stages=[data] force=[data]` on an edited file): its output is not
    # what the checkpoints were made on; refused before extract reruns for hours, naming force=[train]
    marker = read_marker(cfg, "data")
    stages._save_marker(cfg, "data", {**marker, "output_id": "rebuilt"})
    assert "the data stage's output changed since the training checkpoints" in stages.orphaned_checkpoints(
        make_cfg([*BASE, f"output_root={tmp_path}"]))
    assert stages.orphaned_checkpoints(make_cfg([*BASE, f"output_root={tmp_path}", "force=[train]"])) is None
    # (forced, data may come out as the checkpoints' again: train compares once it has)
    assert stages.orphaned_checkpoints(make_cfg([*BASE, f"output_root={tmp_path}", "force=[data]"])) is None
    stages._save_marker(cfg, "data", marker)
    assert stages.orphaned_checkpoints(make_cfg([*BASE, f"output_root={tmp_path}"])) is None   # the same command


def test_markers_made_before_the_fingerprint_rules_of_2026_12_06_stay_current(tmp_path, monkeypatch):
    """A run made with model.path and model.hub_id before the Hub id stopped counting there has data and extract
    markers of the old fingerprint: they are taken as current (rewritten with today's, their output ids kept), and
    nothing reruns."""
    from train.target import target_path

    local = [*BASE, "model.source=hf", f"model.path={target_path(make_cfg(BASE))}", "model.hub_id=org/tiny",
             f"output_root={tmp_path}", "stages=[data,extract,train]", "train.max_steps=3"]
    cfg = make_cfg(local)
    run_stages(cfg)
    old = {}
    for name in ("data", "extract"):
        old[name] = {**read_marker(cfg, name), "fingerprint": stages.fingerprint(cfg, name, legacy=True)}
        assert old[name]["fingerprint"] != stages.fingerprint(cfg, name)
        (stage_dir(cfg, name) / stages.MARKER).write_text(json.dumps(old[name]))     # as the version before wrote it
    lines = []
    monkeypatch.setattr(stages, "log", lambda msg, *a: lines.append(msg))
    run_stages(cfg)
    assert all(any(f"[{name}] up to date" in line for line in lines) for name in ("data", "extract", "train")), lines
    for name in ("data", "extract"):
        marker = read_marker(cfg, name)
        assert marker["fingerprint"] == stages.fingerprint(cfg, name) and marker["output_id"] == old[name]["output_id"]


def test_a_publish_marker_made_while_the_token_counted_stays_current_without_it(tmp_path):
    """publish.token counted in the publish fingerprint and was kept in its marker's config (a secret on disk): a
    marker of then is current (nothing uploaded again) and rewritten without the token."""
    cfg = make_cfg([*BASE, f"output_root={tmp_path}", "publish.token=hf_secret"])
    old = {"stage": "publish", "fingerprint": stages.fingerprint(cfg, "publish", legacy=True), "output_id": "x",
           "config": {**stages.flat_config(cfg, "publish"), "publish.token": "hf_secret"}}
    assert old["fingerprint"] != stages.fingerprint(cfg, "publish")
    stage_dir(cfg, "publish").mkdir(parents=True)
    (stage_dir(cfg, "publish") / stages.MARKER).write_text(json.dumps(old))
    stages.migrate_markers(cfg)
    marker = read_marker(cfg, "publish")
    assert marker["fingerprint"] == stages.fingerprint(cfg, "publish") and "hf_secret" not in json.dumps(marker)


def test_a_second_run_in_the_same_run_directory_stops_at_once(tmp_path):
    """Two runs in one run directory would rewrite each other's markers and rotate each other's checkpoints: the
    second stops before any stage, naming the holder and the fix."""
    from train.stages import run_dir_lock

    cfg = make_cfg([*BASE, f"output_root={tmp_path}"])
    with run_dir_lock(cfg):
        with pytest.raises(UserError, match=rf"another run is using .* \(pid {os.getpid()} on .*run_dir="):
            with run_dir_lock(cfg):
                pass
    with run_dir_lock(cfg):   # released with its holder
        pass


def test_a_best_head_saved_after_the_last_checkpoint_stays_the_best(prepared, tmp_path, monkeypatch):
    """A crash after head/ took a new best (step 4) and before the next checkpoint: the resumed run restored the
    checkpoint's best score (step 2's), so any later validation above that replaced the better head; and the
    validation replayed at step 4 counted towards early stopping (patience 1: the run stopped there). The head is
    recognised by the run's id, not by file times: one copied with older times is still taken over; another run's
    (a forced rerun's predecessor's) or one saved before run ids is not."""
    base = ["stages=[train]", "train.eval_every=2", "train.checkpoint_every=2", "train.keep_checkpoints=5",
            "train.patience=1"]
    cfg = fresh_run(prepared, tmp_path, *base, "train.max_steps=4")
    run_stages(cfg)
    out = stage_dir(cfg, "train")

    def crashed_after_step_2_with(head_step: int, sim_tau: float, run: str | None = "same") -> None:
        for tag in (p for p in (out / "checkpoints").iterdir() if p.name > "step0000002" and p.is_dir()):
            shutil.rmtree(tag)
        (out / "checkpoints" / "latest").write_text("step0000002")
        (out / stages.MARKER).unlink()
        saved = out / "head" / "metrics.json"
        metrics = {**json.loads(saved.read_text()), "step": head_step, "sim_tau": sim_tau}
        if run != "same":
            metrics.pop("run")
            metrics.update({"run": run} if run else {})
        saved.write_text(json.dumps(metrics))
        when = (out / "checkpoints" / "step0000002" / "client.json").stat().st_mtime - 60
        os.utime(saved, (when, when))  # older than the checkpoint, as in a copy that did not keep the times

    lines = logged(monkeypatch)
    again = [*BASE, f"output_root={tmp_path}", *base, "train.max_steps=6"]
    crashed_after_step_2_with(4, 9.0)
    run_stages(make_cfg(again))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["best"]["sim_tau"] == 9.0 and summary["steps"] == 6
    assert sum("holds a better head saved at step 4" in line for line in lines) == 1
    for other in ("0" * 32, None):
        crashed_after_step_2_with(6, 9.0, run=other)
        run_stages(make_cfg(again))
        assert json.loads((out / "summary.json").read_text())["best"]["sim_tau"] < 9.0  # this run's, at the end at the latest
    assert sum("holds a better head" in line for line in lines) == 1  # not the other run's, nor the id-less one


def test_a_best_head_of_the_last_validation_after_its_steps_checkpoint_stays_the_best(prepared, tmp_path,
                                                                                        monkeypatch):
    """The run's last validation runs after the checkpoint of its step (step 3 here: checkpoint_every=3, validations
    every 2 steps), and the last checkpoint leaves that one as it is: the checkpoint holds step 2's best. A longer
    budget resumes from it; the head saved at the checkpoint's own step keeps its score (it used to be taken for one
    of an earlier run, and any later validation above step 2's replaced it)."""
    base = ["stages=[train]", "train.eval_every=2", "train.checkpoint_every=3", "train.keep_checkpoints=5"]
    cfg = fresh_run(prepared, tmp_path, *base, "train.max_steps=3")
    run_stages(cfg)
    out = stage_dir(cfg, "train")
    assert (out / "checkpoints" / "latest").read_text() == "step0000003"
    assert [h["step"] for h in json.loads((out / "summary.json").read_text())["history"]] == [2, 3]
    saved = out / "head" / "metrics.json"
    saved.write_text(json.dumps({**json.loads(saved.read_text()), "step": 3, "sim_tau": 9.0}))
    lines = logged(monkeypatch)
    run_stages(make_cfg([*BASE, f"output_root={tmp_path}", *base, "train.max_steps=5"]))
    assert sum("holds a better head saved at step 3" in line for line in lines) == 1, lines
    summary = json.loads((out / "summary.json").read_text())
    assert summary["best"]["sim_tau"] == 9.0 and summary["steps"] == 5


def test_a_rank_restores_its_own_gpus_generator_whatever_the_devices_visible(monkeypatch):
    """The CUDA generator is saved per rank for its own GPU; a checkpoint made before (every visible GPU's state)
    restores this rank's one, and one made with fewer GPUs visible than this rank's index restores none instead
    of raising IndexError."""
    set_to = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda: torch.tensor([7]))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda t: set_to.append(int(t[0])))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    state = train.loop.rng_state()
    train.loop.set_rng_state(state)
    train.loop.set_rng_state(state | {"cuda": [torch.tensor([0]), torch.tensor([1])]})
    train.loop.set_rng_state(state | {"cuda": [torch.tensor([0])]})
    assert set_to == [7, 1]


def test_a_longer_time_budget_continues_the_run(prepared, tmp_path, monkeypatch):
    """train.max_minutes extended: resumed from the last checkpoint, the schedule refitted from the current
    step (the learning rate continues its decay, no jump), training goes on instead of starting over."""
    budget = ["stages=[train]", "train.max_steps=100000", "train.checkpoint_every=100000", "train.warmup_steps=2"]
    cfg = fresh_run(prepared, tmp_path, *budget, "train.max_minutes=0.04")
    run_stages(cfg)
    first_summary = json.loads((stage_dir(cfg, "train") / "summary.json").read_text())
    first, first_wall = first_summary["steps"], first_summary["wall_s"]
    assert 2 < first < 100000
    lr_before = [m["lr"] for m in train_metrics(cfg)]
    lines = logged(monkeypatch)
    run_stages(make_cfg([*BASE, f"output_root={tmp_path}", *budget, "train.max_minutes=0.08"]))
    summary = json.loads((stage_dir(cfg, "train") / "summary.json").read_text())
    assert any(f"resumed from step{first:07d}" in line for line in lines)
    assert summary["steps"] > first
    metrics = train_metrics(cfg)
    assert [m["step"] for m in metrics] == list(range(1, summary["steps"] + 1))  # continued, not restarted
    assert metrics[first]["lr"] <= lr_before[-1] * 1.0001  # no jump up
    assert metrics[-1]["lr"] < metrics[first]["lr"] or metrics[first]["lr"] == pytest.approx(
        metrics[-1]["lr"])
    assert summary["wall_s"] >= first_wall  # the budget counts both runs (rounded to 0.1 s: a short second run ties)


def test_budget_is_for_the_whole_run():
    """fit_schedule: earlier runs' time is in elapsed_s; a refit continues the cosine from the ratio reached;
    a slower measured step shrinks the plan, a faster one extends it up to the planned steps."""
    from omegaconf import OmegaConf

    tcfg = OmegaConf.create({"max_minutes": 1})
    state = {"step": 10, "total_steps": 1000}
    assert train.loop.fit_schedule(state, tcfg, step_s=1.0, elapsed_s=27.0, planned_steps=1000, lr_ratio=1.0)
    assert state["total_steps"] == 10 + 30 and state["fitted"] and state["segment"] == [10, 1.0]
    ratio = train.loop.lr_lambda(20, 2, 40, 0.1, state["segment"])
    assert 0.1 < ratio < 1.0
    state["step"] = 20  # steps ran slower than measured: 2 s each
    assert train.loop.fit_schedule(state, tcfg, step_s=2.0, elapsed_s=37.0, planned_steps=1000, lr_ratio=ratio)
    assert state["total_steps"] == 20 + 10 and state["segment"] == [20, ratio]
    assert train.loop.lr_lambda(20, 2, 30, 0.1, state["segment"]) == pytest.approx(ratio)  # no jump
    assert train.loop.lr_lambda(30, 2, 30, 0.1, state["segment"]) == pytest.approx(0.1)  # ends at the new total
    assert not train.loop.fit_schedule(state, tcfg, step_s=2.0, elapsed_s=36.9, planned_steps=1000, lr_ratio=ratio)
    assert train.loop.fit_schedule(state, tcfg, step_s=0.01, elapsed_s=37.0, planned_steps=100, lr_ratio=ratio)
    assert state["total_steps"] == 100  # faster: extended, never beyond the planned steps
    state["step"] = 100  # the last planned step: no step added (a bug once extended the run a step at a time)
    assert not train.loop.fit_schedule(state, tcfg, step_s=0.01, elapsed_s=37.0, planned_steps=100, lr_ratio=0.1)
    resumed = state | {"step": 34, "total_steps": 40, "segment": [20, ratio]}
    reached = train.loop.lr_lambda(34, 2, 40, 0.1, [20, ratio])
    assert train.loop.replan(resumed, 100, 2, 0.1, reached) == pytest.approx(reached)   # the budget grew: no jump
    assert resumed["segment"] == [34, reached] and resumed["total_steps"] == 100 and not resumed["fitted"]
    assert train.loop.lr_lambda(100, 2, 100, 0.1, resumed["segment"]) == pytest.approx(0.1)


def test_a_short_run_extended_warms_up_instead_of_training_at_its_annealed_rate():
    """A 50-step smoke run (annealed to min_lr_ratio by step 50) in the run directory the real run then reuses (1000
    steps, warmup 100): the real run warms up from step 50 to the full rate, then anneals; it used to continue from
    the smoke run's ratio down to 0.1, never at the full rate. A run above the new ramp (an 80-step run at step 20,
    0.94, extended) continues its cosine from there rather than dropping to the ramp."""
    smoke = {"step": 50, "total_steps": 50}
    assert train.loop.replan(smoke, 1000, 100, 0.1, reached=0.1) == pytest.approx(51 / 100)
    ratios = [train.loop.lr_lambda(s, 100, smoke["total_steps"], 0.1, smoke["segment"]) for s in range(50, 1000)]
    assert max(ratios) == pytest.approx(1.0) and ratios[-1] == pytest.approx(0.1, abs=1e-3)
    early = {"step": 20, "total_steps": 80}
    assert train.loop.replan(early, 1000, 100, 0.1, reached=0.94) == pytest.approx(0.94)
    assert early["segment"] == [20, 0.94]


def test_a_resumed_run_continues_at_the_rate_its_scheduler_reached(prepared, tmp_path):
    """The ratio a budget change continues from is the restored scheduler's, whatever warmup the first run had (the
    warmup depends on the planned steps: recomputed from the new plan, it made an annealed run look mid-warmup, at
    11/12, and the real run then annealed from there, never at the full rate)."""
    base = ["stages=[train]", "train.checkpoint_every=10", "train.warmup_steps=20"]
    cfg = fresh_run(prepared, tmp_path, *base, "train.max_steps=10")   # warmup 1 (a tenth of 10): annealed at 10
    run_stages(cfg)
    first = [m["lr"] for m in train_metrics(cfg)]
    run_stages(make_cfg([*BASE, f"output_root={tmp_path}", *base, "train.max_steps=120"]))   # warmup 12
    lr = [m["lr"] for m in train_metrics(cfg)]
    assert lr[:10] == pytest.approx(first) and first[-1] == pytest.approx(0.1 * first[0])  # annealed at step 10
    assert lr[10] == max(lr) == pytest.approx(first[0])   # warmed up again to the full rate (logged: the next step's)


# ---------------------------------------------------------------------------------------------------
# Eval records


def fake_train(cfg) -> dict:
    from eval.bench import random_head
    from heads.io import save_head
    from train.target import load_target

    head = random_head(cfg.head.type, load_target(cfg), cfg.head, torch.arange(200))
    save_head(head, stages.stage_dir(cfg, "train") / "head")
    return {}


def test_eval_resumes_from_its_records(tmp_path, monkeypatch, request):
    import eval.shared
    import eval.stage

    request.addfinalizer(partial(torch.set_num_threads, torch.get_num_threads()))   # (the later tests' threads)
    torch.set_num_threads(1)
    monkeypatch.setitem(sys.modules, "fake_train", types.SimpleNamespace(run=fake_train))
    monkeypatch.setitem(stages.ENTRY, "train", "fake_train")
    overrides = ["model=tiny-llama", "stages=[train,eval]", "eval.datasets=[builtin]", "eval.limit=4",
                 "eval.warmup=0", "eval.max_new_tokens=8", "eval.tree.sizes=[1,2,4]", "eval.tree.context=32",
                 "eval.tree.calibration_prompts=1", "eval.methods=[eagle3-tree]", "eval.temperatures=[0.0,1.0]",
                 "eval.share_baselines=false"]  # what is tested: this run's own records.jsonl
    cfg = make_cfg(overrides, tmp_path)
    calls = []
    real_converse, real_size = eval.stage.converse, eval.stage.size_tree
    monkeypatch.setattr(eval.stage, "converse", lambda *a, **k: (calls.append(a[3].id), real_converse(*a, **k))[1])
    sized = []
    monkeypatch.setattr(eval.stage, "size_tree", lambda *a: (sized.append(1), real_size(*a))[1])
    run_stages(cfg)
    out = stage_dir(cfg, "eval")
    straight = json.loads((out / "report.json").read_text())
    records = (out / "records.jsonl").read_text().splitlines()
    assert len(records) == 4 * 2 * 2 and len(sized) == 1

    # A crash after 5 prompt records (2 prompts and a half) plus a torn line; the marker and report gone.
    (out / "records.jsonl").write_text("\n".join(records[:5]) + "\n" + records[5][:30])
    for name in (stages.MARKER, "report.json"):
        (out / name).unlink()
    calls.clear()
    run_stages(cfg)
    # 8 prompt x temperature pairs, 2 complete kept: 6 decoded again, 2 methods each; the tree sizing reused.
    assert len(calls) == 6 * 2 and len(sized) == 1
    resumed = json.loads((out / "report.json").read_text())
    assert resumed["tree"] == json.loads(json.dumps(straight["tree"]))
    assert [(r["dataset"], r["category"], r["method"], r["temperature"], r["n_prompts"]) for r in resumed["results"]] \
        == [(r["dataset"], r["category"], r["method"], r["temperature"], r["n_prompts"]) for r in straight["results"]]
    again = (out / "records.jsonl").read_text().splitlines()
    assert again[:4] == records[:4] and len(again) == 16
    keys = [(json.loads(r)["id"], json.loads(r)["method"], json.loads(r)["temperature"]) for r in again]
    assert len(set(keys)) == 16

    # eval.min_speedup changes the recommendation only: the stage reruns, every decode kept.
    calls.clear()
    run_stages(make_cfg([*overrides, "eval.min_speedup=1.5"], tmp_path))
    assert calls == [] and len(sized) == 1

    # Crashed again, then resumed by another decoder version: its timings are not mixed with the kept ones.
    (out / "records.jsonl").write_text("\n".join(records[:5]) + "\n")
    for name in (stages.MARKER, "report.json"):
        (out / name).unlink()
    calls.clear()
    monkeypatch.setattr(eval.shared, "DECODER_VERSION", eval.shared.DECODER_VERSION + 1)
    run_stages(cfg)
    assert len(calls) >= 8 * 2 and len(sized) == 2  # (+ the tree sizing's calibration decodes)
    assert len((out / "records.jsonl").read_text().splitlines()) == 16

    # force=[eval] starts over; repeated after a crash in it, it keeps what its first attempt decoded and sized.
    forced = make_cfg([*overrides, "force=[eval]"], tmp_path)
    calls.clear()
    run_stages(forced)
    assert len(calls) >= 8 * 2 and len(sized) == 3
    calls.clear()

    def crash_at_the_fifth(*a, **k):
        if len(calls) == 4:
            raise RuntimeError("crash")
        calls.append(a[3].id)
        return real_converse(*a, **k)

    monkeypatch.setattr(eval.stage, "converse", crash_at_the_fifth)
    with pytest.raises(RuntimeError, match="crash"):
        run_stages(forced)
    kept = (out / "records.jsonl").read_text().splitlines()   # the prompts decoded whole before the crash
    monkeypatch.setattr(eval.stage, "converse", lambda *a, **k: (calls.append(a[3].id), real_converse(*a, **k))[1])
    calls.clear()
    run_stages(forced)
    again = (out / "records.jsonl").read_text().splitlines()
    assert kept and again[:len(kept)] == kept and len(again) == 16 and len(sized) == 4   # kept as decoded, not redone
    assert len(calls) <= 8 * 2 - len(kept) // 2


EVAL = ["eval.datasets=[builtin]", "eval.limit=4", "eval.warmup=0", "eval.max_new_tokens=24",
        "eval.tree.total_tokens=4", "eval.methods=[eagle3-tree]", "train.max_steps=2"]


def test_eval_killed_for_real_resumes(prepared, tmp_path, monkeypatch):
    """SIGKILL once the first prompt's records are on disk; the rerun decodes only the missing prompts."""
    import eval.stage

    cfg = fresh_run(prepared, tmp_path, "stages=[train]", *EVAL)
    run_stages(cfg)
    records = stage_dir(cfg, "eval") / "records.jsonl"
    proc = cli(["stages=[eval]", *EVAL], tmp_path, killed_after("eval.stage:Records.add"))
    output = proc.output(300)
    assert proc.returncode == -signal.SIGKILL, output[-3000:]
    kept = records.read_text().count("\n") // 2  # prompts whose 2 records were written
    assert kept == 1 and read_marker(cfg, "eval") is None
    calls = []
    real = eval.stage.converse
    monkeypatch.setattr(eval.stage, "converse", lambda *a, **k: (calls.append(a[3].id), real(*a, **k))[1])
    run_stages(make_cfg([*BASE, f"output_root={tmp_path}", "stages=[eval]", *EVAL]))
    assert len(calls) == (4 - kept) * 2
    lines = [json.loads(line) for line in records.read_text().splitlines()]
    assert len({(r["id"], r["method"]) for r in lines}) == len(lines) == 8
    report = json.loads((stage_dir(cfg, "eval") / "report.json").read_text())
    assert {r["method"] for r in report["results"]} == {"plain", "eagle3-tree"}


# ---------------------------------------------------------------------------------------------------
# Data regeneration killed for real


REGEN = ["data.sources=[{type:builtin,limit:48}]", "data.regen.max_new_tokens=32", "data.regen.batch_size=4",
         "stages=[data]"]


def test_data_regeneration_survives_sigkill(tmp_path):
    from data.regenerate import read_cache

    ref = make_cfg([*BASE, *REGEN], tmp_path / "ref")
    run_stages(ref)
    cache = Path(json.loads((stage_dir(ref, "data") / "stats.json").read_text())["regeneration"]["file"])
    reference = read_cache(cache)

    cfg = make_cfg([*BASE, *REGEN], tmp_path / "b")
    target = Path(str(cache).replace(str(tmp_path / "ref"), str(tmp_path / "b")))
    proc = cli(REGEN, tmp_path / "b", killed_after("data.regenerate:_flush", 2))  # 2 batches' answers written
    output = proc.output(300)
    assert proc.returncode == -signal.SIGKILL, output[-3000:]
    at_kill = read_cache(target)
    complete = sum(r["complete"] for r in at_kill.values())
    assert 0 < complete < len(reference) and read_marker(cfg, "data") is None

    run_stages(cfg)
    stats = json.loads((stage_dir(cfg, "data") / "stats.json").read_text())["regeneration"]
    assert stats["cached"] == complete and stats["generated"] == len(reference) - complete
    finished = [json.loads(line)["key"] for line in target.read_text().splitlines() if json.loads(line)["complete"]]
    assert len(finished) == len(set(finished)) == len(reference)  # no conversation finished twice
    assert read_cache(target) == reference
    assert read_marker(cfg, "data")["output_id"] == read_marker(ref, "data")["output_id"]


def test_warmup_never_outlasts_a_short_run():
    """A run of few planned steps (the built-in prompts on 8 GPUs: ~2 steps per epoch, 20 in all, against
    train=full's 200 warmup steps) warms up over a tenth of them and reaches the full rate, then anneals; a
    long run keeps the configured warmup."""
    assert train.loop.warmup_steps(200, 100000) == 200
    warmup = train.loop.warmup_steps(200, 20)
    assert warmup == 2
    ratios = [train.loop.lr_lambda(s, warmup, 20, 0.1) for s in range(20)]
    assert max(ratios) == pytest.approx(1.0) and ratios[-1] < 0.2
    assert max(train.loop.lr_lambda(s, 200, 20, 0.1) for s in range(20)) <= 0.1   # what the configured 200 gave


def test_validation_rows_are_dealt_among_the_ranks_once_each_with_balanced_tokens():
    """8 ranks score 1000 validation rows between them (train=full's validation_max_rows): each row on exactly
    one rank, the ranks' tokens within one row's length of each other, so none waits on a long tail."""
    lengths = torch.randint(20, 2048, (1500,), generator=torch.Generator().manual_seed(0)).tolist()
    rows = list(range(0, 1500, 3)) + list(range(1, 1500, 3))[:500]
    shares = [train.loop.validation_share(lengths, rows, r, 8) for r in range(8)]
    assert sorted(r for share in shares for r in share) == sorted(rows)
    tokens = [sum(lengths[r] for r in share) for share in shares]
    assert max(tokens) - min(tokens) <= max(lengths[r] for r in rows)
    assert train.loop.validation_share(lengths, rows[:3], 5, 8) == []   # more ranks than rows: some score none


def test_a_waiting_rank_stops_when_rank0_stops_beating_or_hangs(tmp_path, monkeypatch):
    """The other ranks wait for a rank-0-only stage's marker as long as rank 0's heartbeat changes (here past
    the staleness limit) and its progress bars move (here past hang_minutes), and stop with an error naming
    it once it no longer beats (rank 0 killed without a word, which a launcher on another node does not see) or
    beats without progress (hung: its heartbeat thread alone runs). On a fake clock: the waiting rank's polls
    drive rank 0's beats, so a stalled test process cannot pass for a stalled rank 0."""
    cfg = OmegaConf.create({"run_dir": str(tmp_path), "hang_minutes": 0.01})   # 0.6 s
    folder = stage_dir(cfg, "eval")
    folder.mkdir()
    now, rank0 = [0.0], {"beats": True, "works_until": 1.5, "done_at": 1.2, "count": 0}

    def poll(seconds: float) -> None:  # time passes; rank 0 beats (with its steps) and finishes as scripted
        now[0] += seconds
        assert now[0] < 100, "waited forever"
        if rank0["beats"]:
            rank0["count"] += 1
            steps = min(now[0], rank0["works_until"]) // 0.05
            (folder / stages.ALIVE).write_text(f"{rank0['count']} {steps:.0f}")
        if now[0] >= rank0["done_at"] and not (folder / stages.MARKER).exists():
            (folder / stages.MARKER).write_text(json.dumps({"fingerprint": "fp"}))
            rank0["done_at"] = float("inf")

    monkeypatch.setattr(stages, "time", types.SimpleNamespace(monotonic=lambda: now[0], sleep=poll))
    assert stages.wait_for_marker(cfg, "eval", "fp", poll_s=0.02, stale_s=0.3) == {"fingerprint": "fp"}
    assert now[0] >= 1.2  # waited past the staleness limit while rank 0 beat and worked
    (folder / stages.MARKER).unlink()
    start = now[0]  # 1.2 s: rank 0 beats on, its steps stop at 1.5 s
    with pytest.raises(RuntimeError, match=r"rank 0 is alive but has made no progress working on stage 'eval' "
                                           r"for 1 s \(hang_minutes\): hung .* A rerun resumes"):
        stages.wait_for_marker(cfg, "eval", "fp", poll_s=0.02, stale_s=0.3)
    assert now[0] == pytest.approx(1.5 + 0.6, abs=0.08)  # hang_minutes after its last step, not sooner
    rank0["beats"], start = False, now[0]
    with pytest.raises(RuntimeError, match=r"rank 0 stopped working on stage 'eval': its heartbeat .*_alive has not "
                                           r"changed for 0 s .* A rerun resumes"):
        stages.wait_for_marker(cfg, "eval", "fp", poll_s=0.02, stale_s=0.3)
    assert 0.3 < now[0] - start < 0.4


def test_the_heartbeat_carries_a_rising_count_and_the_progress_bars_steps(tmp_path):
    """What rank 0 beats (:func:`train.stages.heartbeat`): a counter that rises and its progress bars' updates;
    the file is gone once its block ends. Event-driven: waits for each beat, asserts no timing."""
    from train.log import progress

    path = tmp_path / stages.ALIVE

    def next_beat(after: str | None) -> str:
        for _ in range(2000):  # up to ~20 s of a stalled machine
            beat = path.read_text() if path.exists() else None
            if beat is not None and beat != after:
                return beat
            time.sleep(0.01)
        raise AssertionError("no beat")

    with stages.heartbeat(path, 0.01):
        first = next_beat(None)
        bar = progress(total=10)
        for _ in range(3):
            bar.update()
        beat = first
        while beat.split()[1] == first.split()[1]:
            beat = next_beat(beat)
        bar.close()
        assert int(beat.split()[0]) > int(first.split()[0]) and int(beat.split()[1]) == int(first.split()[1]) + 3
    assert not path.exists()


def test_a_rank0_stage_whose_marker_fails_tells_the_waiting_ranks(tmp_path, monkeypatch):
    """Writing the marker (its output id hashes the data; its outputs are fsynced) ran after the failure handler: an
    error there left no _failed.json, and the other ranks waited STALE_S for a rank 0 taken for dead."""
    import sys
    import types

    monkeypatch.setitem(sys.modules, "fake_eval", types.SimpleNamespace(run=lambda cfg: {}))
    monkeypatch.setitem(stages.ENTRY, "eval", "fake_eval")
    monkeypatch.setattr(stages, "output_id", lambda *a: (_ for _ in ()).throw(OSError(5, "Input/output error")))
    cfg = make_cfg([*BASE, f"output_root={tmp_path}", "stages=[eval]"])
    with pytest.raises(OSError, match="Input/output error"):
        run_stages(cfg)
    assert "Input/output error" in (stage_dir(cfg, "eval") / stages.FAILED).read_text()


def test_a_heartbeat_outlives_a_network_filesystems_moment(tmp_path, monkeypatch):
    """One EIO or ESTALE of a network filesystem ended the heartbeat thread for good: 600 s later the waiting ranks
    stopped a live rank's run. The beat goes on; a reader's own error is read as no change, not raised."""
    import errno

    path = tmp_path / stages.ALIVE
    real, fails = os.replace, [2]

    def flaky(src, dst):
        if fails[0]:
            fails[0] -= 1
            raise OSError(errno.ESTALE, "Stale file handle")
        return real(src, dst)

    monkeypatch.setattr(stages.os, "replace", flaky)
    with stages.heartbeat(path, 0.01):
        for _ in range(2000):   # up to ~20 s of a stalled machine
            if path.exists():
                break
            time.sleep(0.01)
        assert path.exists() and fails == [0]
    monkeypatch.setattr(stages.os, "replace", real)
    unreadable = tmp_path / "a_folder"
    unreadable.mkdir()   # reading it raises IsADirectoryError, an OSError like EIO
    assert stages.Pulse(unreadable, stale_s=60).problem("rank 1", "working") is None


def test_metrics_of_a_crashed_run_are_cut_at_the_resumed_step(tmp_path):
    """Training resumes at its checkpoint's step: metrics.jsonl keeps the records up to it; a last line torn by the
    crash (a full disk) is dropped, not a JSONDecodeError that stopped every resume."""
    from train.tracking import Tracker

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "train/loss": 1.0 / s}) + "\n" for s in (1, 2, 3))
                    + '{"step": 4, "train/lo')
    Tracker(make_cfg([*BASE], tmp_path), "train", path, resume_step=2)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]
