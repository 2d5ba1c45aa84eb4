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
    direct_weights = direct.state_dict()
    for name, tensor in cached.state_dict().items():  # the same numbers, bit for bit
        assert torch.equal(tensor, direct_weights[name]), name
    with torch.no_grad():
        # fp32 GEMMs are not bitwise reproducible across memory layouts (a fresh CI run once differed by 5e-3
        # on logits of magnitude ~20); the weights above are the exact check
        torch.testing.assert_close(cached(ids).logits, direct(ids).logits, rtol=1e-3, atol=2e-2)
        a = cached.generate(ids, max_new_tokens=16, do_sample=False)
        b = direct.generate(ids, max_new_tokens=16, do_sample=False)
    assert a.shape[1] == ids.shape[1] + 16 or a[0, -1].item() == tok.eos_token_id
    assert a.tolist() == b.tolist()


def test_full_training_preset_extends_the_default():
    default, full = make_cfg([]).train, make_cfg(["train=full"]).train
    assert full.max_minutes is None and full.val_tokens is None and full.lr < default.lr
    assert set(full) == set(default) and full.positions == "assistant"
    for preset in (["train=full"], ["model=qwen3-8b"]):   # the real presets select it
        assert make_cfg(preset).data.regen.max_new_tokens == 2048 > make_cfg([]).data.regen.max_new_tokens


def test_qwen3_regenerates_with_the_sampling_its_card_asks_for_reasoning():
    """Qwen3's reasoning is sampled (0.6 / 0.95 / top-k 20: greedy loops until max_new_tokens); the other targets regenerate
    greedily; an override still wins."""
    regen = make_cfg(["model=qwen3-8b"]).data.regen
    assert (regen.temperature, regen.top_p, regen.top_k) == (0.6, 0.95, 20)
    for model in ("qwen2.5-7b", "llama3.1-8b", "smollm2-135m"):
        assert make_cfg([f"model={model}"]).data.regen.temperature == 0.0
    assert make_cfg(["model=qwen3-8b", "data.regen.temperature=0"]).data.regen.temperature == 0


# --- One validation pass (train/checks.py): every enum-like key rejects a typo, listing the valid values.

from train.checks import ENUMS, NUMBERS, problems  # noqa: E402


def _cfg_with(key: str, value):
    """A composed config where ``key`` exists (its head/model/tracking preset), set to ``value``."""
    for presets in ([], ["head=medusa"], ["tracking=wandb"]):
        cfg = make_cfg(["model=tiny-llama", *presets])
        if "[]." in key or OmegaConf.select(cfg, key, default="absent") != "absent":
            break
    if "[]." in key:
        outer, inner = key.split("[].", 1)
        source = {"path": "mine.jsonl", inner: value} if inner != "type" else {"type": value}
        OmegaConf.update(cfg, outer, [source], merge=False)
    else:   # a list key gets the value as its one element (a bare value is refused as not a list: LISTS)
        OmegaConf.update(cfg, key, [value] if OmegaConf.is_list(OmegaConf.select(cfg, key)) else value, merge=False)
    return cfg


@pytest.mark.parametrize("key", list(ENUMS))
def test_every_enum_key_rejects_a_typo_listing_valid_values(key):
    found = problems(_cfg_with(key, "no-such-value"))
    name = key.replace("[]", "[0]")
    assert len(found) == 1 and found[0].startswith(f"{name}='no-such-value' is not valid"), found
    allowed = ENUMS[key](make_cfg(["model=tiny-llama"])) if callable(ENUMS[key]) else ENUMS[key]
    assert all(("null" if a is None else str(a)) in found[0] for a in allowed), found


@pytest.mark.parametrize("key", list(NUMBERS))
def test_every_sized_key_rejects_a_non_number(key):
    found = [p for p in problems(_cfg_with(key, "many")) if not p.startswith("eval.chain_k=") or key == "eval.chain_k"]
    # (eval.chain_k follows export.num_speculative_tokens by interpolation: its error comes too)
    assert len(found) == 1 and found[0].startswith(f"{key.replace('[]', '[0]')}='many' must be"), found


@pytest.mark.parametrize(("override", "message"), [
    ("train.epochs=0", "train.epochs=0 must be an integer >= 1"),
    ("train.micro_batch_tokens=-512", "train.micro_batch_tokens=-512 must be an integer >= 1"),
    ("head.draft_vocab_size=1.5", "head.draft_vocab_size=1.5 must be an integer >= 1"),
    ("data.validation_fraction=1.0", "data.validation_fraction=1.0 must be a number in [0, 1)"),
    ("head.dropout=1.0", "head.dropout=1.0 must be a number in [0, 1)"),
    ("data.train_rows=-5", "data.train_rows=-5 must be an integer >= 1 or null"),
    ("train.lr=0", "train.lr=0 must be a number > 0"),
    ("train.patience=0", "train.patience=0 must be an integer >= 1 or null"),   # (stopped after one step)
    ("train.autocast=float16 dtype=bfloat16", "train.autocast=float16 with weights in bfloat16 (dtype=bfloat16): "
                                              "nothing scales the loss there"),
    ("train.autocast=float16", "train.autocast=float16 with weights in float32 (dtype=auto): nothing scales"),
    ("eval.tree.total_tokens=0", "eval.tree.total_tokens=0 must be an integer >= 1 or auto"),
    ("device=cuda:x", "device='cuda:x' is not valid"),
    ("eval.dtype=bf16", "eval.dtype='bf16' is not valid (did you mean bfloat16?)"),   # (failed after training)
    ("export.formats=[medusa]", "export.formats='medusa' is not valid; valid values: auto, vllm, speculators, sglang"),
    ("data.sources=[{pth:x.jsonl}]", "data.sources[0] has unknown key(s) ['pth']"),
    ("force=eval", "force='eval' must be a list, e.g. force=[eval]"),
    ("stages=publish", "stages='publish' must be a list, e.g. stages=[publish]"),
    ("eval.temperatures=0.7", "eval.temperatures=0.7 must be a list, e.g. eval.temperatures=[0.7]"),
    ("eval.datasets=humaneval", "eval.datasets='humaneval' must be a list"),
    ("head.type=medusa", "head.type=medusa over the eagle3 head's settings: choose the head with head=medusa"),
    ("train.zero_stage=3", "train.zero_stage=3 is not supported: the head would be saved from partitioned"),
    ("eval.methods=[plain,medusa-tree]", "eval.methods has medusa-tree, which needs a medusa head: this run trains a "
                                         "eagle3 head"),
])
def test_ranges_and_head_dependent_values(override, message):
    found = problems(make_cfg(["model=tiny-llama", *override.split()]))
    assert any(p.startswith(message) for p in found), found
    if override.startswith("train.autocast=float16"):   # over float16 weights (DeepSpeed scales the loss): fine
        assert problems(make_cfg(["model=tiny-llama", "train.autocast=float16", "dtype=float16"])) == []


def test_eval_settings_of_another_head_are_refused_before_training():
    """A method or a Medusa tree the trained head cannot run failed in the eval stage, after the training."""
    medusa = ["model=tiny-llama", "head=medusa"]
    assert any("eval.methods has eagle3+ngram-tree, which needs a eagle3 head" in p
               for p in problems(make_cfg([*medusa, "eval.methods=[plain,eagle3+ngram-tree]"])))
    assert any("eval.medusa_choices [0, 0, 0, 0] reaches depth 4, but head.num_heads=3" in p
               for p in problems(make_cfg([*medusa, "eval.medusa_choices=[[0],[0,0,0,0]]", "head.num_heads=3"])))
    assert problems(make_cfg([*medusa, "eval.methods=[plain,ngram,medusa+ngram-tree]",
                              "eval.medusa_choices=[[0],[0,0,0]]", "head.num_heads=3"])) == []


@pytest.mark.parametrize("model", [*MODELS, "tiny-qwen3"])
@pytest.mark.parametrize("head", ["eagle3", "medusa"])
def test_every_preset_passes_validation(model, head):
    for extra in ([], ["train=full"], ["tracking=wandb"], ["device=cuda:1", "plan=true", "eval.methods=[plain,ngram]"]):
        assert problems(make_cfg([f"model={model}", f"head={head}", *extra])) == []


def test_all_problems_are_reported_at_once():
    from train.checks import validate
    from train.errors import ConfigError, UserError

    with pytest.raises(ConfigError) as info:
        validate(make_cfg(["model=tiny-llama", "data.overflow=cut", "data.on_error=ignore", "dtype=fp8"]))
    text = str(info.value)
    assert isinstance(info.value, UserError) and "\n" not in text
    for part in ("data.overflow='cut'", "truncate, drop", "data.on_error='ignore'", "raise, skip",
                 "dtype='fp8'", "auto, float32, bfloat16, float16"):
        assert part in text
