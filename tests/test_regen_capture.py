"""Hidden states kept while regenerating (``extract.source: regen``) equal a separate extraction pass."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from data.captured import CapturedStates
from tests.conftest import generate, make_cfg
from train.extract import capture, capture_layers
from train.losses import full_argmax
from train.stages import read_marker, run_stages, stage_dir
from train.target import load_config, load_target, load_tokenizer

LAYERS = [1, 4, 6, 8]  # tiny twins have 8 layers: three taps and the final (post-norm) state


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("twin", ["tiny-qwen2", "tiny-llama"])
def test_generation_keeps_the_states_of_a_forward_pass(twin, temperature):
    """Prefill + one state per fed token + the forced tail == one forward pass over the whole sequence (fp32),
    and keeping the states changes no answer (sampling draws only for rows still answering)."""
    cfg = make_cfg([f"model={twin}"])
    model, tok = load_target(cfg), load_tokenizer(cfg)
    prompts = [tok(t)["input_ids"] for t in ["a b", "hello there, how are you", "x"]]
    eos = {tok.eos_token_id}
    tails = {0: [tok.eos_token_id, 7], 1: [], 2: None}  # row 2: its states are dropped

    def run(layers):
        gen = torch.Generator().manual_seed(3)
        return generate(model, prompts, 12, eos, tok.pad_token_id, temperature, 0.9, gen, layers,
                        lambda j, answer, hit_eos: None if tails[j] is None else list(tails[j]))

    plain, kept = run(None), run(LAYERS)
    assert [(a.tokens, a.hit_eos) for a in plain] == [(a.tokens, a.hit_eos) for a in kept]
    assert all(a.states is None for a in plain) and kept[2].states is None
    for j in (0, 1):
        ids = prompts[j] + kept[j].tokens + tails[j]
        assert kept[j].states.shape == (len(ids), len(LAYERS), model.config.hidden_size)
        ref = capture(model, torch.tensor([ids]), LAYERS)[0]
        torch.testing.assert_close(kept[j].states, ref, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def text_twin(tmp_path_factory) -> list[str]:
    """Overrides for tiny-qwen2 whose lm_head rows are zero except for printable ASCII characters and EOS: its
    greedy answers are text that re-tokenises to the same ids (a random byte-level twin writes invalid UTF-8,
    which never round-trips: its rows train on the generated ids, data.template.as_generated)."""
    import shutil

    from train.target import target_path

    cfg = make_cfg(["model=tiny-qwen2"])
    out = tmp_path_factory.mktemp("text-twin")
    shutil.copytree(target_path(cfg), out, dirs_exist_ok=True)
    model, tok = load_target(cfg), load_tokenizer(cfg)
    ok = [i for i in range(len(tok)) if len(t := tok.decode([i])) == 1 and t.isascii() and t.isprintable() and t != " "]
    keep = torch.zeros(model.config.vocab_size, dtype=torch.bool)
    keep[ok + [tok.eos_token_id]] = True
    with torch.no_grad():
        model.get_output_embeddings().weight[~keep] = 0.0  # logit 0 < the max of ~90 random logits
    model.save_pretrained(out)
    return ["model=tiny-qwen2", "model.source=hf", f"model.path={out}", "model.name=text-qwen2"]


# The regeneration in float32 whatever the default: these tests compare the states kept while regenerating with
# a float32 extraction pass.
FP32_REGEN = "data.regen.dtype=float32"


def _run(tmp_path, twin: list[str], source: str, *extra: str, regen: str = FP32_REGEN):
    cfg = make_cfg([*twin, "data.sources=[{type:builtin,limit:16}]", "data.regen.max_new_tokens=12",
                    "data.regen.batch_size=5", regen, "head.draft_vocab_size=96", f"extract.source={source}",
                    "extract.shard_mb=0.05", "stages=[data,extract]", f"output_root={tmp_path / source}", *extra])
    run_stages(cfg)
    return cfg


def _shards(cfg) -> dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]]:
    """(split, row) -> (hidden, argmax) over every shard of the extract stage."""
    out = {}
    for shard in json.loads((stage_dir(cfg, "extract") / "manifest.json").read_text())["shards"]:
        t = load_file(str(stage_dir(cfg, "extract") / shard["file"]))
        for j, r in enumerate(t["row_index"].tolist()):
            a, b = t["offsets"][j], t["offsets"][j + 1]
            out[shard["split"], r] = (t["hidden"][a:b], t["argmax"][a:b])
    return out


def test_an_extract_rerun_that_writes_the_same_states_keeps_the_training_checkpoints(tmp_path, text_twin):
    """extract.batch_tokens changed (how the states are computed, not what they are): the stage reruns and finds its
    shards done. Its output identity must stay: it changed with what the manifest said of how it was made (rows
    kept while regenerating: all the first time, 0 after, their states deleted once copied; the rank count), so the
    training checkpoints were refused and force=[train] threw the head's training away."""
    base = [*text_twin, "data.sources=[{type:builtin,limit:16}]", "data.regen.max_new_tokens=12", FP32_REGEN,
            "head.draft_vocab_size=96", "extract.shard_mb=0.05", f"output_root={tmp_path}", "train.checkpoint_every=2",
            "train.eval_every=1000", "train.max_minutes=null", "train.micro_batch_tokens=1024"]
    cfg = make_cfg([*base, "stages=[data,extract,train]", "train.max_steps=2"])
    run_stages(cfg)
    assert json.loads((stage_dir(cfg, "extract") / "provenance.json").read_text())["from_regeneration"]["rows"] > 0
    extract_id = read_marker(cfg, "extract")["output_id"]
    run_stages(make_cfg([*base, "stages=[extract,train]", "train.max_steps=4", "extract.batch_tokens=1024"]))
    assert read_marker(cfg, "extract")["output_id"] == extract_id
    assert json.loads((stage_dir(cfg, "train") / "summary.json").read_text())["steps"] == 4   # resumed, not refused


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 2e-2)])
def test_extract_from_regeneration_equals_a_separate_pass(tmp_path, text_twin, dtype, tol):
    """Data + extract with the states kept while regenerating write the same shards as regeneration followed
    by an extraction pass: within fp32 rounding in float32, within bf16 rounding in bfloat16."""
    kept = _run(tmp_path, text_twin, "regen", f"extract.dtype={dtype}")
    passed = _run(tmp_path, text_twin, "pass", f"extract.dtype={dtype}")
    manifest = json.loads((stage_dir(kept, "extract") / "manifest.json").read_text())
    provenance = json.loads((stage_dir(kept, "extract") / "provenance.json").read_text())
    rows = sum(manifest["rows"].values())
    assert provenance["from_regeneration"]["rows"] == rows
    assert not (stage_dir(kept, "data") / "captured").exists()  # consumed
    a, b = _shards(kept), _shards(passed)
    assert a.keys() == b.keys() and len(a) == rows
    for key in a:
        torch.testing.assert_close(a[key][0].float(), b[key][0].float(), rtol=tol, atol=tol)
        # argmax from states that differ in the last bits may flip only at near-ties
        assert (a[key][1] == b[key][1]).float().mean() >= (1.0 if dtype == "float32" else 0.95)


@pytest.mark.parametrize("keep_all,disk", [(False, 1.7), (True, 1.5)])
def test_a_disk_filling_up_keeps_fewer_states_and_extract_computes_the_rest(tmp_path, text_twin, monkeypatch,
                                                                            keep_all, disk):
    """States kept while regenerating take 28.7 KB per token at 7B (TBs for a ShareGPT-sized set), and the extract
    stage writes every row's shards while they are still on disk. The disk holds ``disk`` x the shards. The data
    stage keeps no more states once the shards of every row (its estimate: the mean kept row x all rows) would no
    longer fit beside them: it kept until only a copy of the kept ones fit, and the extract stage then refused,
    after the whole data stage. Where that estimate falls short (here: a writer made to keep all), the
    extract stage deletes the last kept files until the shards fit. Either way it computes the rows not kept and
    writes the same shards as a separate pass."""
    from collections import namedtuple
    from functools import partial

    import data.engines

    passed = _run(tmp_path, text_twin, "pass", "extract.dtype=float32")
    shards = json.loads((stage_dir(passed, "extract") / "manifest.json").read_text())["bytes"]
    usage = namedtuple("usage", "total used free")

    def disk_usage(path):   # less what the run below has written (kept states, then shards)
        used = sum(f.stat().st_size for f in (tmp_path / "short").rglob("*.safetensors"))
        return usage(2**40, used, int(disk * shards) - used)

    monkeypatch.setattr("shutil.disk_usage", disk_usage)
    writer = {"keep_free": -2**40, "margin": 0.0} if keep_all else {"keep_free": int(0.1 * shards)}
    monkeypatch.setattr(data.engines, "CaptureWriter", partial(data.engines.CaptureWriter, **writer))
    short = _run(tmp_path / "short", text_twin, "regen", "extract.dtype=float32")
    rows = sum(json.loads((stage_dir(short, "extract") / "manifest.json").read_text())["rows"].values())
    kept = json.loads((stage_dir(short, "extract") / "provenance.json").read_text())["from_regeneration"]["rows"]
    assert 0 < kept < rows
    a, b = _shards(short), _shards(passed)
    assert a.keys() == b.keys() and len(a) == rows
    for key in a:
        torch.testing.assert_close(a[key][0], b[key][0], rtol=1e-5, atol=1e-5)


def test_kept_states_are_deleted_only_where_that_makes_room(tmp_path):
    """The extract stage deletes the newest kept parts to fit its shards, but none where deleting them all would not:
    it refused anyway, and the user who made room then had every row to compute again."""
    from train.extract import make_room

    kept, out = tmp_path / "captured", tmp_path / "extract"
    kept.mkdir(), out.mkdir()
    for i in range(3):
        (kept / f"part-{i}-1.safetensors").write_bytes(b"x" * 100)
    assert make_room(kept, out, 301) == 0 and len(list(kept.iterdir())) == 3
    assert make_room(kept, out, 150) == 200 and [p.name for p in kept.iterdir()] == ["part-0-1.safetensors"]


def test_states_kept_for_a_source_changed_to_pass_are_deleted(tmp_path, text_twin):
    """Kept while regenerating, then extract.source=pass: nothing reads them, and nothing deleted them (TBs)."""
    cfg = _run(tmp_path, text_twin, "regen", "stages=[data]")
    assert any((stage_dir(cfg, "data") / "captured").iterdir())
    run_stages(make_cfg([*text_twin, "data.sources=[{type:builtin,limit:16}]", "data.regen.max_new_tokens=12",
                         "data.regen.batch_size=5", FP32_REGEN, "head.draft_vocab_size=96", "extract.source=pass",
                         "extract.shard_mb=0.05", "stages=[extract]", f"output_root={tmp_path / 'regen'}"]))
    assert not (stage_dir(cfg, "data") / "captured").exists()


def test_each_rank_checks_the_kept_states_of_its_own_rows_only(tmp_path, text_twin, monkeypatch):
    """Every rank compared the kept tokens of every row with the dataset's (500k rows x 8 ranks: each row read 8
    times over, through a file cache missing in dataset order); a rank now checks only the rows of its shards."""
    from data.stage import load_dataset, row_lengths
    from train.extract import ReadyStates

    cfg = _run(tmp_path, text_twin, "regen", "stages=[data]")
    ds = load_dataset(cfg)
    lengths = {s: row_lengths(ds[s]) for s in ("train", "validation")}
    manifest = json.loads((stage_dir(cfg, "data") / "manifest.json").read_text())
    checked, covers = [], CapturedStates.covers
    monkeypatch.setattr(CapturedStates, "covers", lambda self, key, ids: checked.append(key) or covers(self, key, ids))
    wanted = {"train": [0, 2, 3], "validation": [0]}
    ready = ReadyStates(cfg, ds, lengths, capture_layers(cfg, load_config(cfg)), manifest["target_fingerprint"],
                        manifest["dataset_id"], True, wanted)
    assert sorted(checked) == sorted(ds[s][r]["key"] for s, rows in wanted.items() for r in rows)
    assert ready.rows == {s: dict.fromkeys(rows, "regeneration") for s, rows in wanted.items()}
    assert ready.summary()["from_regeneration"] == {"rows": 4, "tokens": sum(lengths[s][r] for s in wanted
                                                                              for r in wanted[s])}


def test_states_kept_before_a_backend_change_are_still_used(tmp_path, text_twin):
    """Kept with hf, then data.regen.backend=openai (the data stage ignores the key: not rerun): under
    extract.source=auto the extract stage neither used nor deleted them (TBs, every row computed again)."""
    cfg = _run(tmp_path, text_twin, "auto", "stages=[data]")
    changed = _run(tmp_path, text_twin, "auto", "stages=[extract]", "data.regen.backend=openai",
                   "data.regen.url=http://127.0.0.1:9")
    assert read_marker(changed, "data")["fingerprint"] == read_marker(cfg, "data")["fingerprint"]
    provenance = json.loads((stage_dir(changed, "extract") / "provenance.json").read_text())
    assert provenance["from_regeneration"]["rows"] > 0
    assert not (stage_dir(changed, "data") / "captured").exists()  # copied, then deleted


def test_a_data_stage_with_every_answer_cached_loads_no_target(tmp_path, text_twin, monkeypatch):
    """A data stage rerun whose answers are all cached (force=[data], a changed data.max_length) loaded the 7-8B
    target for nothing (1-2 min per run)."""
    import train.target

    _run(tmp_path, text_twin, "pass", "stages=[data]")
    monkeypatch.setattr(train.target, "load_target", lambda *a, **k: pytest.fail("the target was loaded"))
    cfg = _run(tmp_path, text_twin, "pass", "stages=[data]", "force=[data]")
    assert json.loads((stage_dir(cfg, "data") / "stats.json").read_text())["regeneration"]["generated"] == 0


@pytest.mark.parametrize("caps,native", [({"amx_bf16": True}, True), ({"avx512_bf16": True, "amx_bf16": False}, True),
                                         ({"avx512_bf16": False, "amx_bf16": False, "avx2": True}, False)])
def test_regen_dtype_auto_is_bf16_on_a_cpu_with_native_bf16_else_the_runs_dtype(caps, native, monkeypatch):
    """data.regen.dtype=auto regenerates in bfloat16 on a CPU with AMX tiles or AVX-512 BF16, elsewhere in the
    run's dtype; an explicit value wins."""
    from train.target import regen_dtype

    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: caps)
    assert regen_dtype(make_cfg(["device=cpu"])) == (torch.bfloat16 if native else torch.float32)
    assert regen_dtype(make_cfg(["device=cpu", "dtype=bfloat16"])) == torch.bfloat16
    assert regen_dtype(make_cfg(["device=cpu", "data.regen.dtype=bfloat16"])) == torch.bfloat16
    assert regen_dtype(make_cfg(["device=cpu", "dtype=bfloat16", "data.regen.dtype=float32"])) == torch.float32


def test_regeneration_in_bfloat16_keeps_the_states_of_its_own_pass(tmp_path, text_twin):
    """data.regen.dtype=bfloat16 (a float32 run otherwise): the target regenerates in bfloat16, says so in the
    stats, and the states it keeps are those of a bfloat16 extraction pass over the same answers, up to bf16
    rounding (an incremental decode and a prefill round differently)."""
    from data.stage import load_dataset
    from tests.test_regen_backends import cache_of

    regen = "data.regen.dtype=bfloat16"
    kept = _run(tmp_path, text_twin, "regen", "extract.dtype=bfloat16", regen=regen)
    passed = _run(tmp_path, text_twin, "pass", "extract.dtype=bfloat16", "dtype=bfloat16", regen=regen)
    stats = json.loads((stage_dir(kept, "data") / "stats.json").read_text())["regeneration"]
    assert stats["dtype"] == "bfloat16" and kept.dtype == "auto"
    answers = [{k: r["messages"] for k, r in cache_of(cfg).items()} for cfg in (kept, passed)]
    # the same batches in the same dtype: the same answers, but where a bf16 near-tie of the greedy choice flips
    # (the run that keeps states takes its logits from the whole sequence's lm_head product, the other from the last
    # position's: another GEMM, other roundings)
    assert answers[0].keys() == answers[1].keys()
    assert sum(answers[0][k] == answers[1][k] for k in answers[0]) >= 0.75 * len(answers[0])
    a, b = _shards(kept), _shards(passed)
    assert a.keys() == b.keys() and len(a) == sum(json.loads((stage_dir(kept, "extract") / "manifest.json")
                                                             .read_text())["rows"].values())
    ids = [{(split, r): list(map(int, row["input_ids"])) for split, rows in load_dataset(cfg).items()
            for r, row in enumerate(rows)}
           for cfg in (kept, passed)]
    same = [k for k in a if ids[0][k] == ids[1][k]]   # rows of the same answers
    assert len(same) >= 0.75 * len(a)
    scale = max(v[0].float().abs().max().item() for v in b.values())
    for key in same:
        assert (a[key][0].float() - b[key][0].float()).abs().max().item() <= 0.05 * scale
    assert torch.cat([a[k][1] == b[k][1] for k in same]).float().mean() >= 0.9


def _check_captured(cfg):
    """(the train split, how many of its rows the kept states cover): each covered row's states and argmax equal a
    float32 forward pass over its ids."""
    from data.stage import load_dataset

    model, layers = load_target(cfg), capture_layers(cfg, load_config(cfg))
    ds = load_dataset(cfg)["train"]
    captured = CapturedStates(stage_dir(cfg, "data") / "captured", layers, "float32",
                              json.loads((stage_dir(cfg, "data") / "manifest.json").read_text())["target_fingerprint"])
    checked = 0
    for row in ds:
        if not captured.covers(row["key"], row["input_ids"]):
            continue
        hidden, argmax = captured.get(row["key"], int(row["length"]))
        ref = capture(model, torch.tensor([row["input_ids"].tolist()]), layers)[0]
        torch.testing.assert_close(hidden, ref, rtol=1e-5, atol=1e-5)
        assert torch.equal(argmax.long(), full_argmax(ref[:, -1], model.get_output_embeddings().weight))
        checked += 1
    stats = json.loads((stage_dir(cfg, "data") / "stats.json").read_text())
    assert stats["regeneration"]["captured"]["rows"] == len(captured) >= checked
    return ds, checked


def test_a_reasoning_cut_at_max_new_tokens_trains_on_what_the_target_saw(tmp_path):
    """Qwen3's template renders a last answer without ``</think>`` after an empty ``<think>`` block of its own: an
    answer cut at max_new_tokens (the twin writes no ``</think>``: a reasoning cut before its end) would train on a
    context the target never saw, and lose its kept states. Its row is the prompt and the answer as generated, which
    the states kept while regenerating cover."""
    from train.target import target_path

    base = make_cfg(["model=tiny-qwen3"])
    out = tmp_path / "qwen3-template"
    shutil.copytree(target_path(base), out)
    tok = load_tokenizer(base)
    tok.chat_template = (Path(__file__).parent / "fixtures/templates/qwen3-8b.jinja").read_text()
    tok.save_pretrained(out)
    cfg = make_cfg(["model=tiny-qwen3", "model.source=hf", f"model.path={out}", "model.name=qwen3-template", FP32_REGEN,
                    "data.sources=[{type:builtin,limit:6,split:train}]", "data.regen.max_new_tokens=4",
                    "head.draft_vocab_size=96", "extract.source=regen", "extract.dtype=float32", "stages=[data]",
                    f"output_root={tmp_path}"])
    run_stages(cfg)
    ds, checked = _check_captured(cfg)
    assert checked == len(ds) > 0
    for row in ds:
        text = tok.decode(row["input_ids"])
        assert "</think>" not in text and not text.endswith("<|im_end|>\n")   # no block before, no end of turn after
        assert list(row["loss_mask"][-4:]) == [1] * 4    # the answer's 4 ids end the row, all trained


@pytest.mark.parametrize("writes", ["text", "bytes"])
def test_kept_states_cover_multi_turn_and_truncated_answers(tmp_path, text_twin, writes, monkeypatch):
    """Two user turns, and answers cut at max_new_tokens: the last turn's prefill covers the first turn, the
    last token of a cut answer and the template's end of turn are fed, so the states cover the whole row. A
    random twin writes bytes that are not UTF-8 (its text tokenises to other ids): the rows train on the ids it
    generated (data.template.as_generated), which its kept states cover. No state of the first turn's passes is
    copied to host memory (they were, then dropped: 48 MB a 2k-token turn at 8B)."""
    import data.regenerate

    copied, keep = [], data.regenerate._keep

    def counted(kept, jobs, out, layers, last):
        copied.append(sum(n for job, n in zip(jobs, last, strict=True) if kept[job] is not None) if layers else 0)
        keep(kept, jobs, out, layers, last)

    monkeypatch.setattr(data.regenerate, "_keep", counted)
    conv = {"turns": ["Say one word.", "And another one?"]}
    path = tmp_path / "two_turns.jsonl"
    path.write_text(json.dumps(conv) + "\n" + json.dumps({"turns": ["Count to three."]}) + "\n")
    twin = text_twin if writes == "text" else ["model=tiny-qwen2"]
    cfg = make_cfg([*twin, FP32_REGEN, f"data.sources=[{{path:{path},split:train}}]", "data.regen.max_new_tokens=4",
                    "head.draft_vocab_size=96", "extract.source=regen", "extract.dtype=float32", "stages=[data]",
                    f"output_root={tmp_path}"])
    run_stages(cfg)
    ds, checked = _check_captured(cfg)
    assert checked == len(ds) == 2 and sum("And another one?" in load_tokenizer(cfg).decode(r["input_ids"])
                                           for r in ds) == 1
    assert sum(copied) == sum(len(r["input_ids"]) for r in ds)
    from tests.test_regen_backends import cache_of

    spliced = [r for r in cache_of(cfg).values() if "token_ids" in r["messages"][-1]]
    assert len(spliced) == (0 if writes == "text" else 2)


def test_regen_source_needs_the_hf_backend():
    from train.checks import problems

    found = problems(make_cfg(["extract.source=regen", "data.regen.backend=vllm"]))
    assert any("extract.source=regen" in p and "extract.source=auto" in p for p in found)
    assert not any("extract.source" in p for p in problems(make_cfg(["extract.source=auto", "data.regen.backend=vllm"])))


@pytest.mark.slow
def test_two_ranks_keep_states_like_one_process_passes(tmp_path, text_twin):
    """deepspeed --num_gpus 2: each rank keeps the states of its share of the regeneration, extract (both ranks)
    copies them into the shards: the same shards as one process that regenerates and then runs the pass."""
    import subprocess
    import sys

    from tests.conftest import ROOT, child_env

    args = [*text_twin, FP32_REGEN, "tracking=none", "stages=[data,extract]", "data.sources=[{type:builtin,limit:16}]",
            "data.regen.max_new_tokens=12", "head.draft_vocab_size=96", "extract.dtype=float32", "extract.shard_mb=0.05"]
    deepspeed = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port", "29691"]
    runs = {"regen": (deepspeed, tmp_path / "two"), "pass": ([sys.executable], tmp_path / "one")}
    for source, (launcher, root) in runs.items():
        proc = subprocess.run([*launcher, str(ROOT / "train/run.py"), *args, f"extract.source={source}",
                               f"output_root={root}"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                              env=child_env(OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE"))
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    two, one = (make_cfg([*args, f"extract.source={s}", f"output_root={root}"]) for s, (_, root) in runs.items())
    manifest = json.loads((stage_dir(two, "extract") / "manifest.json").read_text())
    provenance = json.loads((stage_dir(two, "extract") / "provenance.json").read_text())
    assert provenance["world_size"] == 2 and provenance["from_regeneration"]["rows"] == sum(manifest["rows"].values())
    regen = json.loads((stage_dir(two, "data") / "stats.json").read_text())["regeneration"]
    assert [s["captured"]["rows"] > 0 for s in regen["per_rank"]] == [True, True]
    a, b = _shards(two), _shards(one)
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key][0], b[key][0], rtol=1e-5, atol=1e-5)
        assert torch.equal(a[key][1], b[key][1])


@pytest.mark.integration
def test_default_target_keeps_states_for_its_answers(tmp_path):
    """The embedded default target (real text, real chat template, a real BPE vocabulary): every regenerated row
    trains on the ids the target generated (``data.template.as_generated``, also where their text tokenises
    otherwise), so every row's states are kept and no second pass runs; the shards agree with a separate pass
    within the storage dtype (bf16)."""
    args = ["data.sources=[{type:builtin,limit:6}]", "data.regen.max_new_tokens=32", "head.draft_vocab_size=512",
            FP32_REGEN, "stages=[data,extract]"]
    kept = make_cfg([*args, "extract.source=auto", f"output_root={tmp_path / 'regen'}"])
    passed = make_cfg([*args, "extract.source=pass", f"output_root={tmp_path / 'pass'}"])
    run_stages(kept)
    run_stages(passed)
    manifest = json.loads((stage_dir(kept, "extract") / "manifest.json").read_text())
    provenance = json.loads((stage_dir(kept, "extract") / "provenance.json").read_text())
    assert provenance["from_regeneration"]["rows"] == sum(manifest["rows"].values())
    a, b = _shards(kept), _shards(passed)
    assert a.keys() == b.keys()
    scale = max(v[0].float().abs().max().item() for v in b.values())
    for key in a:
        assert (a[key][0].float() - b[key][0].float()).abs().max().item() <= 0.02 * scale
    assert torch.cat([a[k][1] == b[k][1] for k in a]).float().mean() >= 0.99


def _sibling_runs(tmp_path, monkeypatch) -> tuple[list[str], list[int]]:
    """An EAGLE-3 run's data and extract stages under ``tmp_path``; (the args of a Medusa run beside it, a list
    that grows by one each time extract loads the target)."""
    args = ["model=tiny-llama", "data.sources=[{type:builtin,limit:12}]", "data.regen.max_new_tokens=12",
            FP32_REGEN, "extract.dtype=float32", "stages=[data,extract]", f"output_root={tmp_path}"]
    run_stages(make_cfg([*args, "head=eagle3", "head.draft_vocab_size=96"]))
    import train.extract as extract

    loads, real = [], extract._loaded_target
    monkeypatch.setattr(extract, "_loaded_target", lambda *a: loads.append(1) or real(*a))
    return [*args, "head=medusa"], loads


def test_a_medusa_run_reuses_the_eagle3_runs_shards(tmp_path, monkeypatch):
    """The Medusa run's extract copies the final state from the EAGLE-3 run's shards (same target and dataset):
    no forward pass, the target not even loaded, the same states as its own pass."""
    args, loads = _sibling_runs(tmp_path, monkeypatch)
    reused = make_cfg(args)
    own = make_cfg([*args, "extract.reuse=false", "run_dir=" + str(tmp_path / "own")])
    run_stages(reused)
    assert not loads  # every row came from the EAGLE-3 run
    run_stages(own)
    assert loads
    manifest = json.loads((stage_dir(reused, "extract") / "manifest.json").read_text())
    provenance = json.loads((stage_dir(reused, "extract") / "provenance.json").read_text())
    assert provenance["from_run"]["rows"] == sum(manifest["rows"].values()) and manifest["layers"] == [8]
    assert provenance["from_run"]["run"].endswith("eagle3")
    a, b = _shards(reused), _shards(own)
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key][0], b[key][0], rtol=1e-5, atol=1e-5)
        assert torch.equal(a[key][1], b[key][1])


def test_a_sibling_run_of_a_dataset_cut_in_place_is_not_reused(tmp_path, monkeypatch):
    """A dataset cut in place after its data stage keeps its old ``dataset_id`` (CI once met this through a
    benchmark's scratch run): the sibling's shards hold rows it lacks, so extract makes its own forward pass."""
    import datasets

    args, loads = _sibling_runs(tmp_path, monkeypatch)
    cfg = make_cfg(args)
    run_stages(make_cfg([*args, "stages=[data]"]))
    path = stage_dir(cfg, "data") / "dataset"
    full = datasets.load_from_disk(str(path))
    cut = datasets.DatasetDict({k: v.select(range(min(3, len(v)))) for k, v in full.items()})
    cut.save_to_disk(str(path) + ".cut")
    shutil.rmtree(path)
    Path(str(path) + ".cut").rename(path)
    run_stages(make_cfg([*args, "stages=[extract]"]))
    assert loads
    manifest = json.loads((stage_dir(cfg, "extract") / "manifest.json").read_text())
    provenance = json.loads((stage_dir(cfg, "extract") / "provenance.json").read_text())
    assert manifest["rows"] == {k: len(v) for k, v in cut.items()} and "from_run" not in provenance
