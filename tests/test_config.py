"""Config composition, the command line, stage selection, and the embedded default target."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from tests.conftest import ROOT, make_cfg
from train.stages import ORDER, run_stages

MODELS = ["smollm2-135m", "qwen2.5-7b", "llama3.1-8b", "qwen3-8b", "tiny-llama", "tiny-qwen2"]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("head", ["eagle3", "medusa"])
def test_every_preset_composes(model, head):
    cfg = make_cfg([f"model={model}", f"head={head}"])
    OmegaConf.resolve(cfg)
    assert cfg.model.name == model and cfg.head.type == head
    assert cfg.run_dir == f"outputs/{model}/{head}"
    assert list(cfg.stages) == ORDER[:5]
    for group in ("data", "extract", "train", "eval", "export", "publish", "tracking"):
        assert group in cfg


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "HOME": "/nonexistent"}
    return subprocess.run([sys.executable, str(ROOT / "train/run.py"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_cfg_job_prints_full_config_offline_without_weights():
    out = run_cli("model=qwen2.5-7b", "head=eagle3", "--cfg", "job")
    assert out.returncode == 0, out.stderr
    printed = OmegaConf.create(out.stdout)
    assert printed.model.hub_id == "Qwen/Qwen2.5-7B-Instruct" and printed.head.type == "eagle3"
    assert "Loading" not in out.stderr


def test_typo_in_override_lists_valid_choices():
    out = run_cli("model=qwen2.5-7", "--cfg", "job")
    assert out.returncode != 0
    assert "Could not find 'model/qwen2.5-7'" in out.stderr and "qwen2.5-7b" in out.stderr
    with pytest.raises(ConfigCompositionException):
        make_cfg(["head=eagle"])


def test_unknown_stage_is_refused():
    with pytest.raises(ValueError, match="Unknown stage.*'evaluate'.*valid stages"):
        run_stages(make_cfg(["stages=[data,evaluate]"]))


def test_missing_upstream_stage_is_a_clear_error(tmp_path):
    cfg = make_cfg(["model=tiny-llama", f"output_root={tmp_path}", "stages=[extract]"])
    with pytest.raises(FileNotFoundError, match="Stage 'data' has no complete output.*stages=\\[data\\]"):
        run_stages(cfg)


@pytest.mark.integration
def test_default_target_gguf_equals_cached_directory(default_cfg):
    """The GGUF default, loaded straight from the package, and its cached HF directory agree."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from train.target import _gguf_path, load_target, load_tokenizer, target_path

    cached = load_target(default_cfg)
    tok = load_tokenizer(default_cfg)
    folder = Path(target_path(default_cfg))
    assert folder.parent == Path(default_cfg.cache_dir).expanduser() / "targets"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in folder.iterdir()}
    gguf = _gguf_path(default_cfg.model)
    direct = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    direct_tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    messages = [{"role": "user", "content": "Name three colours."}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    assert ids.tolist() == direct_tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                                          return_dict=True)["input_ids"].tolist()
    with torch.no_grad():
        torch.testing.assert_close(cached(ids).logits, direct(ids).logits, rtol=1e-4, atol=1e-4)
        a = cached.generate(ids, max_new_tokens=16, do_sample=False)
        b = direct.generate(ids, max_new_tokens=16, do_sample=False)
    assert a.shape[1] == ids.shape[1] + 16 or a[0, -1].item() == tok.eos_token_id
    assert a.tolist() == b.tolist()


def test_full_training_preset_extends_the_default():
    default, full = make_cfg([]).train, make_cfg(["train=full"]).train
    assert full.max_minutes is None and full.val_tokens is None and full.lr < default.lr
    assert set(full) == set(default) and full.positions == "assistant"
