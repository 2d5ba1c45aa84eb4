"""The planner: disk, memory per rank and time of every stage, before any weight is loaded.

``python train/run.py model=qwen2.5-7b ... plan=true`` prints :func:`print_plan` and exits; the train stage
calls :func:`check_train_memory` first and refuses to start when the estimate exceeds the free memory.

Nothing here loads weights. The target's architecture is its config (:func:`architecture`: the real one
when it can be had, else the snapshot ``conf/model/arch/<model.name>.json``); parameter counts come from
the target and the head built on the meta device. Activation memory is what the training code keeps
alive, derived from ``train/losses.py`` (``eagle3_loss``, ``medusa_loss``, ``soft_ce``) and
``heads/eagle3.py`` (RMSNorm, attention, ``TTTCache``): each term below names the tensors it stands for,
and the integration test checks the sum against the live tensors of a real training step.
"""

from __future__ import annotations

import json
import os
import shutil
import weakref
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import torch
from omegaconf import DictConfig
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from data.captured import keeps_states
from data.stage import validation_count
from heads.eagle3 import TTTCache
from heads.io import build_head, head_config
from train import dist
from train.errors import ConfigError, UserError
from train.extract import capture_layers
from train.log import log
from train.stages import current_marker, stage_dir, upstream
from train.target import load_config, regen_dtype, resolve_device, resolve_dtype

ARCH_DIR = Path(__file__).resolve().parents[1] / "conf" / "model" / "arch"
GiB = 2**30
F32 = 4  # bytes of the fp32 tensors the losses and the optimizer keep whatever the training dtype


class MemoryShortError(UserError, RuntimeError):
    pass


@dataclass
class Estimate:
    """Bytes per rank by item (with a note each) and the peak those items reach together."""

    items: dict[str, int] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)
    peak: int = 0

    def add(self, name: str, nbytes: float, note: str = "") -> int:
        self.items[name], self.notes[name] = int(nbytes), note
        return int(nbytes)


# ---------------------------------------------------------------------------------------------- shapes
def _architecture(cfg: DictConfig):
    """(config, where it came from)."""
    try:
        return load_config(cfg), f"the config of {cfg.model.path or cfg.model.hub_id or cfg.model.name}"
    except (OSError, ValueError) as e:
        snapshot = ARCH_DIR / f"{cfg.model.name}.json"
        if not snapshot.exists():
            raise
        log(f"[plan] the config of {cfg.model.name} is not available here ({type(e).__name__}); using {snapshot}")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = json.loads(snapshot.read_text())["model_type"]
    return CONFIG_MAPPING[model_type].from_json_file(str(snapshot)), str(snapshot.relative_to(ARCH_DIR.parents[2]))


def architecture(cfg: DictConfig):
    """The target's ``PretrainedConfig`` without weights: the real one (local dir, HF cache, the Hub when
    online; tiny/GGUF targets materialise their small local dir), else ``conf/model/arch/<model.name>.json``."""
    return _architecture(cfg)[0]


def _linear_params(module: nn.Module) -> int:
    """Weights that cost 2 FLOPs per token each in a forward pass (the nn.Linear ones)."""
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, nn.Linear))


@dataclass
class Shapes:
    """Everything the estimates need, counted on the meta device."""

    config: object                 # the target's text config
    target_params: int
    target_linear: int             # matmul weights of a forward pass (lm_head included)
    head: object                   # the head's config (Eagle3Config | MedusaConfig)
    trainable: int
    frozen: int
    buffer_bytes: int
    head_once: int                 # EAGLE-3 fc: run once per token
    head_repeat: int               # run once per TTT step (EAGLE-3) / once (Medusa)
    largest: int                   # the largest trainable weight
    captured: int                  # target layers the extract stage stores per token


def shapes(cfg: DictConfig, config) -> Shapes:
    """Parameter counts of the target and the head."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        target = AutoModelForCausalLM.from_config(config)
        kind = cfg.head.type
        vocab = getattr(config, "text_config", config).vocab_size   # the train stage caps it at the vocabulary
        hcfg = head_config(kind, config, cfg.head, min(cfg.head.draft_vocab_size, vocab))
        head = build_head(kind, hcfg)
    if kind == "eagle3" and not cfg.head.train_lm_head:
        head.lm_head.requires_grad_(False)
    once = head.fc.weight.numel() if kind == "eagle3" else 0
    return Shapes(
        config=getattr(config, "text_config", config),
        target_params=sum(p.numel() for p in target.parameters()), target_linear=_linear_params(target),
        head=hcfg,
        trainable=sum(p.numel() for p in head.parameters() if p.requires_grad),
        frozen=sum(p.numel() for p in head.parameters() if not p.requires_grad),
        buffer_bytes=sum(b.numel() * b.element_size() for b in head.buffers()),
        largest=max((p.numel() for p in head.parameters() if p.requires_grad), default=0),
        head_once=once, head_repeat=_linear_params(head) - once, captured=len(capture_layers(cfg, config)))


# ------------------------------------------------------------------------------------------------ data
@dataclass
class Rows:
    """The conversations the data stage will keep, by split (rows without a split of their own split as
    :func:`data.stage.assign_splits` will, ``data.train_rows`` applied), and the user turns regeneration answers."""

    train: int
    validation: int
    train_turns: float
    validation_turns: float
    source: str

    @property
    def turns(self) -> int:
        return round(self.train_turns + self.validation_turns)


def row_tokens(cfg: DictConfig, rows: Rows | None = None) -> int:
    """Tokens per conversation assumed before the data stage has run: ``planner.avg_row_tokens``, or, where the
    target answers every user turn of ``rows`` (``data.regenerate``), the answers' tokens if more (train=full's
    2048-token answers: ~1350 each, five times the demo's whole row); at most ``data.max_length``."""
    per_row = cfg.planner.avg_row_tokens
    if rows is not None and cfg.data.regenerate:
        per_row = max(per_row, round(rows.turns / max(rows.train + rows.validation, 1) * answer_tokens(cfg)))
    return min(per_row, cfg.data.max_length)


def answer_tokens(cfg: DictConfig) -> float:
    """Tokens the target writes per answer, assumed: ``planner.answer_tokens`` or ``answer_share`` x
    ``data.regen.max_new_tokens``."""
    return cfg.planner.answer_tokens or cfg.planner.answer_share * cfg.data.regen.max_new_tokens


def copies_states(cfg: DictConfig) -> bool:
    """Whether extract copies states the data stage keeps while it regenerates (:func:`data.captured.keeps_states`,
    and something is regenerated), rather than computing them."""
    return keeps_states(cfg) and bool(cfg.data.regenerate)


def count_rows(cfg: DictConfig) -> Rows:
    """:class:`Rows` from ``planner.rows`` or ``planner.tokens`` (one turn each, no split of their own), else read
    from ``data.sources`` (builtin, humaneval, local files; synth: its ``n``, ``limit`` applied)."""
    from data.formats import read_source, row_split

    pc, dc = cfg.planner, cfg.data
    rows, turns = Counter(), Counter()   # by split (None: assigned later)
    if pc.rows or pc.tokens:
        rows[None] = turns[None] = int(pc.rows or round(pc.tokens / row_tokens(cfg, Rows(1, 0, 1, 0, ""))))
        source = "planner.rows" if pc.rows else "planner.tokens / planner.avg_row_tokens"
    else:
        source = "data.sources"
        for src in dc.sources:
            if src.get("type") == "synth":   # prompts the target writes: as many as asked for, one turn each
                n, split = min(_synth_n(src), src.get("limit") or 1 << 62), row_split({}, src)
                rows[split] += n
                turns[split] += n
            elif src.get("hf"):
                raise ConfigError(f"the planner cannot count the rows of data source {dict(src)} (a Hub dataset): "
                                  "set planner.rows (conversations) or planner.tokens, or run the data stage first")
            else:
                for conv in read_source(src, "skip", Counter()):
                    rows[conv["split"]] += 1
                    turns[conv["split"]] += sum(m["role"] == "user" for m in conv["messages"])
    free_val = validation_count(rows[None], dc.validation_fraction, dc.validation_max_rows) if rows[None] else 0
    val, train = rows["validation"] + free_val, rows["train"] + rows[None] - free_val
    per_turn = turns[None] / max(rows[None], 1)   # of the rows without a split of their own
    val_turns = turns["validation"] + free_val * per_turn
    train_turns = turns["train"] + (rows[None] - free_val) * per_turn
    if dc.train_rows is not None and dc.train_rows < train:   # a random subset: its share of the turns
        train_turns, train = train_turns * dc.train_rows / train, int(dc.train_rows)
    return Rows(train, val, train_turns, val_turns, source)


def _synth_n(source) -> int:
    from data.synth import DEFAULTS

    return int(source.get("n", DEFAULTS["n"]))


def data_tokens(cfg: DictConfig, rows: Rows | None = None) -> tuple[dict[str, int], str]:
    """({train, validation} tokens, where the figure comes from); ``rows``: :func:`count_rows`'s, if counted."""
    pcfg = cfg.planner
    manifest = stage_dir(cfg, "data") / "manifest.json"
    if pcfg.tokens:
        return {"train": int(pcfg.tokens), "validation": 0}, "planner.tokens"
    if manifest.exists():
        return {k: int(v) for k, v in json.loads(manifest.read_text())["tokens"].items()}, f"data manifest {manifest}"
    rows = rows or count_rows(cfg)
    per_row = row_tokens(cfg, rows)
    basis = "planner.avg_row_tokens" if per_row == row_tokens(cfg) else "the target's answers, planner.answer_share"
    return ({"train": rows.train * per_row, "validation": rows.validation * per_row},
            f"estimate: {rows.train + rows.validation} rows ({rows.source}) x {per_row} tokens/row "
            f"({basis}); run the data stage or set planner.tokens for the real figure")


def generation(cfg: DictConfig, sh: Shapes, kind: str, dtype: torch.dtype, world: int, per_token: int,
               rows: Rows | None = None, done: bool = False) -> dict:
    """The data stage's generation (``data.sources`` of type synth: the target writes prompts; ``data.regenerate``:
    it answers every user turn of every conversation kept): tokens, tokens/s of one replica and the replicas
    (:func:`regen_rate`), hours; nothing left when the data stage is done. Keeping the states of what it generates
    (``extract.source``) also writes ``per_token`` bytes per token of every row: the disk's bandwidth
    (``planner.disk_mb_s``) can bind instead. ``rows``: :func:`count_rows`'s, if counted; ``done``: the data stage's
    outputs are current (nothing to generate)."""
    pc, dc = cfg.planner, cfg.data
    if done:
        return {"done": True, "hours": 0.0}
    rows = rows or count_rows(cfg)
    answers = rows.turns if dc.regenerate else 0
    prompts = sum(_synth_n(s) for s in dc.sources if s.get("type") == "synth")
    tokens = {"prompts": round(prompts * pc.synth_tokens), "answers": round(answers * answer_tokens(cfg))}
    rate, replicas, basis = regen_rate(cfg, sh, kind, dtype, world)
    hours = None if rate is None else sum(tokens.values()) / (rate * replicas) / 3600
    if copies_states(cfg) and hours is not None:
        disk_h = (rows.train + rows.validation) * row_tokens(cfg, rows) * per_token / (pc.disk_mb_s * 1e6) / 3600
        if disk_h > hours:
            hours, basis = disk_h, f"planner.disk_mb_s: writing the states kept for extract ({basis} would be faster)"
    return {"done": False, "prompts": prompts, "answers": answers, "tokens": tokens, "tok_s": rate,
            "replicas": replicas, "basis": basis, "hours": hours}


def regen_rate(cfg: DictConfig, sh: Shapes, kind: str, dtype: torch.dtype,
               world: int) -> tuple[float | None, int, str]:
    """(tokens/s of one replica, replicas, why). Replicas: the ``hf`` backend's ranks (rank 0 alone when it
    regenerates nothing), the ``vllm`` server's data-parallel replicas over ``world`` GPUs (``-tp``/``-dp`` of
    ``data.regen.vllm.args``, as :class:`data.engines.VLLMServer` starts it), one ``openai`` server. A decode step
    over B rows (hf: ``data.regen.batch_size``; vllm: ``data.regen.concurrency`` shared by the replicas) costs the
    backend's own loop (``hf``: ``hf_step_ms_per_layer`` x layers) plus the larger of reading the weights and the
    rows' KV cache (``hbm_gb_s``) and the matmuls (``regen_tflops``), both over the tensor-parallel GPUs. An
    ``openai`` server's rate, and ``planner.regen_tok_s``, are taken as stated."""
    from data.engines import DP_FLAGS, TP_FLAGS, _flag

    pc, rg = cfg.planner, cfg.data.regen
    if rg.backend == "openai":
        return (float(pc.regen_tok_s), 1, "planner.regen_tok_s") if pc.regen_tok_s else (
            None, 1, "a server of your own (data.regen.backend=openai): set planner.regen_tok_s")
    tp = 1
    if rg.backend == "hf":
        replicas, rows = (world if cfg.data.regenerate else 1), rg.batch_size
    elif kind == "gpu":
        args = [str(a) for a in rg.vllm.args]
        tp = _flag(args, TP_FLAGS) or 1
        replicas = _flag(args, DP_FLAGS) or max(1, world // tp)
        rows = max(1, (rg.concurrency or 64 * tp * replicas) // replicas)
    else:
        replicas, rows = 1, rg.concurrency or 16
    if pc.regen_tok_s:
        return float(pc.regen_tok_s), replicas, "planner.regen_tok_s"
    rates = pc[kind]
    context = row_tokens(cfg)   # the rows' mean cached length, about
    loop = rates.hf_step_ms_per_layer * sh.config.num_hidden_layers / 1e3 if rg.backend == "hf" else 0.0
    memory = (sh.target_params + rows * context * _kv_bytes(sh.config, 1)) * dtype.itemsize / (tp * rates.hbm_gb_s * 1e9)
    compute = 2 * sh.target_linear * rows / (tp * rates.regen_tflops * 1e12)
    step = loop + max(memory, compute)
    return rows / step, replicas, (
        f"{rows} rows a step of {step * 1e3:.0f} ms" + (f" over {tp} GPUs" if tp > 1 else "")
        + f": {rg.backend} loop {loop * 1e3:.0f} ms + "
        + (f"weights and KV cache at planner.{kind}.hbm_gb_s" if memory > compute else f"matmuls at planner.{kind}.regen_tflops"))


# ---------------------------------------------------------------------------------------------- memory
def _ttt_rows(B: int, heads: int, T: int) -> int:
    """Query rows per chunk of a TTT step k > 0, as ``TTTCache.attend`` picks them."""
    return TTTCache.rows_per_chunk(B, heads, T)


@dataclass
class Activations:
    """Bytes of one micro-batch in the train stage (see :func:`activations`)."""

    batch: int          # what ``Batches`` builds: hidden states, ids, loss mask, target argmax
    saved: int          # the target's log-probs, the head's inputs, and what autograd saves over all steps
    released: int       # of ``saved``, freed before the gradients of weights reused by every step all exist
    transient: int      # the largest short-lived tensors on top of ``saved`` (loss, TTT attention chunk)


# [tokens, draft vocab] fp32 tensors that one draft step's objective (train.losses.objective) keeps for
# backward, and those it holds only while it runs. kl: log q (the log_softmax output) and p = exp(log p) for the
# product's backward; transient the shifted log p and the product. kl_mix also keeps q = exp(log q), and p - q
# and log p - log q (the product's operands) instead of p; transient the shifted log p, p and the product.
LOSS_TENSORS = {"kl": (2, 2), "kl_mix": (4, 3)}


def activations(sh: Shapes, kind: str, tokens: int, seq_len: int, steps: int, s: int, states_bytes: int,
                loss: str = "kl") -> Activations:
    """What ``train.loop.compute`` keeps alive for one micro-batch of ``tokens`` padded tokens in rows of
    ``seq_len``: training dtype of ``s`` bytes, hidden states of the batch stored with ``states_bytes``;
    ``loss``: ``head.loss`` (:data:`LOSS_TENSORS`; the other objectives are counted as ``kl``)."""
    h, N, T = sh.head, tokens, seq_len
    H, V = h.hidden_size, h.draft_vocab_size
    # Batches: states [N, layers, H], ids, mask, argmax (int64). target_view: fp32 log-probs [N, V].
    batch, log_p = N * (sh.captured * H * states_bytes + 3 * 8), N * V * F32
    kept, held = LOSS_TENSORS.get(loss, LOSS_TENSORS["kl"])
    loss_saved, transient = kept * N * V * F32, held * N * V * F32   # per step (head); the last loss's
    if kind == "medusa":
        # Per head: each ResBlock layer keeps its input (linear) and pre-activation (silu), lm_head its input;
        # and the objective's tensors. Heads share no weight.
        saved = h.num_heads * (N * (2 * h.num_layers + 1) * H * s + loss_saved)
        return Activations(batch, log_p + N * H * s + saved, 0, transient)   # + the head's input in its dtype
    d, heads, inter = h.head_dim, h.num_attention_heads, h.intermediate_size
    qd, kvd = heads * d, h.num_key_value_heads * d
    per_step = N * s * (8 * H           # 4 RMSNorm outputs before the weight (x_normed), 2 norm outputs feeding
                                        # linears (MLP, lm_head), the [emb | hidden] concat (2H)
                        + 2 * qd        # rotated q, the attention output fed to o_proj
                        + 2 * kvd       # rotated k and v (step 0: SDPA inputs; k > 0: the cache's diagonal)
                        + 2 * d         # RoPE cos, sin
                        + 4 * inter     # MLP: gate, silu(gate), up, their product
                        ) + loss_saved
    # Inputs of the 3 RMSNorms that need a gradient, saved by pow/mul in fp32: in fp32 the features
    # themselves (fc output + after attention + after the MLP of each step); in bf16 each norm's fp32 copy.
    norm_in = N * H * F32
    saved = (steps * per_step + norm_in * (2 * steps + 1 if s == F32 else 3 * steps)
             + N * kvd * s * steps * (steps - 1)    # stacked diagonal k, v of steps 1..k (checkpoint inputs)
             + N * heads * F32)                     # step-0 SDPA logsumexp
    # TTT step k > 0, backward of one checkpointed chunk: the fp32 softmax output and its fp32 gradient
    # plus two score-sized tensors in the training dtype, over [B, heads, rows, T + k] scores.
    B = max(1, N // T)
    attention = B * heads * _ttt_rows(B, heads, T) * (T + steps - 1) * (2 * F32 + 2 * s) if steps > 1 else 0
    # The weights of a step serve every step: their gradients all exist once the last step's backward is
    # done, which has released that step's tensors and the loss tensors of the step before.
    released = per_step + norm_in * 2 + loss_saved if steps > 1 else 0
    return Activations(batch, log_p + N * 3 * H * s + saved, released, max(transient, attention))   # + taps [N, 3H]


def train_memory(cfg: DictConfig, sh: Shapes, dtype: torch.dtype, world: int) -> Estimate:
    """Peak memory of one rank of the train stage: static + max(forward, backward, optimizer step)."""
    from train.loop import deepspeed_config

    tc, s, est = cfg.train, dtype.itemsize, Estimate()
    kind = cfg.head.type
    zero = deepspeed_config(tc, dtype)["zero_optimization"]["stage"]
    # DeepSpeed's BF16 optimizer (bf16 + fp32 gradient accumulation): a full fp32 gradient buffer, and the
    # bf16 gradients stay until the next backward.
    fp32_accum = s < F32 and tc.grad_accum_dtype == "fp32"
    steps = cfg.head.ttt_steps if kind == "eagle3" else 1
    N, T = tc.micro_batch_tokens, min(tc.micro_batch_tokens, cfg.data.max_length)
    H, V, P = sh.config.hidden_size, sh.head.draft_vocab_size, sh.trainable
    shard = (lambda stage: world if zero >= stage else 1)  # noqa: E731
    static = est.add("target weights", sh.target_params * s if tc.online else 0,
                     f"{_count(sh.target_params)} params x {_name(dtype)} (online)" if tc.online else
                     "offline: only the embedding, lm_head and final norm are read, on the host, and released")
    static += est.add("draft lm_head rows", V * H * s, f"the target's lm_head rows of the {V} draft ids")
    static += est.add("head trainable weights", P * s, f"{_count(P)} x {_name(dtype)}")
    shared = sh.config.vocab_size * H if tc.online and kind == "eagle3" else 0   # online: the target's own embedding
    static += est.add("head frozen weights", (sh.frozen - shared) * s + sh.buffer_bytes,
                      f"{_count(sh.frozen - shared)} x {_name(dtype)} (the target's embedding"
                      + (", shared with the online target: not counted" if shared else "") + ") + vocabulary maps")
    static += est.add("optimizer states", P * ((2 * F32 + (F32 if s < F32 else 0)) / shard(1) + (F32 if fp32_accum else 0)),
                      "AdamW m, v" + (" + fp32 master weights" if s < F32 else "") + (" + fp32 gradients" if fp32_accum else "")
                      + (f"; ZeRO-{zero} over {world} ranks" if zero and world > 1 else ""))
    grads = est.add("gradients", P * s / shard(2), "during backward" + (
        "; kept until the next backward" if fp32_accum else "; kept across micro-batches" if tc.grad_accum > 1 else ""))
    prefetch = 0 if tc.online else tc.get("prefetch", 0)
    act = activations(sh, kind, N, T, steps, s, s if tc.online else getattr(torch, cfg.extract.dtype).itemsize,
                      cfg.head.loss)
    # train.loss_norm=token builds a step's micro-batches before its first forward (their counts of positions)
    step = tc.grad_accum if tc.get("loss_norm") == "token" and tc.grad_accum > 1 else 1
    batch = est.add("batches", act.batch * (step + prefetch), f"{N} tokens (train.micro_batch_tokens) x {step + prefetch} "
                    + (f"({step} of a step (train.loss_norm=token) " if step > 1 else "(current ")
                    + "+ train.prefetch): hidden states, ids, argmax")
    saved = est.add("activations", act.saved, "target log-probs over the draft vocabulary, saved for backward over "
                    + (f"{steps} TTT steps" if kind == "eagle3" else f"{sh.head.num_heads} heads"))
    transient = est.add("peak transient", act.transient, f"the last loss ({cfg.head.loss}): [N, draft vocab] fp32 tensors"
                        + (" | a TTT attention chunk" if steps > 1 else ""))
    held = grads if fp32_accum or tc.grad_accum > 1 else 0
    largest = sh.largest * s / shard(2)
    # Backward's high point. Weights that every TTT step reuses have all their gradients once the last step
    # is done, while the earlier steps' tensors (less ``released``) are alive; a new gradient and the
    # out-of-place sum then join them. Weights used once (1 step, Medusa): its start, the loss gradients
    # (one [N, draft vocab] fp32 beyond the saved tensors) and the first weight gradient.
    backward = (batch + saved - act.released + grads + 2 * largest if steps > 1
                else batch + saved + N * V * F32 + max(held, largest))
    phases = {"forward": batch + saved + transient + held, "backward": backward,
              "step": grads + P * F32 / shard(1)}   # + one fp32 copy (AdamW's sqrt(v), the flat all-reduce buffer)
    if tc.online:   # Batches runs the target's forward (no grad) before the head's
        capture = extract_memory(cfg, sh, dtype, world, N)
        phases["capture"] = capture.peak - capture.items["target weights"]
    est.peak = static + max(phases.values())
    return est


def _kv_bytes(c, s: int) -> int:
    """KV cache bytes per token of the target (every layer, k and v)."""
    return 2 * c.num_hidden_layers * c.num_key_value_heads * (getattr(c, "head_dim", None)
                                                             or c.hidden_size // c.num_attention_heads) * s


def extract_memory(cfg: DictConfig, sh: Shapes, dtype: torch.dtype, world: int, tokens: int | None = None) -> Estimate:
    """One rank's peak during extraction (``tokens`` per forward, default ``extract.batch_tokens``):
    target weights (under ZeRO-3 a 1/world share, plus the whole lm_head the argmax gathers) + max(forward,
    full-vocabulary argmax), from ``train.extract.capture``/``full_argmax``."""
    c, s, est = sh.config, dtype.itemsize, Estimate()
    N, L, H = tokens or cfg.extract.batch_tokens, sh.captured, sh.config.hidden_size
    zero3 = cfg.extract.zero_stage == 3
    weights = est.add("target weights", sh.target_params * s / (world if zero3 else 1),
                      f"{_count(sh.target_params)} params x {_name(dtype)}" + (f" / {world} ranks (ZeRO-3)" if zero3 else ""))
    if zero3:   # train.extract._full_weight: a gathered copy of the lm_head on every rank, for the whole stage
        weights += est.add("gathered lm_head", c.vocab_size * H * s, "ZeRO-3: the full-vocabulary argmax's copy")
    # The decoder's forward (no KV cache) keeps the captured layers, two residual streams, the embeddings
    # and a normed input while one MLP holds gate, act(gate) and up [N, I].
    fwd = est.add("forward activations", N * ((L + 3) * H + 3 * c.intermediate_size) * s,
                  "captured layers, residual streams, one MLP")
    # full_argmax: the stacked captures and one [1024, vocab] chunk of logits.
    arg = est.add("argmax logits", (N * L * H + min(N, 1024) * c.vocab_size) * s, "1024-row chunks over the full vocabulary")
    est.peak = weights + max(fwd, arg)
    return est


def eval_memory(cfg: DictConfig, sh: Shapes, dtype: torch.dtype) -> Estimate:
    """Rank 0 in the eval stage: target + head weights + the target's KV cache at the longest context."""
    s, est = dtype.itemsize, Estimate()
    ctx = cfg.data.max_length + cfg.eval.max_new_tokens
    est.peak = (est.add("target weights", sh.target_params * s, f"{_count(sh.target_params)} params x {_name(dtype)}")
                + est.add("head weights", (sh.trainable + sh.frozen) * s + sh.buffer_bytes, "trained + frozen")
                + est.add("KV cache", ctx * _kv_bytes(sh.config, s), f"{ctx} tokens (data.max_length + eval.max_new_tokens)"))
    return est


# ------------------------------------------------------------------------------------------------ plan
def _device(cfg: DictConfig) -> torch.device:
    choice = cfg.planner.device
    return resolve_device(cfg.device) if choice == "auto" else torch.device("cuda" if choice == "gpu" else "cpu")


def _free_memory(device: torch.device) -> int:
    """Free bytes for this process: the GPU's free memory, or the available RAM shared by this host's ranks."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return psutil.virtual_memory().available // dist.local_world_size()


def _here(device: torch.device) -> bool:
    """Whether ``device`` is this machine's kind (its free memory can be compared)."""
    return device.type == "cpu" or torch.cuda.is_available()


def plan(cfg: DictConfig, device: torch.device | None = None) -> dict:
    """Disk, memory per rank and hours of extract / train / eval (see the module docstring)."""
    config, source = _architecture(cfg)
    device = device or _device(cfg)
    dtype = resolve_dtype(cfg.dtype, device)
    pc, tc = cfg.planner, cfg.train
    world = int(pc.world_size or os.environ.get("WORLD_SIZE", 1))
    sh = shapes(cfg, config)
    H, V = sh.config.hidden_size, sh.head.draft_vocab_size
    done: dict[str, bool] = {}   # outputs current, and so are its upstream stages' (a stage that reruns reruns those after it)
    for name in ("data", "extract", "train"):
        done[name] = current_marker(cfg, name) is not None and all(done.get(u, True) for u in upstream(cfg, name))
    rows = None if done["data"] or (stage_dir(cfg, "data") / "manifest.json").exists() else count_rows(cfg)
    tokens, tokens_source = data_tokens(cfg, rows)
    total = sum(tokens.values())
    per_token = sh.captured * H * getattr(torch, cfg.extract.dtype).itemsize + 4   # + the int32 argmax
    run_dir = Path(cfg.run_dir).absolute()
    disk_dir = next(p for p in (run_dir, *run_dir.parents) if p.exists())
    # what extract still writes: the shards not written yet and, before the data stage has kept its states (they sit
    # beside the shards until copied), those states too; what is on disk already is out of the free space
    shards = stage_dir(cfg, "extract")
    written = sum(f.stat().st_size for f in shards.glob("*.safetensors")) if shards.is_dir() else 0
    to_write = 0 if done["extract"] else max(0, total * per_token - written) + (
        total * per_token if copies_states(cfg) and not done["data"] else 0)
    # Throughputs per rank: stated, or sustained FLOP/s over FLOPs per token (2 per matmul weight forward,
    # 6 forward + backward); extraction also limited by the disk's write bandwidth shared by all ranks.
    kind = "gpu" if device.type == "cuda" else "cpu"
    rates = pc[kind]
    compute_rate = pc.extract_tok_s or rates.extract_tflops * 1e12 / (2 * sh.target_linear)
    disk_rate = pc.disk_mb_s * 1e6 / per_token / world
    extract_rate = min(compute_rate, disk_rate)
    extract_basis = ("planner.disk_mb_s" if disk_rate < compute_rate else "planner.extract_tok_s" if pc.extract_tok_s
                     else f"planner.{kind}.extract_tflops / {2 * sh.target_linear / 1e9:.2f} GFLOP/token")
    if copies_states(cfg):   # the states kept while regenerating: copied (read + write)
        extract_rate, extract_basis = disk_rate / 2, ("planner.disk_mb_s: copying the states kept while regenerating "
                                                      "(answers already cached, or a disk gone short, need a pass)")
    steps = cfg.head.ttt_steps if cfg.head.type == "eagle3" else 1
    train_flops = (6 * (sh.head_once + steps * sh.head_repeat) + 2 * H * V   # + target_view's [H, draft vocab] matmul
                   + (2 * sh.target_linear if tc.online else 0))
    train_rate = pc.train_tok_s or rates.train_tflops * 1e12 / train_flops
    train_basis = "planner.train_tok_s" if pc.train_tok_s else f"planner.{kind}.train_tflops / {train_flops / 1e9:.2f} GFLOP/token"
    if not (tc.online or pc.train_tok_s) and disk_rate < train_rate:   # every step reads its rows' states from disk
        train_rate, train_basis = disk_rate, (f"planner.disk_mb_s: each step reads its rows' states ({per_token / 1e3:.1f} "
                                              f"KB/token) from run_dir, all ranks together")
    trained = tc.max_steps * world * tc.grad_accum * tc.micro_batch_tokens if tc.max_steps else tc.epochs * min(tokens["train"], tc.data_tokens or tokens["train"])
    train_h = trained / (train_rate * world) / 3600
    # A training checkpoint: the trainable weights in the run's dtype, DeepSpeed's fp32 master copy when that is not
    # fp32, Adam's two fp32 moments, train.ema's fp32 average (the frozen weights are not saved); the rotation keeps
    # train.keep_checkpoints and writes the next before deleting the oldest.
    checkpoint = sh.trainable * (dtype.itemsize + (4 if dtype != torch.float32 else 0) + 8 + (4 if tc.ema else 0))
    checkpoints = tc.keep_checkpoints + 1
    return {
        "model": cfg.model.name, "architecture": type(config).__name__.removesuffix("Config"), "config_source": source,
        "device": device.type, "dtype": _name(dtype), "world_size": world, "shapes": sh, "tokens": tokens,
        "tokens_source": tokens_source, "free_here": _free_memory(device) if _here(device) else None,
        "data": generation(cfg, sh, kind, regen_dtype(cfg, device), world, per_token, rows, done["data"]),
        "headroom": pc.headroom, "online": bool(tc.online),
        "extract": {"bytes_per_token": per_token, "disk_bytes": total * per_token, "disk_dir": str(disk_dir),
                    # states kept while regenerating sit beside the shards until extract has copied them all
                    "disk_peak": total * per_token * (2 if copies_states(cfg) else 1),
                    "disk_free": shutil.disk_usage(disk_dir).free, "disk_margin": cfg.extract.disk_margin,
                    "disk_to_write": to_write,
                    "memory": extract_memory(cfg, sh, dtype, world), "tok_s": extract_rate, "basis": extract_basis,
                    "hours": 0.0 if done["extract"] else total / (extract_rate * world) / 3600, "done": done["extract"]},
        "train": {"memory": train_memory(cfg, sh, dtype, world), "tok_s": train_rate, "tokens": trained,
                  "checkpoints": checkpoints, "checkpoint_bytes": checkpoint, "disk_bytes": checkpoint * checkpoints,
                  "basis": train_basis, "hours": 0.0 if done["train"] else min(train_h, (tc.max_minutes or 1e9) / 60),
                  "done": done["train"],
                  "capped": bool(tc.max_minutes) and train_h > tc.max_minutes / 60},
        "eval": {"memory": eval_memory(cfg, sh, dtype)},
    }


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _gib(n: float) -> str:
    return f"{n / GiB:8.2f} GiB"


def _duration(hours: float) -> str:
    return f"{hours * 60:8.1f} min" if hours < 1 else f"{hours:8.1f} h  " if hours < 48 else f"{hours / 24:8.1f} days"


DONE = "    done     (its outputs are current)"   # the time of a stage with nothing left to do


def format_plan(p: dict) -> str:
    """The plan as a table (what ``plan=true`` prints)."""
    sh, ex, tr = p["shapes"], p["extract"], p["train"]
    c, free = sh.config, p["free_here"]
    short_disk = ex["disk_free"] < ex["disk_to_write"] * ex["disk_margin"]
    lines = [
        f"PLAN   model={p['model']}: {p['architecture']}, {_count(sh.target_params)} parameters, {c.num_hidden_layers} "
        f"layers, hidden {c.hidden_size}, vocabulary {c.vocab_size} (from {p['config_source']})",
        f"       head: {_count(sh.trainable)} trainable + {_count(sh.frozen)} frozen parameters, draft vocabulary "
        f"{sh.head.draft_vocab_size}",
        f"       {p['device']}, {p['dtype']}, {p['world_size']} rank(s)"
        + ("" if p["device"] == "cuda" else "   (planner.device=gpu plans a GPU run)"),
        f"       data: {p['tokens']['train']:,} train + {p['tokens']['validation']:,} validation tokens ({p['tokens_source']})",
    ]

    def memory(title: str, est: Estimate) -> None:
        over = free is not None and est.peak * p["headroom"] > free
        lines.append(f"  {title:<27}{_gib(est.peak)}" + (f"   << MORE THAN THE {free / GiB:.1f} GiB FREE HERE"
                                                          f" (x{p['headroom']} headroom)" if over else ""))
        lines.extend(f"    {k:<25}{_gib(v)}   {est.notes[k]}" for k, v in est.items.items())

    ge = p["data"]
    if ge["done"]:
        lines += ["", "DATA  done (its outputs are current): nothing to generate"]
    else:
        lines += ["", "DATA", f"  {'generation':<27}{ge['tokens']['prompts'] + ge['tokens']['answers']:>12,} tokens   "
                  f"{ge['prompts']:,} prompts written by the target x planner.synth_tokens, {ge['answers']:,} "
                  "answers (user turns) x planner.answer_tokens (null: planner.answer_share x data.regen.max_new_tokens)",
                  f"  {'time':<27}" + ("       ?    " if ge["hours"] is None else _duration(ge["hours"]))
                  + (f"   at {ge['tok_s']:,.0f} tok/s x {ge['replicas']} replica(s)" if ge["tok_s"] else "")
                  + f" ({ge['basis']})"]
    if p.get("online"):
        lines += ["", "EXTRACT  skipped: train.online=true computes the hidden states during training (no disk)"]
    else:
        lines += ["", "EXTRACT", f"  {'disk':<27}{_gib(ex['disk_bytes'])}   {ex['bytes_per_token']:,} bytes/token x "
                  f"{sum(p['tokens'].values()):,} tokens = {ex['bytes_per_token'] * 1e6 / GiB:.1f} GiB per million "
                  f"tokens; {ex['disk_free'] / GiB:.1f} GiB free at {ex['disk_dir']}"
                  + (f"; peak {ex['disk_peak'] / GiB:.1f} GiB: the states kept while regenerating (extract.source) "
                     "stay until extract has copied them into its shards" if ex["disk_peak"] > ex["disk_bytes"] else "")
                  + (f"   << DISK TOO SMALL (x{ex['disk_margin']} margin): extract will refuse" if short_disk else "")]
        memory("memory per rank (peak)", ex["memory"])
        lines.append(f"  {'time':<27}" + (DONE if ex["done"] else
                     f"{_duration(ex['hours'])}   at {ex['tok_s']:,.0f} tok/s per rank ({ex['basis']})"))
    lines += ["", "TRAIN", f"  {'disk':<27}{_gib(tr['disk_bytes'])}   {tr['checkpoints']} "
              f"checkpoints (train.keep_checkpoints + the next) x {tr['checkpoint_bytes'] / GiB:.2f} GiB: trainable "
              "weights, fp32 master copy and Adam moments (and train.ema's average)"]
    memory("memory per rank (peak)", tr["memory"])
    lines.append(f"  {'time':<27}" + (DONE if tr["done"] else
                 f"{_duration(tr['hours'])}   {tr['tokens']:,} tokens at {tr['tok_s']:,.0f} tok/s per rank "
                 f"({tr['basis']})" + ("; capped by train.max_minutes" if tr["capped"] else "")))
    lines += ["", "EVAL"]
    memory("memory on rank 0 (peak)", p["eval"]["memory"])
    stages = [ge["hours"], 0.0 if p.get("online") else ex["hours"], tr["hours"]]
    if None not in stages:
        lines += ["", f"TIME  data + extract + train{_duration(sum(stages))}   (the eval stage not included)"]
    lines += ["", "Peak = weights and optimizer + the largest of forward, backward and optimizer step. Rates: "
              "planner.gpu | cpu (TFLOP/s, GB/s), regen_tok_s | extract_tok_s | train_tok_s, disk_mb_s. Less memory: "
              "train.micro_batch_tokens, head.ttt_steps, head.draft_vocab_size, train.zero_stage over more ranks."]
    return "\n".join(lines)


def print_plan(cfg: DictConfig) -> dict:
    p = plan(cfg)
    print(format_plan(p), flush=True)
    return p


def check_train_memory(cfg: DictConfig, device: torch.device) -> Estimate:
    """Refuse to train when the estimated peak (x ``planner.headroom``) exceeds the free memory of the tightest
    rank, on every rank alike (one rank refusing alone, a GPU another job uses, would leave the others waiting in
    their next collective until the timeout); log the estimate otherwise. Call first in the train stage, before
    anything is loaded on ``device``, once the process group exists."""
    from train import dist

    frees = dist.all_gather_objects(_free_memory(device))   # (first: a rank failing below fails after it)
    est = train_memory(cfg, shapes(cfg, architecture(cfg)), resolve_dtype(cfg.dtype, device),
                       dist.world_size())
    free, need = min(frees), est.peak * cfg.planner.headroom
    top = ", ".join(f"{k} {v / GiB:.2f}" for k, v in sorted(est.items.items(), key=lambda kv: -kv[1])[:4])
    where = f"on {device}" if len(frees) == 1 else f"on rank {frees.index(free)}'s {device.type} (the least of {len(frees)})"
    msg = (f"[train] memory estimate {est.peak / GiB:.2f} GiB per rank (x{cfg.planner.headroom} headroom), "
           f"{free / GiB:.2f} GiB free {where}; largest (GiB): {top}")
    if need <= free:
        log(msg)
    elif not cfg.planner.enforce:
        log(msg + " -- MORE THAN FREE; continuing (planner.enforce=false)")
    else:
        raise MemoryShortError(
            msg + ". Not enough memory: lower train.micro_batch_tokens (batch, activations and transients scale "
            "with it), head.ttt_steps (activations per step), head.draft_vocab_size ([tokens, draft vocab] fp32 "
            "log-probabilities per step), or shard the optimizer with train.zero_stage=1|2 across more ranks"
            + ("; train.online=false (extract first) frees the target's weights" if cfg.train.online else "")
            + "; planner.enforce=false tries anyway. `plan=true` prints the whole plan.")
    return est


# ----------------------------------------------------------------------------------------- measurement
@dataclass
class PeakMemory:
    peak: int = 0          # bytes; set when the block exits


class _LiveStorages(TorchDispatchMode):
    """Bytes of tensor storages created inside the mode and alive at the same time. Outputs sharing a
    storage with an input (views, in-place ops) are not new memory; tensors from before are not counted."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}
        self.now = self.peak = 0

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {id(t.untyped_storage()) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and (key := id(st := t.untyped_storage())) not in self.live \
                    and key not in inputs:
                self.live[key] = st.nbytes()
                self.now += st.nbytes()
                self.peak = max(self.peak, self.now)
                weakref.finalize(st, self._free, key)
        return out


@contextmanager
def peak_tensor_memory(device: torch.device | str = "cpu") -> Iterator[PeakMemory]:
    """Peak bytes of the tensors allocated inside the block and alive together (those from before excluded):
    ``torch.cuda.max_memory_allocated`` above the entry level on CUDA, live tensor storages on CPU."""
    device, result = torch.device(device), PeakMemory()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        yield result
        torch.cuda.synchronize(device)
        result.peak = torch.cuda.max_memory_allocated(device) - base
        return
    mode = _LiveStorages()
    with mode:
        yield result
    result.peak = mode.peak
