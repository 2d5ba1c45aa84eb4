"""Head-independent eval work shared per target (eval/shared.py): plain and n-gram records decoded by the
first head's eval and reused by the next (tokens, timings, the losslessness check against them), the
cache keys, and the tree sizing: held-out calibration prompts, cached measurements, progress bar."""

from __future__ import annotations

import json
import sys
import types
from collections import Counter

import pytest
import torch

import eval.stage
import train.stages as stages
from eval.prompts import calibration_prompts, load_prompts
from eval.shared import Baselines, JsonCache, baseline_settings, machine, record_key, target_identity
from eval.stage import Fp32Scorer, turn_prompt
from tests.test_eval import fake_train, one_thread  # noqa: F401  (autouse fixture: one torch thread)
from train.target import load_target, load_tokenizer

EVAL = ["model=tiny-llama", "stages=[train,eval]", "eval.datasets=[builtin]", "eval.limit=2", "eval.warmup=1",
        "eval.max_new_tokens=8", "eval.tree.sizes=[1,2,4]", "eval.tree.context=32", "eval.tree.calibration_prompts=1",
        "eval.dtype=float32"]   # verify passes counted below: none for eval.dtype=auto's choice (test_eval.py)


@pytest.fixture
def calls(monkeypatch) -> Counter:
    """Drafter class -> decodes (converse calls), and 'verify'/'acceptance' -> tree sizing measurements."""
    monkeypatch.setitem(sys.modules, "fake_train", types.SimpleNamespace(run=fake_train))
    monkeypatch.setitem(stages.ENTRY, "train", "fake_train")
    count: Counter = Counter()
    for name, label in (("converse", None), ("measure_verify_time", "verify"), ("measure_acceptance", "acceptance")):
        real = getattr(eval.stage, name)

        def spy(*a, _real=real, _label=label, **k):
            count[_label or type(a[1]).__name__] += 1
            return _real(*a, **k)

        monkeypatch.setattr(eval.stage, name, spy)
    return count


def run_eval(cfg_factory, *overrides: str) -> tuple[dict, list[dict]]:
    cfg = cfg_factory(*EVAL, *overrides)
    stages.run_stages(cfg)
    out = stages.stage_dir(cfg, "eval")
    return (json.loads((out / "report.json").read_text()),
            [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()])


def test_second_head_reuses_plain_and_ngram_records(cfg_factory, calls):
    """EAGLE-3 first: plain and n-gram decoded here (warmup + 2 prompts) and stored. Medusa next: neither is
    decoded again (not even in warmup), their records are the EAGLE-3 run's (tokens, timings), every method
    is still checked against plain's tokens, and the report says the timings come from another process.
    share_baselines=false decodes them again; the verify curve of the tree sizing is measured once (each head
    measures its own acceptance curve)."""
    first, first_records = run_eval(cfg_factory, "head=eagle3")
    assert calls["PlainDrafter"] == calls["NGramDrafter"] == 3 and calls["verify"] == 1
    assert first["baselines"]["shared"] and first["baselines"]["reused"] == {}
    assert "measured in the same process" in (first_md := markdown_of(first)) and "another process" not in first_md

    calls.clear()
    second, records = run_eval(cfg_factory, "head=medusa")
    # tree and chain on warmup + 2 prompts, and one calibration decode sizing its tree (on a held-out prompt)
    assert calls["PlainDrafter"] == calls["NGramDrafter"] == 0 and calls["MedusaDrafter"] == 3 * 2 + 1
    assert calls["verify"] == 0 and calls["acceptance"] == 1              # the verify curve is the target's
    assert second["tree"]["verify_ms"] == first["tree"]["verify_ms"]
    assert second["baselines"]["reused"] == {"plain": 2, "ngram": 2}
    assert "different processes" in second["baselines"]["note"] and "another process" in markdown_of(second)

    def timing(rows: list[dict], method: str) -> list[tuple]:
        return [(r["id"], r["tokens"], r["wall_s"]) for r in rows if r["method"] == method]

    for method in ("plain", "ngram"):
        assert timing(records, method) == timing(first_records, method)
        assert all(r["reused"] for r in records if r["method"] == method)
    assert not any(r["reused"] for r in records if r["method"].startswith("medusa"))
    assert all(r["identical"] is True for r in records)                   # judged against the reused plain tokens
    by_method = {r["method"]: r for r in second["results"] if r["category"] == "all"}
    assert by_method["plain"]["tokens_per_s"] == pytest.approx(
        {r["method"]: r for r in first["results"] if r["category"] == "all"}["plain"]["tokens_per_s"])

    calls.clear()
    third, records = run_eval(cfg_factory, "head=medusa", "eval.share_baselines=false")
    assert calls["PlainDrafter"] == calls["NGramDrafter"] == 3
    assert (third["baselines"]["shared"], third["baselines"]["file"], third["baselines"]["reused"]) == (False, None, {})
    assert not any(r["reused"] for r in records)


def markdown_of(report: dict) -> str:
    from eval.report import markdown

    return markdown(report)


def test_reused_plain_tokens_are_what_methods_are_checked_against(cfg_factory, calls, tmp_path):
    """A stored plain record whose tokens were changed: the next head's methods now depart from it, and the
    fp32 re-scoring calls it a real mismatch (a decoder bug): losslessness is checked against the reused
    tokens, not assumed."""
    run_eval(cfg_factory, "head=eagle3", "eval.methods=[eagle3-chain]")
    [path] = (tmp_path / "tiny-llama" / "eval_shared").glob("baselines-*.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    plain = next(r for r in rows if r["method"] == "plain")
    cfg = cfg_factory(*EVAL)
    tokenizer, prompt = load_tokenizer(cfg), next(p for p in load_prompts(cfg) if p.id == plain["id"])
    logits = Fp32Scorer(load_target(cfg), cfg)(turn_prompt(tokenizer, prompt, cfg, []) + plain["tokens"][0][:2])
    plain["tokens"][0][2:] = [int(logits.argmin())] * (len(plain["tokens"][0]) - 2)   # the least likely token
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report, records = run_eval(cfg_factory, "head=medusa", "eval.methods=[medusa-chain]")
    bad = [r for r in records if r["id"] == plain["id"] and r["method"] == "medusa-chain"]
    assert bad[0]["divergence"]["position"] == 2 and bad[0]["divergence"]["kind"] == "mismatch"
    assert report["decoder_bugs"] and report["decoder_bugs"][0]["method"] == "medusa-chain"


def test_baseline_keys(tmp_path, tiny_llama_cfg):
    """Records are found only under the same target/machine/settings key; greedy records ignore the seed,
    sampled ones do not; a torn line is skipped; fresh reads nothing."""
    store = Baselines(tmp_path, {"a": 1})
    rec = {"method": "plain", "temperature": 0.0, "seed": 7, "tokens": [[1, 2]], "id": "x"}
    store.add(["hi"], [rec, {**rec, "method": "ngram", "temperature": 1.0}])
    with open(store.path, "a") as f:
        f.write('{"torn": ')
    again = Baselines(tmp_path, {"a": 1})
    assert again.find(["hi"], ["plain", "ngram"], 0.0, 99) == {"plain": {**rec, "reused": True}}   # seed: greedy
    assert set(again.find(["hi"], ["plain", "ngram"], 1.0, 7)) == {"ngram"}
    assert again.find(["hi"], ["ngram"], 1.0, 8) == {} and again.find(["ho"], ["plain"], 0.0, 7) == {}
    assert Baselines(tmp_path, {"a": 2}).find(["hi"], ["plain"], 0.0, 7) == {}
    assert Baselines(tmp_path, {"a": 1}, fresh=True).find(["hi"], ["plain"], 0.0, 7) == {}
    assert record_key(["hi"], "plain", 0.0, 1) == record_key(["hi"], "plain", 0, 2)
    assert record_key(["hi"], "plain", 0.5, 1) != record_key(["hi"], "plain", 0.5, 2)

    from omegaconf import OmegaConf

    settings = baseline_settings(tiny_llama_cfg)
    for override in ({"eval": {"max_new_tokens": 3}}, {"eval": {"top_p": 0.5}}, {"eval": {"ngram": {"k": 2}}},
                     {"data": {"system_prompt": "Be brief."}}, {"data": {"thinking": True}}):
        assert baseline_settings(OmegaConf.merge(tiny_llama_cfg, override)) != settings, override
    assert baseline_settings(OmegaConf.merge(tiny_llama_cfg, {"eval": {"limit": 3, "temperatures": [1.0]}})) == settings
    target = torch.nn.Linear(2, 2)
    one = target_identity("fp", {2, 1}, target)
    torch.set_num_threads(2)
    assert machine(target)["threads"] == 2 and target_identity("fp", [1, 2], target) != one
    assert one["eos"] == [1, 2] and target_identity("fp2", [1, 2], target)["target"] == "fp2"
    # off the CPU the threads are not part of it: an eval after training inherits the threads training set per
    # rank, a rerun of eval alone does not, and a GPU's timings do not follow them (its records were thrown away)
    off_cpu = torch.nn.Linear(2, 2, device="meta")
    torch.set_num_threads(1)
    assert machine(off_cpu)["threads"] is None and machine(target)["threads"] == 1


def test_timings_under_another_openmp_wait_policy_are_not_reused(monkeypatch):
    """OMP_WAIT_POLICY=PASSIVE (the Makefile set it for `make demo` too) made the CPU's verify passes of 2+ tokens
    1.6-2.1x as long: records and verify times measured so are another machine's, on the CPU."""
    target = torch.nn.Linear(2, 2)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    unset = target_identity("fp", [1], target)
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert machine(target)["omp_wait_policy"] == "PASSIVE" and target_identity("fp", [1], target) != unset
    assert machine(torch.nn.Linear(2, 2, device="meta"))["omp_wait_policy"] is None   # a GPU's timings: not so


def test_timings_of_another_host_are_not_reused(monkeypatch):
    """The nodes of a cluster share an image, a GPU model and output_root (eval.shared_dir under it): one node's
    plain decoding is not the baseline of another's speedups."""
    import platform

    target = torch.nn.Linear(2, 2)
    here = target_identity("fp", [1], target)
    monkeypatch.setattr(platform, "node", lambda: "node-7")
    assert target_identity("fp", [1], target) != here and machine(target)["host"] == "node-7"


def test_eval_reruns_on_another_precision_or_device(tiny_llama_cfg):
    """eval.dtype=auto follows the top-level dtype: a report measured in bf16 was kept for a dtype=float32 run
    (eval "up to date"). Training's result does not change with them (its checkpoints refuse another dtype)."""
    from omegaconf import OmegaConf

    from train.stages import fingerprint

    base = {s: fingerprint(tiny_llama_cfg, s) for s in ("eval", "train")}
    for override in ({"dtype": "float32"}, {"device": "cpu"}):
        other = OmegaConf.merge(tiny_llama_cfg, override)
        assert fingerprint(other, "eval") != base["eval"] and fingerprint(other, "train") == base["train"], override


def test_json_cache(tmp_path):
    cache = JsonCache(tmp_path, {"target": "t"})
    made = []
    assert cache.get_or({"k": 1}, lambda: made.append(1) or {1: 2.0}) == {"1": 2.0}     # as read back
    assert cache.get_or({"k": 1}, lambda: made.append(1) or {1: 3.0}) == {"1": 2.0} and made == [1]
    assert JsonCache(tmp_path, {"target": "u"}).get({"k": 1}) is None              # identity is part of the key
    assert JsonCache(tmp_path, {"target": "t"}, fresh=True).get({"k": 1}) is None
    assert JsonCache(None).get_or({"k": 1}, lambda: 5) == 5 and not list(tmp_path.glob("*.tmp"))


def test_calibration_prompts_are_held_out(tiny_llama_cfg):
    """Tree sizing calibrates on the evaluation datasets' prompts beyond eval.limit: never timed (disjoint from
    load_prompts), never trained on (the built-in ones are validation prompts), both datasets in turn; with
    nothing left, the training prompts, labelled optimistic."""
    from omegaconf import OmegaConf

    from eval.prompts import _read

    cfg = OmegaConf.merge(tiny_llama_cfg, {"eval": {"datasets": ["builtin", "humaneval"], "limit": 3}})
    timed = {(p.dataset, p.id) for p in load_prompts(cfg)}
    picked, source = calibration_prompts(cfg, 6)
    assert len(picked) == 6 and not timed & {(p.dataset, p.id) for p in picked}
    assert [p.dataset for p in picked] == ["builtin", "humaneval"] * 3
    validation = {p.id for p in _read("builtin", {"type": "builtin"}, None, False, "validation")}
    assert {p.id for p in picked if p.dataset == "builtin"} <= validation
    assert source.startswith("held-out prompts beyond eval.limit")
    everything = OmegaConf.merge(cfg, {"eval": {"limit": None}})
    train, source = calibration_prompts(everything, 4)
    assert len(train) == 4 and "TRAINING" in source and not {p.id for p in train} & validation


def test_tree_sizing_is_cached_and_shows_progress(cfg_factory, calls, monkeypatch):
    """A rerun of the same head with another eval fingerprint measures nothing again (verify curve,
    acceptance curve and draft times cached, the same tree); force=[eval] measures again. The sizing shows
    one progress bar over every measurement; tau comes from held-out prompts (report: tree.calibration)."""
    bars = []
    real = eval.stage.progress

    def spy(*a, **k):
        bars.append(real(*a, **k))
        return bars[-1]

    monkeypatch.setattr(eval.stage, "progress", spy)
    first, _ = run_eval(cfg_factory, "head=eagle3", "eval.methods=[eagle3-tree]")
    sizing = [b for b in bars if b.desc.startswith("eval tree sizing")]
    assert len(sizing) == 1 and sizing[0].total == 3 + 2 + 1 and sizing[0].n == sizing[0].total
    assert calls["verify"] == calls["acceptance"] == 1
    [calibrated] = calibration_prompts(cfg_factory(*EVAL), 1)[0]
    assert first["tree"]["calibration"].startswith("held-out prompts beyond eval.limit")
    assert first["tree"]["calibration"].endswith(f": builtin/{calibrated.id}")
    assert first["tree"]["calibration"] in markdown_of(first)

    calls.clear()
    second, _ = run_eval(cfg_factory, "head=eagle3", "eval.methods=[eagle3-tree]", "eval.min_speedup=1.2")
    assert calls["verify"] == calls["acceptance"] == 0 and second["tree"] == first["tree"]
    third, _ = run_eval(cfg_factory, "head=eagle3", "eval.methods=[eagle3-tree]", "eval.min_speedup=1.2",
                        "force=[eval]")
    assert calls["verify"] == calls["acceptance"] == 1


def test_tree_sizes_without_one_token_are_sized_against_it(cfg_factory, calls):
    """eval.tree.sizes trimmed to the trees a GPU user wants ([2,4]): the 1-token pass every prediction divides by is
    measured all the same (it was a KeyError after the whole sizing)."""
    report, _ = run_eval(cfg_factory, "head=eagle3", "eval.methods=[eagle3-tree]", "eval.tree.sizes=[4,2]")
    assert sorted(report["tree"]["verify_ms"]) == ["1", "2", "4"] and report["tree"]["total_tokens"] in (2, 4)
