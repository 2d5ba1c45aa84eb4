"""The real presets' quirks on tiny random twins (unit tier): padded vocabulary (Qwen2.5/Qwen3), untied
and tied embeddings, q/k/v biases, Qwen3 q/k norms and head_dim, Llama-3.1 rope scaling, GQA. Each
twin runs data -> extract -> train -> eval -> export, and every export passes the completeness check.
Also: the GPU-scale defaults of the real presets, and the checks that refuse silently wrong settings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from heads.io import head_config
from tests.conftest import make_cfg
from tests.test_export import engine_shapes
from train.export import FORMATS, check_tensors, expected_tensors, import_export
from train.stages import run_stages, stage_dir
from train.target import load_config, load_target, load_tokenizer, load_weights

TWINS = {
    "qwen2.5 (padded vocab, qkv bias, untied)": ["model=tiny-qwen2"],
    "qwen3 (q/k norm, head_dim, padded vocab)": ["model=tiny-qwen3"],
    "llama3.1 (rope scaling, GQA, untied)": ["model=tiny-llama"],
    "tied embeddings": ["model=tiny-llama", "model.tie_word_embeddings=true", "model.name=tiny-llama-tied"],
}
FAST = ["data.sources=[{type:builtin,limit:12}]", "data.regen.max_new_tokens=16", "head.draft_vocab_size=96",
        "extract.dtype=float32", "train.max_steps=3", "train.warmup_steps=1", "train.micro_batch_tokens=2048",
        "train.max_minutes=null", "train.eval_every=1000", "train.num_threads=1", "eval.datasets=[builtin]",
        "eval.limit=1", "eval.warmup=0", "eval.max_new_tokens=8", "eval.tree.total_tokens=4"]


@pytest.mark.parametrize("head", ["eagle3", "medusa"])
@pytest.mark.parametrize("twin", list(TWINS))
def test_twin_runs_every_stage_and_exports_completely(twin, head, tmp_path):
    cfg = make_cfg([*TWINS[twin], f"head={head}", *FAST, f"output_root={tmp_path}"])
    run_stages(cfg)
    config, tokenizer = load_config(cfg), load_tokenizer(cfg)
    vocab = load_file(str(stage_dir(cfg, "data") / "vocab.safetensors"))
    # Everything keyed on the target vocabulary has the model's size, whatever the tokenizer's length.
    assert vocab["all_counts"].numel() == vocab["masked_counts"].numel() == config.vocab_size >= len(tokenizer)
    assert json.loads((stage_dir(cfg, "eval") / "report.json").read_text())["results"]
    target = load_target(cfg)
    for fmt in FORMATS[head]:
        folder = stage_dir(cfg, "export") / fmt
        tensors = load_file(str(folder / "model.safetensors"))
        again = import_export(folder, fmt, target)
        check_tensors(fmt, tensors, expected_tensors(fmt, again), torch.bfloat16)
        assert {k: tuple(t.shape) for k, t in tensors.items()} == engine_shapes(fmt, config, cfg.head.draft_vocab_size)
        vocab_rows = tensors["t2d"] if head == "eagle3" else tensors["lm_heads.0.weight"]
        assert vocab_rows.shape[0] == config.vocab_size
        if head == "eagle3":
            assert_layer_config_is_the_targets(cfg.model, config, fmt, json.loads((folder / "config.json").read_text()))


def assert_layer_config_is_the_targets(preset, config, fmt: str, exported: dict) -> None:
    """The exported draft layer's hyper-parameters and taps, from the preset itself (the import round trip
    above reads them back from the same file, so it cannot see a wrong head_dim, rope_theta or tap)."""
    layer = exported.get("transformer_layer_config", exported)
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "rope_theta", "max_position_embeddings")
    assert {k: layer[k] for k in keys} == {
        **{k: preset[k] for k in keys}, "head_dim": preset.head_dim or preset.hidden_size // preset.num_attention_heads}
    assert layer["rms_norm_eps"] == config.rms_norm_eps and layer["rope_scaling"] is None  # the head's plain RoPE
    assert exported["target_hidden_size"] == preset.hidden_size
    n = preset.num_hidden_layers
    taps = [2, n // 2, n - 3]   # entering layer i; SGLang: output of layer i - 1
    assert exported["eagle_aux_hidden_state_layer_ids"] == taps
    if fmt != "speculators":
        assert exported["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in taps]


def test_padded_twins_are_padded():
    for name in ("tiny-qwen2", "tiny-qwen3"):
        cfg = make_cfg([f"model={name}"])
        assert load_config(cfg).vocab_size > len(load_tokenizer(cfg))


def test_target_loads_without_hub_kernels(monkeypatch):
    """transformers swaps the target's layers for Hub kernels by default (fetched at run time), and without the
    `kernels` package on a GPU it refused to load the target (an H200, 2026-12-04): the target never uses them."""
    import transformers.modeling_utils

    monkeypatch.setattr(transformers.modeling_utils, "is_kernels_available", lambda: False)
    target = load_target(make_cfg(["model=tiny-qwen2"]))
    assert target.use_kernels is False


def test_target_streams_onto_its_gpu(monkeypatch):
    """On a GPU the target loads with a device_map onto this rank's GPU: without one transformers builds the whole
    model in host RAM first (8 ranks x 15-16 GB for an 8B target). Not under ZeRO-3, which partitions at load time
    and refuses a map; not on a CPU. (No GPU here: what reaches from_pretrained is recorded.)"""
    from transformers.integrations import HfDeepSpeedConfig

    import train.target

    asked = []

    class Loaded(torch.nn.Module):
        def to(self, *args, **kwargs):
            return self

    monkeypatch.setattr(train.target, "_from_pretrained", lambda factory, path, cfg, **kw: asked.append(kw) or Loaded())
    cfg = make_cfg(["model=tiny-qwen2"])
    gpu = torch.device("cuda", 3)
    load_target(cfg, gpu, torch.bfloat16)
    load_target(cfg, torch.device("cpu"), torch.float32)
    keep = HfDeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}})
    load_target(cfg, gpu, torch.bfloat16)
    del keep
    assert [kw.get("device_map") for kw in asked] == [{"": gpu}, None, None]
    assert all(kw["use_kernels"] is False for kw in asked)


@pytest.mark.parametrize("twin", list(TWINS))
def test_weights_read_from_files_equal_the_loaded_model(twin):
    """Train and export read three tensors from the checkpoint instead of loading the whole target."""
    cfg = make_cfg(TWINS[twin])
    target, weights = load_target(cfg), load_weights(cfg)
    assert torch.equal(weights.embed, target.get_input_embeddings().weight)
    assert torch.equal(weights.lm_head, target.get_output_embeddings().weight)
    assert torch.equal(weights.norm, target.get_decoder().norm.weight)


@pytest.mark.parametrize("model", ["qwen2.5-7b", "llama3.1-8b", "qwen3-8b"])
def test_real_presets_get_gpu_scale_settings(model):
    cfg = make_cfg([f"model={model}"])
    assert cfg.train.max_minutes is None and cfg.train.micro_batch_tokens == 8192 and cfg.train.lr == 1e-4
    assert cfg.head.ttt_steps == 7 and cfg.head.draft_vocab_size == 32768 and cfg.train.grad_accum_dtype == "fp32"
    assert cfg.eval.limit == 80
    demo = make_cfg([])  # the embedded default keeps the CPU demo's budget
    assert demo.train.max_minutes and demo.head.ttt_steps == 2 and demo.eval.limit == 8
    assert make_cfg([f"model={model}", "head.ttt_steps=5"]).head.ttt_steps == 5


def test_unsorted_or_repeated_taps_are_refused():
    cfg = make_cfg(["model=tiny-llama"])
    config = load_config(cfg)
    for taps in ([5, 4, 2], [2, 2, 5]):
        cfg.head.aux_layers = taps
        with pytest.raises(ValueError, match="ascending and distinct"):
            head_config("eagle3", config, cfg.head, 64)


def hub_snapshot(tmp_path: Path, monkeypatch, commit: str = "0123abcd") -> Path:
    """A Hub cache's snapshot folder of repo org/tiny at ``commit`` (the tiny twin's config and tokenizer files), as
    transformers' cached_file finds it (patched to look there)."""
    import shutil

    import transformers.utils

    from train.target import target_path

    snapshot = tmp_path / "hub" / "models--org--tiny" / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for f in Path(target_path(make_cfg(["model=tiny-llama"]))).iterdir():
        if f.suffix == ".json":
            shutil.copy(f, snapshot / f.name)
    monkeypatch.setattr(transformers.utils, "cached_file", lambda repo, name, **kw: str(Path(repo) / name))
    return snapshot


def test_a_hub_targets_identity_does_not_change_when_its_weights_arrive(tmp_path, monkeypatch):
    """A Hub target's regeneration cache is keyed before its weights are downloaded (config and tokenizer
    only) and looked up again after: the identity of a Hub snapshot is its repository, commit and config, so
    a rerun finds the answers of the crashed run. A local folder is identified by its files, weights included."""
    import shutil

    from train.target import target_fingerprint, target_path

    tiny = Path(target_path(make_cfg(["model=tiny-llama"])))
    snapshot = hub_snapshot(tmp_path, monkeypatch)
    cfg = make_cfg(["model=qwen2.5-7b", f"model.path={snapshot}"])
    before = target_fingerprint(cfg)
    for f in tiny.glob("*.safetensors"):   # the weights arrive
        shutil.copy(f, snapshot / f.name)
    assert target_fingerprint(cfg) == before
    other = snapshot.parent / "4567ef01"   # another commit of the repository
    shutil.copytree(snapshot, other)
    assert target_fingerprint(make_cfg(["model=qwen2.5-7b", f"model.path={other}"])) != before
    # data made from the first commit, read by a run that resolves the second: told which commit to pin
    from train.extract import ExtractError, check_data
    from train.target import target_snapshot, tokenizer_fingerprint

    tokenizer = load_tokenizer(make_cfg(["model=tiny-llama"]))
    made = make_cfg(["model=qwen2.5-7b", f"model.path={snapshot}", f"output_root={tmp_path}"])
    assert target_snapshot(made) == "org/tiny@0123abcd"
    (stage_dir(made, "data")).mkdir(parents=True)
    (stage_dir(made, "data") / "manifest.json").write_text(json.dumps({
        "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer), "target_fingerprint": before,
        "target_snapshot": target_snapshot(made)}))
    assert check_data(made, tokenizer)["target_fingerprint"] == before
    with pytest.raises(ExtractError, match=r"made from org/tiny@0123abcd, and this run loads org/tiny@4567ef01.*"
                                           r"model\.revision=0123abcd"):
        check_data(make_cfg(["model=qwen2.5-7b", f"model.path={other}", f"output_root={tmp_path}"]), tokenizer)
    local = tmp_path / "local"   # a plain folder: its weight files count
    shutil.copytree(snapshot, local)
    first = target_fingerprint(make_cfg(["model=qwen2.5-7b", f"model.path={local}"]))
    for f in local.glob("*.safetensors"):
        f.unlink()
    assert target_fingerprint(make_cfg(["model=qwen2.5-7b", f"model.path={local}"])) != first


def test_a_local_folder_is_told_from_its_fine_tune_and_keeps_what_was_made_for_it(tmp_path):
    """Two local folders whose weight files differ only past each file's first MiB (a fine-tune whose first tensors
    of each file, embeddings and norms, are the base's) have two identities: the regeneration cache, kept states and
    data of one are not the other's. What was made before 2026-12-07, under the first-MiB identity, is still found:
    the regeneration cache under its old name, the data stage's manifest."""
    import shutil

    from safetensors.torch import save_file

    from data.regenerate import found_cache
    from train.extract import check_data
    from train.target import target_fingerprint, target_fingerprints, target_path, tokenizer_fingerprint

    base, tuned = tmp_path / "base", tmp_path / "tuned"
    shutil.copytree(target_path(make_cfg(["model=tiny-llama"])), base)
    weights = torch.zeros(1 << 21)   # 8 MiB
    save_file({"layers": weights}, str(base / "model-extra.safetensors"))
    shutil.copytree(base, tuned)
    weights[1 << 20: (1 << 20) + (1 << 16)] = 1.0   # 256 KiB, 4 MiB into the file
    save_file({"layers": weights}, str(tuned / "model-extra.safetensors"))
    cfg, other = (make_cfg(["model=tiny-llama", "model.source=hf", f"model.path={d}", f"output_root={tmp_path}"])
                  for d in (base, tuned))
    assert target_fingerprint(cfg) != target_fingerprint(other)
    assert target_fingerprint(cfg, legacy=True) == target_fingerprint(other, legacy=True)
    fps = target_fingerprints(cfg)
    assert fps == [target_fingerprint(cfg), target_fingerprint(cfg, legacy=True)]
    tiny = make_cfg(["model=tiny-llama"])   # a folder the pipeline builds keeps one identity
    assert target_fingerprints(tiny) == [target_fingerprint(tiny)]
    caches = [tmp_path / "regenerated" / f"{fp}.jsonl" for fp in fps]
    caches[1].parent.mkdir()
    caches[1].write_text('{"key": "k"}\n')
    part = caches[1].with_name(f"{caches[1].stem}.rank1of2.jsonl")   # an interrupted sharded run's
    part.write_text('{"key": "p"}\n')
    assert found_cache(caches) == caches[0] and caches[0].read_text() == '{"key": "k"}\n'
    assert caches[0].with_name(f"{caches[0].stem}.rank1of2.jsonl").read_text() == '{"key": "p"}\n'
    assert caches[1].exists() and part.exists()   # copied: a folder that shared the old identity keeps them
    caches[0].write_text('{"key": "new"}\n')
    assert found_cache(caches) == caches[0] and caches[0].read_text() == '{"key": "new"}\n'   # once
    tokenizer = load_tokenizer(cfg)
    manifest = stage_dir(cfg, "data") / "manifest.json"
    manifest.parent.mkdir(parents=True)
    for fp in fps[::-1]:   # (data made before: the fine-tune would take it too, as it did then)
        manifest.write_text(json.dumps({"tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
                                        "target_fingerprint": fp}))
        assert check_data(cfg, tokenizer)["target_fingerprint"] == fp
    with pytest.raises(Exception, match="made with another target"):
        check_data(other, tokenizer)


@pytest.mark.parametrize("twin", list(TWINS))
def test_online_training_sees_what_the_extract_stage_stores(twin, tmp_path):
    """`train.online=true` computes inside training what the extract stage stores for each row (the same taps, the same
    full-vocabulary argmax, over a padded vocabulary too), so a head trained either way trains on the same data."""
    from data.stage import load_dataset
    from train.extract import Captures, capture_layers
    from train.loop import Batches

    cfg = make_cfg([*TWINS[twin], *FAST, "extract.source=pass", "stages=[data,extract]", f"output_root={tmp_path}"])
    run_stages(cfg)
    target, cpu = load_target(cfg), torch.device("cpu")
    layers, train = capture_layers(cfg, target.config), load_dataset(cfg)["train"]
    rows = list(range(min(5, len(train))))
    offline = Batches("train", train, Captures(stage_dir(cfg, "extract")), None, layers, cpu)(rows)
    online = Batches("train", train, None, target, layers, cpu)(rows)
    lengths = offline["lengths"]
    valid = torch.arange(int(lengths.max()))[None] < lengths[:, None]
    assert torch.equal(online["input_ids"], offline["input_ids"]) and valid.sum() > 50
    torch.testing.assert_close(online["states"][valid], offline["states"][valid].to(online["states"].dtype),
                               atol=1e-5, rtol=1e-4)
    assert torch.equal(online["argmax"][valid], offline["argmax"][valid])


def test_a_cache_of_a_hub_target_that_moved_on_is_not_started_over_without_a_word(tmp_path, monkeypatch):
    """Any new commit of a Hub repo (a README edit) names a new regeneration cache: a rerun after days of answers
    started over, saying only "0 cached". Refused, naming how to continue (the old snapshot) and how to start over
    (model.revision=<new>); the old cache found through the Hugging Face cache's other snapshots (a cache made before
    the notes) or its note (that snapshot pruned). Other settings, a cache under way or a pinned revision go on."""
    import shutil

    from data.regenerate import cache_file, cache_settings, check_snapshot
    from train.errors import UserError
    from train.target import target_fingerprint

    first, moved = hub_snapshot(tmp_path, monkeypatch), hub_snapshot(tmp_path, monkeypatch, "4567ef01")
    made, now = (make_cfg(["model=qwen2.5-7b", f"model.path={p}"]) for p in (first, moved))
    rcfg, regen = made.data.regen, tmp_path / "regen"
    regen.mkdir()
    settings = cache_settings(rcfg, None)

    def name_for(fp: str) -> Path:
        return cache_file(regen, fp, rcfg, None)

    old, new = (name_for(target_fingerprint(c)) for c in (made, now))
    old.with_name(f"{old.stem}.rank3of8.jsonl").write_text('{"key": "a"}\n')   # answers, in an interrupted rank's part
    moved_on = (r"org/tiny has moved on to commit 4567ef01 since .*\.jsonl \(0\.0 MiB with its parts\) was made with "
                r"these settings at commit 0123abcd: this run would start it over\. Set {} to continue it .*, or add "
                r"model\.revision=4567ef01 to start over")
    with pytest.raises(UserError, match=moved_on.format(f"model\\.path={first}")):
        check_snapshot(now, new, settings, name_for)
    check_snapshot(made, old, settings, name_for)   # the first commit's run goes on, and notes its snapshot
    shutil.rmtree(first)   # the Hugging Face cache pruned: the note still names the old cache
    with pytest.raises(UserError, match=moved_on.format("model\\.path at that snapshot")):
        check_snapshot(now, new, settings, name_for)
    other = OmegaConf.merge(rcfg, {"seed": 5})   # other answers: another cache, nothing of it made before
    check_snapshot(now, cache_file(regen, target_fingerprint(now), other, None), cache_settings(other, None),
                   lambda fp: cache_file(regen, fp, other, None))
    new.with_name(f"{new.stem}.rank1of8.jsonl").write_text('{"key": "b"}\n')   # this commit's own work under way
    check_snapshot(now, new, settings, name_for)
    new.with_name(f"{new.stem}.rank1of8.jsonl").unlink()
    now.model.revision = "4567ef01"   # consent to the new commit: started over, as asked
    check_snapshot(now, new, settings, name_for)


def test_a_quantised_checkpoints_layer_is_refused_not_read_without_its_scales(tmp_path):
    """An FP8 target (Qwen3-8B-FP8: block scales beside each weight) loads and extracts (transformers dequantises),
    but head.layer_init read its layer's raw float8 values into the draft layer, wrong by the missing scales, without
    a word: refused, naming the bf16 checkpoint and head.layer_init=null."""
    import shutil

    from safetensors.torch import save_file

    from train.errors import TargetError
    from train.target import load_layer_weights, load_weights, target_path

    folder = tmp_path / "fp8"
    shutil.copytree(target_path(make_cfg(["model=tiny-qwen3"])), folder)
    tensors = load_file(str(folder / "model.safetensors"))
    name = next(k for k in tensors if k.endswith("layers.1.self_attn.q_proj.weight"))
    tensors[name] = tensors[name].to(torch.float8_e4m3fn)
    save_file(tensors, str(folder / "model.safetensors"))
    cfg = make_cfg(["model=tiny-qwen3", "model.source=hf", f"model.path={folder}"])
    assert load_weights(cfg).embed.shape[0] > 0   # its embedding, norm and lm_head are not quantised: read
    with pytest.raises(TargetError, match=r"self_attn.q_proj.weight is stored as F8_E4M3 .*, a quantised checkpoint "
                                          r".* bf16 checkpoint .*head.layer_init=null"):
        load_layer_weights(cfg, 1)


def test_a_checkpoint_laid_out_otherwise_is_named_not_a_key_error(tmp_path):
    """A multimodal wrapper's checkpoint (Qwen3.5: model.language_model.*, model.visual.*, mtp.*) loaded as its
    text model by transformers' renames: the final norm matched every stored *.norm.weight, and training stopped on a
    bare KeyError after the data and extract stages."""
    from train.errors import TargetError
    from train.target import _Checkpoint

    ckpt = _Checkpoint(make_cfg(["model=tiny-qwen3"]))
    ckpt.where = {k: "model.safetensors" for k in ("model.language_model.layers.0.norm.weight",
                                                    "model.visual.merger.norm.weight", "mtp.norm.weight")}
    with pytest.raises(TargetError, match=r"'model.norm.weight' is ambiguous .* \(3 stored names end like it.*"
                                          r"Point model.path at a text-only checkpoint"):
        ckpt.key("model.norm.weight")
