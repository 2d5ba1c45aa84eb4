"""Export formats (names, shapes, dtypes, flags, layer ids per engine, completeness), the round
trip into our own heads, and the publish stage (dry run and its errors)."""

from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file

from heads import MedusaConfig, MedusaHead, save_head
from heads.eagle3 import KVCache
from tests.test_heads import HEAD_CFG, tiny_eagle3
from train.export import ExportError, check_tensors, expected_tensors, import_export
from train.publish import PublishError
from train.stages import MARKER, run_stages, stage_dir
from train.target import load_target


def fake_trained(cfg, head) -> None:
    """Place a head where the train stage leaves it, with the stage's completion marker."""
    save_head(head, stage_dir(cfg, "train") / "head")
    (stage_dir(cfg, "train") / MARKER).write_text(json.dumps({"stage": "train", "fingerprint": "test"}))


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


def read(cfg, fmt):
    folder = stage_dir(cfg, "export") / fmt
    return folder, json.loads((folder / "config.json").read_text()), load_file(str(folder / "model.safetensors"))


def test_eagle3_formats_names_shapes_dtypes_flags(eagle_export):
    cfg, target, head = eagle_export
    ours = head.config.aux_layers
    for fmt in ("vllm", "sglang", "speculators"):
        folder, config, tensors = read(cfg, fmt)
        expected = expected_tensors(fmt, head)
        assert set(tensors) == set(expected)
        for name, t in tensors.items():
            assert tuple(t.shape) == expected[name][0], name
            assert t.dtype == {"d2t": torch.int64, "t2d": torch.bool}.get(name, torch.bfloat16), name
        assert "README.md" in {p.name for p in folder.iterdir()}
        card = (folder / "README.md").read_text()
        assert "num_speculative_tokens" in card or "speculative-num-steps" in card
    _, vllm_cfg, vllm_t = read(cfg, "vllm")
    assert vllm_cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert vllm_cfg["norm_before_residual"] is False and vllm_cfg["draft_vocab_size"] == 64
    assert vllm_cfg["target_hidden_size"] == target.config.hidden_size
    assert vllm_cfg["vocab_size"] == target.config.vocab_size and vllm_cfg["num_hidden_layers"] == 1
    assert "embed_tokens.weight" not in vllm_t
    # Layer ids: vLLM = hidden state entering layer i (ours); SGLang = output of layer i (ours - 1).
    assert vllm_cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == ours
    _, sglang_cfg, _ = read(cfg, "sglang")
    assert sglang_cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in ours]
    _, spec_cfg, spec_t = read(cfg, "speculators")
    assert spec_cfg["speculators_model_type"] == "eagle3" and spec_cfg["norm_before_residual"] is False
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


def test_medusa_format_and_round_trip(medusa_export):
    cfg, target, head = medusa_export
    folder, config, tensors = read(cfg, "medusa")
    assert "eagle" not in str(folder).lower()
    assert config["model_type"] == "medusa" and config["medusa_fc_bias"] is True
    V = target.config.vocab_size
    assert config["num_heads"] == 3 and config["num_hidden_layers"] == 2 and config["truncated_vocab_size"] == V
    assert set(tensors) == set(expected_tensors("medusa", head))
    # vLLM 0.32 loads full-vocabulary heads only: the trained rows in place, zeros elsewhere.
    rows = head.draft_ids()
    assert tensors["lm_heads.1.weight"].shape == (V, target.config.hidden_size)
    assert torch.equal(tensors["lm_heads.1.weight"][rows], head.lm_heads[1].weight.bfloat16())
    assert tensors["lm_heads.1.weight"].float().abs().sum() == tensors["lm_heads.1.weight"][rows].float().abs().sum()
    again = import_export(folder, "medusa", target)
    x = torch.randn(2, 5, target.config.hidden_size)
    ours, theirs = head.to(torch.bfloat16).float()(x), again(x)
    assert torch.equal(theirs[..., rows], ours)
    assert torch.count_nonzero(theirs[..., ~head.t2d]) == 0


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


def test_publish_refuses_a_missing_export(cfg_factory):
    cfg = cfg_factory("model=tiny-llama", "stages=[publish]", "publish.repo_id=someone/x")
    with pytest.raises(FileNotFoundError, match="Stage 'export' has no complete output"):
        run_stages(cfg)


def test_publish_refuses_foreign_files(eagle_export):
    cfg, _, _ = eagle_export
    save_file({"x": torch.zeros(1)}, str(stage_dir(cfg, "export") / "vllm" / "optimizer.safetensors"))
    cfg = OmegaConf.merge(cfg, {"stages": ["publish"], "publish": {"repo_id": "someone/x", "dry_run": True}})
    with pytest.raises(PublishError, match="optimizer.safetensors"):
        run_stages(cfg)
