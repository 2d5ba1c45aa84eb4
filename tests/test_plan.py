"""The planner (train/plan.py): printed offline for the big presets without weights, the train stage's memory
refusal, and (integration) its disk and memory figures against a real extraction and training step."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch

from tests.conftest import ROOT, child_env, make_cfg
from tests.test_pipeline import prepared as prepared  # noqa: F401  (a module fixture, re-exported)
from train import plan as planner
from train.stages import _write_marker, fingerprint

GiB = 2**30


@pytest.mark.parametrize("model", ["qwen2.5-7b", "llama3.1-8b"])
def test_plan_cli_offline_without_weights(model, tmp_path):
    """`plan=true` prints every stage for a 7-8B preset offline, from the shipped config snapshot,
    without loading weights (the process stays far below the weights' size)."""
    script = ("import runpy, sys; sys.argv = sys.argv[1:]\n"
              "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
              "finally:\n    from train.log import peak_rss_gib\n    print('MAXRSS', peak_rss_gib())")
    env = child_env(HF_HOME=str(tmp_path / "hf"))   # an empty HF cache
    out = subprocess.run([sys.executable, "-c", script, str(ROOT / "train/run.py"), f"model={model}", "head=eagle3",
                          "train=full", "plan=true", "tracking=none", f"output_root={tmp_path}"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    params = {"qwen2.5-7b": "7.62B", "llama3.1-8b": "8.03B"}[model]
    hidden = {"qwen2.5-7b": 3584, "llama3.1-8b": 4096}[model]
    for expected in (f"{params} parameters", f"conf/model/arch/{model}.json", "DATA", "EXTRACT", "TRAIN", "EVAL",
                     f"{4 * hidden * 2 + 4:,} bytes/token", "memory per rank (peak)", "activations", "peak transient",
                     "optimizer states", "tok/s per rank"):
        assert expected in text, (expected, text)
    assert float(text.rsplit("MAXRSS", 1)[1]) < 3
    assert not (tmp_path / model / "eagle3" / "data").exists()   # no stage ran


def test_plan_figures_follow_the_config(cfg_factory):
    """Disk = bytes/token x tokens (stated tokens), memory grows with the micro-batch and the TTT steps."""
    cfg = cfg_factory("model=qwen2.5-7b", "planner.device=gpu", "planner.tokens=1000000")
    p = planner.plan(cfg)
    assert p["dtype"] == "bfloat16" and p["extract"]["disk_bytes"] == 1_000_000 * (4 * 3584 * 2 + 4)
    # the hf backend keeps the states it generates; extract copies them into shards, then deletes them
    assert p["extract"]["disk_peak"] == 2 * p["extract"]["disk_bytes"] and "peak" in planner.format_plan(p)
    single = planner.plan(cfg_factory("model=qwen2.5-7b", "planner.device=gpu", "planner.tokens=1000000",
                                      "extract.source=pass"))["extract"]
    assert single["disk_peak"] == single["disk_bytes"] == p["extract"]["disk_bytes"]
    # extract.source=regen with nothing regenerated: no states kept, so none sit beside the shards
    unregenerated = planner.plan(cfg_factory("model=qwen2.5-7b", "planner.device=gpu", "planner.tokens=1000000",
                                             "extract.source=regen", "data.regenerate=false"))["extract"]
    assert unregenerated["disk_peak"] == unregenerated["disk_bytes"]
    base = p["train"]["memory"]
    bigger = planner.plan(cfg_factory("model=qwen2.5-7b", "planner.device=gpu", "train.micro_batch_tokens=16384"))
    deeper = planner.plan(cfg_factory("model=qwen2.5-7b", "planner.device=gpu", "head.ttt_steps=8"))
    assert bigger["train"]["memory"].items["activations"] > 1.9 * base.items["activations"]
    assert deeper["train"]["memory"].items["activations"] > base.items["activations"]
    # train.loss_norm=token holds a step's micro-batches at once (their counts before the first forward)
    accum = {norm: planner.plan(cfg_factory("model=qwen2.5-7b", "planner.device=gpu", "train.grad_accum=4",
                                            f"train.loss_norm={norm}"))["train"]["memory"].items["batches"]
             for norm in ("token", "micro_batch")}
    prefetch = make_cfg(["model=qwen2.5-7b"]).train.prefetch
    assert accum["token"] * (1 + prefetch) == accum["micro_batch"] * (4 + prefetch) == base.items["batches"] * (4 + prefetch)
    assert p["eval"]["memory"].items["target weights"] == pytest.approx(7.62e9 * 2, rel=0.01)
    # ZeRO-3 extraction: a share of the weights, and the whole (padded) lm_head gathered for the argmax on every rank
    zero3 = planner.extract_memory(cfg_factory("model=qwen2.5-7b", "extract.zero_stage=3"), p["shapes"],
                                   torch.bfloat16, 8)
    assert zero3.items["target weights"] == pytest.approx(7.62e9 * 2 / 8, rel=0.01)
    assert zero3.items["gathered lm_head"] == 152064 * 3584 * 2
    assert zero3.peak > zero3.items["target weights"] + zero3.items["gathered lm_head"]
    huge = planner.plan(cfg_factory("model=qwen2.5-7b", "planner.tokens=10000000000000"))
    assert "DISK TOO SMALL" in planner.format_plan(huge)
    # online training has no extract stage: no disk to refuse
    online = planner.format_plan(planner.plan(cfg_factory("model=qwen2.5-7b", "planner.tokens=10000000000000",
                                                          "train.online=true")))
    assert "EXTRACT  skipped: train.online=true" in online and "DISK TOO SMALL" not in online


def test_the_disk_check_counts_only_what_extract_still_writes(prepared, tmp_path, monkeypatch):
    """A plan between stages said "DISK TOO SMALL: extract will refuse" with room to spare: it wanted twice the
    shards free (the kept states beside them) after the data stage had already written those states, and the
    shards' room again after extract had written them (the free space already counts both)."""
    import collections
    import shutil

    from tests.test_pipeline import fresh_run
    from train.stages import MARKER, stage_dir

    cfg = fresh_run(prepared, tmp_path, "stages=[extract]")
    done = planner.plan(cfg)["extract"]
    assert done["done"] and done["disk_to_write"] == 0 and done["disk_peak"] > 0
    out = stage_dir(cfg, "extract")
    (out / MARKER).unlink()
    shard = max(out.glob("*.safetensors"), key=lambda f: f.stat().st_size)
    lost = shard.stat().st_size
    shard.unlink()   # extraction cut short: one shard to write, the data stage's states long written
    p = planner.plan(cfg)
    assert not p["extract"]["done"] and 0 < p["extract"]["disk_to_write"] <= lost < p["extract"]["disk_peak"]
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(0, 0, 2 * lost))
    assert "DISK TOO SMALL" not in planner.format_plan(planner.plan(cfg))
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(0, 0, lost // 2))
    assert "DISK TOO SMALL" in planner.format_plan(planner.plan(cfg))


def test_plan_reads_the_states_of_every_training_step_from_disk(cfg_factory):
    """Each training step reads its rows' states from run_dir (~29 KB per token at 7B, TBs in all: no page cache
    holds them): 8 GPUs at 17k tok/s each need 4 GB/s, and the plan counted none of it. Training's rate is now also
    capped by planner.disk_mb_s shared by the ranks; online training reads none, and a stated rate stands."""
    args = ("model=qwen2.5-7b", "planner.device=gpu", "planner.world_size=8")
    p = planner.plan(cfg_factory(*args))
    per_token = p["extract"]["bytes_per_token"]
    assert p["train"]["tok_s"] == pytest.approx(1000e6 / per_token / 8) and per_token > 28e3
    assert p["train"]["basis"].startswith("planner.disk_mb_s") and "reads its rows' states" in planner.format_plan(p)
    fast = planner.plan(cfg_factory(*args, "planner.disk_mb_s=100000"))["train"]
    assert fast["basis"].startswith("planner.gpu.train_tflops") and fast["tok_s"] > 2 * p["train"]["tok_s"]
    online = planner.plan(cfg_factory(*args, "train.online=true"))["train"]
    assert online["basis"].startswith("planner.gpu.train_tflops")
    assert planner.plan(cfg_factory(*args, "planner.train_tok_s=9000"))["train"]["tok_s"] == 9000


def test_plan_holds_out_the_validation_rows_the_data_stage_will(cfg_factory):
    """Before the data stage, the plan's validation tokens are the rows ``data.stage.assign_splits`` holds out
    (rounded, at least one, capped) at the tokens of one regenerated answer each (train=full's 2048-token answers:
    ~1350 tokens, where ``planner.avg_row_tokens``, 256, made the plan's disk and hours 5x short), or
    ``planner.avg_row_tokens`` for data kept as it is."""
    from data.stage import assign_splits

    for rows, fraction, cap in ((10, 0.05, None), (500_000, 0.05, 1000), (1000, 0.1, None)):
        args = ("model=qwen2.5-7b", f"planner.rows={rows}", f"data.validation_fraction={fraction}",
                f"data.validation_max_rows={'null' if cap is None else cap}")
        cfg = cfg_factory(*args)
        convs = [{"id": str(i), "split": None} for i in range(rows)]
        assign_splits(convs, fraction, 0, cap)
        held = sum(c["split"] == "validation" for c in convs)
        tokens, _ = planner.data_tokens(cfg)
        per_row = min(round(0.66 * 2048), cfg.data.max_length)
        assert tokens == {"train": (rows - held) * per_row, "validation": held * per_row}
        as_is, _ = planner.data_tokens(cfg_factory(*args, "data.regenerate=false"))
        assert as_is == {"train": (rows - held) * 256, "validation": held * 256}


def test_plan_times_the_data_stage(cfg_factory, tmp_path):
    """The data stage's generation: prompts x planner.synth_tokens + answered user turns x answer tokens, over the
    backend's rate x its replicas (hf: one per rank, vllm: data-parallel replicas of its GPUs sharing
    data.regen.concurrency, openai: stated or unknown); a finished data stage has nothing left; the extract stage
    copies the states kept while regenerating instead of computing them."""
    args = ("model=qwen2.5-7b", "planner.device=gpu", "planner.rows=1000", "data.regen.max_new_tokens=1000",
            "data.sources=[{type:builtin},{type:synth,n:500,split:train}]")
    hf = planner.plan(cfg_factory(*args))
    ge = hf["data"]
    assert ge["tokens"] == {"prompts": 500 * 64, "answers": round(1000 * 0.66 * 1000)} and ge["answers"] == 1000
    assert ge["hours"] == pytest.approx(sum(ge["tokens"].values()) / ge["tok_s"] / 3600)
    # a step of the hf loop at 28 layers costs more than reading 15 GB of bf16 weights over the rows' KV caches
    assert ge["tok_s"] == pytest.approx(64 / (28 * 3.2e-3 + (7.62e9 + 64 * 256 * 2 * 28 * 4 * 128) * 2 / 3350e9), rel=0.01)
    eight = planner.plan(cfg_factory(*args, "planner.world_size=8"))["data"]
    assert eight["replicas"] == 8 and eight["hours"] == pytest.approx(ge["hours"] / 8)
    vllm = planner.plan(cfg_factory(*args, "data.regen.backend=vllm"))
    assert vllm["data"]["hours"] < ge["hours"] / 5   # no Python loop per layer
    # 8 GPUs at -tp 2: 4 replicas of 2 GPUs, the 128 conversations in flight shared by them
    tp = planner.plan(cfg_factory(*args, "data.regen.backend=vllm", "planner.world_size=8", "data.regen.concurrency=128",
                                  "data.regen.vllm.args=[-tp,2]"))["data"]
    assert tp["replicas"] == 4 and tp["basis"].startswith("32 rows a step") and "over 2 GPUs" in tp["basis"]
    # the hf backend keeps the states it generates: extract copies them (reads and writes them: disk-bound);
    # vllm's rows need the target's forward pass
    ex = hf["extract"]
    assert "copying the states kept" in ex["basis"] and "copying" not in vllm["extract"]["basis"]
    assert ex["hours"] == pytest.approx(2 * sum(hf["tokens"].values()) * ex["bytes_per_token"] / 1000e6 / 3600)
    server = planner.plan(cfg_factory(*args, "data.regen.backend=openai"))
    assert server["data"]["hours"] is None and "set planner.regen_tok_s" in planner.format_plan(server)
    stated = planner.plan(cfg_factory(*args, "data.regen.backend=openai", "planner.regen_tok_s=1000"))["data"]
    assert stated["hours"] == pytest.approx(sum(ge["tokens"].values()) / 1000 / 3600)
    assert "TIME  data + extract + train" in planner.format_plan(hf)
    # a slow disk binds the hf backend's kept states (every row: one answer of 0.66 x 1000 tokens, over 256)
    slow = planner.plan(cfg_factory(*args, "planner.disk_mb_s=1"))["data"]
    assert slow["basis"].startswith("planner.disk_mb_s") and slow["hours"] == pytest.approx(
        1000 * 660 * hf["extract"]["bytes_per_token"] / 1e6 / 3600)
    given = planner.plan(cfg_factory(*args, "data.regenerate=false", "data.sources=[{type:builtin}]"))
    assert given["data"]["tokens"] == {"prompts": 0, "answers": 0} and given["data"]["hours"] == 0
    assert "copying" not in given["extract"]["basis"]   # nothing regenerated, nothing kept
    # stages whose outputs are current take no time; a marker of another config does not count
    done = cfg_factory(*args)
    for name in ("data", "extract"):
        planner.stage_dir(done, name).mkdir(parents=True)
        _write_marker(done, name, fingerprint(done, name), time.time(), {})
    (planner.stage_dir(done, "data") / "manifest.json").write_text(json.dumps({"tokens": {"train": 10, "validation": 1}}))
    finished = planner.plan(done)
    text = planner.format_plan(finished)
    assert finished["data"] == {"done": True, "hours": 0.0} and "DATA  done" in text
    assert finished["extract"]["hours"] == 0 and finished["train"]["hours"] > 0 and "time" in text
    changed = planner.plan(cfg_factory(*args, "data.regen.max_new_tokens=999"))
    assert not changed["data"]["done"] and changed["data"]["hours"] > 0 and changed["extract"]["hours"] > 0


def test_plan_counts_rows_and_turns_as_the_data_stage_will(cfg_factory, tmp_path):
    """Rows with a split of their own keep it, the others split as assign_splits will; every user turn is an answer;
    data.train_rows keeps its share of the training rows and turns; a synth source counts min(n, limit) rows (all n
    prompts written); a Hub source needs planner.rows or planner.tokens."""
    from data.stage import assign_splits

    local = tmp_path / "chats.jsonl"
    convs = [{"messages": [{"role": "user", "content": f"question {i} " * 3}, {"role": "assistant", "content": "a"},
                           {"role": "user", "content": "and then?"}, {"role": "assistant", "content": "b"}]}
             for i in range(40)]
    local.write_text("\n".join(json.dumps(c) for c in convs))
    sources = (f"data.sources=[{{type:builtin}},{{path:{local}}},{{type:synth,n:30,limit:20,split:train}}]",
               "data.validation_fraction=0.1")
    rows = planner.count_rows(cfg_factory(*sources))
    builtin = planner.count_rows(cfg_factory("data.sources=[{type:builtin}]"))
    free = [{"id": str(i), "split": None} for i in range(40)]
    assign_splits(free, 0.1, 0)
    held = sum(c["split"] == "validation" for c in free)
    assert held == 4 and builtin.validation == 96   # the built-in set's own validation split, not 5% of it
    assert rows.validation == builtin.validation + held and rows.train == builtin.train + 40 - held + 20
    assert rows.turns == builtin.turns + 2 * 40 + 20 and builtin.turns > builtin.train + builtin.validation
    subset = planner.count_rows(cfg_factory(*sources, "data.train_rows=100"))
    assert subset.train == 100 and subset.validation == rows.validation
    assert subset.validation_turns == rows.validation_turns
    assert subset.train_turns == pytest.approx(rows.train_turns * 100 / rows.train)
    tokens, _ = planner.data_tokens(cfg_factory(*sources, "data.train_rows=100"))
    assert tokens == {"train": 100 * 256, "validation": rows.validation * 256}
    plan = planner.plan(cfg_factory(*sources))["data"]
    assert plan["prompts"] == 30 and plan["answers"] == rows.turns
    hub = "data.sources=[{hf:some/dataset},{type:synth}]"
    with pytest.raises(planner.ConfigError, match="planner.rows"):
        planner.count_rows(cfg_factory(hub))
    counted = planner.count_rows(cfg_factory(hub, "planner.tokens=256000"))
    assert counted.train + counted.validation == counted.turns == 1000
    assert planner.plan(cfg_factory(hub, "planner.rows=10"))["data"]["prompts"] == 100   # the synth default n


def test_check_train_memory_refuses_when_short(cfg_factory, monkeypatch):
    cfg = cfg_factory("model=qwen2.5-7b", "device=cpu")
    free = {"bytes": GiB}
    monkeypatch.setattr(planner.psutil, "virtual_memory", lambda: type("VM", (), {"available": free["bytes"]})())
    with pytest.raises(planner.MemoryShortError) as err:
        planner.check_train_memory(cfg, torch.device("cpu"))
    message = str(err.value)
    for key in ("train.micro_batch_tokens", "head.ttt_steps", "head.draft_vocab_size", "train.zero_stage",
                "1.00 GiB free"):
        assert key in message, message
    free["bytes"] = 10**15
    est = planner.check_train_memory(cfg, torch.device("cpu"))
    assert est.peak > est.items["activations"] > 0
    free["bytes"] = GiB
    planner.check_train_memory(cfg_factory("model=qwen2.5-7b", "device=cpu", "planner.enforce=false"), torch.device("cpu"))


def test_every_rank_refuses_when_one_rank_is_short(cfg_factory, monkeypatch):
    """Rank 1's GPU is half taken by another job: rank 0, with room, refuses too (alone, rank 1 refusing left the
    others waiting in their next collective until the timeout)."""
    from train import dist

    cfg = cfg_factory("model=qwen2.5-7b", "device=cpu")
    monkeypatch.setattr(planner.psutil, "virtual_memory", lambda: type("VM", (), {"available": 10**15})())
    monkeypatch.setattr(dist, "all_gather_objects", lambda mine: [mine, GiB])
    with pytest.raises(planner.MemoryShortError, match=r"1.00 GiB free on rank 1's cpu \(the least of 2\)"):
        planner.check_train_memory(cfg, torch.device("cpu"))


def test_online_training_counts_the_embedding_its_head_shares_once(cfg_factory):
    """Online, the EAGLE-3 head embeds with the target's own embedding: counted in the target's weights, not again
    in the head's (1.09 GB per rank at Qwen2.5-7B, enough for planner.enforce to refuse a run that fits)."""
    items = {}
    for online in (False, True):
        cfg = cfg_factory("model=qwen2.5-7b", "device=cpu", f"train.online={str(online).lower()}")
        sh = planner.shapes(cfg, planner.architecture(cfg))
        items[online] = planner.train_memory(cfg, sh, torch.bfloat16, 1).items["head frozen weights"]
    assert items[False] - items[True] == sh.config.vocab_size * sh.config.hidden_size * 2


def test_peak_tensor_memory_counts_new_storages_only():
    before = torch.zeros(1000)
    with planner.peak_tensor_memory() as m:
        view = before[:500].view(10, 50)          # a view of an older tensor: no new memory
        before.add_(1)                            # in place: no new memory
        a = torch.zeros(1000)                     # 4000 bytes
        b = a * 2                                 # 4000 more
        del a
        c = torch.zeros(250)                      # 1000: the peak stays 8000
        del b, c, view
    assert m.peak == 8000


# ----------------------------------------------------------------------------------------- integration
# 16 built-in prompts with short answers; train.prefetch=0: the measured step builds its batch inline (tensors
# made on a prefetch thread escape the dispatch mode that measures).
DATA = ["data.sources=[{type:builtin,limit:16}]", "data.regen.max_new_tokens=32", "train.prefetch=0"]


@pytest.fixture(scope="module")
def extracted(tmp_path_factory):
    """The default target's data and extract stages on 16 built-in prompts (the default config otherwise)."""
    from train.stages import run_stages

    cfg = make_cfg([*DATA, f"output_root={tmp_path_factory.mktemp('plan')}", "stages=[data,extract]"])
    run_stages(cfg)
    return cfg


def within(planned: float, measured: float, tolerance: float = 0.10) -> bool:
    print(f"planned {planned:,.0f} B, measured {measured:,.0f} B ({planned / measured - 1:+.2%})")
    return abs(planned / measured - 1) <= tolerance


@pytest.mark.integration
def test_extract_disk_and_memory_match_a_real_extraction(extracted):
    from train.extract import capture
    from train.losses import full_argmax
    from train.stages import stage_dir
    from train.target import load_target

    manifest = json.loads((stage_dir(extracted, "extract") / "manifest.json").read_text())
    p = planner.plan(extracted)
    assert p["tokens"] == json.loads((stage_dir(extracted, "data") / "manifest.json").read_text())["tokens"]
    assert within(p["extract"]["disk_bytes"], manifest["bytes"])
    # One forward of extract.batch_tokens (as in train.extract.run), fp32 on CPU: everything but the weights.
    target = load_target(extracted)
    est = planner.extract_memory(extracted, p["shapes"], torch.float32, 1, tokens=2048)
    ids = torch.randint(0, 1000, (4, 512))
    with torch.inference_mode(), planner.peak_tensor_memory() as m:
        states = capture(target, ids, manifest["layers"], torch.ones_like(ids))
        full_argmax(states[:, :, -1], target.get_output_embeddings().weight)
    assert within(est.peak - est.items["target weights"], m.peak)


def measure_train_step(cfg, *overrides: str) -> tuple[int, int]:
    """(planned, measured) peak bytes of one training step of ``cfg`` + ``overrides`` on its extracted data, set
    up as ``train.loop.run`` does offline (the target is never loaded), fp32 on CPU: live tensors of the second
    step (the optimizer's states exist) + the head, its buffers, the draft rows and the optimizer's states."""
    from data.stage import load_dataset, row_lengths
    from train.extract import Captures, capture_layers
    from train.loop import Batches, _n_steps, compute, make_head, micro_batches
    from train.stages import stage_dir
    from train.target import load_weights

    cfg = make_cfg([*DATA, f"output_root={cfg.output_root}", *overrides])
    kind, dtype, device = cfg.head.type, torch.float32, torch.device("cpu")
    torch.manual_seed(0)
    weights = load_weights(cfg, dtype)
    head, draft_rows = make_head(cfg, weights, device, dtype)
    ds = load_dataset(cfg)
    make = Batches("train", ds["train"], Captures(stage_dir(cfg, "extract")), None,
                   capture_layers(cfg, weights.config), device)
    del weights
    lengths = row_lengths(ds["train"])
    rows = max(micro_batches(lengths, cfg.train.micro_batch_tokens, 0), key=lambda b: len(b) * max(lengths[r] for r in b))
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay, betas=(0.9, 0.95))

    def step() -> None:
        batch = make(rows)
        stats = compute(head, kind, batch, draft_rows, cfg, cfg.train.positions, _n_steps(cfg))
        stats.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.train.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    with planner.peak_tensor_memory() as m:
        step()
    state = [*head.parameters(), *head.buffers(), draft_rows, *(v for s in optimizer.state.values() for v in s.values())]
    measured = m.peak + sum(t.untyped_storage().nbytes() for t in state)
    # The plan of exactly this micro-batch: rows x longest padded tokens.
    T = max(lengths[r] for r in rows)
    like = make_cfg([*DATA, f"output_root={cfg.output_root}", *overrides, f"train.micro_batch_tokens={len(rows) * T}",
                     f"data.max_length={T}"])
    est = planner.train_memory(like, planner.shapes(like, planner.architecture(like)), dtype, 1)
    assert est.items["target weights"] == 0
    return est.peak, measured


@pytest.mark.integration
@pytest.mark.parametrize("overrides", [(), ("train.micro_batch_tokens=200", "head.ttt_steps=5"), ("head.loss=kl",)],
                         ids=["default", "small-batch-ttt5", "kl"])
def test_train_memory_matches_a_real_training_step(extracted, overrides):
    """The planned peak of a training step (head, optimizer, batch, activations, transients) against a real
    step of the default config (and one where the backward's gradients, not the forward, set the peak; and
    the objective before kl_mix, which keeps two fewer [tokens, draft vocab] tensors per step)."""
    assert within(*measure_train_step(extracted, *overrides))
