"""Extract and train stages on a tiny target: captures, crash safety, resume, ranks, tracking."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from data.captured import OpenShards
from data.formats import read_jsonl
from tests.conftest import ROOT, LoggedRun, child_env, killed_after, make_cfg
from train.extract import Captures, ExtractError
from train.stages import fingerprint, read_marker, run_stages, stage_dir
from train.target import load_target

# Regenerated in float32: the states kept while regenerating (every row: the random twin's answers train as generated)
# then equal a float32 extraction pass, which several tests redo.
BASE = ["model=tiny-llama", "head.draft_vocab_size=64", "data.sources=[{type:builtin,limit:24}]",
        "data.regen.max_new_tokens=24", "data.regen.dtype=float32", "extract.dtype=float32", "head.ttt_steps=3", "train.micro_batch_tokens=1024",
        "train.log_every=1", "train.eval_every=1000", "train.checkpoint_every=3", "train.max_steps=6",
        "train.warmup_steps=2", "train.num_threads=1", "train.max_minutes=null"]
ENV = child_env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A run directory with the data and extract stages done (shared, copied per test)."""
    root = tmp_path_factory.mktemp("prepared")
    cfg = make_cfg([*BASE, f"output_root={root}", "stages=[data,extract]"])
    run_stages(cfg)
    return Path(cfg.run_dir)


def fresh_run(prepared: Path, tmp_path: Path, *overrides: str, stages: tuple[str, ...] = ("data", "extract")):
    cfg = make_cfg([*BASE, f"output_root={tmp_path}", *overrides])
    for stage in stages:
        shutil.copytree(prepared / stage, Path(cfg.run_dir) / stage)
    return cfg


def cli(cfg_overrides: list[str], tmp_path: Path, launcher: list[str] | None = None) -> LoggedRun:
    cmd = [*(launcher or [sys.executable]), str(ROOT / "train/run.py"), "tracking=none", *BASE,
           f"output_root={tmp_path}", *cfg_overrides]
    return LoggedRun(cmd, tmp_path / f"cli-{time.time_ns()}.log", cwd=ROOT, env=ENV)


def test_a_torn_shard_is_redone_and_force_redoes_them_all(prepared, tmp_path):
    """A shard a crash or power loss left empty under its final name made every rerun fail in safetensors; it is
    redone. force=[extract] writes every shard again (it kept the finished ones)."""
    cfg = fresh_run(prepared, tmp_path)
    out = stage_dir(cfg, "extract")
    shards = sorted(out.glob("*.safetensors"))
    shards[0].write_bytes(b"")
    run_stages(make_cfg([*BASE, f"output_root={tmp_path}", "stages=[extract]", "extract.batch_tokens=1024"]))
    reference = Captures(stage_dir(make_cfg([*BASE, f"output_root={prepared.parents[1]}"]), "extract"))
    for split in ("train", "validation"):
        for r in Captures(out).index[split]:
            torch.testing.assert_close(Captures(out).get(split, r), reference.get(split, r), rtol=1e-5, atol=1e-5)
    before = {f.name: f.stat().st_mtime_ns for f in out.glob("*.safetensors")}
    time.sleep(0.01)
    run_stages(make_cfg([*BASE, f"output_root={tmp_path}", "stages=[extract]", "extract.batch_tokens=1024",
                         "force=[extract]"]))
    assert all(f.stat().st_mtime_ns > before[f.name] for f in out.glob("*.safetensors")) and len(before) > 1


def test_a_forcing_command_repeated_after_a_crash_keeps_what_its_force_redid(prepared, tmp_path, monkeypatch):
    """force=[extract] redoes every shard once per command (hours at 8B): repeated after a crash inside extract,
    the shards its first attempt wrote are kept; repeated after a crash in a later stage (train), extract is not run
    again; once the command has ended, the same force redoes them all again."""
    import train.extract
    import train.loop
    import train.stages

    cfg = fresh_run(prepared, tmp_path)
    out, record = stage_dir(cfg, "extract"), Path(cfg.run_dir) / train.stages.FORCE_RECORD
    forced = make_cfg([*BASE, f"output_root={tmp_path}", "stages=[extract,train]", "force=[extract]"])

    def mtimes() -> dict[str, int]:
        return {f.name: f.stat().st_mtime_ns for f in out.glob("*.safetensors")}

    write, written = train.extract._write_shard, []

    def crash_after_one(path, *args):
        if written:
            raise OSError("the disk is gone")
        written.append(path.name)
        write(path, *args)

    lines: list[str] = []
    monkeypatch.setattr(train.stages, "log", lambda msg, *a: lines.append(msg))
    before = mtimes()
    monkeypatch.setattr(train.extract, "_write_shard", crash_after_one)
    with pytest.raises(OSError, match="the disk is gone"):
        run_stages(forced)
    first = mtimes()
    assert len(first) > 1 and [f for f in first if first[f] != before[f]] == written
    monkeypatch.setattr(train.extract, "_write_shard", write)
    finish = train.loop.Trainer.finish
    monkeypatch.setattr(train.loop.Trainer, "finish", lambda self: (_ for _ in ()).throw(RuntimeError("crash")))
    with pytest.raises(RuntimeError, match="crash"):
        run_stages(forced)   # the repeat: the other shards redone, not the one the first attempt wrote
    second = mtimes()
    assert [f for f in second if second[f] == first[f]] == written and read_marker(cfg, "extract")
    monkeypatch.setattr(train.loop.Trainer, "finish", finish)
    run_stages(make_cfg([*BASE, f"output_root={tmp_path}", "stages=[data]"]))   # another command between
    marker = read_marker(cfg, "extract")
    run_stages(forced)   # extract was redone by this command: not again, training goes on
    assert mtimes() == second and read_marker(cfg, "extract") == marker and read_marker(cfg, "train")
    assert any(line.startswith("[extract] forced, and finished at") for line in lines), lines
    assert not record.exists()
    run_stages(forced)   # the command ended: its force redoes every shard
    assert all(t != second[f] for f, t in mtimes().items())


def test_a_repeated_force_data_reads_a_file_edited_between_its_attempts(tmp_path, monkeypatch):
    """force=[data] is how an edited source file is read again: the forcing command repeated after a crash in a later
    stage skips the data it already re-read, unless a file changed since (the user fixed a row, then repeated it)."""
    import train.extract
    import train.stages

    path = tmp_path / "chats.jsonl"
    rows = [json.dumps({"messages": [{"role": "user", "content": f"Say {w}."}, {"role": "assistant", "content": w}]})
            for w in "cat dog owl fig tea sun".split()]
    path.write_text("\n".join(rows) + "\n")
    cfg = make_cfg([*BASE, f"output_root={tmp_path}", f"data.sources=[{{path:'{path}'}}]", "data.regenerate=false",
                    "stages=[data,extract]", "force=[data]"])
    lines: list[str] = []
    monkeypatch.setattr(train.stages, "log", lambda msg, *a: lines.append(msg))
    monkeypatch.setattr(train.extract, "run", lambda cfg: (_ for _ in ()).throw(RuntimeError("crash")))
    for _ in range(2):
        with pytest.raises(RuntimeError, match="crash"):
            run_stages(cfg)
    assert sum(line.startswith("[data] running") for line in lines) == 1   # the repeat: skipped
    path.write_text("\n".join(rows[:-1]) + "\n")   # a row fixed (here: left out) between two attempts
    with pytest.raises(RuntimeError, match="crash"):
        run_stages(cfg)
    assert sum(line.startswith("[data] running") for line in lines) == 2
    assert json.loads((stage_dir(cfg, "data") / "stats.json").read_text())["rows_read"] == 5


def test_without_validation_rows_the_last_head_is_kept_and_training_runs_its_course(tmp_path):
    """data.validation_fraction=0 (the README's way to hold out none): every validation scored 1.0, so the first
    head stayed "best" for good and early stopping ended the run after train.patience validations; now the last head
    is kept, the run trains its planned steps, and the card says so instead of a validation score."""
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Say {w} twice."},
                                                     {"role": "assistant", "content": f"{w} {w}."}]}) + "\n"
                            for w in "cat dog owl fig tea sun sky sea elm oak ivy fox".split()))
    cfg = make_cfg([*BASE, f"output_root={tmp_path}", f"data.sources=[{{path:'{path}'}}]", "data.regenerate=false",
                    "data.validation_fraction=0", "train.micro_batch_tokens=64", "train.eval_every=1",
                    "train.patience=1", "stages=[data,extract,train,export]"])
    run_stages(cfg)
    summary = json.loads((stage_dir(cfg, "train") / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["best"]["step"] == 6 and "sim_tau" not in summary["best"]
    assert [h["rows"] for h in summary["history"]] == [0] * 6
    card = (stage_dir(cfg, "export") / "vllm" / "README.md").read_text()
    assert "No validation rows were held out: this is the last head trained (step 6)." in card


def test_patience_null_turns_early_stopping_off():
    """train.patience=null (the common way to say "no early stopping") raised a TypeError after the first step."""
    from types import SimpleNamespace

    from train.loop import Trainer

    trainer = SimpleNamespace(state={"bad_evals": 9}, tcfg=SimpleNamespace(patience=None, max_minutes=None))
    assert Trainer.should_stop(trainer, timed_out=False) is False
    trainer.tcfg.patience = 9
    assert Trainer.should_stop(trainer, timed_out=False) is True


@pytest.mark.parametrize("override, message", [
    ("train.micro_batch_tokens=100000", r"20 training rows \(\d+ tokens\) make 1 micro-batches of "
                                        r"train.micro_batch_tokens=100000, fewer than one optimizer step takes \(2: 1 "
                                        r"rank\(s\) x train.grad_accum=2\): lower train.micro_batch_tokens"),
])
def test_training_that_cannot_work_is_refused_naming_the_fix(prepared, tmp_path, override, message):
    """Fewer micro-batches than one step takes (a small dataset on 8 ranks, grad_accum 4: a bare ValueError after
    the weights were built)."""
    from train.errors import UserError

    cfg = fresh_run(prepared, tmp_path, "stages=[train]", "train.grad_accum=2", "train.autocast=float16", override)
    with pytest.raises(UserError, match=message):
        run_stages(cfg)


def test_extract_counts_the_room_of_a_killed_data_stage_part_as_free(prepared, tmp_path, monkeypatch):
    """A data stage killed while it wrote kept states leaves a `.part-*.tmp` (GBs per rank at 8B); the extract stage
    deletes it before its disk check, which counted it as used."""
    import train.extract

    cfg = fresh_run(prepared, tmp_path)
    torn = stage_dir(cfg, "data") / "captured" / ".part-1-2.safetensors.tmp"
    torn.parent.mkdir(exist_ok=True)
    torn.write_bytes(b"half a part")
    seen, check = [], train.extract.check_disk
    monkeypatch.setattr(train.extract, "check_disk", lambda *a, **k: seen.append(torn.exists()) or check(*a, **k))
    run_stages(make_cfg([*BASE, f"output_root={tmp_path}", "stages=[extract]", "force=[extract]"]))
    assert seen == [False]


def test_captures_equal_hf_hidden_states(prepared):
    cfg = make_cfg([*BASE, f"output_root={prepared.parents[1]}"])
    captures = Captures(stage_dir(cfg, "extract"))
    target = load_target(cfg)
    assert captures.layers == [2, 4, 5, 8]
    import datasets

    ds = datasets.load_from_disk(str(stage_dir(cfg, "data") / "dataset"))
    for split, rows in (("train", [0, 5]), ("validation", [0])):
        for r in rows:
            ids = torch.tensor(ds[split][r]["input_ids"])[None]
            out = target(ids, output_hidden_states=True)
            got, argmax = captures.get(split, r)
            for j, layer in enumerate(captures.layers):
                torch.testing.assert_close(got[:, j], out.hidden_states[layer][0], rtol=1e-5, atol=1e-5)
            assert torch.equal(argmax.long(), out.logits[0].argmax(-1))


def test_the_train_stage_finds_its_rows_in_one_index_file(prepared, tmp_path, monkeypatch):
    """Every rank indexed the rows by opening every shard's header (~200k shards at 8B: minutes on a network
    filesystem before the first step). extract/index.json holds the same index: read alone, equal to the headers'
    (which still serve an extract made before it)."""
    import train.extract

    out = fresh_run(prepared, tmp_path)
    out = stage_dir(out, "extract")
    with monkeypatch.context() as m:
        m.setattr(train.extract, "safe_open", lambda *a, **k: pytest.fail("a shard's header was opened"))
        indexed = Captures(out).index
    (out / "index.json").unlink()
    assert Captures(out).index == indexed and sum(map(len, indexed.values())) == sum(
        json.loads((out / "manifest.json").read_text())["rows"].values())


def mapped(directory: Path) -> int:
    """How many memory mappings of files in ``directory`` this process holds."""
    return sum(str(directory) in line for line in Path("/proc/self/maps").read_text().splitlines())


def test_shard_handles_stay_bounded(tmp_path):
    """Each open shard is one memory mapping (an 8B extract has ~60k shards, a process may hold 65,530 mappings):
    at most ``limit`` stay open, the least recently used closed first, and reads stay right."""
    for i in range(6):
        save_file({"hidden": torch.full((4, 2), float(i))}, str(tmp_path / f"s{i}.safetensors"))
    files = OpenShards(tmp_path, limit=2)
    for i in [0, 1, 0, 2, 3, 4, 5, 0, 5]:
        assert torch.equal(files(f"s{i}.safetensors").get_slice("hidden")[1:3], torch.full((2, 2), float(i)))
        assert mapped(tmp_path) <= 2
    assert list(files._open) == ["s0.safetensors", "s5.safetensors"]


def test_extract_survives_kill_9(prepared, tmp_path):
    """SIGKILL in the middle of extraction, rerun: complete and identical to an uninterrupted run."""
    cfg = fresh_run(prepared, tmp_path, "extract.shard_mb=0.02", stages=("data",))
    out = stage_dir(cfg, "extract")
    proc = cli(["stages=[extract]", "extract.shard_mb=0.02"], tmp_path, killed_after("train.extract:durable_replace", 2))
    output = proc.output(300)
    assert proc.returncode == -signal.SIGKILL, output[-3000:]
    written = len(list(out.glob("*.safetensors")))
    assert written == 2 and not (out / "manifest.json").exists()
    run_stages(make_cfg([*BASE, f"output_root={tmp_path}", "stages=[extract]", "extract.shard_mb=0.02"]))
    resumed = Captures(out)
    resumed.files.limit = 2  # fewer handles than shards: read through evictions
    reference = Captures(stage_dir(make_cfg([*BASE, f"output_root={prepared.parents[1]}"]), "extract"))
    assert len(resumed.manifest["shards"]) > written
    for split in ("train", "validation"):
        assert resumed.index[split].keys() == reference.index[split].keys()
        for r in resumed.index[split]:
            torch.testing.assert_close(resumed.get(split, r), reference.get(split, r), rtol=1e-5, atol=1e-5)
    assert mapped(out) <= 2
    assert not list(out.glob(".*tmp*"))


def test_a_shard_write_failing_in_the_writer_thread_stops_the_stage(prepared, tmp_path, monkeypatch):
    """Shards are written by a thread while the next shard's passes run: its error (a full disk) stops the stage
    in the main thread, the shards written before it kept for the rerun, no manifest or marker written."""
    import train.extract

    cfg = fresh_run(prepared, tmp_path, "extract.shard_mb=0.02", stages=("data",))
    calls, save = [], train.extract.save_file

    def full_disk(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return save(*args, **kwargs)

    monkeypatch.setattr(train.extract, "save_file", full_disk)
    with pytest.raises(OSError, match="No space left"):
        run_stages(make_cfg([*BASE, f"output_root={tmp_path}", "stages=[extract]", "extract.shard_mb=0.02"]))
    out = stage_dir(cfg, "extract")
    assert len(list(out.glob("*.safetensors"))) == 1 and not (out / "manifest.json").exists()
    assert read_marker(cfg, "extract") is None


def test_extract_out_of_memory_names_the_fix(prepared, tmp_path, monkeypatch):
    import train.extract
    from train.extract import ExtractMemoryError

    cfg = fresh_run(prepared, tmp_path, "stages=[extract]", "extract.source=pass", "extract.batch_tokens=512",
                    stages=("data",))

    def short_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(train.extract, "capture", short_of_memory)
    with pytest.raises(ExtractMemoryError, match=r"e\.g\. extract\.batch_tokens=256, or, .* set extract\.zero_stage=3"):
        run_stages(cfg)


def test_zero3_extract_equals_plain_extract(prepared, tmp_path):
    """extract.zero_stage=3 (parameters partitioned by DeepSpeed, lm_head gathered) captures the same tensors."""
    cfg = fresh_run(prepared, tmp_path, stages=("data",))
    proc = cli(["stages=[extract]", "extract.zero_stage=3"], tmp_path)
    output = proc.output(600)
    assert proc.returncode == 0, output[-3000:]
    zero3 = Captures(stage_dir(cfg, "extract"))
    reference = Captures(stage_dir(make_cfg([*BASE, f"output_root={prepared.parents[1]}"]), "extract"))
    for split in ("train", "validation"):
        assert zero3.index[split].keys() == reference.index[split].keys()
        for r in zero3.index[split]:
            torch.testing.assert_close(zero3.get(split, r), reference.get(split, r), rtol=1e-5, atol=1e-5)


RELEASED = """
import json, sys, weakref
import train.extract as extract
from tests.conftest import make_cfg
from train.stages import run_stages

loaded, load = [], extract.load_target
extract.load_target = lambda *a, **k: loaded.extend(map(weakref.ref, [model := load(*a, **k), *model.parameters()])) or model
run_stages(make_cfg(json.loads(sys.argv[1])))
print("loaded", len(loaded), "alive after the stage", sum(ref() is not None for ref in loaded))
"""


def test_zero3_extract_releases_its_target(prepared, tmp_path):
    """DeepSpeed keeps a ZeRO-3 module in a global stack and its hooks on it: the partitioned target (17 GiB per GPU
    for 70B on 8) stayed in memory into the train stage. It is released when the extract stage ends."""
    fresh_run(prepared, tmp_path, stages=("data",))
    overrides = [*BASE, "tracking=none", f"output_root={tmp_path}", "stages=[extract]", "extract.zero_stage=3",
                 "extract.batch_tokens=256"]
    out = subprocess.run([sys.executable, "-c", RELEASED, json.dumps(overrides)], cwd=ROOT, env=ENV,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    loaded, alive = map(int, re.search(r"loaded (\d+) alive after the stage (\d+)", out.stdout).groups())
    assert loaded > 1 and alive == 0, out.stdout[-2000:]


@pytest.mark.parametrize("ema", [0.0, 0.99])
def test_planned_checkpoint_size_matches_the_checkpoints_written(prepared, tmp_path, ema):
    """plan=true's train disk line: a checkpoint's bytes (trainable weights, Adam moments, train.ema's average)
    against those the train stage writes; it keeps train.keep_checkpoints of them."""
    from train.plan import plan

    cfg = fresh_run(prepared, tmp_path, "stages=[train]", f"train.ema={ema}")
    run_stages(cfg)
    written = [sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
               for d in (stage_dir(cfg, "train") / "checkpoints").iterdir() if d.is_dir()]
    planned = plan(cfg)["train"]
    assert len(written) == cfg.train.keep_checkpoints
    for size in written:
        print(f"planned {planned['checkpoint_bytes']:,} B, written {size:,} B")
        assert abs(planned["checkpoint_bytes"] / size - 1) < 0.1, (planned["checkpoint_bytes"], size)


def test_extract_refuses_data_of_another_target(prepared, tmp_path):
    cfg = fresh_run(prepared, tmp_path, stages=("data",))
    other = make_cfg([*BASE, "model=tiny-qwen2", f"output_root={tmp_path}", f"run_dir={cfg.run_dir}", "stages=[extract]"])
    with pytest.raises(ExtractError, match="made with another target/tokenizer"):
        run_stages(other)


def test_training_other_taps_than_the_extract_names_the_fix(prepared, tmp_path):
    """head.aux_layers changed after the extract stage, then stages=[train] alone: one user error saying to
    run the extract stage again, not a traceback; with it, the run goes through."""
    cfg = fresh_run(prepared, tmp_path, "stages=[train]", "head.aux_layers=[1,3,6]")
    with pytest.raises(ExtractError, match=r"holds layers \[2, 4, 5, 8\], this head reads \[1, 3, 6, 8\].*stages=\[extract,train\]"):
        run_stages(cfg)
    cfg.stages = ["extract", "train"]
    run_stages(cfg)
    assert (stage_dir(cfg, "train") / "head" / "model.safetensors").exists()


def test_extract_refuses_when_disk_is_short(prepared, tmp_path, monkeypatch):
    cfg = fresh_run(prepared, tmp_path, "stages=[extract]", stages=("data",))
    monkeypatch.setattr(shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(ExtractError, match=r"not enough free disk.*needs about .* GiB.*only 0\.00 GiB"):
        run_stages(cfg)
    assert not list(stage_dir(cfg, "extract").glob("*.safetensors"))


def metrics(cfg) -> list[dict]:
    lines = (stage_dir(cfg, "train") / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if "train/loss" in line]


@pytest.mark.parametrize("average", [[], ["train.ema=0.5"]], ids=["weights", "ema"])
def test_resume_continues_with_the_same_losses(prepared, tmp_path, average):
    """Killed after the checkpoint at step 3 and rerun: the same losses and the same saved head as a run
    never killed (with ``train.ema`` the saved head is the average, which the checkpoint carries)."""
    straight = fresh_run(prepared, tmp_path / "a", "stages=[train]", *average)
    run_stages(straight)
    reference = metrics(straight)
    assert [m["step"] for m in reference] == list(range(1, 7))

    crashed = fresh_run(prepared, tmp_path / "b", "stages=[train]", *average)
    ckpt = stage_dir(crashed, "train") / "checkpoints"
    proc = cli(["stages=[train]", *average], tmp_path / "b", killed_after("train.loop:Trainer.checkpoint"))  # step 3's
    output = proc.output(600)
    assert proc.returncode == -signal.SIGKILL, output[-3000:]
    assert (ckpt / "latest").read_text().strip() == "step0000003"
    run_stages(crashed)
    resumed = metrics(crashed)
    assert [m["step"] for m in resumed] == list(range(1, 7))
    for a, b in zip(reference, resumed, strict=True):
        assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-5), a["step"]
    torch.testing.assert_close(load_file(str(stage_dir(straight, "train") / "head/model.safetensors")),
                               load_file(str(stage_dir(crashed, "train") / "head/model.safetensors")))


def test_offline_training_never_loads_the_whole_target(prepared, tmp_path, monkeypatch):
    """Train (offline) and export read the embedding, lm_head and final norm from the target's files: no stage
    builds the model (refused at its source, whichever module would call it)."""
    from transformers import AutoModelForCausalLM, PreTrainedModel

    def refuse(*_, **__):
        raise AssertionError("the whole target was loaded")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)
    monkeypatch.setattr(PreTrainedModel, "from_pretrained", refuse)
    cfg = fresh_run(prepared, tmp_path, "stages=[train,export]", "train.max_steps=2")
    run_stages(cfg)
    assert (stage_dir(cfg, "export") / "vllm" / "model.safetensors").exists()


def test_draft_vocab_size_reruns_only_training(prepared, tmp_path):
    """Another head.draft_vocab_size: data and extract are kept; the head's vocabulary is the most frequent
    answer tokens of the data stage's counts, at the new size."""
    from data.vocab import build_vocab
    from train.stages import read_marker

    cfg = fresh_run(prepared, tmp_path, "stages=[data,extract,train]", "train.max_steps=2", "head.draft_vocab_size=48")
    kept = {s: read_marker(cfg, s) for s in ("data", "extract")}
    run_stages(cfg)
    assert {s: read_marker(cfg, s) for s in ("data", "extract")} == kept
    counts = load_file(str(stage_dir(cfg, "data") / "vocab.safetensors"))
    d2t, t2d = build_vocab(counts["masked_counts"], counts["all_counts"], 48)
    head = load_file(str(stage_dir(cfg, "train") / "head" / "model.safetensors"))
    assert torch.equal(head["d2t"], d2t) and torch.equal(head["t2d"], t2d) and head["lm_head.weight"].shape[0] == 48
    assert json.loads((stage_dir(cfg, "train") / "summary.json").read_text())["draft_vocab_size"] == 48


@pytest.mark.parametrize("trained", [False, True])
def test_train_lm_head_false_keeps_the_target_rows(prepared, tmp_path, trained):
    """head.train_lm_head=false: the saved head's lm_head is the target's rows of the draft vocabulary, the
    rest of the head trained; with true the lm_head moves off them."""
    from heads.io import load_head

    cfg = fresh_run(prepared, tmp_path, "stages=[train]", "train.max_steps=3", f"head.train_lm_head={trained}")
    run_stages(cfg)
    target = load_target(cfg)
    head = load_head(stage_dir(cfg, "train") / "head", target)
    rows = target.lm_head.weight[head.draft_ids()]
    assert torch.equal(head.lm_head.weight, rows) != trained
    start = torch.zeros_like(head.fc.weight)  # fc_init=last_tap: the highest tap passed through
    start[:, -head.config.hidden_size:] = torch.eye(head.config.hidden_size)
    assert not torch.equal(head.fc.weight, start)  # the rest of the head trained


def test_batches_keep_the_stored_dtype_and_prefetch_keeps_the_order(prepared, tmp_path):
    from data.stage import load_dataset, row_lengths
    from train.loop import Batches, micro_batches, prefetch

    cfg = fresh_run(prepared, tmp_path, "extract.dtype=bfloat16", stages=("data",))
    run_stages(make_cfg([*BASE, f"output_root={tmp_path}", "extract.dtype=bfloat16", "stages=[extract]"]))
    rows = load_dataset(cfg)["train"]
    make = Batches("train", rows, Captures(stage_dir(cfg, "extract")), None, [2, 4, 5, 8], torch.device("cpu"))
    order = micro_batches(row_lengths(rows), 512, 0)
    inline, ahead = list(prefetch(make, order, 0)), list(prefetch(make, order, 2))
    assert inline[0]["states"].dtype == torch.bfloat16 and len(ahead) == len(order)
    for a, b in zip(inline, ahead, strict=True):
        assert all(torch.equal(a[k], b[k]) for k in ("input_ids", "states", "argmax"))


def test_train_subset_is_seeded_nested_and_sized():
    from train.loop import train_subset

    lengths = [int(x) for x in torch.randint(20, 700, (300,), generator=torch.Generator().manual_seed(0))]
    assert train_subset(lengths, None, 0) == list(range(300))
    small, large = train_subset(lengths, 5000, 0), train_subset(lengths, 20000, 0)
    assert set(small) < set(large) and small == train_subset(lengths, 5000, 0) != train_subset(lengths, 5000, 1)
    for rows, budget in ((small, 5000), (large, 20000)):
        total = sum(lengths[r] for r in rows)
        assert budget <= total < budget + 700 and rows == sorted(rows)


def test_train_on_a_token_budget_of_the_data(prepared, tmp_path):
    """train.data_tokens: the loop's micro-batches index the subset; the rows and states are the split's own."""
    from data.stage import load_dataset
    from train.loop import Batches

    cfg = fresh_run(prepared, tmp_path, "stages=[train]", "train.data_tokens=1500", "train.max_steps=2")
    run_stages(cfg)
    summary = json.loads((stage_dir(cfg, "train") / "summary.json").read_text())
    rows = load_dataset(cfg)["train"]
    assert 1500 <= summary["data"]["tokens"] < sum(rows["length"]) and summary["data"]["rows"] < len(rows)
    captures = Captures(stage_dir(cfg, "extract"))
    batch = Batches("train", rows, captures, None, [2, 4, 5, 8], torch.device("cpu"), index=[5, 2])([1, 0])
    for j, r in enumerate((2, 5)):
        n = int(rows[r]["length"])
        assert torch.equal(batch["input_ids"][j, :n], torch.as_tensor(rows[r]["input_ids"]).long())
        assert torch.equal(batch["states"][j, :n], captures.get("train", r)[0])


def test_wandb_offline_run_has_the_logged_keys(prepared, tmp_path):
    """The run's metrics and config reach W&B (offline), a Hub token set in the config (publish.token) redacted."""
    cfg = fresh_run(prepared, tmp_path, "stages=[train]", "tracking=wandb", "train.max_steps=2",
                    "publish.token=hf_secret_in_config")
    run_stages(cfg)
    from train.tracking import finish

    finish()
    runs = list((Path(cfg.run_dir) / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    deadline = time.time() + 60  # the W&B service may still be writing the run file
    while time.time() < deadline:
        blob = b"".join(p.read_bytes() for p in runs[0].glob("*.wandb"))
        if b"val/sim_tau" in blob:
            break
        time.sleep(0.5)
    for key in (b"train/loss", b"train/acc_0", b"train/sim_tau", b"val/sim_tau", b"tokens_per_s", b"lr"):
        assert key in blob, key
    sent = b"".join(p.read_bytes() for p in runs[0].rglob("*") if p.is_file())
    assert b"<redacted>" in sent and b"hf_secret_in_config" not in sent


def test_token_norm_weighs_the_micro_batches_of_a_step_by_their_positions(prepared, tmp_path):
    """train.loss_norm: with two micro-batches per step token and micro_batch train different heads; with one
    (one rank, grad_accum 1) the same head, to the bit (the losses' test: token's is the whole step's gradient)."""
    heads = {}
    for accum in (1, 2):
        for norm in ("token", "micro_batch"):
            cfg = fresh_run(prepared, tmp_path / f"{accum}-{norm}", "stages=[train]", f"train.grad_accum={accum}",
                            f"train.loss_norm={norm}", "train.max_steps=3")
            run_stages(cfg)
            heads[accum, norm] = load_file(str(stage_dir(cfg, "train") / "head/model.safetensors"))
    one, two = heads[1, "token"], heads[2, "token"]
    assert all(torch.equal(one[k], heads[1, "micro_batch"][k]) for k in one)
    assert not all(torch.allclose(two[k], heads[2, "micro_batch"][k]) for k in two if two[k].is_floating_point())


@pytest.mark.slow
def test_two_ranks_train_like_one(prepared, tmp_path):
    """deepspeed --num_gpus 2 (two CPU ranks), accumulation 1 == one rank with accumulation 2."""
    one = fresh_run(prepared, tmp_path / "one", "stages=[train]", "train.grad_accum=2", "train.max_steps=4")
    run_stages(one)
    two = fresh_run(prepared, tmp_path / "two", "stages=[train]", "train.max_steps=4")
    deepspeed = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port", "29671"]
    proc = cli(["stages=[train]", "train.max_steps=4", "train.grad_accum=1"], tmp_path / "two", deepspeed)
    output = proc.output(900)
    assert proc.returncode == 0, output[-3000:]
    assert "world 2 x accumulation 1" in output
    # each rank draws its own noise and dropout masks, and the checkpoint keeps each rank's RNG to resume it
    ckpt = stage_dir(two, "train") / "checkpoints"
    client = torch.load(ckpt / (ckpt / "latest").read_text() / "mp_rank_00_model_states.pt", weights_only=False)
    assert len(client["rng"]) == 2 and not torch.equal(client["rng"][0]["torch"], client["rng"][1]["torch"])
    torch.testing.assert_close(load_file(str(stage_dir(one, "train") / "head/model.safetensors")),
                               load_file(str(stage_dir(two, "train") / "head/model.safetensors")),
                               rtol=1e-4, atol=1e-5)
    # the logged training figures are those of the step's micro-batches on both ranks, as one rank logs them
    logged = []
    for run in (one, two):
        records = read_jsonl(stage_dir(run, "train") / "metrics.jsonl")
        logged.append([{k: v for k, v in r.items() if k.startswith("train/")} for r in records if "train/loss" in r])
    assert len(logged[0]) == len(logged[1]) > 0 and set(logged[0][0]) >= {"train/loss", "train/acc_0", "train/sim_tau"}
    for alone, shared in zip(*logged, strict=True):
        assert shared == pytest.approx(alone, rel=1e-4)
    # each rank validated its share of the rows; the figures are those of all of them, as one process scores them
    from heads.io import load_head
    from train.extract import capture_layers
    from train.loop import load_data, validate
    from train.target import load_weights

    weights = load_weights(two, torch.float32)
    head = load_head(stage_dir(two, "train") / "head", weights)
    data = load_data(two, None, capture_layers(two, weights.config), torch.device("cpu"), 1)
    alone = validate(head, "eagle3", two, data.val, data.val_rows, weights.lm_head[head.draft_ids()], 2048)
    shared = json.loads((stage_dir(two, "train") / "head/metrics.json").read_text())
    assert alone["rows"] == len(data.val_rows) > 1 and shared["positions"] == alone["positions"] > 0
    assert {k: shared[k] for k in alone} == pytest.approx(alone, abs=1e-6)


@pytest.mark.slow
def test_a_run_resumes_on_another_rank_count(prepared, tmp_path):
    """A ZeRO-1 run checkpointed on 2 ranks resumes on 1 (a node lost), again on 1, then on 2: each time with the
    accumulation that keeps 2 micro-batches per step (the second 1-rank run too: its checkpoint records 2 per step,
    not the config's accumulation), the optimizer's shards converted to DeepSpeed's universal format where the rank
    count changed; the head equals one trained on 1 rank x accumulation 2 through the same four runs (they used to
    be refused: the work thrown away or waited for)."""
    zero = ["stages=[train]", "train.zero_stage=1", "train.checkpoint_every=2"]
    one = fresh_run(prepared, tmp_path / "one", *zero, "train.grad_accum=2")
    for steps in (2, 4, 6, 8):
        run_stages(make_cfg([*BASE, f"output_root={tmp_path / 'one'}", *zero, "train.grad_accum=2",
                             f"train.max_steps={steps}"]))
    moved = fresh_run(prepared, tmp_path / "moved", *zero)
    deepspeed = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port", "29675"]
    proc = cli([*zero, "train.max_steps=2"], tmp_path / "moved", deepspeed)
    output = proc.output(900)
    assert proc.returncode == 0, output[-3000:]
    ckpt = stage_dir(moved, "train") / "checkpoints"
    assert len(list((ckpt / "step0000002").glob("*optim_states.pt"))) == 2  # ZeRO shards, one per rank
    for steps in (4, 6):
        run_stages(make_cfg([*BASE, f"output_root={tmp_path / 'moved'}", *zero, f"train.max_steps={steps}"]))
        client = json.loads((ckpt / f"step000000{steps}" / "client.json").read_text())
        assert (client["world"], client["per_step"]) == (1, 2)
        assert len(list((ckpt / f"step000000{steps}").glob("*optim_states.pt"))) == 1
    proc = cli([*zero, "train.max_steps=8"], tmp_path / "moved", deepspeed)
    output = proc.output(900)
    assert proc.returncode == 0, output[-3000:]
    assert "world 2 x accumulation 1" in output and "to a universal checkpoint" in output
    assert not list(ckpt.glob("universal-*")) and json.loads((ckpt / "step0000008" / "client.json").read_text())[
        "world"] == 2
    for run in (one, moved):
        assert json.loads((stage_dir(run, "train") / "summary.json").read_text())["steps"] == 8
    torch.testing.assert_close(load_file(str(stage_dir(moved, "train") / "head/model.safetensors")),
                               load_file(str(stage_dir(one, "train") / "head/model.safetensors")),
                               rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_two_ranks_stop_together_on_a_time_budget(prepared, tmp_path):
    """train.max_minutes with 2 ranks: the budget is read on rank 0's clock and broadcast, so both ranks
    stop after the same step (a rank stopping one step early would leave the other in a collective)."""
    fresh_run(prepared, tmp_path, stages=("data", "extract"))
    deepspeed = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port", "29673"]
    proc = cli(["stages=[train]", "train.max_steps=100000", "train.max_minutes=0.1", "train.checkpoint_every=100000",
                "train.micro_batch_tokens=256"], tmp_path, deepspeed)
    output = proc.output(600)
    assert proc.returncode == 0, output[-3000:]
    cfg = make_cfg([*BASE, f"output_root={tmp_path}"])
    summary = json.loads((stage_dir(cfg, "train") / "summary.json").read_text())
    steps = summary["steps_per_rank"]
    assert len(steps) == 2 and steps[0] == steps[1] == summary["steps"] < 100000
    assert "fit train.max_minutes" in output or "stopping at train.max_minutes" in output


@pytest.mark.slow
def test_rank0_only_stage_outlasts_the_collective_timeout(prepared, tmp_path):
    """2 ranks, the eval stage (rank 0 alone, decoding) longer than dist_timeout_minutes: the other rank
    waits on the stage's marker file, not in a collective that would time out."""
    # ~16 s of decoding here (4 prompts x 64 tokens took 4.8 s on a fast hour of this VM: less than the 6 s timeout)
    slow_eval = ["eval.datasets=[builtin]", "eval.limit=12", "eval.max_new_tokens=128", "eval.tree.total_tokens=4",
                 "eval.dtype=float32"]
    cfg = fresh_run(prepared, tmp_path, "stages=[train]", *slow_eval)
    run_stages(cfg)
    deepspeed = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port", "29674"]
    proc = cli(["stages=[train,eval]", "dist_timeout_minutes=0.1", *slow_eval], tmp_path, deepspeed)
    output = proc.output(900)
    assert proc.returncode == 0, output[-3000:]
    assert "[train] up to date" in output
    marker = json.loads((stage_dir(cfg, "eval") / "_complete.json").read_text())
    assert marker["wall_s"] > 0.1 * 60  # the stage did outlast the timeout


@pytest.mark.slow
def test_two_ranks_extract_like_one(prepared, tmp_path):
    cfg = fresh_run(prepared, tmp_path, stages=("data",))
    deepspeed = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port", "29672"]
    proc = cli(["stages=[extract]", "extract.shard_mb=0.05"], tmp_path, deepspeed)
    output = proc.output(900)
    assert proc.returncode == 0, output[-3000:]
    two = Captures(stage_dir(cfg, "extract"))
    provenance = json.loads((stage_dir(cfg, "extract") / "provenance.json").read_text())
    assert provenance["world_size"] == 2 and len(two.manifest["shards"]) > 2
    one = Captures(stage_dir(make_cfg([*BASE, f"output_root={prepared.parents[1]}"]), "extract"))
    for split in ("train", "validation"):
        assert two.index[split].keys() == one.index[split].keys()
        for r in one.index[split]:
            torch.testing.assert_close(two.get(split, r), one.get(split, r), rtol=1e-5, atol=1e-5)


def test_extract_redoes_shards_of_other_settings(prepared, tmp_path):
    """Shards left by other settings are never taken for complete ones."""
    cfg = fresh_run(prepared, tmp_path, "stages=[extract]", "extract.dtype=bfloat16")
    run_stages(cfg)
    captures = Captures(stage_dir(cfg, "extract"))
    hidden, argmax = captures.get("train", 0)
    assert hidden.dtype == torch.bfloat16 and argmax.dtype == torch.int32


@pytest.mark.parametrize("changed", [["stages=[extract]", "extract.batch_tokens=512"],
                                     ["stages=[data,extract]", "model.revision=0123abcd"]], ids=["how", "pinned"])
def test_extract_keeps_its_shards_when_only_how_it_runs_changes(prepared, tmp_path, monkeypatch, changed):
    """After an out-of-memory error a user halves extract.batch_tokens (or turns ZeRO-3 on); a Hub target moved on and
    extract asks to pin model.revision to the commit the data came from (the same weights: the target's fingerprint
    is). The stages rerun, the shards already written hold the same states and are kept, not recomputed; shards of an
    earlier plan are deleted."""
    import train.extract

    cfg = fresh_run(prepared, tmp_path, stages=("data", "extract"))
    out = stage_dir(cfg, "extract")
    files = {f.name: f.stat().st_mtime_ns for f in out.glob("*.safetensors")}
    (out / "train-09999.safetensors").write_bytes(b"left by another shard_mb")
    passes = []
    monkeypatch.setattr(train.extract, "capture", lambda *a, **k: passes.append(1))
    again = make_cfg([*BASE, f"output_root={tmp_path}", *changed, "extract.source=pass", "extract.reuse=false"])
    run_stages(again)
    assert read_marker(again, "extract")["fingerprint"] != fingerprint(cfg, "extract")   # the stage did rerun
    assert passes == [] and {f.name: f.stat().st_mtime_ns for f in out.glob("*.safetensors")} == files


def test_training_refuses_states_of_another_target(prepared, tmp_path):
    """`stages=[train]` with the target changed (model.path at other weights; another seed of the twin here) trained a
    head with the new target's embedding and lm_head on the old one's states, without a word."""
    fresh_run(prepared, tmp_path, "stages=[train]")
    with pytest.raises(ExtractError, match=r"was made with another target/tokenizer .* add force=\[data\]"):
        run_stages(make_cfg([*BASE, f"output_root={tmp_path}", "stages=[train]", "model.init_seed=1"]))


def test_time_budget_fits_the_schedule_and_stops(prepared, tmp_path):
    # patience off: only the budget stops the run (epochs of 24 rows end in early stopping on a slow machine)
    cfg = fresh_run(prepared, tmp_path, "stages=[train]", "train.max_steps=100000", "train.max_minutes=0.15",
                    "train.patience=100000")
    run_stages(cfg)
    summary = json.loads((stage_dir(cfg, "train") / "summary.json").read_text())
    assert summary["steps"] < 100000  # stopped by the budget
    lrs = [m["lr"] for m in metrics(cfg)]
    assert lrs[-1] < 0.5 * max(lrs)  # the cosine reached its end within the budget


def test_every_epoch_has_the_planned_number_of_micro_batches():
    """Length grouping after a shuffle yields a seed-dependent number of micro-batches; an epoch must not
    (a shorter epoch once crashed the default Medusa run at its end)."""
    from train.loop import epoch_order, micro_batches

    lengths = [int(x) for x in torch.randint(20, 700, (432,), generator=torch.Generator().manual_seed(0))]
    counts = {len(micro_batches(lengths, 512, seed)) for seed in range(20)}
    assert len(counts) > 1  # the situation the fix is for
    n = len(micro_batches(lengths, 512, 0))
    for seed in range(20):
        order = epoch_order(lengths, 512, seed, n)
        assert len(order) == n and all(len(b) * max(lengths[r] for r in b) <= 512 or len(b) == 1 for b in order)
        assert len({r for b in order for r in b}) >= 0.95 * len(lengths)


def test_stages_run_with_denormals_flushed_on_every_thread():
    """After ``run_stages`` a denormal float is zero on the calling thread and on the intra-op threads
    started after it (a large product splits over them): values of head training that fall into the denormal
    range would otherwise take the CPU's slow path."""
    code = ("import torch; from tests.conftest import make_cfg; from train.stages import run_stages; "
            "torch.set_num_threads(2); run_stages(make_cfg(['model=tiny-llama', 'stages=[]'])); "
            "x = torch.full((1 << 22,), 1e-39); print(int((x * 2).count_nonzero()), int((x[:1] * 2).count_nonzero()))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=child_env(), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["0", "0"]


def test_one_cpu_rank_joins_its_group_without_building_the_shared_memory_op_and_leaves_it(tmp_path):
    """DeepSpeed's CPU backend would compile its shared-memory all-reduce (~46 s, once per environment) for a
    process group of one rank, which has nothing to reduce: the train stage's ``dist.init`` leaves it out."""
    code = ("import torch, torch.distributed as d; from train import dist; "
            "dist.init(torch.device('cpu'), single=True, timeout_minutes=7); "
            "t = d.distributed_c10d._get_default_timeout(d.Backend.GLOO).total_seconds(); dist.close(); "
            "print(t, d.is_initialized(), dist.world_size())")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=child_env(TORCH_EXTENSIONS_DIR=str(tmp_path)),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    # DeepSpeed's own groups (made without a timeout) get ours, not PyTorch's default; the group is left at exit
    assert out.stdout.split()[-3:] == ["420.0", "False", "1"]
    assert not any(tmp_path.rglob("*.so")), sorted(map(str, tmp_path.rglob("*")))


def test_each_stage_gives_its_gpu_memory_back(monkeypatch, tmp_path):
    """After a stage, its objects (a target in a reference cycle, here) are collected and then the caching
    allocator's blocks are released, before the next stage checks the free memory."""
    import gc
    import types
    import weakref

    import train.stages as stages

    class Model:
        pass

    refs, events = [], []

    def stage_run(cfg):
        model = Model()
        model.me = model                      # a cycle: freed by the collector only
        refs.append(weakref.ref(model))
        return {}

    monkeypatch.setitem(stages.ENTRY, "export", "fake_export")
    monkeypatch.setitem(sys.modules, "fake_export", types.SimpleNamespace(run=stage_run))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append(refs[-1]() is None))
    gc.disable()
    try:
        stages.run_stages(make_cfg(["model=tiny-llama", "stages=[export]", f"run_dir={tmp_path}"]))
    finally:
        gc.enable()
    assert events == [True]


def test_online_training_runs_no_extract_stage(prepared, tmp_path):
    """train.online=true with the default stages: the hidden states are computed during training, so the extract
    stage (at 8B a forward over every row and ~3 TB of shards per 100M tokens that nothing reads) does not run."""
    cfg = fresh_run(prepared, tmp_path, "stages=[data,extract,train]", "train.online=true", "train.max_steps=2",
                    stages=("data",))
    out = run_stages(cfg)
    assert "extract" not in out and not stage_dir(cfg, "extract").exists()
    assert json.loads((stage_dir(cfg, "train") / "summary.json").read_text())["steps"] == 2


def test_the_train_stage_lets_go_of_its_engine_and_online_target(prepared, tmp_path, monkeypatch):
    """Once the train stage ends, nothing holds its trainer (DeepSpeed engine, optimizer) or the target online
    training loaded: the eval stage then loads its own (at 8B a second 16 GB copy if the first were kept)."""
    import gc
    import weakref

    import train.loop

    refs, init = [], train.loop.Trainer.__init__

    def remembered(self, cfg):
        init(self, cfg)
        refs.extend([weakref.ref(self), weakref.ref(self.data.train.target)])
        # the head embeds with the online target's own embedding (a copy is 1 GB more per GPU at 8B)
        shared.append(self.model.embed_tokens.weight is self.data.train.target.get_input_embeddings().weight)

    shared = []
    monkeypatch.setattr(train.loop.Trainer, "__init__", remembered)
    run_stages(fresh_run(prepared, tmp_path, "stages=[train]", "train.online=true"))
    gc.collect()
    assert len(refs) == 2 and all(ref() is None for ref in refs)
    assert shared == [True]


def test_online_training_refuses_data_of_another_target(prepared, tmp_path):
    """Online, no extract stage checks the data against the target: a target changed since the data stage (another
    model.path, revision or fine-tune of the same tokenizer) would train on answers another model wrote."""
    cfg = fresh_run(prepared, tmp_path, "stages=[train]", "train.online=true", "model.init_seed=1")
    with pytest.raises(ExtractError, match="was made with another target/tokenizer"):
        run_stages(cfg)
