"""End-to-end eval stage on a tiny target: a random head saved where the train stage leaves it (by a
stand-in train stage run through the real stage runner), then the eval stage; the report is checked."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch

import train.stages as stages
from eval.bench import random_head
from eval.report import RESULT_KEYS
from heads.io import save_head
from train.target import load_target

REPORT_KEYS = {"target", "head", "device", "dtype", "head_params", "head_extra_memory_mb", "target_params",
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
    if kind == "eagle3":
        assert tree["total_tokens"] in (2, 4, 8) and set(tree["acceptance_curve"]) == set(tree["verify_ms"])
    else:
        assert 10 <= tree["medusa_nodes"] <= 20

    results = report["results"]
    assert all(set(RESULT_KEYS) <= set(r) for r in results)
    assert {r["method"] for r in results} == METHODS[kind]
    assert {r["dataset"] for r in results} == ({"builtin", "mt_mini"} if kind == "eagle3" else {"humaneval"})
    assert {r["temperature"] for r in results} == ({0.0, 1.0} if kind == "eagle3" else {0.0})
    for r in results:
        assert r["tau"] == pytest.approx(r["new_tokens"] / r["cycles"])
        assert r["speedup"] == pytest.approx(r["tokens_per_s"] / r["plain_tokens_per_s"])
        assert r["identical_to_plain"] is (True if r["temperature"] == 0 else None), r
        if r["method"] == "plain":
            assert r["tau"] == 1.0 and r["speedup"] == 1.0
    assert all(r["n_prompts"] == (1 if r["dataset"] == "mt_mini" else 2) for r in results if r["category"] == "all")
    for rec in report["recommendations"]:
        assert rec["method"] is None or (rec["method"] in METHODS[kind] and rec["speedup"] >= cfg.eval.min_speedup)
    assert {(r["dataset"], r["category"], r["temperature"]) for r in report["recommendations"]} == {
        (r["dataset"], r["category"], r["temperature"]) for r in results}

    assert "## Recommendation" in (out / "report.md").read_text()
    pngs = {p.name for p in out.glob("*.png")}
    if kind == "eagle3":
        records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
        assert {r["turns"] for r in records if r["dataset"] == "mt_mini"} == {2}    # both turns answered
        assert pngs == {"speedup_T0.0.png", "speedup_T1.0.png", "accept_hist_T0.0.png", "accept_hist_T1.0.png"}
    else:
        assert pngs == {"speedup_T0.0.png", "accept_hist_T0.0.png"}
        assert list((tmp_path / "tiny-llama" / "medusa" / "wandb").glob("offline-run-*"))
