"""Smoke tests of every script in scripts/ on the tiny random target (so that none can rot again), and
the optimizer's weight-decay groups.

Each script runs as a subprocess, as a user would run it, with arguments that make it tiny, and must
exit 0 and print its figures. scripts/vllm_check.py is covered by tests/test_vllm_check.py (slow tier);
scripts/gpu_check.sh is meant for a GPU (its CPU smoke run: EXTRA in its header): only parsed here (``bash -n``), like the setup scripts.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

from tests.conftest import child_env, make_cfg

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
# The tiny source run the stage-reading benchmarks copy from (data + extract, 12 prompts).
SOURCE = ["model=tiny-llama", "data.sources=[{type:builtin,limit:12}]", "data.regen.max_new_tokens=16",
          "head.draft_vocab_size=96", "extract.dtype=float32"]


def run_script(name: str, *args: str, timeout: int = 300) -> str:
    """Run scripts/<name> like a user; assert exit status 0; return stdout + stderr."""
    env = child_env(OMP_NUM_THREADS="1", WANDB_SILENT="true", TQDM_DISABLE="1")
    proc = subprocess.run([sys.executable, str(SCRIPTS / name), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{out[-4000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """``prepare(head)`` -> Hydra overrides naming a tiny run whose data + extract stages are done."""
    from train.stages import run_stages

    root = tmp_path_factory.mktemp("bench-source")
    done: set[str] = set()

    def prepare(*heads: str) -> list[str]:
        overrides = [*SOURCE, f"output_root={root}"]
        for head in heads:
            if head not in done:
                run_stages(make_cfg([*overrides, f"head={head}", "stages=[data,extract]"]))
                done.add(head)
        return overrides

    return prepare


def test_every_script_has_a_smoke_test():
    """A new script gets a test here (or a reason not to)."""
    covered = {"_bench.py", "compare_heads.py", "bench_batching.py", "bench_data.py", "bench_decode.py", "bench_dedup.py", "bench_extract.py", "bench_gpu_scale.py",
               "bench_levers.py", "bench_regen_mask.py", "bench_synth.py", "bench_train.py", "bench_ttt_attention.py", "gpu_check.sh", "learning_curve.py",
               "setup_env.sh", "setup_vllm_env.sh", "vllm_check.py"}   # vllm_check.py: tests/test_vllm_check.py
    assert {p.name for p in SCRIPTS.iterdir() if p.is_file()} <= covered


@pytest.mark.parametrize("name", ["gpu_check.sh", "setup_env.sh", "setup_vllm_env.sh"])
def test_shell_scripts_parse(name):
    assert subprocess.run(["bash", "-n", str(SCRIPTS / name)], capture_output=True).returncode == 0


def test_bench_regen_mask_on_a_tiny_twin():
    """Both masks run the real scheduler; in float32 they give the same greedy answers."""
    out = run_script("bench_regen_mask.py", "--rows", "3", "--prompt", "8", "--new", "4", "--rounds", "2",
                     "model=tiny-llama", "dtype=float32")
    assert out.count("round ") == 2 and "3 rows x 8 tokens, 4 new" in out and "answers identical 3/3" in out, out


def test_bench_ttt_attention():
    out = run_script("bench_ttt_attention.py", "--T", "32", "64", "--steps", "1", "--heads", "2", "--kv-heads", "1",
                     "--head-dim", "8")
    rows = re.findall(r"^\s+(\d+)\s+(old|new)\s+([\d.]+)\s+([\d.]+)$", out, re.M)
    assert {(t, impl) for t, impl, *_ in rows} == {("32", "old"), ("32", "new"), ("64", "old"), ("64", "new")}, out


def test_bench_gpu_scale_on_a_tiny_preset():
    import json

    out = run_script("bench_gpu_scale.py", "--model", "tiny-llama", "--steps", "1", "--row-len", "32",
                     "head.draft_vocab_size=64", "train.micro_batch_tokens=64", "extract.batch_tokens=64")
    figures = json.loads(out.strip().splitlines()[-1])
    assert figures["model"] == "tiny-llama" and figures["extract"]["tokens_per_s"] > 0
    assert figures["train"]["tokens_per_s"] > 0 and figures["train"]["draft_vocab"] == 64


def test_bench_decode_eagle3():
    out = run_script("bench_decode.py", "--model", "tiny-llama", "--prompts", "1", "--max-new-tokens", "8",
                     "eval.tree.total_tokens=4", "eval.tree.sizes=[1,2,4]", "head.draft_vocab_size=64",
                     "eval.dtype=float32")   # token identity with plain decoding below (auto may decode in bf16)
    assert "verify time vs tree tokens" in out and "EAGLE tree total_tokens = 4" in out
    assert re.search(r"^\s+eagle3-tree\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+\d+%\s+True$", out, re.M), out


@pytest.mark.slow
def test_bench_decode_medusa():
    out = run_script("bench_decode.py", "--model", "tiny-llama", "--head", "medusa", "--prompts", "1",
                     "--max-new-tokens", "8", "--cudnn-attention", "eval.tree.sizes=[1,2,4]", "head.draft_vocab_size=64")
    assert "Medusa tree:" in out and re.search(r"^\s+medusa-tree\s+[\d.]+", out, re.M), out


def test_bench_synth():
    """Prompts of several 4-prompt batches decode together: more rows per pass than a batch has. (How many of a
    random twin's prompts pass the filters depends on the CPU's rounding: all 6 on one VM, 3 of 28 attempts on
    another.)"""
    out = json.loads(run_script("bench_synth.py", "--n", "6", "--batch-size", "4", "model=tiny-qwen2",
                                "data.regen.batch_size=12").strip().splitlines()[-1])
    assert 1 <= out["prompts"] <= 6 < out["attempts"] and out["decode_passes"] > 0
    assert 4 < out["rows_per_decode_pass"] <= 12, out


def test_bench_dedup():
    """The filter's figures per 10k prompts and at the end; with every candidate compared, the same prompts kept and
    more comparisons."""
    lines = {m: run_script("bench_dedup.py", "--n", "3000", *m).strip().splitlines() for m in ((), ("--margin", "1.0"))}
    estimated, every = (re.match(r"3000 checked: (\d+) kept, [\d.]+ s, (\d+) exact comparisons, peak RSS \d+ MB",
                                 out[-1]).groups() for out in lines.values())
    assert estimated[0] == every[0] and int(estimated[1]) < int(every[1]), lines


def test_bench_data():
    out = run_script("bench_data.py", "--limit", "4", "model=tiny-llama", "data.regen.max_new_tokens=8",
                     "head.draft_vocab_size=64")
    assert re.search(r"^hf\+pass\s+\d+\s+\d+", out, re.M) and re.search(r"^hf\+kept\s+\d+\s+\d+", out, re.M), out
    assert "end-to-end speed-up hf+kept / hf+pass" in out and "4/4 rows comparable" in out


def test_bench_batching(source):
    """The tiny run's 12 regenerated conversations replayed through the real scheduler (each replayed answer
    has its recorded length, or the script fails) in batches of 4, static and continuous."""
    out = run_script("bench_batching.py", "--batch-size", "4", "--refill", "1.0,0.25", *source("eagle3"))
    assert re.search(r": 12 conversations, \d+ answers, \d+ answer tokens; batch_size 4", out), out
    assert re.search(r"^\s+1\.0\s+\d+\s+[\d.]+\s+\d+\s+1\.00$", out, re.M), out
    assert re.search(r"^\s+0\.25\s+\d+\s+[\d.]+\s+\d+\s+[\d.]+$", out, re.M), out


def test_bench_extract(source):
    out = run_script("bench_extract.py", "--rows", "4", *source("eagle3"))
    assert "== extraction benchmark: tiny-llama, head eagle3" in out
    assert re.search(r"bare forward, same batches:\s+\d+ tok/s", out) and "bytes/token on disk" in out


def test_bench_levers(source):
    out = run_script("bench_levers.py", *source("eagle3"), "train.num_threads=1", "--minutes", "1",
                     "--variant", "default:train.max_steps=2,train.warmup_steps=1",
                     "--variant", "bf16 autocast:train.max_steps=2,train.warmup_steps=1,train.autocast=bfloat16")
    assert "== training levers: eagle3" in out
    for row in ("default", "bf16 autocast"):
        assert re.search(rf"^{row}\s+2\s+\d+\s+[\d.]+", out, re.M), out


def test_learning_curve(source, tmp_path):
    """Two nested points trained and exported in fresh processes; the JSON, the plot and the table."""
    import json

    def curve(tokens: str, figure: str, *more: str) -> str:
        return run_script("learning_curve.py", *source("eagle3"), "--tokens", tokens, "--epochs", "1",
                          "--out", str(tmp_path / "points"), "--figure", str(tmp_path / figure),
                          "--train", "train.num_threads=1", "--train", "train.micro_batch_tokens=64",
                          "--train", "train.warmup_steps=1", "--train", "train.eval_every=1000", *more)

    out = curve("150,300", "curve")
    points = json.loads((tmp_path / "curve.json").read_text())["points"]
    assert [p["budget"] for p in points] == [150, 300] and (tmp_path / "curve.png").stat().st_size > 0
    assert 150 <= points[0]["tokens"] < points[1]["tokens"] and points[0]["steps"] < points[1]["steps"]
    assert all((tmp_path / "points" / f"tokens-{t}" / "export" / "vllm" / "config.json").exists() for t in (150, 300))
    assert "== learning curve: eagle3, 1 epochs per point ==" in out and re.search(r"^\s+\d+\s+\d+\s+\d+", out, re.M)
    # a larger budget added to the earlier curve: its points are kept, each with the run it came from
    # ... and another curve drawn beside it: recorded with its own overrides, the points still this curve's
    curve("450", "more", "--earlier", str(tmp_path / "curve.json"), "--beside", str(tmp_path / "curve.json"))
    result = json.loads((tmp_path / "more.json").read_text())
    more = result["points"]
    assert [p["budget"] for p in more] == [150, 300, 450] and more[:2] == points
    assert all(p["source"] == more[2]["source"] for p in more) and (tmp_path / "more.png").stat().st_size > 0
    assert [b["points"] for b in result["beside"]] == [points]


def test_compare_heads(source, tmp_path):
    """A trained head against itself: no difference and a zero interval; its decode_tau is the one the train
    stage's validation saved with it; heads of another type than the run read are refused, naming the fix."""
    import json
    import shutil

    from train.stages import run_stages, stage_dir

    overrides = [*source("medusa"), "head=medusa"]
    run = [*overrides, f"run_dir={tmp_path / 'run'}"]
    cfg = make_cfg([*run, "stages=[train]", "train.max_steps=4", "train.warmup_steps=1", "train.num_threads=1"])
    for stage in ("data", "extract"):
        shutil.copytree(stage_dir(make_cfg(overrides), stage), stage_dir(cfg, stage))
    run_stages(cfg)
    head = stage_dir(cfg, "train") / "head"
    out = run_script("compare_heads.py", str(head), str(head), *run)
    assert "first - second: +0.000, 95% interval over rows [+0.000, +0.000]" in out, out
    saved = json.loads((head / "metrics.json").read_text())
    assert re.search(rf"^{re.escape(str(head))}\s+{saved['sim_tau']:.3f}\s+{saved['decode_tau']:.3f}\s+\d+$", out, re.M), out
    proc = subprocess.run([sys.executable, str(SCRIPTS / "compare_heads.py"), str(head), str(head), *SOURCE,
                           f"output_root={tmp_path}"], cwd=ROOT, env=child_env(), capture_output=True, text=True)
    assert proc.returncode != 0 and "the heads are ['medusa'], the run read is eagle3" in proc.stderr


def test_the_paired_interval_resamples_rows_together():
    """compare_heads.py's bootstrap: tau(a) - tau(b) over rows drawn together. Heads one accepted token apart on
    every pass of uneven rows differ by exactly 1 in every resample (drawn apart, the rows' spread would widen
    it); swapped, the interval is negated; heads that trade wins row by row get an interval around 0."""
    spec = importlib.util.spec_from_file_location("compare_heads", SCRIPTS / "compare_heads.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    b = [[2, 0], [0], [4, 4, 3], [0, 1]]
    a = [[x + 1 for x in row] for row in b]
    assert module.paired_interval(a, b, 500) == pytest.approx((1.0, 1.0))
    low, high = module.paired_interval([[2], [0], [1], [1]] * 5, [[0], [2], [1], [1]] * 5, 2000)
    assert low < 0 < high and (low, high) == pytest.approx(tuple(-x for x in module.paired_interval(
        [[0], [2], [1], [1]] * 5, [[2], [0], [1], [1]] * 5, 2000)[::-1]))


def test_compare_heads_reads_the_taps_each_head_was_trained_on(source, tmp_path):
    """An EAGLE-3 head tapping other layers than the run's extract is scored on its own run's states: the
    figures its train stage saved with it (the run's states would feed it the wrong layers, silently)."""
    import json
    import shutil

    from train.stages import MARKER, run_stages, stage_dir

    overrides = source("eagle3")
    train = ["train.max_steps=4", "train.warmup_steps=1", "train.num_threads=1"]
    runs = {"default": [], "taps": ["head.aux_layers=[1,3,6]", "head.layer_init=-2"]}
    heads = {}
    for name, keys in runs.items():
        cfg = make_cfg([*overrides, f"run_dir={tmp_path / name}", "stages=[extract,train]", *train, *keys])
        shutil.copytree(stage_dir(make_cfg(overrides), "data"), stage_dir(cfg, "data"))
        run_stages(cfg)
        heads[name] = stage_dir(cfg, "train") / "head"
    out = run_script("compare_heads.py", str(heads["taps"]), str(heads["default"]), *overrides,
                     f"run_dir={tmp_path / 'default'}")
    saved = {name: json.loads((head / "metrics.json").read_text()) for name, head in heads.items()}
    for name, head in heads.items():
        assert re.search(rf"^{re.escape(str(head))}\s+{saved[name]['sim_tau']:.3f}\s+{saved[name]['decode_tau']:.3f}\s",
                         out, re.M), out
    diff = float(re.search(r"first - second: ([+-][0-9.]+)", out).group(1))
    assert diff == pytest.approx(saved["taps"]["decode_tau"] - saved["default"]["decode_tau"], abs=1.5e-3)
    marker = heads["taps"].parents[1] / "data" / MARKER  # the taps run's data made other: refused, naming why
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "output_id": "other"}))
    proc = subprocess.run([sys.executable, str(SCRIPTS / "compare_heads.py"), str(heads["taps"]), str(heads["default"]),
                           *overrides, f"run_dir={tmp_path / 'default'}"], cwd=ROOT, env=child_env(), capture_output=True,
                          text=True)
    assert proc.returncode != 0 and "holds other data: compare heads trained on the same data" in proc.stderr


@pytest.mark.slow
def test_bench_train_both_heads(source):
    out = run_script("bench_train.py", *source("eagle3", "medusa"), "train.num_threads=1", "--steps", "2",
                     "--ttt", "1", "--micro-batch-tokens", "512")
    assert "== training benchmark: tiny-llama, 2 steps each ==" in out
    assert re.search(r"^eagle3 TTT 1, 512 tok\s+\d+", out, re.M) and re.search(r"^medusa 3 heads, 512 tok\s+\d+", out, re.M)


@pytest.mark.slow
def test_make_bench_on_the_tiny_target(tmp_path):
    """``make bench`` end to end (its data/extract stages first), tiny."""
    args = " ".join([*(f"'{o}'" for o in SOURCE), f"output_root={tmp_path}", "train.num_threads=1",
                     "eval.tree.total_tokens=4", "eval.max_new_tokens=8", "eval.limit=1"])
    env = child_env(OMP_NUM_THREADS="1", TQDM_DISABLE="1")
    proc = subprocess.run(["make", "bench", f"VENV={Path(sys.executable).parents[1]}", f"ARGS={args}"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    for figure in ("== extraction benchmark: tiny-llama", "== training benchmark: tiny-llama", "greedy, "):
        assert figure in proc.stdout


# --- weight decay: matrices only ------------------------------------------------------------------------

def test_vllm_check_counts_tokens_per_pass_over_every_pass(monkeypatch):
    """A head drafts on every pass (tokens per pass = its tau); n-gram only on a match, so its tau (per
    drafted pass) overstates what a pass yields: 2 prompts x 11 new tokens = 20 decode tokens."""
    monkeypatch.syspath_prepend(str(SCRIPTS))
    from vllm_check import acceptance

    tokens = [list(range(11))] * 2
    head = acceptance(drafts=10, draft_tokens=30, accepted=10, accepted_per_pos=[6, 3, 1], tokens=tokens)
    assert head["tau"] == head["tokens_per_pass"] == 2.0     # 10 passes, each 1 accepted + 1
    ngram = acceptance(drafts=4, draft_tokens=12, accepted=8, accepted_per_pos=[4, 3, 1], tokens=tokens)
    assert ngram["tau"] == 3.0 and ngram["tokens_per_pass"] == round(20 / 12, 4)   # 4 drafted + 8 plain passes


def test_vllm_check_gives_each_export_its_own_verdict(tmp_path, monkeypatch):
    """One report per run directory holds every export of it: each gets its own ``ok`` (a model card gives vLLM's
    figures of an export only when the check passed it), the report's is all of them and the n-gram run."""
    monkeypatch.syspath_prepend(str(SCRIPTS))
    from vllm_check import NGRAM, NO_SPEC, Export, TargetCheck, reports

    exports = []
    for fmt in ("vllm", "speculators"):
        (tmp_path / fmt).mkdir()
        (tmp_path / fmt / "config.json").write_text(json.dumps({"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}))
        exports.append(Export(tmp_path, fmt, tmp_path / fmt, 3))
    tokens = [list(range(11))] * 2
    run = {"tokens": tokens, "drafts": 10, "draft_tokens": 30, "accepted": 10, "accepted_per_pos": [6, 3, 1],
           "aux_layers": [1, 2, 3], "tokens_per_s": 9.0, "startup_s": 1.0}
    runs = {NO_SPEC: run, NGRAM: run, str(tmp_path / "vllm"): run,
            str(tmp_path / "speculators"): {**run, "aux_layers": [2, 5, 8]}}   # vLLM's defaults: not what was trained
    ours = {"tokens": tokens, "tau": 2.0}
    check = TargetCheck("t", [[1, 2]], exports, {"vllm_version": "0.32.0", "runs": runs}, [ours, ours], tmp_path / "log")
    args = types.SimpleNamespace(dtype="float32", k=3, max_tokens=10, tau_tolerance=0.1)
    report = reports(check, args)[tmp_path]
    assert report["exports"]["vllm"]["ok"] is True and report["exports"]["speculators"]["ok"] is False
    assert report["ok"] is False


def test_vllm_check_runs_our_decoder_after_the_engine_where_both_copies_do_not_fit(monkeypatch, capsys):
    """Our decoder's float32 target beside the engine's: meanwhile where both fit in the host's available memory,
    after the engine where not (an 8B target: ~64 GB in float32, which killed the check on a 64 GB host)."""
    import psutil

    monkeypatch.syspath_prepend(str(SCRIPTS))
    from vllm_check import side_by_side

    from train.plan import shapes
    from train.target import load_config

    cfg = make_cfg(["model=tiny-llama"])
    both = shapes(cfg, load_config(cfg)).target_params * (4 + 2)
    for available, fits in ((2 * both, True), (both, False)):
        monkeypatch.setattr(psutil, "virtual_memory", lambda available=available: types.SimpleNamespace(
            available=available))
        assert side_by_side(cfg, "bfloat16") is fits
    assert "our decoder runs after the engine" in capsys.readouterr().out


def test_weight_decay_skips_norms_and_biases():
    import torch

    from heads import MedusaConfig, MedusaHead
    from tests.test_heads import HEAD_CFG, tiny_eagle3
    from train.loop import param_groups
    from train.target import load_target

    target = load_target(make_cfg(["model=tiny-llama"]))
    head = tiny_eagle3(target, dv=64)
    groups = param_groups(head, 0.01)
    assert [g["weight_decay"] for g in groups] == [0.01, 0.0]
    decayed, free = ({id(p) for p in g["params"]} for g in groups)
    names = {id(p): n for n, p in head.named_parameters()}
    trainable = {id(p) for p in head.parameters() if p.requires_grad}
    assert decayed | free == trainable and not decayed & free
    assert all(p.ndim >= 2 for g in groups[:1] for p in g["params"])
    assert all(p.ndim == 1 for p in groups[1]["params"])
    assert {"norm.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight"} <= {names[i] for i in free}
    assert {"fc.weight", "midlayer.self_attn.q_proj.weight", "lm_head.weight"} <= {names[i] for i in decayed}
    assert "embed_tokens.weight" not in {names[i] for i in decayed | free}   # frozen: the target's
    optimizer = torch.optim.AdamW(groups, lr=1e-3)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.01, 0.0]
    # Medusa: biases of its residual blocks are not decayed either.
    V = target.config.vocab_size
    medusa = MedusaHead(MedusaConfig.from_target(target.config, HEAD_CFG, 100))
    medusa.set_vocab(torch.zeros(100, dtype=torch.long), torch.zeros(V, dtype=torch.bool))
    mnames = {id(p): n for n, p in medusa.named_parameters()}
    free = {mnames[id(p)] for p in param_groups(medusa, 0.1)[1]["params"]}
    assert free and all(n.endswith(".bias") for n in free)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_bf16_engines_accumulate_and_reduce_gradients_in_fp32(stage):
    """bf16 with ``train.grad_accum_dtype=fp32`` (the default): the engine all-reduces the ranks' gradients in fp32,
    not in DeepSpeed's bf16 default, which rounded every step's gradient on N ranks and not on one; at stage 0 or 1
    it is DeepSpeed's BF16 optimizer (fp32 gradients). Stage 2 stays (its checkpoints load into its own optimizer),
    with a warning: its gradient partitions stay bf16. With ``grad_accum_dtype=bf16`` the stage asked for stays."""
    import torch

    from tests.test_heads import tiny_eagle3
    from train import dist
    from train.loop import make_engine
    from train.target import load_target

    dist.init(torch.device("cpu"), single=True)
    for accum in ("fp32", "bf16"):
        cfg = make_cfg(["model=tiny-llama", f"train.zero_stage={stage}", f"train.grad_accum_dtype={accum}"])
        engine, _ = make_engine(tiny_eagle3(load_target(cfg), dv=64), cfg.train, torch.bfloat16, lambda step: 1.0)
        if accum == "fp32":
            assert engine.zero_optimization_stage() == max(stage, 1) and engine.communication_data_type == torch.float32
            assert (type(engine.optimizer).__name__ == "BF16_Optimizer") is (stage != 2)
        else:
            assert engine.zero_optimization_stage() == stage and engine.communication_data_type == torch.bfloat16


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_the_trainers_engine_decays_matrices_only(optimizer):
    """The optimizer the train stage really steps (AdamW or Muon inside DeepSpeed's engine,
    ``train.loop.make_engine``) keeps the groups: no decay on any norm weight or bias of either head. Muon
    takes the hidden matrices at ``train.muon_lr`` and orthogonalises their updates; the lm_head(s) and the
    1-D weights stay with AdamW at ``train.lr``."""
    import torch

    from heads import MedusaConfig, MedusaHead
    from tests.test_heads import HEAD_CFG, tiny_eagle3
    from train import dist
    from train.loop import make_engine
    from train.target import load_target

    cfg = make_cfg(["model=tiny-llama", "train.weight_decay=0.1", f"train.optimizer={optimizer}"])
    target = load_target(cfg)
    dist.init(torch.device("cpu"), single=True)
    medusa = MedusaHead(MedusaConfig.from_target(target.config, HEAD_CFG, 100))
    medusa.set_vocab(torch.zeros(100, dtype=torch.long), torch.zeros(target.config.vocab_size, dtype=torch.bool))
    for head in (tiny_eagle3(target, dv=64), medusa):
        engine, _ = make_engine(head, cfg.train, torch.float32, lambda step: 1.0)
        names = {id(p): n for n, p in head.named_parameters()}
        decay = {names[id(p)]: g["weight_decay"] for g in engine.optimizer.param_groups for p in g["params"]}
        assert decay.keys() == {n for n, p in head.named_parameters() if p.requires_grad}
        free = {n for n, wd in decay.items() if wd == 0.0}
        assert free == {n for n in decay if "norm" in n or n.endswith(".bias")} and free, decay
        assert set(decay.values()) == {0.0, 0.1}
        if optimizer == "adamw":
            continue
        lr = {names[id(p)]: g["lr"] for g in engine.optimizer.param_groups for p in g["params"]}
        hidden = {n for n, p in head.named_parameters() if p.requires_grad and p.ndim == 2 and "lm_head" not in n}
        assert hidden and {n for n, v in lr.items() if v == cfg.train.muon_lr} == hidden, lr
        assert {lr[n] for n in lr.keys() - hidden} == {cfg.train.lr}
        matrix = dict(head.named_parameters())[min(hidden)]
        before = matrix.detach().clone()
        (u, _), (v, _) = (torch.linalg.qr(torch.randn(n, min(matrix.shape))) for n in matrix.shape)
        grad = u @ torch.diag(torch.logspace(3, 0, min(matrix.shape))) @ v.T   # singular values 1000 .. 1
        matrix.grad = grad.clone()
        for p in head.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
        engine.optimizer.step()
        update = (before * (1 - cfg.train.muon_lr * 0.1) - matrix.detach()).double()
        half = min(update.shape) // 2   # the larger half of the singular values: Newton-Schulz's 5 steps flatten them
        spread = [(s[0] / s[half]).item() for s in (torch.linalg.svdvals(t.double()) for t in (grad, update))]
        assert spread[0] > 10 and spread[1] < 2.5, spread   # quintic NS: about [0.7, 1.2] x, not exactly 1
