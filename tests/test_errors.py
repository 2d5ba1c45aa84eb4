"""User errors print one line and exit 1 (no traceback, no Hydra hint); bugs keep their traceback;
a user's own data file with the defaults gets a validation split."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import datasets
import pytest

from data.formats import DataError
from data.stage import SPLITS, assign_splits, sample_train_rows, save_dataset
from tests.conftest import ROOT, make_cfg
from train.errors import ConfigError, MissingStageError, UserError

ENV = {"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "OMP_NUM_THREADS": "1",
       "WANDB_SILENT": "true", "SPECHEADS_CACHE": os.environ["SPECHEADS_CACHE"]}


def cli(tmp_path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "train/run.py"), "tracking=none", f"output_root={tmp_path}",
                           "model=tiny-llama", *args], cwd=ROOT, env={**ENV, **(env or {})},
                          capture_output=True, text=True, timeout=300)


def one_error_line(out: subprocess.CompletedProcess) -> str:
    """The run failed with status 1 and said why in exactly one line, without a traceback or Hydra's hint."""
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    assert "Traceback" not in text and "HYDRA_FULL_ERROR" not in text, text
    lines = [line for line in out.stderr.splitlines() if line.startswith("error")]
    assert len(lines) == 1, text
    return lines[0]


def test_bad_enum_override_is_one_line_before_the_plan(tmp_path):
    line = one_error_line(cli(tmp_path, "train.positions=asistant", "plan=true"))
    assert "train.positions='asistant'" in line and "valid values: all, assistant" in line
    assert "did you mean assistant" in line


def test_missing_upstream_stage_is_one_line(tmp_path):
    line = one_error_line(cli(tmp_path, "stages=[train]"))
    assert "Stage 'data' has no complete output" in line and "stages=[data]" in line


def test_malformed_input_line_is_one_line(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps({"prompt": "Say hi."}) + "\n{not json\n")
    line = one_error_line(cli(tmp_path, "stages=[data]", f"data.sources=[{{path:'{path}'}}]", "data.regenerate=false"))
    assert f"{path}:2: malformed JSON" in line and "data.on_error=skip" in line


def test_what_later_stages_need_from_outside_is_refused_before_the_first(tmp_path):
    """No W&B login with tracking.mode=online (the run starts in the train stage), no Hugging Face token and a
    malformed repo id (the publish stage): one line before any stage, not after the data, extract and training."""
    def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(ROOT / "train/run.py"), "tracking=wandb", "tracking.mode=online",
                               f"output_root={tmp_path}", "model=tiny-llama", *args], cwd=ROOT,
                              env={**ENV, **(env or {})}, capture_output=True, text=True, timeout=300)

    line = one_error_line(run("stages=[data,extract,train,eval,export,publish]", "publish.repo_id=not a repo"))
    assert "needs a W&B login" in line and "wandb login" in line and "tracking.mode=offline" in line, line
    assert "no Hugging Face token" in line and "must look like 'user/name'" in line, line
    assert not any(tmp_path.rglob("data")), "a stage ran"
    line = one_error_line(run("stages=[train]", env={"WANDB_API_KEY": "not-a-key"}))
    assert "cannot log in to W&B" in line and "40+ characters" in line, line
    line = one_error_line(run("stages=[train]", env={"WANDB_API_KEY": "k" * 40}))   # a key: read, not sent
    assert "Stage 'data' has no complete output" in line, line                     # (the stage's own error)


def test_debug_switch_shows_the_traceback(tmp_path):
    out = cli(tmp_path, "train.positions=asistant", "plan=true", env={"SPECHEADS_DEBUG": "1"})
    assert out.returncode != 0 and "Traceback" in out.stderr and "ConfigError" in out.stderr


def test_user_errors_share_one_base_class():
    from train.export import ExportError
    from train.extract import ExtractError
    from train.plan import MemoryShortError
    from train.publish import PublishError

    for cls in (DataError, ExtractError, ExportError, PublishError, MemoryShortError, ConfigError, MissingStageError):
        assert issubclass(cls, UserError), cls
    assert issubclass(MissingStageError, FileNotFoundError) and issubclass(DataError, ValueError)


def test_a_target_that_cannot_be_loaded_is_one_line(tmp_path):
    """A Hub id not in the cache offline, a gated model, a wrong model.path: one line naming the fixes, not a
    traceback (it stays an OSError, as from_pretrained raises)."""
    from train.errors import TargetError
    from train.target import load_tokenizer

    cfg = make_cfg(["model=qwen2.5-7b", f"model.path={tmp_path / 'nowhere'}"])
    with pytest.raises(TargetError, match=r"could not load target .*nowhere.*model.path") as info:
        load_tokenizer(cfg)
    assert isinstance(info.value, UserError) and isinstance(info.value, OSError) and "\n" not in str(info.value)


@pytest.mark.parametrize("error", [DataError("bad row"), RuntimeError("a bug")])
def test_in_process_user_error_exits_1_and_bug_propagates(monkeypatch, capsys, error):
    """``main`` called with a config (Hydra passes it through): a user error -> one line + SystemExit(1);
    any other exception -> raised as is (its traceback is shown)."""
    import train.run as run_module

    def fail(cfg):
        raise error

    monkeypatch.delenv("SPECHEADS_DEBUG", raising=False)
    monkeypatch.setattr(run_module, "run", fail)
    cfg = make_cfg(["model=tiny-llama"])
    if isinstance(error, UserError):
        with pytest.raises(SystemExit) as exit_info:
            run_module.main(cfg)
        assert exit_info.value.code == 1
        assert capsys.readouterr().err.strip() == "error: bad row"
    else:
        with pytest.raises(RuntimeError, match="a bug"):
            run_module.main(cfg)


def _conv(i, split=None):
    return {"id": f"mine-{i}", "split": split}


@pytest.mark.parametrize(("n", "fraction", "expected"), [(20, 0.05, 1), (100, 0.05, 5), (2, 0.05, 1), (1, 0.05, 0),
                                                         (20, 0.0, 0), (10, 0.3, 3)])
def test_rows_without_a_split_hold_out_a_share(n, fraction, expected):
    convs = [_conv(i) for i in range(n)] + [_conv("t", "train"), _conv("v", "validation")]
    assign_splits(convs, fraction, seed=0)
    assert sum(c["split"] == "validation" for c in convs[:n]) == expected
    assert convs[-2]["split"] == "train" and convs[-1]["split"] == "validation"
    again = [_conv(i) for i in reversed(range(n))]  # the order of the file does not matter
    assign_splits(again, fraction, seed=0)
    assert {c["id"] for c in again if c["split"] == "validation"} == {c["id"] for c in convs[:n] if c["split"] == "validation"}


def test_validation_max_rows_caps_the_held_out_share_with_nested_rows():
    """5% of 500k rows would hold out 25k (a 7-8B target's states for them: ~0.5 TB): ``max_rows`` caps it; a
    smaller cap holds out a subset of a larger one's rows; rows with their own split are not counted."""
    held = {}
    for cap in (None, 30, 10):
        convs = [_conv(i) for i in range(1000)] + [_conv("v", "validation")]
        assign_splits(convs, 0.05, seed=0, max_rows=cap)
        held[cap] = {c["id"] for c in convs[:1000] if c["split"] == "validation"}
        assert convs[-1]["split"] == "validation"
    assert (len(held[None]), len(held[30]), len(held[10])) == (50, 30, 10)
    assert held[10] < held[30] < held[None]


def test_train_rows_keep_a_nested_seeded_subset_and_every_validation_row():
    convs = [_conv(i, "validation" if i % 5 == 0 else "train") for i in range(50)]
    ids = lambda rows: [c["id"] for c in rows]  # noqa: E731
    assert sample_train_rows(convs, None, seed=0) == convs and sample_train_rows(convs, 40, seed=0) == convs
    small, large = sample_train_rows(convs, 10, seed=0), sample_train_rows(convs, 20, seed=0)
    assert sum(c["split"] == "train" for c in small) == 10 and sum(c["split"] == "train" for c in large) == 20
    assert [c for c in small if c["split"] == "validation"] == [c for c in convs if c["split"] == "validation"]
    assert set(ids(small)) < set(ids(large)) and ids(small) == [i for i in ids(convs) if i in set(ids(small))]
    shuffled = sample_train_rows(list(reversed(convs)), 10, seed=0)  # the file's order does not choose the rows
    assert set(ids(shuffled)) == set(ids(small)) and set(ids(sample_train_rows(convs, 10, seed=1))) != set(ids(small))


def test_bad_split_value_is_a_data_error():
    with pytest.raises(DataError, match="split must be train or validation"):
        assign_splits([_conv(0, "val")], 0.05, seed=0)


def test_an_empty_split_is_built_not_refused(tmp_path):
    row = {"id": "a", "source": "s", "category": "c", "key": "k", "input_ids": [1, 2], "loss_mask": [0, 1], "length": 2}
    save_dataset({"train": [row], "validation": []}, tmp_path / "ds")
    ds = datasets.load_from_disk(str(tmp_path / "ds")).with_format("numpy")  # as train and extract read it
    assert len(ds["train"]) == 1 and len(ds["validation"]) == 0
    assert ds["validation"].features == ds["train"].features and set(ds) == set(SPLITS)


def test_own_data_with_the_defaults_gets_train_and_validation(tmp_path):
    """The README's "Your own data" example: one file of prompts, nothing else set."""
    path = tmp_path / "my_prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Write one sentence about topic {i}."}) + "\n" for i in range(20)))
    out = cli(tmp_path, "stages=[data]", f"data.sources=[{{path:'{path}'}}]", "data.regen.max_new_tokens=8")
    assert out.returncode == 0, out.stdout + out.stderr
    stats = json.loads((tmp_path / "tiny-llama/eagle3/data/stats.json").read_text())
    assert stats["rows_kept"] == {"train": 19, "validation": 1}
    import datasets

    ds = datasets.load_from_disk(str(tmp_path / "tiny-llama/eagle3/data/dataset"))
    assert len(ds["train"]) == 19 and len(ds["validation"]) == 1


def test_a_data_file_edited_after_the_data_stage_is_named_when_it_is_skipped(tmp_path, caplog):
    """The data stage's fingerprint holds its config, not its files: rows appended to a source file were skipped
    without a word (the run trained on the rows read before); so would a new file its pattern matches."""
    from tests.conftest import make_cfg
    from train.stages import run_stages

    path = tmp_path / "my_prompts-0.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Topic {i}."}) + "\n" for i in range(6)))
    cfg = make_cfg(["model=tiny-llama", "stages=[data]", f"data.sources=[{{path:'{tmp_path}/my_prompts-*'}}]",
                    "data.regen.max_new_tokens=8"], tmp_path)
    with caplog.at_level("INFO", logger="specheads"):
        run_stages(cfg)
        run_stages(cfg)
        assert not [r for r in caplog.records if "input file(s) changed" in r.message]
        with open(path, "a") as f:
            f.write(json.dumps({"prompt": "A new topic."}) + "\n")
        run_stages(cfg)
        (tmp_path / "my_prompts-1.jsonl").write_text(json.dumps({"prompt": "Another topic."}) + "\n")
        (tmp_path / "my_prompts-notes.txt").write_text("not rows")   # matched, not read: not named
        run_stages(cfg)
    warned = [r.message for r in caplog.records if "input file(s) changed" in r.message]
    assert [w.split(" since")[0] for w in warned] == ["[data] warning: 1 input file(s) changed or added",
                                                       "[data] warning: 2 input file(s) changed or added"]
    assert warned[0] == (
        f"[data] warning: 1 input file(s) changed or added since the data stage read them (size or time; the first: "
        f"{path}): this run goes on with the rows read then; add force=[data] to read them again (answers "
        "regenerated before are taken from the cache)")
    folder = tmp_path / "folder"   # a folder source: a README added beside its rows is no input, a shard is
    folder.mkdir()
    (folder / "a.jsonl").write_text(json.dumps({"prompt": "Topic."}) + "\n")
    cfg = make_cfg(["model=tiny-llama", "stages=[data]", f"data.sources=[{{path:'{folder}'}}]",
                    "data.regen.max_new_tokens=8", f"output_root={tmp_path / 'out2'}"], tmp_path)
    run_stages(cfg)
    caplog.clear()
    with caplog.at_level("INFO", logger="specheads"):
        (folder / "README.md").write_text("my prompts")
        run_stages(cfg)
        assert not [r for r in caplog.records if "input file(s) changed" in r.message]
        (folder / "b.jsonl").write_text(json.dumps({"prompt": "Another."}) + "\n")
        run_stages(cfg)
    assert [r.message.split(" since")[0] for r in caplog.records if "input file(s) changed" in r.message] == [
        "[data] warning: 1 input file(s) changed or added"]


@pytest.mark.parametrize("env, device, gpus, error", [
    ({"WORLD_SIZE": "2", "LOCAL_RANK": "1"}, "cuda:0", 8, "each rank takes the GPU of its LOCAL_RANK"),
    ({"WORLD_SIZE": "8", "LOCAL_RANK": "3"}, "cuda", 1, "sees 1 GPU"),
    ({"WORLD_SIZE": "8", "LOCAL_RANK": "3"}, "cuda", 8, None),
    ({"WORLD_SIZE": "1", "LOCAL_RANK": "0"}, "cuda:2", 4, None),
])
def test_rank_binding_refuses_a_gpu_nccl_would_not_use(monkeypatch, env, device, gpus, error):
    """Under a launcher DeepSpeed binds rank r's NCCL communicator to cuda:LOCAL_RANK: another index, or a
    LOCAL_RANK beyond the GPUs the process sees (one GPU per process), is an error naming the fix, not a hang."""
    import torch

    from train import dist

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    made_current = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "set_device", made_current.append)
    if error:
        with pytest.raises(UserError, match=error):
            dist.bind_device(torch.device(device))
        assert not made_current
    else:
        bound = dist.bind_device(torch.device(device))
        expected = torch.device(device) if torch.device(device).index is not None else torch.device("cuda", 3)
        assert bound == expected and made_current == [expected]


SCHEDULER_ENVS = {  # what mpirun / srun give each process, and no RANK or WORLD_SIZE
    "openmpi": {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                "OMPI_COMM_WORLD_LOCAL_SIZE": "2"},
    "mpich": {"PMI_SIZE": "4", "PMI_RANK": "3", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"},
    "srun": {"SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_STEP_TASKS_PER_NODE": "3,2(x2)",
             "SLURM_NTASKS": "4", "SLURM_NODEID": "2"},
    # srun --mpi=pmi2: PMI_RANK and PMI_SIZE without MPI_LOCALRANKID (each would otherwise take cuda:0)
    "srun-pmi2": {"PMI_SIZE": "4", "PMI_RANK": "3", "SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "3",
                  "SLURM_LOCALID": "1", "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_NODEID": "1"},
}


def no_launcher(monkeypatch) -> None:
    """No launcher's variables, and whatever the test (adopt_scheduler) sets of them undone after it."""
    from train import dist

    for name in (*dist.LAUNCHER_VARS, "SLURM_NODEID", *(v for names in dist.SCHEDULERS.values() for v in names)):
        monkeypatch.setenv(name, "")   # recorded as it was: undone at the end, also what is set after this
        monkeypatch.delenv(name)


@pytest.mark.parametrize("launcher", sorted(SCHEDULER_ENVS))
def test_ranks_started_by_mpirun_or_srun_take_their_launchers_numbers(monkeypatch, launcher):
    """mpirun and srun set no RANK/WORLD_SIZE: each process ran alone as rank 0 (all on cuda:0, one run directory).
    Their own variables give the rank; without MASTER_ADDR/MASTER_PORT the run stops naming them."""
    from train import dist

    no_launcher(monkeypatch)
    for name, value in SCHEDULER_ENVS[launcher].items():
        monkeypatch.setenv(name, value)
    with pytest.raises(UserError, match=r"4 processes started by .* without MASTER_ADDR and MASTER_PORT.*export both"):
        dist.adopt_scheduler()
    assert "WORLD_SIZE" not in os.environ
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    dist.adopt_scheduler()
    assert (dist.world_size(), dist.rank(), dist.local_rank(), dist.local_world_size()) == (4, 3, 1, 2)


def test_the_entry_point_reads_the_schedulers_ranks_first(tmp_path):
    line = one_error_line(cli(tmp_path, "plan=true", env=SCHEDULER_ENVS["srun"]))
    assert "4 processes started by srun (SLURM_STEP_NUM_TASKS=4) without MASTER_ADDR and MASTER_PORT" in line


def test_a_launcher_of_several_processes_that_names_no_rank_is_refused(monkeypatch):
    """PMI_SIZE=4 from an MPI launcher that sets no PMI_RANK/MPI_LOCALRANKID, and no srun: each would be rank 0."""
    from train import dist

    no_launcher(monkeypatch)
    monkeypatch.setenv("PMI_SIZE", "4")
    with pytest.raises(UserError, match=r"PMI_SIZE=4 processes, but no PMI_RANK and MPI_LOCALRANKID"):
        dist.adopt_scheduler()


def test_an_error_that_cannot_cross_to_the_other_ranks_crosses_as_text():
    from train import dist

    class Unpicklable(Exception):
        def __reduce__(self):
            raise TypeError("no")

    def fails():
        raise Unpicklable("rank 0's reason")

    with pytest.raises(RuntimeError, match="Unpicklable: rank 0's reason"):
        dist.on_main(fails)


def test_a_batch_script_of_several_tasks_is_one_process(monkeypatch):
    """sbatch --ntasks=8 running `python train/run.py` itself (no srun): Slurm's job variables alone say nothing of
    ranks, and under deepspeed or torchrun (WORLD_SIZE set) nothing is touched."""
    from train import dist

    no_launcher(monkeypatch)
    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.setenv("SLURM_PROCID", "0")
    dist.adopt_scheduler()
    assert "WORLD_SIZE" not in os.environ and dist.world_size() == 1
    for name, value in {**SCHEDULER_ENVS["openmpi"], "WORLD_SIZE": "2", "RANK": "1"}.items():
        monkeypatch.setenv(name, value)
    dist.adopt_scheduler()
    assert (dist.world_size(), dist.rank()) == (2, 1)


def test_threads_follow_the_cpus_this_process_may_use(monkeypatch):
    """A Slurm or cgroup allocation of 4 CPUs on a 128-core host: 4, not 128."""
    from train import dist

    monkeypatch.setattr(os, "cpu_count", lambda: 128)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert dist.cpus() == 4


def _on_main_rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as tdist

    from train import dist

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    tdist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        shared = dist.on_main(lambda: {"rank": dist.rank()})
        try:
            dist.on_main(lambda: json.loads(""))   # rank 0's read fails (a torn file)
            failed = None
        except json.JSONDecodeError as e:
            failed = type(e).__name__
        with open(f"{out}.{rank}", "w") as f:
            json.dump({"shared": shared, "failed": failed}, f)
    finally:
        tdist.destroy_process_group()


def test_a_failure_on_rank_0_is_raised_on_every_rank(tmp_path):
    """Decisions rank 0 takes for all (dist.on_main): its value on every rank, and its error too, where the other
    ranks used to wait in the broadcast until the timeout (an hour)."""
    import torch.multiprocessing as mp

    from train.dist import free_port

    mp.spawn(_on_main_rank, args=(free_port(), str(tmp_path / "out")), nprocs=2, join=True)
    for rank in (0, 1):
        got = json.loads((tmp_path / f"out.{rank}").read_text())
        assert got == {"shared": {"rank": 0}, "failed": "JSONDecodeError"}


def test_a_missing_data_file_is_named_where_it_was_looked_for(tmp_path, monkeypatch):
    """A relative path is read from the working directory (hydra.job.chdir: false): the error shows which."""
    from collections import Counter

    from data.formats import DataError, read_rows

    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError, match=rf"data file not found: my_prompts.jsonl \(read as {tmp_path}/my_prompts.jsonl\)"):
        next(read_rows("my_prompts.jsonl", "raise", Counter()))


def test_a_key_added_with_a_plus_beside_the_configs_own_is_refused():
    """Hydra answers a misspelt key with "To append to your config use +train.lrr=1e-3": followed, the run trained at
    the default learning rate. Adding to a map empty by default (a server's environment) and +debug stay allowed."""
    from train.checks import validate

    typo = ["+train.lrr=1e-3"]
    with pytest.raises(ConfigError, match=r"\+train.lrr adds a key beside train.lr: a typo\? \(set train.lr=..., without"):
        validate(make_cfg(typo), typo)
    fine = ["+debug=true", "+data.regen.vllm.env.VLLM_LOGGING_LEVEL=DEBUG", "train.lr=1e-3", "+data.sources.0.limit=5",
            "head=medusa", "+head.init_from_target=false"]   # optional keys the config does not list
    validate(make_cfg(fine), fine)


def test_a_gpu_this_process_does_not_see_is_refused_before_any_stage(monkeypatch):
    """device=cuda on a machine (or a torch build) without a GPU was a traceback from the first tensor moved there,
    or, under a launcher, from binding a rank; a plan may be made anywhere."""
    import torch

    from train.checks import validate

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"device=cuda: torch .* CPU build; install torch's CUDA build .*whl/cu128"):
        validate(make_cfg(["device=cuda"]))
    with pytest.raises(ConfigError, match=r"device='cuda:x' is not valid"):   # (the enum check's, no traceback)
        validate(make_cfg(["device=cuda:x"]))
    validate(make_cfg(["device=cuda", "plan=true"]))
    validate(make_cfg(["device=auto"]))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    validate(make_cfg(["device=cuda:1"]))
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    with pytest.raises(ConfigError, match=r"device=cuda:2: this process sees 2 GPU\(s\)"):
        validate(make_cfg(["device=cuda:2"]))


@pytest.mark.parametrize("overrides, error", [
    (["model.path=/models/Llama-3.1-8B-Instruct"], r"read with model.source=hf only .*embedded SmolLM2-135M would train"),
    (["model.hub_id=Qwen/Qwen2.5-7B-Instruct"], r"model.hub_id=Qwen/Qwen2.5-7B-Instruct is read with model.source=hf "
                                                r"only .*embedded SmolLM2-135M would train, its exports and cards"),
    (["model=qwen2.5-7b", "model.hub_id=me/my-qwen-finetune"], None),       # a preset's fine-tune: fine
    (["model.source=hf", "model.hub_id=meta-llama/Llama-3.1-8B-Instruct"],
     r"keeps the default target's model.name=smollm2-135m .*train.max_minutes=9"),
    (["model=qwen2.5-7b", "model.path=/models/qwen"], None),                # a preset with a local copy: fine
    (["model.source=hf"], None),                                            # SmolLM2 itself from the Hub: fine
])
def test_a_target_set_over_the_default_preset_is_refused(overrides, error):
    """model.path without a preset used to train the embedded 135M target silently (the path is read with source=hf
    only); with source=hf, the 8B target trained under the default's name and 9-minute budget."""
    from train.checks import validate

    cfg = make_cfg(overrides)
    if error is None:
        validate(cfg)
    else:
        with pytest.raises(ConfigError, match=error):
            validate(cfg)
