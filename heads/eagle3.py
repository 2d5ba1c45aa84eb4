"""EAGLE-3 draft head (one file, names = checkpoint keys of the EAGLE/SGLang format).

    taps (3 target layers, concatenated low|mid|high) --fc--> h
    midlayer: x = cat(input_layernorm(embed(token)), hidden_norm(h)); h = h + attn(x); h = h + mlp(norm(h))
    logits over the draft vocabulary = lm_head(norm(h)); draft id i is target id i + d2t[i]

The layer output before ``norm`` is the feature fed to the next draft step. How attention sees keys
is decided by the cache object passed to :meth:`Eagle3Head.forward`: :class:`TTTCache` for
training-time test, :class:`KVCache` for decoding (tree masks). The head holds no training code.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from heads.frozen import TargetWeights
from heads.vocab import DraftVocab

EMBED_HALF = ("zero", "copy")  # head.layer_init_embed: how init_layer_from_target fills q/k/v's embedding half


@dataclass
class Eagle3Config:
    vocab_size: int                 # the target's
    draft_vocab_size: int
    hidden_size: int
    target_hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    aux_layers: list[int] = field(default_factory=list)   # HF hidden_states indices (input of layer i)
    num_target_layers: int = 0

    @classmethod
    def from_target(cls, tcfg, head_cfg, draft_vocab_size: int) -> Eagle3Config:
        """Defaults from the target's config; any non-null key of ``head_cfg`` overrides."""
        tcfg = getattr(tcfg, "text_config", tcfg)
        n = tcfg.num_hidden_layers
        heads = tcfg.num_attention_heads
        rope = getattr(tcfg, "rope_parameters", None) or {}
        defaults = dict(
            hidden_size=tcfg.hidden_size,
            intermediate_size=tcfg.intermediate_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(tcfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(tcfg, "head_dim", None) or tcfg.hidden_size // heads,
            rms_norm_eps=tcfg.rms_norm_eps,
            rope_theta=rope.get("rope_theta", getattr(tcfg, "rope_theta", 10000.0)),
            aux_layers=[2, n // 2, n - 3],
        )
        for key in defaults:
            if head_cfg.get(key) is not None:
                defaults[key] = head_cfg[key]
        cfg = cls(
            vocab_size=tcfg.vocab_size,
            draft_vocab_size=draft_vocab_size,
            target_hidden_size=tcfg.hidden_size,
            max_position_embeddings=tcfg.max_position_embeddings,
            num_target_layers=n,
            **defaults,
        )
        cfg.aux_layers = [int(i) for i in cfg.aux_layers]
        # Index n is HF's post-norm final state, while engines read the pre-norm residual there: not allowed.
        if len(cfg.aux_layers) != 3 or not all(0 <= i < n for i in cfg.aux_layers):
            raise ValueError(f"head.aux_layers must be 3 hidden_states indices in [0, {n - 1}], got {cfg.aux_layers}")
        # Engines concatenate the taps in ascending layer order: any other order is a silently wrong export.
        if cfg.aux_layers != sorted(set(cfg.aux_layers)):
            raise ValueError(f"head.aux_layers must be ascending and distinct, got {cfg.aux_layers} (a target with "
                             f"{n} layers gives default taps [2, {n // 2}, {n - 3}]: it needs at least 7 layers)")
        if cfg.hidden_size != cfg.target_hidden_size:
            raise ValueError("head.hidden_size must equal the target's hidden size: the head uses the target's "
                             f"embedding ({cfg.target_hidden_size} wide), got {cfg.hidden_size}")
        return cfg

    def to_dict(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class TTTCache:
    """Attention of training-time test (EAGLE-3).

    Step 0: causal attention over the sequence (right padding needs no extra mask). Step k > 0: row t
    attends to step-0 keys [0..t] plus the keys of row t of steps 1..k (a diagonal), in one softmax.

    Memory: step k > 0 never materialises [B, heads, T, T] scores. Its query rows go in chunks of
    ``chunk_rows`` (default: as many as keep one chunk's scores near ``score_budget`` elements); a chunk
    ending at row e scores step-0 keys [0..e) (causal mask) and its rows' diagonal keys in one fp32
    softmax -- the same math as one masked [T, T + k] softmax, keys past e being masked for all its rows.
    Each chunk runs under ``torch.utils.checkpoint``: autograd keeps only its inputs and output and
    recomputes the chunk's scores in backward, so peak memory is O(chunk_rows x T), not O(T^2) per step.
    GQA: query heads are grouped per kv head ([B, kv_heads, groups, ...]), keys are never repeated.
    """

    score_budget = 2**26  # elements of one chunk's score tensor [B, heads, rows, keys]

    def __init__(self, chunk_rows: int | None = None):
        self.k0 = self.v0 = None
        self.diag: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.chunk_rows = chunk_rows

    @classmethod
    def rows_per_chunk(cls, batch: int, heads: int, T: int) -> int:
        """Query rows per chunk of a step k > 0 (default): one chunk's scores near ``score_budget`` elements."""
        return min(T, max(64, cls.score_budget // (batch * heads * T)))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.k0 is None:
            self.k0, self.v0 = k, v
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        self.diag.append((k, v))
        B, H, T, _ = q.shape
        qg = q.unflatten(1, (k.shape[1], H // k.shape[1]))              # [B, kv, groups, T, d]
        dk = torch.stack([kj for kj, _ in self.diag], 3)                 # [B, kv, T, steps, d]
        dv = torch.stack([vj for _, vj in self.diag], 3)
        rows = self.chunk_rows or self.rows_per_chunk(B, H, T)
        out = []
        for s in range(0, T, rows):
            e = min(s + rows, T)
            args = (qg[:, :, :, s:e], self.k0[:, :, :e], self.v0[:, :, :e], dk[:, :, s:e], dv[:, :, s:e])
            if torch.is_grad_enabled():
                out.append(checkpoint(_ttt_chunk, *args, use_reentrant=False))
            else:
                out.append(_ttt_chunk(*args))
        return torch.cat(out, 3).flatten(1, 2)


@contextmanager
def _tensor_core_products(x: torch.Tensor) -> Iterator[None]:
    """Float32 matrix products of ``x``'s bf16/fp16 values on a GPU's tensor cores (TF32), not its float32 units (the
    default; an H100's run at ~1/7 of its dense TF32 rate: at 7B with 8k-token micro-batches, TTT's scores in IEEE
    float32 would take about as long as the head's lm_head, by FLOP count; not measured). Such values are exact in TF32
    (8-bit exponent, 10-bit mantissa), so their products are float32's and accumulate in float32: IEEE float32's
    precision at TF32's speed, in the forward and its recompute; the backward's products (of float32 gradients, not
    exact in TF32) run after the chunk, in IEEE float32. Elsewhere (the CPU, float32 or float64 values) nothing
    changes."""
    if x.device.type != "cuda" or x.dtype not in (torch.bfloat16, torch.float16):
        yield
        return
    matmul = torch.backends.cuda.matmul
    before = matmul.allow_tf32
    matmul.allow_tf32 = True
    try:
        yield
    finally:
        matmul.allow_tf32 = before


def _ttt_chunk(q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor) -> torch.Tensor:
    """Rows [e - C, e) of a TTT step k > 0. q [B, kv, groups, C, d]; k0/v0 [B, kv, e, d] (step-0 keys up
    to the chunk's last row); dk/dv [B, kv, C, k, d] (each row's diagonal keys). Returns [B, kv, groups, C, d]."""
    C, e = q.shape[3], k0.shape[2]
    scale = 1.0 / math.sqrt(q.shape[-1])
    causal = torch.arange(e, device=q.device) <= torch.arange(e - C, e, device=q.device)[:, None]
    # Scores in float32 at least, as step 0's fused attention (and the engines serving the head) keeps them: bf16
    # scores rounded q.k before the softmax (steps 1+ had ~1.7x step 0's output error in bf16). The chunk's copies
    # are small beside its scores. (Autocast off: it would run the products in bf16 again under train.autocast.)
    wide = torch.promote_types(q.dtype, torch.float32)
    with torch.autocast(q.device.type, enabled=False), _tensor_core_products(q):
        qw = q.to(wide)
        s0 = torch.einsum("bngcd,bnkd->bngck", qw, k0.to(wide)).mul_(scale).masked_fill_(~causal, float("-inf"))
        sd = torch.einsum("bngcd,bncjd->bngcj", qw, dk.to(wide)) * scale
        p = torch.softmax(torch.cat([s0, sd], -1), -1).to(q.dtype)
    return torch.einsum("bngck,bnkd->bngcd", p[..., :e], v0) + torch.einsum("bngcj,bncjd->bngcd", p[..., e:], dv)


class KVCache:
    """Draft KV for decoding: ``committed`` context rows plus ``pending`` rows (the tree being drafted).

    Before a forward the caller sets ``mask``: bool [q_len, committed + pending + q_len] (True = may
    attend), or None for "all committed and pending rows, causal among the new ones".
    """

    def __init__(self):
        self.k = self.v = None          # committed [B, kv_heads, L, head_dim]
        self.pk = self.pv = None        # pending
        self.mask: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.pk = k if self.pk is None else torch.cat([self.pk, k], 2)
        self.pv = v if self.pv is None else torch.cat([self.pv, v], 2)
        keys = self.pk if self.k is None else torch.cat([self.k, self.pk], 2)
        values = self.pv if self.v is None else torch.cat([self.v, self.pv], 2)
        mask = self.mask
        if mask is None:
            T, S = q.shape[2], keys.shape[2]
            mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)

    def commit(self, rows: torch.Tensor | None = None) -> None:
        """Keep pending ``rows`` (all when None) as context, drop the other pending rows."""
        if self.pk is not None:
            pk, pv = (self.pk, self.pv) if rows is None else (self.pk[:, :, rows], self.pv[:, :, rows])
            self.k = pk if self.k is None else torch.cat([self.k, pk], 2)
            self.v = pv if self.v is None else torch.cat([self.v, pv], 2)
        self.drop_pending()

    def drop_pending(self) -> None:
        self.pk = self.pv = self.mask = None


class Eagle3Attention(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(2 * cfg.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        out = cache.attend(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class Eagle3MLP(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3DecoderLayer(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Eagle3Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = Eagle3MLP(cfg)

    def forward(self, emb, hidden, cos, sin, cache) -> torch.Tensor:
        # norm_before_residual = false: the residual is the un-normalised feature.
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], -1)
        hidden = hidden + self.self_attn(x, cos, sin, cache)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3Head(DraftVocab):
    def __init__(self, cfg: Eagle3Config):
        super().__init__(cfg.draft_vocab_size, cfg.vocab_size)
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.requires_grad_(False)  # the target's, frozen (never exported as trained)
        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = Eagle3DecoderLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)

    @torch.no_grad()
    def init_from_target(self, target, from_lm_head: bool = True) -> None:
        """Copy the target's embedding (always) and, optionally, its final norm and the lm_head rows
        of the draft vocabulary (a strong start when data is small). ``target``: a model or
        :class:`~heads.frozen.TargetWeights`."""
        weights = TargetWeights.of(target)
        self.embed_tokens.weight.copy_(weights.embed)
        if from_lm_head:
            self.lm_head.weight.copy_(weights.lm_head[self.draft_ids().to(weights.lm_head.device)])
            self.norm.weight.copy_(weights.norm)

    @torch.no_grad()
    def init_layer_from_target(self, layer: dict[str, torch.Tensor], embed_half: str = "zero") -> list[str]:
        """Start ``midlayer`` from a target decoder layer (``layer``: its tensors by name inside the layer,
        as :func:`train.target.load_layer_weights` reads them). q/k/v get the target's weights on the
        hidden-state half of their 2H-wide input and zeros on the embedding half; ``hidden_norm`` gets the
        target's ``input_layernorm``; o_proj, the MLP and ``post_attention_layernorm`` are copied. So the
        first draft step computes exactly that target layer on its feature (with ``fc_init=last_tap`` and the
        last tap entering that layer: the target's own next residual state), up to what the head lacks; the
        token path (embedding half, ``input_layernorm``) starts at zero and is learned. ``embed_half="copy"``: the
        embedding half gets the same q/k/v weights and ``input_layernorm`` the target's too, so the next token
        enters attention as if it were part of the residual stream.
        Returns the target's tensors the head has no place for (Qwen2's q/k/v biases, Qwen3's q/k norms):
        they are not copied."""
        if embed_half not in EMBED_HALF:
            raise ValueError(f"head.layer_init_embed must be {' or '.join(EMBED_HALF)}, got {embed_half!r}")
        H, attn, mlp = self.config.hidden_size, self.midlayer.self_attn, self.midlayer.mlp
        into = {"input_layernorm.weight": self.midlayer.hidden_norm.weight,
                "post_attention_layernorm.weight": self.midlayer.post_attention_layernorm.weight,
                "self_attn.o_proj.weight": attn.o_proj.weight,
                **{f"self_attn.{p}_proj.weight": getattr(attn, f"{p}_proj").weight[:, H:] for p in "qkv"},
                **{f"mlp.{p}_proj.weight": getattr(mlp, f"{p}_proj").weight for p in ("gate", "up", "down")}}
        missing = sorted(set(into) - set(layer))
        wrong = [f"{k} {tuple(layer[k].shape)} vs {tuple(v.shape)}" for k, v in into.items()
                 if k in layer and layer[k].shape != v.shape]
        if missing or wrong:
            raise ValueError(f"head.layer_init: the target layer does not fit the draft layer (missing {missing}, "
                             f"target vs head shapes {wrong}); leave the head's layer sizes at null (the target's)")
        for name, param in into.items():
            param.copy_(layer[name])
        if embed_half == "copy":
            self.midlayer.input_layernorm.weight.copy_(layer["input_layernorm.weight"])
        for p in "qkv":
            w = getattr(attn, f"{p}_proj").weight
            w[:, :H] = w[:, H:] if embed_half == "copy" else 0
        return sorted(set(layer) - set(into))

    @torch.no_grad()
    def init_fc_last_tap(self) -> None:
        """``fc`` passes the highest tap through: the first feature is the target's own residual stream."""
        H = self.config.hidden_size
        self.fc.weight.zero_()
        self.fc.weight[:, 2 * H:] = torch.eye(H)

    def rope(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of plain RoPE with base ``rope_theta``, computed in fp32 whatever the head's dtype."""
        d = self.config.head_dim
        inv_freq = 1.0 / self.config.rope_theta ** (torch.arange(0, d, 2, device=position_ids.device).float() / d)
        freqs = position_ids[..., None].float() * inv_freq
        emb = torch.cat([freqs, freqs], -1)[:, None]  # [B, 1, T, head_dim]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def project(self, taps: torch.Tensor) -> torch.Tensor:
        """[B, T, 3 * target_hidden] (low|mid|high) -> [B, T, hidden]."""
        return self.fc(taps)

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor,
                cache) -> torch.Tensor:
        """One draft step: features [B, T, H] and the NEXT tokens [B, T] -> output features [B, T, H]."""
        emb = self.embed_tokens(input_ids).to(hidden.dtype)
        cos, sin = self.rope(position_ids, hidden.dtype)
        return self.midlayer(emb, hidden, cos, sin, cache)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary."""
        return self.lm_head(self.norm(hidden))

    def trained_state_dict(self) -> dict[str, torch.Tensor]:
        """Everything but the frozen embedding (reloaded from the target)."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("embed_tokens.")}
