"""Speculative tree decoding for any Hugging Face causal LM (batch size 1, KV cache).

Invariant: of the committed sequence x[0..n), the target's KV cache holds every token but the newest
(the root). A cycle asks the drafter for a tree below the root, runs ONE target pass over root + nodes
(tree attention mask, position = n - 1 + depth), accepts a path (eval.sampling), appends its tokens and
the bonus token, and keeps only the KV rows of the root and the accepted nodes (gathered into place).
Plain decoding is the same loop with an empty tree, so tau (new tokens / target passes, prefill
included) is exactly 1 there.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache

from eval.drafters import Drafter
from eval.sampling import Sampling, accept
from eval.tree import DraftTree
from train.errors import ConfigError
from train.kvcache import kv_cache
from train.target import last_logits_only, masks_single_queries

# Bumped when a change to the decoder changes its timings: cached plain / n-gram records and verify times
# (eval.shared) measured by another version are not reused.
DECODER_VERSION = 7  # 3: the KV cache in preallocated buffers (train.kvcache); 4: prefills index the last position
                     # (train.target.last_logits_only) where the target computes its own logits; 5: the root alone
                     # attends under a mask on the CPU (SpecDecoder.mask_root); 6: the linear layers of a verify pass
                     # in the faster GEMM layout for its row count on the CPU (SpecDecoder.verify); 7: `make demo` no
                     # longer sets OMP_WAIT_POLICY=PASSIVE (its timings are not reused: eval.shared.machine)

# The two GEMM layouts of x @ W.T for x [rows, in]: SpecDecoder.logits keeps the faster per row count for the lm_head,
# SpecDecoder.verify the faster for all the target's decoder layers together per verify pass's row count (CPU).
GEMM_LAYOUTS = {"linear": lambda x, w: F.linear(x, w), "mm": lambda x, w: (w @ x.T).T}


def _mm_forward(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)`` in the ``mm`` layout."""
    y = GEMM_LAYOUTS["mm"](x.reshape(-1, x.shape[-1]), layer.weight).reshape(*x.shape[:-1], -1)
    return y if layer.bias is None else y + layer.bias

# Causal LMs whose logits are lm_head(final hidden state), nothing else (no soft-capping or scaling).
PLAIN_HEAD = {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"}


@dataclass
class Generation:
    tokens: list[int]                                        # new tokens (EOS included when hit)
    cycles: int = 1                                          # target passes, prefill included
    paths: list[list[int]] = field(default_factory=list)     # per verify cycle: accepted drafted nodes
    prefill_s: float = 0.0
    draft_s: float = 0.0                                     # drafter: propose + update
    verify_s: float = 0.0                                    # target verify pass + acceptance + KV gather
    wall_s: float = 0.0

    @property
    def tau(self) -> float:
        return len(self.tokens) / self.cycles

    @property
    def accept_lengths(self) -> list[int]:
        """Drafted tokens the target accepted per verify cycle (before EOS / max_new_tokens truncation)."""
        return [len(p) for p in self.paths]


class SpecDecoder:
    """``generate(prompt, drafter, ...)``; ``prefill``/``verify`` are the two target calls (also timed by
    :func:`eval.treesize.measure_verify_time`)."""

    def __init__(self, target, eos_token_ids: Iterable[int] = ()):
        self.target = target
        self.device = next(target.parameters()).device
        self.eos = set(eos_token_ids)
        impl = target.config._attn_implementation
        if impl not in ("sdpa", "eager"):  # transformers passes our 4D tree mask on to the kernel as it is
            raise ConfigError(f"the decoder verifies trees with a 4D attention mask, which needs the target's "
                              f"attn_implementation to be sdpa or eager, not {impl!r} (flash attention reads it as "
                              "padding, flex attention adds it to the scores: not lossless)")
        self.eager = impl == "eager"
        self.mask_root = masks_single_queries(target)   # the root alone (plain decoding): the faster kernel
        if self.device.type == "cuda":
            # PyTorch picks cuDNN attention first on Hopper/Blackwell (cuDNN > 9.15), which builds a plan for each
            # new key length: every decode step, verify and draft step would pay one (~20-40 ms), timed as decoding.
            torch.backends.cuda.enable_cudnn_sdp(False)
        head = target.get_output_embeddings()
        self.plain_head = type(target).__name__ in PLAIN_HEAD and getattr(head, "bias", None) is None
        self.lm_head = head.weight
        self.layouts: dict[int, str] = {}   # rows -> the faster lm_head GEMM layout on this machine
        # The decoder layers' linear layers on the CPU, for the architectures whose modeling code takes their outputs
        # in either layout (a view that only splits the last dimension), and the faster layout per verify pass rows.
        # (A layer with its own forward, e.g. a hook that moves it between devices, is left alone.)
        self.linears = [m for m in target.get_decoder().modules() if type(m) is nn.Linear and "forward" not in vars(m)] \
            if self.device.type == "cpu" and type(target).__name__ in PLAIN_HEAD else []
        self.pass_layouts: dict[int, str] = {}
        self.tuning_s = 0.0                 # seconds spent choosing layouts (left out of clock())

    def clock(self) -> float:
        """Seconds, after the device has finished its queued work; the time spent choosing lm_head layouts
        (:meth:`logits`, :meth:`verify`) is left out, so a row count seen for the first time does not weigh on a
        timed decode."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - self.tuning_s

    def prefill(self, ids: list[int], hidden_layers: list[int], room: int = 256):
        """Cache ``ids`` (in buffers with ``room`` more positions: they grow past it); returns (cache, logits
        [1, vocab] at the last position, hidden_states or None)."""
        cache = kv_cache(self.target.config, len(ids) + room)
        logits, hidden = self.forward(torch.tensor([ids], device=self.device), hidden_layers, cache, last_only=True)
        return cache, logits, hidden

    def verify(self, cache: DynamicCache, root: int, tree: DraftTree, hidden_layers: list[int]):
        """One target pass over root + tree nodes; returns (logits [m+1, vocab], hidden_states or None). The
        root alone (plain decoding, an empty draft) passes a mask only where that is faster (``mask_root``).
        On the CPU the pass runs the decoder layers' linear layers in the GEMM layout that was faster for its
        number of rows, the root alone included, both timed on the whole pass the first time
        (:attr:`pass_layouts`): on the 2-core AMD CPU (MKL, float32, AVX2 only) F.linear's small-row products do
        not stream the weights at the memory's speed, and SmolLM2's 4-token pass took 121 ms with them, 104 ms
        in the other layout, one token 80 ms either way."""
        past = cache.get_seq_length()
        ids = torch.tensor([[root, *tree.tokens]], device=self.device)
        if tree.tokens:
            positions = past + torch.tensor(tree.depths(), device=self.device)
            tree_mask = tree.ancestor_mask(self.device)
            mask = torch.cat([tree_mask.new_ones(len(tree_mask), past), tree_mask], 1)[None, None]
            if self.eager:   # eager attention adds the mask to the scores
                mask = torch.zeros(mask.shape, dtype=self.target.dtype, device=self.device).masked_fill(
                    ~mask, torch.finfo(self.target.dtype).min)
            where = {"attention_mask": mask, "position_ids": positions[None]}
        else:
            where = {"attention_mask": torch.ones(1, 1, 1, past + 1, dtype=torch.bool, device=self.device)
                     if self.mask_root else None}

        def run():
            return self.forward(ids, hidden_layers, cache, **where)

        if not self.linears:
            return run()
        rows = ids.shape[1]
        if rows not in self.pass_layouts:
            start = self.clock()
            self.pass_layouts[rows] = self._fastest(
                {name: functools.partial(self._undone, cache, run, name) for name in GEMM_LAYOUTS})
            self.tuning_s += self.clock() - start
        with self.layers_in(self.pass_layouts[rows]):
            return run()

    @contextmanager
    def layers_in(self, layout: str) -> Iterator[None]:
        """The decoder layers' linear layers (:attr:`linears`) compute in ``layout`` (of :data:`GEMM_LAYOUTS`)."""
        if layout == "linear":
            yield
            return
        try:
            for layer in self.linears:
                layer.forward = functools.partial(_mm_forward, layer)
            yield
        finally:
            for layer in self.linears:
                vars(layer).pop("forward", None)

    def _undone(self, cache: DynamicCache, run: Callable[[], object], layout: str) -> None:
        """``run`` (a verify pass) with the layers in ``layout``, its rows then dropped from ``cache``."""
        past = cache.get_seq_length()
        with self.layers_in(layout):
            run()
        cache.crop(past - cache.get_seq_length())

    def forward(self, ids: torch.Tensor, hidden_layers: list[int], cache: DynamicCache, last_only: bool = False,
                **kwargs):
        """Target pass -> (logits [rows, vocab], hidden_states or None); for architectures whose logits are
        exactly ``lm_head(h)`` the product is :meth:`logits`."""
        if not self.plain_head:
            out = self.target(ids, cache=cache, use_cache=True, output_hidden_states=hidden_layers or None,
                              logits_to_keep=last_logits_only(ids) if last_only else 0, **kwargs)
            return out.logits[0], out.hidden_states
        out = self.target.get_decoder()(input_ids=ids, cache=cache, use_cache=True,
                                        output_hidden_states=hidden_layers or None, **kwargs)
        h = out.last_hidden_state[0, -1:] if last_only else out.last_hidden_state[0]
        return self.logits(h), out.hidden_states

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """``lm_head(h)`` for ``h`` [rows, H] in the faster GEMM layout for this number of rows, timed once per
        row count on this machine: ``F.linear(h, W)`` or ``(W @ h.T).T``. The lm_head is a large share of a
        small target's step and neither layout wins everywhere: on the 2-core CPU (MKL) with SmolLM2's
        49152 x 576 head, F.linear takes 6.5 ms for 2 rows where the other takes 14, and 20 ms for 8 rows
        where the other takes 13.5. Plain decoding goes through the same code, so speedups stay like for like."""
        rows = len(h)
        if rows not in self.layouts:
            start = self.clock()
            self.layouts[rows] = self._fastest(
                {name: functools.partial(product, h, self.lm_head) for name, product in GEMM_LAYOUTS.items()})
            self.tuning_s += self.clock() - start
        return GEMM_LAYOUTS[self.layouts[rows]](h, self.lm_head)

    def _fastest(self, runs: dict[str, Callable[[], object]], repeats: int = 3) -> str:
        """The name of the run with the shortest best-of-``repeats`` time (each after a warm-up run)."""
        best = {}
        for name, run in runs.items():
            run()
            times = []
            for _ in range(repeats):
                start = self.clock()
                run()
                times.append(self.clock() - start)
            best[name] = min(times)
        return min(best, key=best.get)

    @staticmethod
    def _keep_rows(cache: DynamicCache, start: int, rows: list[int]) -> None:
        """Keep the tree rows ``rows`` (root = 0) of the cache at ``start``.., in that order; drop the rest."""
        if rows != list(range(len(rows))):
            src = torch.tensor(rows, device=cache.layers[0].keys.device) + start
            for layer in cache.layers:
                layer.keys[:, :, start:start + len(rows)] = layer.keys[:, :, src]
                layer.values[:, :, start:start + len(rows)] = layer.values[:, :, src]
        if drop := cache.get_seq_length() - start - len(rows):   # (plain decoding's one row: nothing to walk the
            cache.crop(-drop)                                      # layers for, per token)

    def _commit(self, ids: list[int], new: list[int], max_new_tokens: int, prompt_len: int) -> bool:
        """Append ``new`` to ``ids``, cut at the first EOS and at ``max_new_tokens``; True when done."""
        cut = next((i + 1 for i, t in enumerate(new) if t in self.eos), len(new))
        room = max_new_tokens - (len(ids) - prompt_len)
        ids.extend(new[:min(cut, room)])
        return ids[-1] in self.eos or len(ids) - prompt_len >= max_new_tokens

    @torch.inference_mode()
    def generate(self, prompt: list[int], drafter: Drafter, max_new_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int = 0, typical: bool = False, top_k: int = 0) -> Generation:
        """Decode up to ``max_new_tokens`` after ``prompt``; ``typical`` = Medusa typical acceptance (LOSSY)."""
        gen = torch.Generator(self.device).manual_seed(seed)
        sampling = Sampling(temperature, top_p, gen, top_k)
        layers = drafter.hidden_layers
        ids = list(prompt)
        start = self.clock()
        drafter.reset(sampling)
        cache, logits, hidden = self.prefill(ids, layers, max_new_tokens + 64)  # + a last tree
        _, first = accept(DraftTree([], []), logits, sampling)
        out = Generation([])
        done = self._commit(ids, [first], max_new_tokens, len(prompt))
        out.prefill_s = (t := self.clock()) - start
        while not done:
            drafter.update(ids, {layer: hidden[layer] for layer in layers})
            tree = drafter.propose(ids)
            out.draft_s += (t2 := self.clock()) - t
            past = cache.get_seq_length()
            logits, hidden = self.verify(cache, ids[-1], tree, layers)
            path, bonus = accept(tree, logits, sampling, typical)
            out.paths.append(path)
            out.cycles += 1
            done = self._commit(ids, [tree.tokens[i - 1] for i in path] + [bonus], max_new_tokens, len(prompt))
            rows = [0, *path]
            if not done:
                self._keep_rows(cache, past, rows)
                if layers:
                    index = torch.tensor(rows, device=self.device)
                    hidden = {layer: hidden[layer][:, index] for layer in layers}
            out.verify_s += (t := self.clock()) - t2
        out.tokens = ids[len(prompt):]
        out.wall_s = self.clock() - start
        return out
