"""Export formats (names, shapes, dtypes, flags, layer ids per engine, completeness), the round
trip into our own heads, and the publish stage (dry run and its errors)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from heads import MedusaConfig, MedusaHead, save_head
from heads.eagle3 import KVCache
from tests.conftest import load_script
from tests.test_heads import HEAD_CFG, tiny_eagle3
from train.export import (
    NORM_FLAGS,
    ExportError,
    card_results,
    check_tensors,
    expected_tensors,
    full_vocab_rows,
    import_export,
    made_of,
    serve_commands,
)
from train.publish import PublishError
from train.stages import MARKER, fingerprint, flat_config, read_marker, run_stages, stage_dir
from train.target import load_target


def fake_trained(cfg, head) -> None:
    """Place a head where the train stage leaves it, with the stage's completion marker."""
    save_head(head, stage_dir(cfg, "train") / "head")
    (stage_dir(cfg, "train") / MARKER).write_text(json.dumps({"stage": "train", "fingerprint": fingerprint(cfg, "train"),
                                                              "output_id": "test", "config": flat_config(cfg, "train")}))


@pytest.fixture
def eagle_export(cfg_factory):
    cfg = cfg_factory("model=tiny-llama", "stages=[export]")
    target = load_target(cfg)
    head = tiny_eagle3(target, dv=64)
    with torch.no_grad():
        for p in head.parameters():
            if p.requires_grad:
                p.normal_(0, 0.1)
    fake_trained(cfg, head)
    run_stages(cfg)
    return cfg, target, head


@pytest.fixture
def medusa_export(cfg_factory):
    cfg = cfg_factory("model=tiny-qwen2", "head=medusa", "stages=[export]")
    target = load_target(cfg)
    V = target.config.vocab_size
    head = MedusaHead(MedusaConfig.from_target(target.config, HEAD_CFG, 100))
    kept = torch.arange(0, 200, 2)
    head.set_vocab(kept - torch.arange(100), torch.zeros(V, dtype=torch.bool).index_fill_(0, kept, True))
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.1)
    fake_trained(cfg, head)
    run_stages(cfg)
    return cfg, target, head


def engine_shapes(fmt: str, T, draft_vocab: int, medusa_heads: int = 3) -> dict[str, tuple[int, ...]]:
    """The tensors an engine loads from export ``fmt`` of a head on target config ``T``, written out from the
    target's shapes, not from the exporter's own table (:func:`train.export.expected_tensors`, which it checks
    itself): EAGLE-3, one decoder layer whose q/k/v read [embedding, feature] (2H), fc over three taps, the draft
    vocabulary's lm_head and its map (left out of vLLM's formats over the whole vocabulary); Medusa, one residual
    block per head and full-vocabulary lm_heads."""
    H, V = T.hidden_size, T.vocab_size
    if fmt == "medusa":
        return {name: shape for h in range(medusa_heads) for name, shape in (
            (f"blocks.{h}.layers.0.weight", (H, H)), (f"blocks.{h}.layers.0.bias", (H,)),
            (f"lm_heads.{h}.weight", (V, H)))}
    d = getattr(T, "head_dim", None) or H // T.num_attention_heads
    q, kv, inter = T.num_attention_heads * d, T.num_key_value_heads * d, T.intermediate_size
    layer = {"input_layernorm.weight": (H,), "hidden_norm.weight": (H,), "post_attention_layernorm.weight": (H,),
             "self_attn.q_proj.weight": (q, 2 * H), "self_attn.k_proj.weight": (kv, 2 * H),
             "self_attn.v_proj.weight": (kv, 2 * H), "self_attn.o_proj.weight": (H, q),
             "mlp.gate_proj.weight": (inter, H), "mlp.up_proj.weight": (inter, H), "mlp.down_proj.weight": (H, inter)}
    prefix = "layers.0" if fmt == "speculators" else "midlayer"
    out = {"fc.weight": (H, 3 * H), "norm.weight": (H,), "lm_head.weight": (draft_vocab, H),
           **{f"{prefix}.{k}": v for k, v in layer.items()}}
    if fmt == "sglang" or draft_vocab != V:
        out.update({"d2t": (draft_vocab,), "t2d": (V,)})
    if fmt == "speculators":
        out["embed_tokens.weight"] = (V, H)
    return out


def read(cfg, fmt):
    folder = stage_dir(cfg, "export") / fmt
    return folder, json.loads((folder / "config.json").read_text()), load_file(str(folder / "model.safetensors"))


def test_eagle3_formats_names_shapes_dtypes_flags(eagle_export):
    cfg, target, head = eagle_export
    ours = head.config.aux_layers
    for fmt in ("vllm", "sglang", "speculators"):
        folder, config, tensors = read(cfg, fmt)
        assert {k: tuple(t.shape) for k, t in tensors.items()} == engine_shapes(fmt, target.config, 64), fmt
        assert {k: v[0] for k, v in expected_tensors(fmt, head).items()} == engine_shapes(fmt, target.config, 64)
        for name, t in tensors.items():
            assert t.dtype == {"d2t": torch.int64, "t2d": torch.bool}.get(name, torch.bfloat16), name
        assert "README.md" in {p.name for p in folder.iterdir()}
        card = (folder / "README.md").read_text()
        assert "num_speculative_tokens" in card or "speculative-num-steps" in card
    _, vllm_cfg, vllm_t = read(cfg, "vllm")
    assert vllm_cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert vllm_cfg["draft_vocab_size"] == 64
    assert vllm_cfg["target_hidden_size"] == target.config.hidden_size
    assert vllm_cfg["vocab_size"] == target.config.vocab_size and vllm_cfg["num_hidden_layers"] == 1
    assert "embed_tokens.weight" not in vllm_t
    # Layer ids: vLLM = hidden state entering layer i (ours); SGLang = output of layer i (ours - 1). Each folder
    # holds both, where each engine reads them: vLLM's model runners the attribute of the draft's loaded config first
    # (V2, its GPU default, only that), SGLang eagle_config's alone. So either folder taps the trained layers in
    # either engine (one convention in one place tapped others in the other engine, with no error).
    for fmt in ("vllm", "sglang"):
        folder, fmt_cfg, _ = read(cfg, fmt)
        assert getattr(AutoConfig.from_pretrained(folder), "eagle_aux_hidden_state_layer_ids", None) == ours, fmt
        assert [i + 1 for i in fmt_cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]] == ours, fmt
    _, sglang_cfg, _ = read(cfg, "sglang")
    _, spec_cfg, spec_t = read(cfg, "speculators")
    assert spec_cfg["speculators_model_type"] == "eagle3"
    # Our layer normalises neither fc's input nor its output (vLLM's speculators reader defaults
    # norm_before_residual to true): every such flag written, false, in each EAGLE-3 format.
    for fmt_cfg in (vllm_cfg, sglang_cfg, spec_cfg):
        assert {k: fmt_cfg.get(k) for k in NORM_FLAGS} == dict.fromkeys(NORM_FLAGS, False)
    assert spec_cfg["eagle_aux_hidden_state_layer_ids"] == ours
    assert "layers.0.self_attn.q_proj.weight" in spec_t
    torch.testing.assert_close(spec_t["embed_tokens.weight"].float(),
                               target.get_input_embeddings().weight.bfloat16().float())
    assert torch.equal(vllm_t["d2t"], head.d2t) and torch.equal(vllm_t["t2d"], head.t2d)


def test_completeness_check_names_the_tensor(eagle_export):
    cfg, _, head = eagle_export
    _, _, tensors = read(cfg, "vllm")
    expected = expected_tensors("vllm", head)
    check_tensors("vllm", tensors, expected, torch.bfloat16)
    del tensors["midlayer.hidden_norm.weight"]
    with pytest.raises(ExportError, match="missing tensor midlayer.hidden_norm.weight"):
        check_tensors("vllm", tensors, expected, torch.bfloat16)
    tensors["midlayer.hidden_norm.weight"] = torch.ones(3, dtype=torch.bfloat16)
    tensors["embed_tokens.weight"] = torch.zeros(2, 2, dtype=torch.bfloat16)
    with pytest.raises(ExportError, match=r"unexpected tensor embed_tokens.weight.*hidden_norm.weight: shape \(3,\)"):
        check_tensors("vllm", tensors, expected, torch.bfloat16)
    tensors = dict(read(cfg, "vllm")[2])
    tensors["d2t"] = tensors["d2t"].int()
    with pytest.raises(ExportError, match="d2t: dtype torch.int32, expected torch.int64"):
        check_tensors("vllm", tensors, expected, torch.bfloat16)


def test_eagle3_round_trip_gives_identical_outputs(eagle_export):
    cfg, target, head = eagle_export
    torch.manual_seed(0)
    taps = torch.randn(1, 6, 3 * target.config.hidden_size)
    ids = torch.randint(0, target.config.vocab_size, (1, 6))
    pos = torch.arange(6)[None]
    bf16 = head.to(torch.bfloat16).float()  # exports are bf16: compare with the rounded weights
    for fmt in ("vllm", "sglang", "speculators"):
        again = import_export(stage_dir(cfg, "export") / fmt, fmt, target)
        # The embedding is the target's: the engine's own copy (classic formats) or the exported bf16 one.
        bf16.embed_tokens.weight.data.copy_(again.embed_tokens.weight)
        assert again.config.aux_layers == head.config.aux_layers
        assert torch.equal(again.d2t, head.d2t) and torch.equal(again.t2d, head.t2d)
        a = bf16.logits(bf16(bf16.project(taps), ids, pos, KVCache()))
        b = again.logits(again(again.project(taps), ids, pos, KVCache()))
        assert torch.equal(a, b), fmt
    # an sglang folder of export format 3 held SGLang's ids in eagle_config only: read as the same taps
    old = stage_dir(cfg, "export") / "sglang-format3"
    shutil.copytree(stage_dir(cfg, "export") / "sglang", old)
    config = json.loads((old / "config.json").read_text())
    del config["eagle_aux_hidden_state_layer_ids"]
    (old / "config.json").write_text(json.dumps(config))
    assert import_export(old, "sglang", target).config.aux_layers == head.config.aux_layers
    shutil.rmtree(old)


def test_a_full_vocabulary_eagle3_export_has_no_vocabulary_map_in_vllms_formats(cfg_factory):
    """With the draft vocabulary the whole vocabulary, vLLM 0.32 makes no draft_id_to_target_id parameter and refuses
    a file carrying d2t: vLLM's formats leave the map out (SGLang's keeps it); the round trip is unchanged."""
    cfg = cfg_factory("model=tiny-llama", "stages=[export]")
    target = load_target(cfg)
    head = tiny_eagle3(target, dv=target.config.vocab_size)
    fake_trained(cfg, head)
    run_stages(cfg)
    for fmt in ("vllm", "speculators", "sglang"):
        tensors = load_file(str(stage_dir(cfg, "export") / fmt / "model.safetensors"))
        assert ("d2t" in tensors) == ("t2d" in tensors) == (fmt == "sglang"), fmt
        again = import_export(stage_dir(cfg, "export") / fmt, fmt, target)
        assert torch.equal(again.draft_ids(), torch.arange(target.config.vocab_size)) and again.t2d.all()


def test_medusa_format_and_round_trip(medusa_export):
    cfg, target, head = medusa_export
    folder, config, tensors = read(cfg, "medusa")
    assert "eagle" not in str(folder).lower()
    assert config["model_type"] == "medusa" and config["medusa_fc_bias"] is True
    V = target.config.vocab_size
    assert config["num_heads"] == 3 and config["num_hidden_layers"] == 2 and config["truncated_vocab_size"] == V
    assert set(tensors) == set(expected_tensors("medusa", head))
    # vLLM 0.32 loads full-vocabulary heads only: the trained rows in place, their mean elsewhere.
    rows = head.draft_ids()
    full = tensors["lm_heads.1.weight"]
    assert full.shape == (V, target.config.hidden_size)
    assert torch.equal(full[rows], head.lm_heads[1].weight.bfloat16())
    mean = head.lm_heads[1].weight.bfloat16().float().mean(0).bfloat16()
    assert (full[~head.t2d] == mean).all()
    again = import_export(folder, "medusa", target)
    x = torch.randn(2, 5, target.config.hidden_size)
    ours, theirs = head.to(torch.bfloat16).float()(x), again(x)
    assert torch.equal(theirs[..., rows], ours)
    assert head.t2d[theirs.argmax(-1)].all()   # the engine's top token is one the head was trained on


def test_medusa_export_never_lets_an_untrained_token_outscore_the_trained_ones():
    """Where every trained logit is negative (y chosen so), rows outside the draft vocabulary must not win: zero
    rows (logit 0) did; the mean of the trained rows never scores above their maximum."""
    torch.manual_seed(0)
    weight, rows = torch.randn(8, 16), torch.tensor([3, 5, 8, 13, 21, 34, 55, 89])
    full = full_vocab_rows(weight, rows, 100)
    below_zero = -torch.linalg.pinv(weight) @ (1 + torch.rand(8))   # every trained logit in [-2, -1]
    assert (weight @ below_zero).max() < 0
    for y in [below_zero, *torch.randn(1000, 16)]:
        assert int((full @ y).argmax()) in rows.tolist()


def test_publish_dry_run_lists_only_the_export(eagle_export):
    cfg, _, _ = eagle_export
    cfg = OmegaConf.merge(cfg, {"stages": ["publish"], "publish": {"repo_id": "someone/tiny-eagle3", "dry_run": True}})
    out = run_stages(cfg)["publish"]["outputs"]
    assert out["dry_run"] is True
    assert sorted(f["path"] for f in out["files"]) == ["README.md", "config.json", "model.safetensors"]


@pytest.mark.parametrize("change,error", [
    ({"repo_id": "not a repo"}, "must look like 'user/name'"),
    ({"repo_id": None}, "must look like 'user/name'"),
    ({"format": "medusa"}, "not an export of a eagle3 head"),
    ({"dry_run": False, "token": None}, "no Hugging Face token"),
])
def test_publish_errors_before_sending(eagle_export, monkeypatch, change, error):
    cfg, _, _ = eagle_export
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr("train.publish.resolve_token", lambda pcfg: pcfg.token or None)
    cfg = OmegaConf.merge(cfg, {"stages": ["publish"], "publish": {"repo_id": "someone/x", "dry_run": False, **change}})
    with pytest.raises(PublishError, match=error):
        run_stages(cfg)


class FakeHub:
    """huggingface_hub.HfApi with a repo that exists already (``remote``: its files, ``public``)."""
    remote, public, commits = [], False, []

    def __init__(self, token: str):
        assert token == "hf_test"

    def create_repo(self, repo_id, private, exist_ok, repo_type):
        return f"https://huggingface.co/{repo_id}"

    def repo_info(self, repo_id, repo_type):
        return SimpleNamespace(private=not self.public)

    def list_repo_files(self, repo_id, repo_type):
        return self.remote

    def create_commit(self, repo_id, operations, repo_type, commit_message):
        self.commits.append(operations)


@pytest.mark.parametrize("public", [False, True])
def test_publish_into_an_existing_repo(eagle_export, monkeypatch, public):
    """create_repo leaves an existing repo's visibility as it is: with publish.private=true (the default) a public
    repo is refused before anything is sent (the head went public). Weights an earlier upload left (a sharded
    upload's index makes vLLM load its shards instead of ours) are deleted in the same commit; other files stay."""
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete

    cfg, _, _ = eagle_export
    hub = type("Hub", (FakeHub,), {"public": public, "commits": [], "remote": [
        ".gitattributes", "README.md", "model.safetensors", "model-00001-of-00002.safetensors",
        "model.safetensors.index.json", "pytorch_model.bin", "figures/curve.png", "extras/adapter.safetensors"]})
    monkeypatch.setattr("huggingface_hub.HfApi", hub)
    cfg = OmegaConf.merge(cfg, {"stages": ["publish"], "publish": {"repo_id": "someone/x", "dry_run": False,
                                                                   "token": "hf_test"}})
    if public:
        with pytest.raises(PublishError, match="someone/x exists and is public while publish.private=true"):
            run_stages(cfg)
        assert hub.commits == []
        return
    out = run_stages(cfg)["publish"]["outputs"]
    [operations] = hub.commits
    added = {op.path_in_repo for op in operations if isinstance(op, CommitOperationAdd)}
    deleted = {op.path_in_repo for op in operations if isinstance(op, CommitOperationDelete)}
    assert added == {"README.md", "config.json", "model.safetensors"}
    assert deleted == set(out["deleted"]) == {"model-00001-of-00002.safetensors", "model.safetensors.index.json",
                                              "pytorch_model.bin"}


@pytest.mark.parametrize("failure", ["forbidden", "offline"])
def test_publish_names_the_fix_when_the_hub_refuses_or_is_unreachable(eagle_export, monkeypatch, failure):
    """A token without write access (403) or no network: one line saying nothing was committed, not a traceback."""
    from huggingface_hub.errors import HfHubHTTPError

    from train.publish import hub_errors

    def create_repo(self, repo_id, private, exist_ok, repo_type):
        if failure == "offline":   # the HTTP client's own error (httpx, or requests in older huggingface_hub)
            raise hub_errors()[2]("[Errno 101] Network is unreachable")
        error = HfHubHTTPError.__new__(HfHubHTTPError)   # (its constructor wants a response, version by version)
        OSError.__init__(error, "403 Forbidden: You don't have the rights to create a model under someone")
        raise error

    hub = type("Hub", (FakeHub,), {"commits": [], "create_repo": create_repo})
    monkeypatch.setattr("huggingface_hub.HfApi", hub)
    cfg, _, _ = eagle_export
    cfg = OmegaConf.merge(cfg, {"stages": ["publish"], "publish": {"repo_id": "someone/x", "dry_run": False,
                                                                   "token": "hf_test"}})
    with pytest.raises(PublishError, match=r"(403 Forbidden|Network is unreachable).*nothing was committed to "
                                           r"someone/x.*write access"):
        run_stages(cfg)
    assert hub.commits == []


def test_publish_refuses_a_missing_export(cfg_factory):
    cfg = cfg_factory("model=tiny-llama", "stages=[publish]", "publish.repo_id=someone/x", "publish.token=hf_test")
    with pytest.raises(FileNotFoundError, match="Stage 'export' has no complete output"):
        run_stages(cfg)


def test_publish_refuses_foreign_files(eagle_export):
    cfg, _, _ = eagle_export
    save_file({"x": torch.zeros(1)}, str(stage_dir(cfg, "export") / "vllm" / "optimizer.safetensors"))
    cfg = OmegaConf.merge(cfg, {"stages": ["publish"], "publish": {"repo_id": "someone/x", "dry_run": True}})
    with pytest.raises(PublishError, match="optimizer.safetensors"):
        run_stages(cfg)


# --- model cards: portable (no local path) and Hub metadata -------------------------------------------

REPORT = {"device": "cpu", "dtype": "float32", "results": [
    {"dataset": "builtin", "category": "all", "method": "eagle3-tree", "temperature": 0.0, "tau": 2.5,
     "tokens_per_s": 10.0, "plain_tokens_per_s": 5.0, "speedup": 2.0},
    {"dataset": "builtin", "category": "all", "method": "eagle3-chain", "temperature": 0.0, "tau": 2.2,
     "tokens_per_s": 11.0, "plain_tokens_per_s": 5.0, "speedup": 2.2},
    {"dataset": "builtin", "category": "all", "method": "plain", "temperature": 0.0, "tau": 1.0,
     "tokens_per_s": 5.0, "plain_tokens_per_s": 5.0, "speedup": 1.0},
    {"dataset": "humaneval", "category": "all", "method": "eagle3-tree", "temperature": 0.0, "tau": 3.0,
     "tokens_per_s": 12.0, "plain_tokens_per_s": 5.0, "speedup": 2.4},
    {"dataset": "humaneval", "category": "all", "method": "eagle3+ngram-tree", "temperature": 0.0, "tau": 3.4,
     "tokens_per_s": 14.0, "plain_tokens_per_s": 5.0, "speedup": 2.8}],
    "recommendations": [
        {"dataset": "builtin", "category": "all", "temperature": 0.0, "method": "eagle3-tree", "speedup": 2.0, "tau": 2.5},
        {"dataset": "humaneval", "category": "all", "temperature": 0.0, "method": None, "speedup": 2.4, "tau": 3.0}]}


def export_with_report(cfg_factory, *overrides, vllm_check: dict | None = None):
    import yaml  # noqa: F401  (the card's front matter is YAML)

    cfg = cfg_factory("model=tiny-llama", "stages=[export]", *overrides)
    target = load_target(cfg)
    fake_trained(cfg, tiny_eagle3(target, dv=64))
    ev = stage_dir(cfg, "eval")
    ev.mkdir(parents=True, exist_ok=True)
    (ev / "report.json").write_text(json.dumps(REPORT))
    (ev / MARKER).write_text(json.dumps({"stage": "eval", "fingerprint": fingerprint(cfg, "eval")}))  # of this head
    if vllm_check is not None:
        stage_dir(cfg, "export").mkdir(parents=True, exist_ok=True)
        (stage_dir(cfg, "export") / "vllm_check.json").write_text(json.dumps({**made_of(cfg), **vllm_check}))
    run_stages(cfg)
    return cfg


def test_cards_leave_out_measurements_of_an_earlier_head(cfg_factory, caplog, capsys):
    """After a retraining, the eval report and the vLLM check of the head before are not this head's figures:
    the cards leave them out (they carried them while they were current); so does a re-export in another dtype.
    scripts/vllm_check.py reports what the folders it ran are made of, from the export's marker (it stamped the head
    of the run's config, whatever the folders held), and refuses an export made before the marker said so unless it
    is of the run as it is now; a report made before it said what it ran is left out, saying so."""
    check = {"engine": "vllm 0.32.0", "dtype": "float32", "ok": True, "ngram": {"tau": 2.49, "tokens_per_pass": 1.26},
             "exports": {"vllm": {"folder": "/x/export/vllm", "k": 3, "vllm": {"tau": 2.31, "tokens_per_pass": 2.32}}}}
    cfg = export_with_report(cfg_factory, vllm_check=check)
    card = (stage_dir(cfg, "export") / "vllm" / "README.md").read_text()
    assert "eagle3-tree" in card and "2.32 tokens with this head" in card and "This export ran in vLLM" in card
    run_stages(OmegaConf.merge(cfg, {"force": ["export"]}))   # the same files again: the check stays theirs
    assert "2.32 tokens with this head" in (stage_dir(cfg, "export") / "vllm" / "README.md").read_text()
    exported_again = OmegaConf.merge(cfg, {"export": {"dtype": "float32"}})   # other files than vLLM ran
    run_stages(exported_again)
    assert "tau in vllm" not in (stage_dir(cfg, "export") / "vllm" / "README.md").read_text()
    made = read_marker(cfg, "export")["outputs"]["made_of"]   # what a check of these folders now reports
    assert made == made_of(exported_again) != made_of(cfg) and made["export"]["dtype"] == "float32"
    vllm_check = load_script("vllm_check")
    assert [(e.fmt, e.made_of) for e in vllm_check.find_exports(Path(cfg.run_dir), cfg, 3)] == [
        ("vllm", made), ("speculators", made)]
    marker = read_marker(cfg, "export")   # an export made before its marker said what it holds: refused unless current
    del marker["outputs"]["made_of"]
    (stage_dir(cfg, "export") / MARKER).write_text(json.dumps(marker))
    with pytest.raises(SystemExit, match=r"not of this run as it is now \(export.dtype='float32' \(this command: "
                                         r"'bfloat16'\)\): export it again"):
        vllm_check.find_exports(Path(cfg.run_dir), cfg, 3)
    assert [e.fmt for e in vllm_check.find_exports(Path(cfg.run_dir), exported_again, 3)] == ["vllm", "speculators"]
    run_stages(cfg)
    legacy = {**check, "train_output": made["train_output"]}   # no "export": made before it
    (stage_dir(cfg, "export") / "vllm_check.json").write_text(json.dumps(legacy))
    with caplog.at_level("INFO", logger="specheads"):
        run_stages(OmegaConf.merge(cfg, {"force": ["export"]}))
    assert any("was made before the check recorded which export it ran" in r.message for r in caplog.records)
    assert "tau in vllm" not in (stage_dir(cfg, "export") / "vllm" / "README.md").read_text()
    (stage_dir(cfg, "train") / MARKER).write_text(json.dumps({"stage": "train", "fingerprint": fingerprint(cfg, "train"),
                                                              "output_id": "retrained"}))
    vllm_check.find_exports(Path(cfg.run_dir), cfg, 3)   # checked, but said to be the earlier head's
    assert "the export folders hold the head of an earlier training" in capsys.readouterr().out
    run_stages(cfg)  # the train output changed: export reruns
    card = (stage_dir(cfg, "export") / "vllm" / "README.md").read_text()
    assert "No evaluation report of this head was found" in card and "eagle3-tree" not in card
    assert "2.32 tokens with this head" not in card and "tau in vllm" not in card
    assert "This export ran in vLLM" not in card and "This export itself has not been run in an engine" in card


def test_an_eval_report_made_with_other_eval_keys_is_named_and_publish_refuses_to_leave_it_out(cfg_factory, caplog):
    """An export or publish command without the eval overrides the report was made with: export names the keys
    (it said "an earlier head", and the stages=[eval,export] it advised overwrote the user's report), publish
    refuses (the published card would leave the report out); with the overrides repeated the card carries it."""
    cfg = export_with_report(cfg_factory)
    made = OmegaConf.merge(cfg, {"eval": {"limit": 7}})
    (stage_dir(cfg, "eval") / MARKER).write_text(json.dumps({"stage": "eval", "fingerprint": fingerprint(made, "eval"),
                                                             "config": flat_config(made, "eval")}))
    with caplog.at_level("INFO", logger="specheads"):
        run_stages(OmegaConf.merge(cfg, {"force": ["export"]}))
    assert any("report.json was made with eval.limit=7 (this command: 8): left out" in r.message
               for r in caplog.records)
    publish = {"stages": ["publish"], "publish": {"repo_id": "someone/tiny-eagle3", "dry_run": True}}
    with pytest.raises(PublishError, match=r"eval report in .* was made with eval.limit=7 \(this command: 8\), and "
                                           r"the published card would leave it out: repeat those overrides"):
        run_stages(OmegaConf.merge(cfg, publish))
    assert "eagle3-tree" in run_stages(OmegaConf.merge(made, publish))["publish"]["outputs"]["card"]


@pytest.mark.parametrize("thinking,flag", [(None, None), (False, "false"), (True, "true")])
def test_serve_commands_render_the_template_as_trained(cfg_factory, thinking, flag):
    """A Qwen3 head trained with data.thinking=false, served with the template's default (thinking on), drafts for
    answers it never saw: vLLM's commands pass the setting, SGLang's name it for each request."""
    cfg = cfg_factory("model=tiny-qwen2", f"data.thinking={'null' if thinking is None else thinking}")
    for fmt in ("vllm", "speculators"):
        command = serve_commands(fmt, "someone/x", cfg)
        if flag is None:
            assert "--default-chat-template-kwargs" not in command
        else:
            wanted = f"--default-chat-template-kwargs '{{\"enable_thinking\": {flag}}}'"
            assert command.count(wanted) == command.count("vllm serve") > 0
    sglang = serve_commands("sglang", "someone/x", cfg)   # no server-wide default there: each request carries it
    assert ("chat_template_kwargs" in sglang) is (flag is not None)
    assert flag is None or f'"chat_template_kwargs": {{"enable_thinking": {flag}}}' in sglang


def test_serve_commands_pin_the_targets_commit_the_head_was_trained_on(cfg_factory):
    """model.revision (the commit a moved-on Hub repo is pinned to, as extract asks): the serve commands load that
    commit, not the repo's latest; the speculators folder, whose config names the repo only, is served the long way."""
    cfg = cfg_factory("model=qwen2.5-7b", "model.revision=0123abc")
    for fmt in ("vllm", "speculators", "sglang"):
        command = serve_commands(fmt, "someone/x", cfg)
        assert "Qwen/Qwen2.5-7B-Instruct --revision 0123abc " in command, command
        assert "vllm serve someone/x" not in command.replace("(not `vllm serve someone/x`", "")
    assert "--revision" not in serve_commands("vllm", "someone/x", cfg_factory("model=qwen2.5-7b"))


def test_card_headline_is_this_heads_own_lossless_method():
    """The model-index's headline figures came from the recommended method whatever it was (n-gram, when it won) or,
    without one, from the fastest of every method (one with real mismatches too, or a head + n-gram hybrid): they are
    this head's alone, and their names say that the specheads decoder measured them with which method."""
    def row(method, tau, speedup, mismatches=0):
        return {"dataset": "builtin", "temperature": 0.0, "category": "all", "method": method, "tau": tau,
                "speedup": speedup, "mismatches": mismatches}

    results = [row("plain", 1.0, 1.0), row("ngram", 1.5, 1.4), row("eagle3-tree", 2.0, 1.5, mismatches=2),
               row("eagle3+ngram-tree", 1.9, 1.3), row("eagle3-chain", 1.7, 1.2)]
    # Nor a hybrid's (head + n-gram drafts, recommended or fastest): the headline is the head alone, here its chain.
    for recommended in ("ngram", None, "eagle3+ngram-tree"):
        recs = [{"dataset": "builtin", "temperature": 0.0, "category": "all", "method": recommended}] if recommended else []
        out = card_results("vllm", {"results": results, "recommendations": recs}, None, "eagle3-chain", 3)
        assert {(m["metric"], m["value"]) for m in out} == {("acceptance_length", 1.7), ("speedup", 1.2)}
        speedup = next(m["name"] for m in out if m["metric"] == "speedup")
        assert "eagle3-chain" in speedup and "specheads decoder" in speedup   # our decoder's figure, not vLLM's
    # a report with accept_len (accepted + 1 per verify pass, vLLM's definition beside the card's vLLM figure): that
    results[-1]["accept_len"] = 1.8
    out = card_results("vllm", {"results": results, "recommendations": []}, None, "eagle3-chain", 3)
    assert ("acceptance_length", 1.8) in {(m["metric"], m["value"]) for m in out}


@pytest.mark.parametrize("head, chain_k, served, label", [
    ("eagle3", 3, 3, "k=3: what the engines run"),
    ("eagle3", 3, 5, "k=3; the serve commands run k=5"),   # eval.chain_k set apart from export.num_speculative_tokens
    ("medusa", 3, 5, "k=3; the serve commands run k=5"),   # head.num_heads=5: vLLM builds (and runs) 5 heads
    ("medusa", 3, 2, "k=2: what the engines run"),         # 2 heads: the eval chain drafted 2, as vLLM does
])
def test_the_chain_is_labelled_what_the_engines_run_only_at_their_k(head, chain_k, served, label):
    """A card called the eval chain of eval.chain_k tokens "what the engines run" while its serve command ran
    another k (a Medusa head of 5 heads: vLLM runs 5; of 2: the chain drafted 2, the label said 3)."""
    results = [{"dataset": "builtin", "temperature": 0.0, "category": "all", "method": method, "tau": tau,
                "speedup": speedup} for method, tau, speedup in ((f"{head}-tree", 2.0, 1.5), (f"{head}-chain", 1.7, 1.2))]
    report = {"results": results, "recommendations": [], "tree": {"chain_k": chain_k}}
    names = [m["name"] for m in card_results("vllm", report, None, f"{head}-chain", served) if "chain" in m["metric"]]
    assert names and all(f"{head}-chain {label}, T=0.0" in name for name in names), names


def test_a_re_export_keeps_the_users_generation_config_and_names_what_it_removes(eagle_export, caplog):
    """A generation_config.json a user put in an export folder (publish uploads it) was deleted by the next export
    without a word; it is kept, and any other file removed is named."""
    cfg, _, _ = eagle_export
    folder = stage_dir(cfg, "export") / "vllm"
    (folder / "generation_config.json").write_text('{"temperature": 0.6}')
    (folder / "notes.txt").write_text("mine")
    with caplog.at_level("INFO", logger="specheads"):
        run_stages(OmegaConf.merge(cfg, {"force": ["export"]}))
    assert (folder / "generation_config.json").read_text() == '{"temperature": 0.6}' and not (folder / "notes.txt").exists()
    assert any("vllm: removing ['notes.txt']" in r.message for r in caplog.records)
    (folder / "generation_config.json").unlink()


def test_export_removes_an_earlier_exports_other_formats(eagle_export, caplog):
    """An earlier export's format folder that this export does not write (export.formats narrowed) described the
    head before: publish.format and scripts/vllm_check.py took it under this head's card. It is removed, and said."""
    cfg, _, _ = eagle_export
    out = stage_dir(cfg, "export")
    assert (out / "speculators").is_dir()
    with caplog.at_level("INFO", logger="specheads"):
        run_stages(OmegaConf.merge(cfg, {"export": {"formats": ["vllm"]}, "force": ["export"]}))
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["vllm"]
    assert any(f"removing {out / 'speculators'}: an earlier export's format" in r.message for r in caplog.records)


def assert_portable(cfg, folder):
    """Nothing of this machine in what leaves it: no absolute path, no /tmp, no home directory."""
    import os
    import re
    from pathlib import Path

    for name in ("README.md", "config.json"):
        text = (folder / name).read_text()
        for local in (str(Path.home()), "/tmp", os.environ.get("TMPDIR") or "/tmp", str(cfg.output_root),
                      str(Path(cfg.cache_dir).expanduser()), str(stage_dir(cfg, "export"))):
            assert local not in text, (folder / name, local)
        # No absolute POSIX path (a "/" after a space, quote, backtick or line start followed by a name).
        assert not re.search(r"""(^|[\s"'`(=])/(home|tmp|root|usr|var|work|mnt|data|Users)\b""", text, re.M), folder / name


def test_cards_carry_hub_metadata_and_no_local_path(cfg_factory):
    from huggingface_hub import ModelCard

    check = {"engine": "vllm 0.32.0", "dtype": "float32", "ok": True, "ngram": {"tau": 2.49, "tokens_per_pass": 1.26},
             "exports": {"vllm": {"folder": "/somewhere/export/vllm", "k": 3,
                                  "vllm": {"tau": 2.31, "tokens_per_pass": 2.32}}}}
    cfg = export_with_report(cfg_factory, "model.hub_id=HuggingFaceTB/SmolLM2-135M-Instruct",
                             "publish.repo_id=someone/smol-eagle3", vllm_check=check)
    for fmt in ("vllm", "speculators", "sglang"):
        folder = stage_dir(cfg, "export") / fmt
        assert_portable(cfg, folder)
        card = ModelCard.load(folder / "README.md")
        data = card.data.to_dict()
        assert data["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
        assert data["library_name"] == ("sglang" if fmt == "sglang" else "vllm")
        assert data["license"] == "apache-2.0"
        assert {"speculative-decoding", "eagle3", "draft-model"} <= set(data["tags"])
        metrics = {(r.dataset_name, r.metric_type): r for r in card.data.eval_results}
        # Recommended method (builtin: the tree, although the chain is faster), else the fastest (humaneval).
        assert metrics["builtin", "acceptance_length"].metric_value == 2.5
        assert metrics["builtin", "speedup"].metric_value == 2.0
        assert "eagle3-tree" in metrics["builtin", "speedup"].metric_name
        assert metrics["humaneval", "speedup"].metric_value == 2.4   # the tree: the faster hybrid is not the head's
        assert "specheads decoder" in metrics["humaneval", "speedup"].metric_name
        # what the engines run (one drafted path) beside the recommended method, where it was measured
        assert metrics["builtin", "chain_acceptance_length"].metric_value == 2.2
        assert "eagle3-chain: what the engines run" in metrics["builtin", "chain_speedup"].metric_name
        assert ("humaneval", "chain_speedup") not in metrics
        vllm_tau = [r for r in card.data.eval_results if r.metric_name.startswith("tau in vllm")]
        assert [r.metric_value for r in vllm_tau] == ([] if fmt == "speculators" else [2.31])
        text = (folder / "README.md").read_text()
        assert "| humaneval | eagle3+ngram-tree (hybrid: head + n-gram) | 0.0 | 3.40 |" in text
        # the n-gram comparison per target pass, for the exports the check measured (sglang: vLLM's weights)
        assert ("2.32 tokens with this head, 1.26 with vLLM's n-gram" in text) == (fmt != "speculators")
        # The draft's location: the publish repo for the published folder (vllm), a placeholder elsewhere.
        if fmt == "vllm":
            assert '"model": "someone/smol-eagle3"' in text and "<your-hf-user>" not in text
        else:
            assert f"<your-hf-user>/tiny-llama-eagle3-{fmt}" in text and "is a placeholder" in text
        assert "vllm serve HuggingFaceTB/SmolLM2-135M-Instruct" in text or "--model-path HuggingFaceTB/" in text
    spec = json.loads((stage_dir(cfg, "export") / "speculators" / "config.json").read_text())
    assert spec["speculators_config"]["verifier"]["name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_card_of_a_target_without_hub_id(cfg_factory):
    """A tiny (or local) target: its name only plus a note; no license guessed, no base_model."""
    import yaml

    cfg = export_with_report(cfg_factory)
    for fmt in ("vllm", "speculators"):
        folder = stage_dir(cfg, "export") / fmt
        assert_portable(cfg, folder)
        text = (folder / "README.md").read_text()
        meta = yaml.safe_load(text.split("---")[1])
        assert "base_model" not in meta and "license" not in meta and meta["library_name"] == "vllm"
        assert "set `export.license`" in text and "without a Hub id" in text
    spec = json.loads((stage_dir(cfg, "export") / "speculators" / "config.json").read_text())
    assert spec["speculators_config"]["verifier"]["name_or_path"] == "tiny-llama"


def test_target_name_never_a_local_path(tmp_path):
    from train.export import card_license, target_name

    local = OmegaConf.create({"model": {"name": "mine", "source": "hf", "hub_id": None, "path": str(tmp_path / "my-model")},
                              "export": {"license": None}})
    assert target_name(local) == "my-model"
    local.model.hub_id = "org/my-model"
    assert target_name(local) == "org/my-model" and card_license(local) is None
    local.export.license = "mit"
    assert card_license(local) == "mit"
    gguf = OmegaConf.create({"model": {"name": "smollm2-135m", "source": "gguf_package", "path": None,
                                       "hub_id": "HuggingFaceTB/SmolLM2-135M-Instruct"}, "export": {"license": None}})
    assert target_name(gguf) == "HuggingFaceTB/SmolLM2-135M-Instruct" and card_license(gguf) == "apache-2.0"


def test_publish_fills_the_placeholder_repo_in_the_uploaded_card(cfg_factory):
    """The uploaded card is made at publish time: it names publish.repo_id (the export's card, written without
    one, names a placeholder) and carries a vLLM check run after the export."""
    cfg = export_with_report(cfg_factory)   # exported without publish.repo_id: placeholder in the card
    folder = stage_dir(cfg, "export") / "vllm"
    assert "<your-hf-user>/tiny-llama-eagle3-vllm" in (folder / "README.md").read_text()
    assert "tau in vllm" not in (folder / "README.md").read_text()
    check = {**made_of(cfg), "engine": "vllm 0.32.0", "dtype": "float32",
             "ok": True, "ngram": {"tau": 2.49, "tokens_per_pass": 1.26},
             "exports": {"vllm": {"folder": "/x/export/vllm", "k": 3, "vllm": {"tau": 2.31, "tokens_per_pass": 2.32}}}}
    (stage_dir(cfg, "export") / "vllm_check.json").write_text(json.dumps(check))   # scripts/vllm_check.py, later
    cfg = OmegaConf.merge(cfg, {"stages": ["publish"], "publish": {"repo_id": "someone/tiny-eagle3", "dry_run": True}})
    card = run_stages(cfg)["publish"]["outputs"]["card"]
    assert '"model": "someone/tiny-eagle3"' in card and "<your-hf-user>" not in card and "is a placeholder" not in card
    assert "tau in vllm 0.32.0 (k=3" in card and "2.32 tokens with this head, 1.26 with vLLM's n-gram" in card


def test_a_failed_vllm_check_gives_no_figures_and_says_why(cfg_factory, caplog):
    """scripts/vllm_check.py writes its report when the check fails too: the card of an export it failed gives none
    of vLLM's figures for it, says why it failed instead of "ran in vLLM", and publish warns; an export it passed in
    the same report keeps its figures (per-export verdicts)."""
    check = {"engine": "vllm 0.32.0", "dtype": "float32", "ok": False,
             "ngram": {"tau": 2.49, "tokens_per_pass": 1.26, "identical_to_no_spec": True},
             "exports": {"vllm": {"folder": "/x/export/vllm", "k": 3, "ok": False,
                                  "vllm": {"tau": 1.02, "tokens_per_pass": 1.02, "identical_to_no_spec": True},
                                  "aux_layers": {"exported": [1, 2, 3], "vllm": [2, 15, 27], "match": False},
                                  "ours": {"tau": 2.3}, "tau_within_tolerance": False},
                         "speculators": {"folder": "/x/export/speculators", "k": 3, "ok": True,
                                         "vllm": {"tau": 2.31, "tokens_per_pass": 2.32, "identical_to_no_spec": True},
                                         "aux_layers": {"exported": [1, 2, 3], "vllm": [1, 2, 3], "match": True},
                                         "ours": {"tau": 2.3}, "tau_within_tolerance": True}}}
    cfg = export_with_report(cfg_factory, vllm_check=check)
    why = ("The vLLM check of this export failed: vLLM tapped target layers [2, 15, 27], not the exported [1, 2, 3]; "
           "vLLM's acceptance length differs from this project's decoder's by more than the check's tolerance")
    for fmt in ("vllm", "sglang"):   # sglang: the vllm export's weights
        card = (stage_dir(cfg, "export") / fmt / "README.md").read_text()
        assert why in card and "1.02" not in card
        assert "tau in vllm" not in card and "tokens with this head" not in card and "ran in vLLM" not in card
    assert "This export failed its vLLM check" in (stage_dir(cfg, "export") / "vllm" / "README.md").read_text()
    card = (stage_dir(cfg, "export") / "speculators" / "README.md").read_text()
    assert "tau in vllm 0.32.0" in card and "This export ran in vLLM" in card and "check of this export failed" not in card
    with caplog.at_level("INFO", logger="specheads"):
        card = run_stages(OmegaConf.merge(cfg, {"stages": ["publish"], "publish": {
            "repo_id": "someone/tiny-eagle3", "dry_run": True}}))["publish"]["outputs"]["card"]
    assert why in card and "tau in vllm" not in card
    assert any(r.message.startswith("[publish] warning: scripts/vllm_check.py failed this export") for r in caplog.records)


def test_vllm_check_verdicts_per_export_else_the_reports():
    """A report from before per-export verdicts: the report's ``ok`` decides for each export; an engine error is
    named as such, not as a tau."""
    from train.export import passed_export, vllm_failure

    entry = {"vllm": {"tau": 2.0, "identical_to_no_spec": True}, "aux_layers": {"match": True}, "tau_within_tolerance": True}
    assert passed_export("vllm", {"ok": True, "exports": {"vllm": entry}}) == entry
    assert vllm_failure("vllm", {"ok": True, "exports": {"vllm": entry}}) is None
    failed = {"ok": False, "exports": {"vllm": entry}}
    assert passed_export("vllm", failed) is None and passed_export("medusa", failed) is None
    assert vllm_failure("vllm", failed) == "the check as a whole failed (vLLM's n-gram run or another export)"
    error = {"ok": False, "exports": {"vllm": {"ok": False, "aux_layers": {"match": False}, "tau_within_tolerance": False,
                                               "vllm": {"identical_to_no_spec": False, "error": "Traceback ..."}}}}
    assert vllm_failure("sglang", error) == "vLLM could not load or run it"


def test_a_torn_vllm_check_report_is_ignored(cfg_factory, caplog):
    """A check interrupted while writing its report left a torn file: export and publish leave it out, saying so,
    instead of failing with a JSONDecodeError."""
    cfg = export_with_report(cfg_factory)
    torn = json.dumps({"train_output": "test", "ok": True, "exports": {"vllm": {"vllm": {"tau": 2.31}}}})[:40]
    (stage_dir(cfg, "export") / "vllm_check.json").write_text(torn)
    with caplog.at_level("INFO", logger="specheads"):
        run_stages(OmegaConf.merge(cfg, {"force": ["export"]}))
        card = run_stages(OmegaConf.merge(cfg, {"stages": ["publish"], "publish": {
            "repo_id": "someone/tiny-eagle3", "dry_run": True}}))["publish"]["outputs"]["card"]
    assert "This export itself has not been run in an engine" in card and "tau in vllm" not in card
    assert "This export itself has not been run in an engine" in (stage_dir(cfg, "export") / "vllm" / "README.md").read_text()
    assert len([r for r in caplog.records if "vllm_check.json does not parse" in r.message]) == 2   # export, publish


def test_publish_refuses_an_export_of_another_head(cfg_factory):
    """The card is made at publish time from the head trained now: an export made before a retraining would go
    up with another head's card, so it is refused, naming the fix."""
    cfg = export_with_report(cfg_factory)
    (stage_dir(cfg, "train") / MARKER).write_text(json.dumps({"stage": "train", "fingerprint": fingerprint(cfg, "train"),
                                                              "output_id": "retrained"}))
    cfg = OmegaConf.merge(cfg, {"stages": ["publish"], "publish": {"repo_id": "someone/x", "dry_run": True}})
    with pytest.raises(PublishError, match="export again .*force=\\[export\\]"):
        run_stages(cfg)


@pytest.mark.parametrize("stage", ["export", "publish"])
def test_a_card_is_refused_for_settings_the_head_was_not_trained_with(eagle_export, stage):
    """An export or publish command without the overrides the head was trained with: the card (data sources,
    training settings, template kwargs) would describe this command's config. Refused, naming each difference."""
    cfg, _, _ = eagle_export
    other = OmegaConf.merge(cfg, {"stages": [stage], "force": [stage], "train": {"lr": 0.5},
                                  "publish": {"repo_id": "someone/x", "dry_run": True}})
    error = ExportError if stage == "export" else PublishError
    with pytest.raises(error, match=rf"the train stage in .* was made with train.lr={cfg.train.lr!r} "
                                    r"\(this command: 0.5\).*repeat the overrides"):
        run_stages(other)


def test_publish_refuses_a_card_with_a_local_path(eagle_export):
    cfg, _, _ = eagle_export
    card = stage_dir(cfg, "export") / "vllm" / "README.md"
    card.write_text(card.read_text() + f"\nvllm serve {stage_dir(cfg, 'export') / 'vllm'}\n")
    cfg = OmegaConf.merge(cfg, {"stages": ["publish"], "publish": {"repo_id": "someone/x", "dry_run": True}})
    with pytest.raises(PublishError, match="name directories of this machine"):
        run_stages(cfg)


@pytest.mark.parametrize("repo", ["me/qwen3-8b-medusa-vs-eagle3", "me/Medusa-not-EAGLE-3", "me/dflash-medusa"])
def test_publish_refuses_a_medusa_repo_vllm_takes_for_another_method(medusa_export, repo):
    """vLLM 0.32 switches the method on 'eagle-', 'eagle3', 'dflash' or 'dspark' anywhere in the draft's path: a
    Medusa head published under such a name failed to load with its card's own command."""
    cfg = OmegaConf.merge(medusa_export[0], {"stages": ["publish"], "publish": {"repo_id": repo, "dry_run": True}})
    with pytest.raises(PublishError, match="vLLM would load this Medusa head as another method"):
        run_stages(cfg)


def test_a_llama_targets_export_carries_its_license_terms(cfg_factory, tmp_path, caplog):
    """The Llama 3.1 license asks a redistribution for a copy of the agreement, "Built with Llama", and "Llama" first
    in the name of a model Llama's outputs trained: each export folder gets the target's LICENSE and USE_POLICY.md,
    the card both lines, and publish sends them."""
    import shutil

    from train.target import target_path

    local = tmp_path / "llama-target"
    shutil.copytree(target_path(cfg_factory("model=tiny-llama")), local)
    (local / "LICENSE").write_text("LLAMA 3.1 COMMUNITY LICENSE AGREEMENT ...")
    (local / "USE_POLICY.md").write_text("Llama 3.1 Acceptable Use Policy ...")
    cfg = cfg_factory("model=tiny-llama", "model.source=hf", f"model.path={local}", "stages=[export]",
                      "model.hub_id=meta-llama/Llama-3.1-8B-Instruct")
    head = tiny_eagle3(load_target(cfg), dv=64)
    fake_trained(cfg, head)
    with caplog.at_level("INFO", logger="specheads"):
        run_stages(cfg)
    # a local target named by a Hub id: right for a copy, wrong for a fine-tune (engines would serve the base model)
    assert any("for a fine-tune set model.hub_id to its own repo" in r.message for r in caplog.records)
    for fmt in ("vllm", "speculators", "sglang"):
        folder = stage_dir(cfg, "export") / fmt
        assert (folder / "LICENSE").read_text().startswith("LLAMA 3.1") and (folder / "USE_POLICY.md").exists()
        card = (folder / "README.md").read_text()
        assert "Built with Llama" in card and "license: llama3.1" in card
        assert f"model_name: Llama-{cfg.model.name}-eagle3-{fmt}" in card  # "Llama" first: the preset, Llama3.1-8b-...
    publish = OmegaConf.merge(cfg, {"stages": ["publish"], "publish": {"repo_id": "me/Llama-3.1-8B-eagle3",
                                                                       "dry_run": True}})
    sent = [f["path"] for f in run_stages(publish)["publish"]["outputs"]["files"]]
    assert sorted(sent) == ["LICENSE", "README.md", "USE_POLICY.md", "config.json", "model.safetensors"]
    # a target whose cache from_pretrained filled (weights and config, no LICENSE): publish refuses, naming the fix
    (stage_dir(cfg, "export") / "vllm" / "LICENSE").unlink()
    with pytest.raises(PublishError, match=rf"holds no copy of the Llama 3.1 license.*hf download meta-llama/"
                                           rf"Llama-3.1-8B-Instruct LICENSE USE_POLICY.md --local-dir {local}`.*force=\[export\]"):
        run_stages(OmegaConf.merge(publish, {"publish": {"dry_run": False, "token": "hf_test"}}))


def test_medusa_card_is_portable(medusa_export):
    import yaml

    cfg, _, _ = medusa_export
    folder = stage_dir(cfg, "export") / "medusa"
    assert_portable(cfg, folder)
    text = (folder / "README.md").read_text()
    meta = yaml.safe_load(text.split("---")[1])
    assert {"speculative-decoding", "medusa", "draft-model"} <= set(meta["tags"]) and meta["library_name"] == "vllm"
    assert '"method": "medusa", "model": "<your-hf-user>/tiny-qwen2-medusa-medusa"' in text
