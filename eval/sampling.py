"""Warping and the acceptance rules that decide which drafted nodes the target keeps.

Every rule returns ``(path, bonus)``: the accepted drafted nodes from the root down (node indices of the
:class:`~eval.tree.DraftTree`) and the token the target adds after the last of them.

- greedy (temperature 0): a child is accepted iff its token is the target's argmax at its parent;
- ``sibling_walk`` (deterministic drafts): children in rank order, child x accepted with probability
  p(x); on reject p(x) = 0 and p is renormalised; if all are rejected the bonus is drawn from what is left;
- ``p/q`` (sampled chains): x accepted with probability min(1, p(x) / q(x)); on reject the token is
  drawn from norm(max(0, p - q)).
All three give exactly the target's distribution. ``typical`` (Medusa) is LOSSY and opt-in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eval.tree import DraftTree


@dataclass
class Sampling:
    temperature: float = 0.0      # 0 = greedy
    top_p: float = 1.0
    generator: torch.Generator | None = None
    top_k: int = 0                # 0 = every token

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


def warp(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """Probabilities over the last dim after temperature, top-k and top-p, in that order (as ``transformers``'
    warpers and vLLM's sampler: ``top_k`` > 0 keeps the tokens at least as likely as the k-th, then the smallest
    set of the most likely of those whose renormalised mass reaches ``top_p``)."""
    probs = torch.softmax(logits.float() / temperature, -1)
    if 0 < top_k < probs.shape[-1]:
        kth = probs.topk(top_k, -1).values[..., -1:]
        probs = probs.masked_fill(probs < kth, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(-1)
        drop = sorted_probs.cumsum(-1) <= 1 - top_p
        drop[..., -1] = False
        probs = probs.masked_fill(drop.scatter(-1, order, drop), 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def _uniform(generator: torch.Generator | None) -> float:
    # drawn on the generator's device: a CUDA generator cannot draw a CPU tensor (every sampled cycle raised on a GPU)
    return float(torch.rand((), generator=generator, device=generator.device if generator else None))


def accept_greedy(tree: DraftTree, logits: torch.Tensor) -> tuple[list[int], int]:
    """``logits`` [m+1, vocab] at nodes 0..m."""
    best = logits.argmax(-1).tolist()
    kids, path, node = tree.children(), [], 0
    while True:
        node = next((c for c in kids[node] if tree.tokens[c - 1] == best[node]), None)
        if node is None:
            return path, best[path[-1] if path else 0]
        path.append(node)


def accept_sampled(tree: DraftTree, logits: torch.Tensor, sampling: Sampling) -> tuple[list[int], int]:
    """Exact speculative sampling: the p/q rule for sampled chains, the sibling walk otherwise."""
    kids, path, node, gen = tree.children(), [], 0, sampling.generator
    while True:
        p = warp(logits[node], sampling.temperature, sampling.top_p, sampling.top_k)
        if tree.q is not None and kids[node]:
            child = kids[node][0]
            x, q = tree.tokens[child - 1], tree.q[child - 1].to(p)
            if _uniform(gen) < min(1.0, float(p[x] / q[x])):
                path.append(child)
                node = child
                continue
            residual = (p - q).clamp_min(0)
            return path, _draw(residual if residual.sum() > 0 else p, gen)   # p == q up to rounding
        for child in kids[node]:
            x = tree.tokens[child - 1]
            if _uniform(gen) < float(p[x]):
                path.append(child)
                node = child
                break
            p[x] = 0.0
            p = p / p.sum()
        else:
            return path, _draw(p, gen)


def accept_typical(tree: DraftTree, logits: torch.Tensor, sampling: Sampling, eps: float = 0.09,
                   delta: float = 0.3) -> tuple[list[int], int]:
    """Medusa's typical acceptance (LOSSY): the first child with p(x) > min(eps, delta * exp(-H(p))) is
    accepted; the bonus is drawn from p restricted to such tokens (the most likely one is always kept)."""
    kids, path, node = tree.children(), [], 0
    while True:
        p = warp(logits[node], sampling.temperature, sampling.top_p, sampling.top_k)
        entropy = -(p * p.clamp_min(1e-12).log()).sum()
        typical = p > torch.minimum(torch.tensor(eps), delta * torch.exp(-entropy))
        child = next((c for c in kids[node] if typical[tree.tokens[c - 1]]), None)
        if child is None:
            typical[p.argmax()] = True
            return path, _draw(p * typical, sampling.generator)
        path.append(child)
        node = child


def accept(tree: DraftTree, logits: torch.Tensor, sampling: Sampling, typical: bool = False) -> tuple[list[int], int]:
    """Dispatch: greedy, exact sampling, or (opt-in, lossy) typical acceptance."""
    if sampling.greedy:
        return accept_greedy(tree, logits)
    if typical:
        return accept_typical(tree, logits, sampling)
    return accept_sampled(tree, logits, sampling)
