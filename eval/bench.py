"""Helpers of the decode benchmark (scripts/bench_decode.py) and the tests: random heads, draft step times."""

from __future__ import annotations

import statistics

import torch
from torch import nn

from eval.decoder import SpecDecoder
from eval.drafters import Drafter
from eval.sampling import Sampling
from heads.eagle3 import Eagle3Config, Eagle3Head
from heads.medusa import MedusaConfig, MedusaHead


def random_head(kind: str, target, head_cfg, kept: torch.Tensor | None = None, seed: int = 0) -> nn.Module:
    """A head with random weights, started from the target as training starts (embedding, lm_head rows),
    over the draft vocabulary ``kept`` (sorted target ids; default: the first ``head_cfg.draft_vocab_size``)."""
    vocab = target.config.vocab_size
    if kept is None:
        kept = torch.arange(min(head_cfg.draft_vocab_size, vocab))
    torch.manual_seed(seed)
    config = {"eagle3": Eagle3Config, "medusa": MedusaConfig}[kind].from_target(target.config, head_cfg, len(kept))
    head = {"eagle3": Eagle3Head, "medusa": MedusaHead}[kind](config)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[kept] = True
    head.set_vocab(kept - torch.arange(len(kept)), t2d)
    head.init_from_target(target)
    return head.to(target.device, target.dtype).eval()


@torch.inference_mode()
def draft_times(decoder: SpecDecoder, drafter: Drafter, context: list[int], new_rows: int = 3,
                repeats: int = 5) -> dict[str, float]:
    """Median ms of a drafter's ``update`` with ``new_rows`` freshly cached rows (what a cycle that
    accepted ``new_rows - 1`` tokens commits) and of its ``propose``, on ``context`` (greedy)."""
    layers = drafter.hidden_layers
    _, _, hidden = decoder.prefill(context[:-1], layers)
    old = {layer: hidden[layer][:, :-new_rows] for layer in layers}
    new = {layer: hidden[layer][:, -new_rows:] for layer in layers}
    times: dict[str, list[float]] = {"update": [], "propose": []}
    for _ in range(repeats + 1):   # the first round warms up
        drafter.reset(Sampling())
        drafter.update(context[:-new_rows], old)
        start = decoder.clock()
        drafter.update(context, new)
        times["update"].append(decoder.clock() - start)
        start = decoder.clock()
        drafter.propose(context)
        times["propose"].append(decoder.clock() - start)
    return {k: 1e3 * statistics.median(v[1:]) for k, v in times.items()}
