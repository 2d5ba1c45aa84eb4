"""End-to-end eval stage on a tiny target: a random head saved where the train stage leaves it (by a
stand-in train stage run through the real stage runner), then the eval stage; the report is checked.
Also greedy honesty: the first divergence from plain decoding, its fp32 tie/mismatch classification
on a tiny target, and how divergences shape the results and the recommendation."""

from __future__ import annotations

import copy
import json
import sys
import types

import pytest
import torch
from omegaconf import OmegaConf

import train.stages as stages
from eval.bench import random_head
from eval.decoder import SpecDecoder
from eval.drafters import PlainDrafter, medusa_choices
from eval.prompts import EvalPrompt
from eval.report import RESULT_KEYS, aggregate, decoder_bugs, markdown, recommend
from eval.stage import (
    Fp32Scorer,
    Records,
    classify_divergence,
    converse,
    divergence,
    eos_token_ids,
    eval_target,
    first_divergence,
    precision_spread,
    sized,
    turn_prompt,
)
from eval.tree import default_medusa_choices
from heads.io import save_head
from train.target import load_target, load_tokenizer

REPORT_KEYS = {"target", "head", "device", "dtype", "dtype_choice", "head_params", "head_extra_memory_mb", "target_params",
               "tree", "results", "recommendations"}
METHODS = {"eagle3": {"plain", "ngram", "eagle3-tree", "eagle3-chain", "eagle3+ngram-tree"},
           "medusa": {"plain", "ngram", "medusa-tree", "medusa-chain", "medusa+ngram-tree"}}


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def fake_train(cfg) -> dict:
    """Stand-in train stage: a random head (first 200 ids as draft vocabulary) saved as training does."""
    head = random_head(cfg.head.type, load_target(cfg), cfg.head, torch.arange(200))
    save_head(head, stages.stage_dir(cfg, "train") / "head")
    return {}


def test_the_sized_tree_resolves_the_medusa_tree(cfg_factory):
    """The drafters take the tree size :func:`size_tree` chose; a Medusa tree kept by an eval from before Medusa's tree
    was sized (no total_tokens, 15 nodes) resumes as the same tree; an explicit list stays as given."""
    ecfg = cfg_factory("head=medusa").eval
    assert medusa_choices(sized(ecfg, {"total_tokens": 8, "medusa_nodes": 7}), 3) == default_medusa_choices(3, 7)
    assert medusa_choices(sized(ecfg, {"total_tokens": None, "medusa_nodes": 15}), 3) == default_medusa_choices(3, 15)
    listed = OmegaConf.merge(ecfg, {"medusa_choices": [[0], [1], [0, 0]]})
    assert medusa_choices(sized(listed, {"total_tokens": None, "medusa_nodes": 3}), 3) == [(0,), (1,), (0, 0)]


@pytest.mark.parametrize("kind", ["eagle3", "medusa"])
def test_eval_stage_end_to_end(cfg_factory, tmp_path, monkeypatch, kind):
    questions = tmp_path / "mt_mini.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "category": "writing",
                                     "turns": ["Write one line about tea.", "Now about coffee."]}) + "\n")
    monkeypatch.setitem(sys.modules, "fake_train", types.SimpleNamespace(run=fake_train))
    monkeypatch.setitem(stages.ENTRY, "train", "fake_train")
    # EAGLE-3: built-in prompts + a 2-turn question file, greedy and sampling; Medusa: HumanEval, W&B offline.
    per_kind = {"eagle3": ["eval.datasets=[builtin]", f"eval.questions={questions}", "eval.all_turns=true",
                           "eval.temperatures=[0.0,1.0]"],
                "medusa": ["eval.datasets=[humaneval]", "tracking=wandb", "tracking.mode=offline"]}
    cfg = cfg_factory("model=tiny-llama", f"head={kind}", "stages=[train,eval]", "eval.limit=2", "eval.warmup=0",
                      "eval.dtype=float32",   # the identity checks below hold in fp32 (auto may pick bf16 on a CPU)
                      "eval.max_new_tokens=12", "eval.tree.sizes=[1,2,4,8]", "eval.tree.context=48",
                      "eval.tree.calibration_prompts=1", *per_kind[kind])
    stages.run_stages(cfg)
    out = stages.stage_dir(cfg, "eval")
    assert stages.read_marker(cfg, "eval")["outputs"]["report"] == str(out / "report.json")

    report = json.loads((out / "report.json").read_text())
    assert REPORT_KEYS <= set(report) and report["head"] == kind and report["head_params"] > 0
    assert report["target_params"] > report["head_params"] and report["head_extra_memory_mb"] > 0
    tree = report["tree"]
    assert list(tree["verify_ms"]) == ["1", "2", "4", "8"]
    assert tree["total_tokens"] in (2, 4, 8) and set(tree["acceptance_curve"]) == set(tree["verify_ms"])
    assert tree["total_tokens_source"].startswith("auto: best predicted speedup")
    layouts = report["gemm_layouts"]   # every verify pass's row count was timed in both (CPU, a Llama twin)
    assert {"1", "2", "4", "8"} <= set(layouts["layers"]) and set(layouts["layers"].values()) <= {"linear", "mm"}
    assert "1" in layouts["lm_head"] and set(layouts["lm_head"].values()) <= {"linear", "mm"}
    if kind == "medusa":   # its default tree sized like EAGLE's: the root and total_tokens - 1 paths
        assert tree["medusa_nodes"] == tree["total_tokens"] - 1 and set(tree["draft_ms"]) == {"2", "4", "8"}

    results = report["results"]
    assert all(set(RESULT_KEYS) <= set(r) for r in results)
    assert {r["method"] for r in results} == METHODS[kind]
    assert {r["dataset"] for r in results} == ({"builtin", "mt_mini"} if kind == "eagle3" else {"humaneval"})
    assert {r["temperature"] for r in results} == ({0.0, 1.0} if kind == "eagle3" else {0.0})
    for r in results:
        assert r["tau"] == pytest.approx(r["new_tokens"] / r["cycles"])
        assert r["speedup"] == pytest.approx(r["tokens_per_s"] / r["plain_tokens_per_s"])
        assert r["identical_to_plain"] is (True if r["temperature"] == 0 else None), r
        greedy = r["temperature"] == 0     # fp32 on CPU: no divergence at all
        assert (r["divergence_rate"], r["divergence_position"], r["ties"], r["mismatches"]) == (
            (0.0, None, 0, 0) if greedy else (None, None, None, None)), r
        if r["method"] == "plain":
            assert r["tau"] == 1.0 and r["speedup"] == 1.0
    assert all(r["n_prompts"] == (1 if r["dataset"] == "mt_mini" else 2) for r in results if r["category"] == "all")
    for rec in report["recommendations"]:
        assert rec["method"] is None or (rec["method"] in METHODS[kind] and rec["speedup"] >= cfg.eval.min_speedup)
    assert {(r["dataset"], r["category"], r["temperature"]) for r in report["recommendations"]} == {
        (r["dataset"], r["category"], r["temperature"]) for r in results}

    assert report["decoder_bugs"] == [] and all("diverged" not in rec["reason"] for rec in report["recommendations"])
    md = (out / "report.md").read_text()
    assert "## Recommendation" in md and "| mismatches |" in md and "DECODER BUGS" not in md
    pngs = {p.name for p in out.glob("*.png")}
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert all(r["divergence"] is None and r["identical"] is (True if r["temperature"] == 0 else None)
               for r in records)
    if kind == "eagle3":
        assert {r["turns"] for r in records if r["dataset"] == "mt_mini"} == {2}    # both turns answered
        assert pngs == {"speedup_T0.0.png", "speedup_T1.0.png", "accept_hist_T0.0.png", "accept_hist_T1.0.png"}
    else:
        assert pngs == {"speedup_T0.0.png", "accept_hist_T0.0.png"}
        assert list((tmp_path / "tiny-llama" / "medusa" / "wandb").glob("offline-run-*"))


def test_eval_dtype_auto_measures_both_precisions_on_a_bf16_cpu(cfg_factory, tmp_path, monkeypatch):
    """eval.dtype=auto on a CPU with native bf16: float32 and bfloat16 copies are timed (alternating, twice) and
    the faster decodes; the choice is kept per target + machine and reused; elsewhere, or with an explicit
    dtype, nothing is measured."""
    import eval.stage as stage

    faster, calls = {"dtype": torch.bfloat16}, []

    def fake_verify(decoder, context, sizes):   # ms per size: 1 for the faster precision, 3 for the other
        calls.append(decoder.target.dtype)
        return {s: 1.0 if decoder.target.dtype == faster["dtype"] else 3.0 for s in sizes}

    monkeypatch.setattr(stage, "measure_verify_time", fake_verify)
    monkeypatch.setattr(stage, "cpu_has_bf16", lambda: True)
    cfg = cfg_factory("model=tiny-llama", "eval.tree.context=32")
    target, fp32, info = eval_target(cfg, load_tokenizer(cfg), tmp_path / "sizing")
    assert target.dtype == torch.bfloat16 and info == {"sizes": [1, 4, 8], "verify_ms": {"float32": 9.0, "bfloat16": 3.0},
                                                       "chosen": "bfloat16"}
    assert fp32.dtype == torch.float32 and Fp32Scorer(target, cfg, fp32).model is fp32   # divergences re-scored by it
    assert calls == [torch.float32, torch.bfloat16] * 2
    faster["dtype"] = torch.float32
    assert eval_target(cfg, load_tokenizer(cfg), tmp_path / "sizing")[0].dtype == torch.bfloat16   # kept
    assert len(calls) == 4
    target, fp32, info = eval_target(cfg, load_tokenizer(cfg), tmp_path / "sizing", fresh=True)
    assert target is fp32 and target.dtype == torch.float32 and info["chosen"] == "float32" and len(calls) == 8
    copies, deepcopy = [], copy.deepcopy
    monkeypatch.setattr(copy, "deepcopy", lambda x, *a: copies.append(isinstance(x, torch.nn.Module)) or deepcopy(x, *a))
    assert eval_target(cfg, load_tokenizer(cfg), tmp_path / "sizing")[0].dtype == torch.float32   # kept
    assert (any(copies), len(calls)) == (False, 8)               # float32 kept: no bf16 copy of the target made
    monkeypatch.undo()
    monkeypatch.setattr(stage, "measure_verify_time", fake_verify)
    monkeypatch.setattr(stage, "cpu_has_bf16", lambda: True)
    for overrides, dtype in [(["eval.dtype=bfloat16"], torch.bfloat16), (["dtype=float32"], torch.float32)]:
        target, fp32, info = eval_target(cfg_factory("model=tiny-llama", *overrides), load_tokenizer(cfg), None, True)
        assert (target.dtype, fp32, info) == (dtype, None, None)
    monkeypatch.setattr(stage, "cpu_has_bf16", lambda: False)
    target, fp32, info = eval_target(cfg, load_tokenizer(cfg), None, True)
    assert (target.dtype, fp32, info, len(calls)) == (torch.float32, None, None, 8)


# ---------------------------------------------------------------------------------------------------
# Greedy honesty: first divergence, fp32 near-tie vs real mismatch


def test_first_divergence():
    plain = [[1, 2, 3], [4, 5, 6, 7]]
    assert first_divergence(plain, [[1, 2, 3], [4, 5, 6, 7]]) is None
    assert first_divergence(plain, [[1, 9, 3], [4, 5, 6, 7]]) == (0, 1, 1)
    assert first_divergence(plain, [[1, 2, 3], [4, 5, 8]]) == (1, 2, 5)      # 3 + 2 tokens matched first
    assert first_divergence(plain, [[1, 2, 3], [4, 5]]) == (1, 2, 5)         # stopped early
    assert first_divergence(plain, [[1, 2, 3, 0], [4]]) == (0, 3, 3)         # went on longer


def test_classify_divergence_from_logits():
    logits = torch.tensor([10.0, 9.9, 9.0, -10.0])
    assert classify_divergence(logits, 0, 1, 0.02) == ("tie", pytest.approx(0.1, abs=1e-5))   # 0.1 <= 0.02 * 10
    assert classify_divergence(logits, 0, 2, 0.02) == ("mismatch", pytest.approx(1.0, abs=1e-5))
    assert classify_divergence(logits, 1, 0, 0.02)[0] == "tie"                          # symmetric
    assert classify_divergence(logits, 0, 1, 0.005)[0] == "mismatch"                    # tolerance matters
    small = torch.tensor([0.01, 0.0, -0.05])     # |logits| < 1: absolute tolerance
    assert classify_divergence(small, 0, 1, 0.02)[0] == "tie" and classify_divergence(small, 0, 2, 0.02)[0] == "mismatch"
    assert classify_divergence(logits, 0, None, 0.02) == ("mismatch", None)              # a length difference


def test_classify_divergence_widens_by_the_decoding_precisions_error():
    """In low precision the margin adds the spread of its logit error over the float32 top tokens: a 0.5 gap
    (beyond 0.02 x 10) is a tie where rounding moved those logits 0.4 apart, a 1.0 gap is not."""
    logits = torch.cat([torch.tensor([10.0, 9.5, 9.0]), torch.linspace(8.0, -5.0, 13)])
    error = torch.zeros_like(logits)
    error[4], error[15] = 0.3, -14.9                     # token 15: outside the top 10, counted only as one of the pair
    error[7] = -0.1                                       # in the top 10: spread 0.3 - (-0.1) = 0.4
    assert precision_spread(logits, error, 0, 1) == pytest.approx(0.4)
    assert precision_spread(logits, None, 0, 1) == 0.0
    assert classify_divergence(logits, 0, 1, 0.02)[0] == "mismatch"                     # float32: 0.5 > 0.2
    assert classify_divergence(logits, 0, 1, 0.02, error) == ("tie", pytest.approx(0.5))  # 0.5 <= 0.2 + 0.4
    assert classify_divergence(logits, 0, 2, 0.02, error)[0] == "mismatch"              # 1.0 > 0.6
    assert classify_divergence(logits, 0, 15, 0.02, error)[0] == "tie"      # gap 15 <= 0.2 + 15.2: rounding moved it


@pytest.fixture(scope="module")
def tiny_plain(tiny_llama_cfg):
    """A tiny fp32 target, a 2-turn prompt and its plain greedy answers (12 tokens a turn)."""
    cfg = OmegaConf.merge(tiny_llama_cfg, {"eval": {"max_new_tokens": 12}})
    target, tokenizer = load_target(cfg), load_tokenizer(cfg)
    prompt = EvalPrompt("mt", "writing", "1", ["Write one line about tea.", "Now about coffee."])

    def decode(model) -> list[list[int]]:
        return [g.tokens for g in converse(SpecDecoder(model, eos_token_ids(model, tokenizer)), PlainDrafter(),
                                           tokenizer, prompt, cfg, 0.0, 0)]

    plain = decode(target)
    assert [len(t) for t in plain] == [12, 12]
    return cfg, target, tokenizer, prompt, plain, decode


def test_divergence_mismatch_on_tiny_target(tiny_plain):
    """A made-up method output that takes the fp32 least likely token after 12 + 2 matched tokens is a
    real mismatch at that position; identical output is no divergence."""
    cfg, target, tokenizer, prompt, plain, _ = tiny_plain
    scorer = Fp32Scorer(target, cfg)
    assert divergence(scorer, tokenizer, prompt, cfg, plain, plain) is None and scorer.model is None  # no forward
    context = turn_prompt(tokenizer, prompt, cfg, plain[:1]) + plain[1][:2]
    logits = scorer(context)
    assert scorer.model is target and int(logits.argmax()) == plain[1][2]    # plain = fp32 greedy there
    worst = int(logits.argmin())
    div = divergence(scorer, tokenizer, prompt, cfg, plain, [plain[0], plain[1][:2] + [worst, 5, 6]])
    assert div == {"position": 14, "turn": 1, "plain_token": plain[1][2], "method_token": worst,
                   "fp32_gap": pytest.approx(float(logits.max() - logits.min())), "precision_spread": None,
                   "kind": "mismatch"}
    assert div["fp32_gap"] > 0.1


def test_divergence_tie_on_tiny_target(tiny_plain):
    """A target with two lm_head rows equal by construction: plain's token and its twin have the same
    fp32 logit everywhere, so a method that emits the twin diverges at an exact tie."""
    cfg, target, tokenizer, prompt, plain, decode = tiny_plain
    token = plain[0][3]
    context = turn_prompt(tokenizer, prompt, cfg, []) + plain[0][:3]
    logits = Fp32Scorer(target, cfg)(context)
    twin = token + 1 + int(logits[token + 1:].argmin())     # after ``token``: argmax ties keep ``token``
    twins = copy.deepcopy(target)
    with torch.no_grad():
        twins.lm_head.weight[twin] = twins.lm_head.weight[token]
    assert decode(twins) == plain                           # the twin is never emitted by plain decoding
    div = divergence(Fp32Scorer(twins, cfg), tokenizer, prompt, cfg, plain, [plain[0][:3] + [twin], plain[1]])
    assert div["kind"] == "tie" and div["position"] == 3 and div["method_token"] == twin
    assert abs(div["fp32_gap"]) < 1e-5
    clear = divergence(Fp32Scorer(target, cfg), tokenizer, prompt, cfg, plain, [plain[0][:3] + [twin], plain[1]])
    assert clear["kind"] == "mismatch"                      # the same output on the original target


def test_divergence_in_bf16_measures_the_precisions_error_and_still_catches_a_wrong_token(tiny_plain):
    """A bf16 target decoding: the judge scores the divergence with the float32 target and the bf16 one; the
    spread of their difference is recorded, and a method that takes the least likely token is still a
    mismatch. In float32 no second forward is made (spread None)."""
    cfg, target, tokenizer, prompt, plain, _ = tiny_plain
    bf16 = copy.deepcopy(target).to(torch.bfloat16)
    scorer = Fp32Scorer(bf16, cfg, target)
    context = turn_prompt(tokenizer, prompt, cfg, plain[:1]) + plain[1][:2]
    logits = scorer(context)
    error = scorer.error(context, logits)
    assert error is not None and error.abs().max() > 0 and Fp32Scorer(target, cfg).error(context, logits) is None
    worst = int(logits.argmin())
    div = divergence(scorer, tokenizer, prompt, cfg, plain, [plain[0], plain[1][:2] + [worst, 5, 6]])
    assert div["kind"] == "mismatch" and 0 < div["precision_spread"] < abs(div["fp32_gap"])
    assert div["precision_spread"] == pytest.approx(precision_spread(logits, error, plain[1][2], worst))
    assert divergence(Fp32Scorer(target, cfg), tokenizer, prompt, cfg, plain,
                      [plain[0], plain[1][:2] + [worst, 5, 6]])["precision_spread"] is None


def test_fp32_scorer_loads_the_float32_target_for_a_bf16_one(tiny_plain, monkeypatch):
    """A bf16 target whose files hold float32 (the default target's): its divergences are judged by the float32
    target as loaded from its files (not its bf16 weights upcast), on the target's device when it has room, else on
    the CPU."""
    import types

    from eval import stage

    cfg, target, tokenizer, prompt, plain, _ = tiny_plain
    bf16 = copy.deepcopy(target).to(torch.bfloat16)
    scorer = Fp32Scorer(bf16, cfg)
    context = turn_prompt(tokenizer, prompt, cfg, [])
    logits = scorer(context)
    assert logits.dtype == torch.float32 and scorer.model is not bf16
    assert scorer.model.dtype == torch.float32 and bf16.dtype == torch.bfloat16     # the target is left alone
    torch.testing.assert_close(logits, Fp32Scorer(target, cfg)(context), atol=0, rtol=0)
    on_gpu = types.SimpleNamespace(parameters=lambda: iter([types.SimpleNamespace(
        device=torch.device("cuda:3"), numel=lambda: 8_000_000_000)]))
    for free, device in ((40 * 2**30, "cuda:3"), (20 * 2**30, "cpu")):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d, free=free: (free, 80 * 2**30))
        assert stage.scorer_device(on_gpu) == torch.device(device)


def test_a_target_stored_in_bf16_is_judged_in_float32_without_a_copy(tiny_plain, tmp_path, monkeypatch):
    """A 7-8B target's files hold bf16 and it decodes in bf16: a float32 copy would be 32 GB more on its GPU (or the
    host's RAM and minutes per pass on its CPU) for the rest of the run. Its divergences are judged by the target
    itself computing in float32 one module at a time: exactly the logits of the float32 target loaded from those
    files, no copy loaded, the target's weights the same tensors afterwards and its buffers untouched."""
    import shutil

    from eval import stage
    from train.target import stored_dtypes, target_path

    cfg, target, tokenizer, prompt, plain, _ = tiny_plain
    shutil.copytree(target_path(cfg), tmp_path / "bf16")
    copy.deepcopy(target).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    bf16_cfg = OmegaConf.merge(cfg, {"model": {"source": "hf", "path": str(tmp_path / "bf16")}})
    assert stored_dtypes(bf16_cfg) == {torch.bfloat16} and stored_dtypes(cfg) == {torch.float32}
    bf16 = load_target(bf16_cfg, torch.device("cpu"), torch.bfloat16)
    fp32 = load_target(bf16_cfg, torch.device("cpu"), torch.float32)
    context = turn_prompt(tokenizer, prompt, cfg, plain[:1]) + plain[1][:2]
    weights = {n: p.data_ptr() for n, p in bf16.named_parameters()}
    buffers = {n: b.clone() for n, b in bf16.named_buffers()}
    before = Fp32Scorer._logits(bf16, context)

    monkeypatch.setattr(stage, "load_target", lambda *a, **k: pytest.fail("a float32 copy was loaded"))
    scorer = Fp32Scorer(bf16, bf16_cfg)
    logits = scorer(context)
    assert scorer.model is bf16 and logits.dtype == torch.float32
    torch.testing.assert_close(logits, Fp32Scorer._logits(fp32, context), atol=1e-5, rtol=1e-5)
    assert (logits - before).abs().max() > 1e-4                # not the bf16 pass
    assert all(p.data_ptr() == weights[n] and p.dtype == torch.bfloat16 for n, p in bf16.named_parameters())
    assert all(torch.equal(b, buffers[n]) and b.dtype == buffers[n].dtype for n, b in bf16.named_buffers())
    torch.testing.assert_close(Fp32Scorer._logits(bf16, context), before, atol=0, rtol=0)
    assert scorer.error(context, logits).abs().max() > 0

    monkeypatch.undo()   # that pass out of device memory, or a bf16 buffer (Gemma's embedding scale): a float32 copy
    monkeypatch.setattr(stage, "float32_weights", lambda model: (_ for _ in ()).throw(torch.OutOfMemoryError("OOM")))
    late = Fp32Scorer(bf16, bf16_cfg)
    torch.testing.assert_close(late(context), logits, atol=1e-5, rtol=1e-5)
    assert late.model is not bf16 and late.model.dtype == torch.float32
    bf16.model.register_buffer("scale", torch.ones((), dtype=torch.bfloat16))
    scaled = Fp32Scorer(bf16, bf16_cfg)
    scaled(context)
    assert scaled.model is not bf16


def record(method: str, prompt: str, wall_s: float, div: dict | None = None, temperature: float = 0.0) -> dict:
    """A synthetic per-prompt record: 20 tokens in 10 cycles (plain: 20), ``wall_s`` seconds."""
    return {"dataset": "d", "category": "c", "id": prompt, "method": method, "temperature": temperature,
            "new_tokens": 20, "cycles": 20 if method == "plain" else 10, "turns": 1, "wall_s": wall_s, "draft_s": 0.1,
            "divergence": div if temperature == 0 else None, "acceptance": "exact"}


def test_aggregate_and_recommend_with_divergences():
    """ngram: identical (1.25x); medusa-chain: one tie (2x, recommended with its divergence rate);
    medusa-tree: a real mismatch (4x, excluded and named as a decoder bug)."""
    tie = {"position": 7, "kind": "tie"}
    records = [record("plain", p, 2.0) for p in "ab"] + [record("ngram", p, 1.6) for p in "ab"] + [
        record("medusa-chain", "a", 1.0), record("medusa-chain", "b", 1.0, {"position": 3, "kind": "tie"}),
        record("medusa-tree", "a", 0.5, tie), record("medusa-tree", "b", 0.5, {"position": 5, "kind": "mismatch"})]
    results = aggregate(records)
    row = {(r["method"], r["category"]): r for r in results}
    assert all(set(RESULT_KEYS) <= set(r) for r in results)

    def stats(method: str) -> tuple:
        return tuple(row[(method, "all")][k] for k in ("identical_to_plain", "divergence_rate", "divergence_position",
                                                        "ties", "mismatches"))

    assert stats("plain") == stats("ngram") == (True, 0.0, None, 0, 0)
    # per verify pass, the prefill's pass and token left out: (20 - 1) / (10 - 1) per record, plain 1
    assert row[("ngram", "all")]["accept_len"] == pytest.approx(19 / 9) and row[("plain", "all")]["accept_len"] == 1.0
    assert stats("medusa-chain") == (False, 0.5, 3.0, 1, 0)
    assert stats("medusa-tree") == (False, 1.0, 6.0, 1, 1)
    recs = {r["category"]: r for r in recommend(results, 1.05)}
    assert recs["all"]["method"] == "medusa-chain" and recs["all"]["speedup"] == pytest.approx(2.0)
    assert "50.0% of prompts diverged" in recs["all"]["reason"] and "EXCLUDED" in recs["all"]["reason"]
    assert "medusa-tree" in recs["all"]["reason"]
    assert decoder_bugs(results) == [{"dataset": "d", "method": "medusa-tree", "temperature": 0.0, "n_prompts": 2,
                                      "mismatches": 1, "divergence_position": 6.0}]
    # Without the tie, the identical method's claim needs no caveat; without any eligible method: plain.
    only_ngram = recommend([r for r in results if r["method"] in ("plain", "ngram")], 1.05)
    assert only_ngram[0]["method"] == "ngram" and "diverged" not in only_ngram[0]["reason"]
    assert recommend([r for r in results if r["method"] in ("plain", "medusa-tree")], 1.05)[0]["method"] is None


def test_sampled_records_have_no_divergence_stats_and_bugs_reach_the_markdown():
    results = aggregate([record("plain", "a", 2.0, temperature=1.0), record("ngram", "a", 1.0, temperature=1.0)])
    assert all(r[k] is None for r in results for k in ("identical_to_plain", "divergence_rate", "ties", "mismatches"))
    assert recommend(results, 1.05)[0]["method"] == "ngram"
    greedy = aggregate([record("plain", "a", 2.0), record("ngram", "a", 1.0, {"position": 2, "kind": "mismatch"})])
    tree = {"top_k": 4, "depth": 5, "total_tokens": 8, "total_tokens_source": "config", "chain_k": 3,
            "verify_ms": {"1": 1.0}}
    md = markdown({"target": "t", "head": "eagle3", "device": "cpu", "dtype": "torch.bfloat16", "cpu_threads": 1,
                   "dtype_choice": {"sizes": [1, 4, 8], "verify_ms": {"float32": 90.4, "bfloat16": 60.0},
                                    "chosen": "bfloat16"},
                   "target_params": 10, "target_memory_mb": 1.0, "head_params": 1, "head_extra_memory_mb": 0.1,
                   "tree": tree, "results": greedy, "recommendations": recommend(greedy, 1.05),
                   "decoder_bugs": decoder_bugs(greedy)})
    assert "## DECODER BUGS" in md and "**ngram**, 1 of 1 prompts" in md and "| 100.0% |" in md
    assert "**plain decoding**" in md and "torch.bfloat16 (`eval.dtype=auto`, one verify pass at 1, 4, 8 tree tokens" in md and "float32 90 ms, bfloat16 60 ms" in md


def test_records_survive_a_torn_progress_file(tmp_path):
    """progress.json (fingerprint, tree) torn by a full disk: nothing is reused and nothing raises (every rerun
    stopped on a JSONDecodeError until force=[eval]); it is written whole or not at all."""
    (tmp_path / "progress.json").write_text('{"fingerprint": "ab')
    (tmp_path / "records.jsonl").write_text(json.dumps({"id": "p", "method": "plain"}) + "\n")
    store = Records(tmp_path, "ab", ["plain"], fresh=False)
    assert store.done == {} and store.tree is None
    assert json.loads((tmp_path / "progress.json").read_text()) == {"fingerprint": "ab", "tree": None, "attempt": None}
    assert not list(tmp_path.glob("*.tmp"))
