"""Drafters: everything that proposes tokens for the target to verify, behind one small interface.

The decoder knows nothing about how a drafter works. It calls
    ``reset(sampling)``          at the start of a generation,
    ``update(ids, hidden)``      after the target cached new rows (the prompt, then root + accepted nodes):
                                 ``ids`` = the whole committed sequence, its last token the (uncached) root;
                                 ``hidden[l]`` [1, r, H] = target hidden_states index l at those r rows,
    ``propose(ids)``             -> a :class:`DraftTree` below the root,
and reads ``hidden_layers`` (the HF hidden_states indices a drafter needs; none for plain / n-gram).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from eval.sampling import Sampling, warp
from eval.tree import DraftTree, default_medusa_choices, static_tree
from heads.eagle3 import Eagle3Head, KVCache
from heads.medusa import MedusaHead

METHODS = ("plain", "ngram", "eagle3-tree", "eagle3-chain", "medusa-tree", "medusa-chain",
           "eagle3+ngram-tree", "medusa+ngram-tree")


class Drafter(Protocol):
    hidden_layers: list[int]

    def reset(self, sampling: Sampling) -> None: ...

    def update(self, ids: list[int], hidden: dict[int, torch.Tensor]) -> None: ...

    def propose(self, ids: list[int]) -> DraftTree: ...


class PlainDrafter:
    """No draft: every cycle verifies the root alone (plain decoding on the same code path). Also the
    base of drafters whose reset/update have nothing to do."""

    hidden_layers: list[int] = []

    def reset(self, sampling: Sampling) -> None:
        pass

    def update(self, ids: list[int], hidden: dict[int, torch.Tensor]) -> None:
        pass

    def propose(self, ids: list[int]) -> DraftTree:
        return DraftTree([], [])


class NGramDrafter(PlainDrafter):
    """Prompt lookup: the latest earlier occurrence of the longest suffix (``max_n`` down to ``min_n``
    tokens) of prompt + generated text that ``k`` tokens follow, else its latest occurrence; proposes the (up to)
    ``k`` tokens that followed it (a chain). In text repeating with a period p < k (a run of one token) the latest
    occurrence is p tokens back and has only p tokens after it: an earlier one drafts all k."""

    def __init__(self, min_n: int = 2, max_n: int = 4, k: int = 4):
        self.min_n, self.max_n, self.k = min_n, max_n, k

    def lookup(self, ids: list[int]) -> list[int]:
        seq = torch.tensor(ids)
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(ids) <= n:
                continue
            windows = seq[:-1].unfold(0, n, 1)   # starts whose continuation exists
            hits = (windows == seq[-n:]).all(-1).nonzero()
            if len(hits):
                starts = hits[:, 0] + n
                full = starts[starts + self.k <= len(ids)]
                start = int(full[-1] if len(full) else starts[-1])
                return ids[start:start + self.k]
        return []

    def propose(self, ids: list[int]) -> DraftTree:
        return DraftTree.chain(self.lookup(ids))


class Eagle3Drafter:
    """EAGLE-3 head: an EAGLE-2 dynamic tree (``mode="tree"``) or a chain of ``chain_k`` tokens.

    Draft row t reads fc(taps at target position t) and token x[t+1] at RoPE position t and predicts
    x[t+2] (as in training). Tree nodes are returned in score order, so the first T-1 nodes are exactly
    the tree this drafter builds with ``total_tokens=T``.
    """

    def __init__(self, head: Eagle3Head, mode: str = "tree", top_k: int = 4, depth: int = 5,
                 total_tokens: int = 16, chain_k: int = 3):
        self.head, self.mode = head, mode
        self.top_k, self.depth, self.total_tokens, self.chain_k = top_k, depth, total_tokens, chain_k
        self.hidden_layers = list(head.config.aux_layers)
        self.vocab = head.draft_ids()   # draft id -> target id

    def reset(self, sampling: Sampling) -> None:
        self.sampling, self.cache = sampling, KVCache()

    def _step(self, feats: torch.Tensor, draft_ids: torch.Tensor, position: int) -> torch.Tensor:
        """One draft forward of k rows at one position (the cache's mask is set by the caller)."""
        ids = self.vocab[draft_ids].view(1, -1)
        return self.head(feats, ids, torch.full_like(ids, position), self.cache)

    def update(self, ids: list[int], hidden: dict[int, torch.Tensor]) -> None:
        taps = torch.cat([hidden[layer] for layer in self.hidden_layers], -1)
        rows = taps.shape[1]
        start = len(ids) - 1 - rows          # target position of the first new row
        dev = taps.device
        tokens = torch.tensor(ids[start + 1:], device=dev)[None]
        positions = torch.arange(start, start + rows, device=dev)[None]
        out = self.head(self.head.project(taps.to(self.head.fc.weight.dtype)), tokens, positions, self.cache)
        self.cache.commit()
        self.feature, self.position = out[:, -1:], start + rows - 1
        self.logits = self.head.logits(self.feature)[0, 0].float()

    def propose(self, ids: list[int]) -> DraftTree:
        tree = self._tree() if self.mode == "tree" else self._chain()
        self.cache.drop_pending()
        return tree

    def _chain(self) -> DraftTree:
        s = self.sampling
        feats, logits, picks, qs = self.feature, self.logits, [], []
        for d in range(1, self.chain_k + 1):
            if s.greedy:
                pick = logits.argmax()
            else:
                q = warp(logits, s.temperature, s.top_p, s.top_k)
                pick = torch.multinomial(q, 1, generator=s.generator)[0]
                qs.append(q)
            picks.append(pick)
            if d < self.chain_k:
                feats = self._step(feats, pick, self.position + d)   # mask None: causal over the chain
                logits = self.head.logits(feats)[0, 0].float()
        tokens = self.vocab[torch.stack(picks)].tolist()
        if s.greedy:
            return DraftTree.chain(tokens)
        q = torch.zeros(len(picks), self.head.config.vocab_size, device=self.vocab.device)
        q[:, self.vocab] = torch.stack(qs)
        return DraftTree.chain(tokens, q)

    def _settled(self, pool_scores: list[torch.Tensor], front_scores: torch.Tensor) -> bool:
        """True when no deeper node can enter the tree: a child's cumulative score is at most its parent's,
        and the frontier's best does not beat the pool's (total_tokens - 1)-th best (a tie loses, since the
        stable sort keeps earlier nodes first). Stopping then saves draft forwards and changes nothing."""
        pool = torch.cat(pool_scores)
        n = self.total_tokens - 1
        return len(pool) >= n and bool(front_scores.max() <= pool.topk(n).values[-1])

    def _tree(self) -> DraftTree:
        k, dev = self.top_k, self.logits.device
        scores, picks = torch.log_softmax(self.logits, -1).topk(k)
        pool_scores, pool_ids, pool_parents = [scores], [picks], [torch.full((k,), -1, device=dev)]
        frontier, front_scores, front_ids = torch.arange(k, device=dev), scores, picks
        feats = self.feature.expand(1, k, -1)
        ancestors = torch.zeros(k, 0, dtype=torch.bool, device=dev)   # frontier x pending draft rows
        eye = torch.eye(k, dtype=torch.bool, device=dev)
        for d in range(1, min(self.depth, self.total_tokens - 1)):
            if self._settled(pool_scores, front_scores):
                break
            committed = torch.ones(k, len(self.cache), dtype=torch.bool, device=dev)
            self.cache.mask = torch.cat([committed, ancestors, eye], 1)
            out = self._step(feats, front_ids, self.position + d)
            logq = torch.log_softmax(self.head.logits(out)[0].float(), -1)
            child_scores, child_ids = (front_scores[:, None] + logq).topk(k, -1)       # [k, k]
            base = sum(len(s) for s in pool_scores)
            pool_scores.append(child_scores.flatten())
            pool_ids.append(child_ids.flatten())
            pool_parents.append(frontier.repeat_interleave(k))
            front_scores, best = child_scores.flatten().topk(k)
            parent = best // k
            frontier, front_ids = base + best, child_ids.flatten()[best]
            ancestors = torch.cat([ancestors[parent], eye[parent]], 1)
            feats = out[:, parent]
        # Best total_tokens - 1 nodes by cumulative score; a stable sort keeps a parent before its children.
        all_scores = torch.cat(pool_scores)
        order = all_scores.sort(descending=True, stable=True).indices[: self.total_tokens - 1]
        node_of = torch.zeros(len(all_scores), dtype=torch.long, device=dev)
        node_of[order] = torch.arange(1, len(order) + 1, device=dev)
        parents = torch.cat(pool_parents)[order]
        parents = torch.where(parents < 0, 0, node_of[parents.clamp_min(0)])
        return DraftTree(self.vocab[torch.cat(pool_ids)[order]].tolist(), parents.tolist())


class MedusaDrafter(PlainDrafter):
    """Medusa heads on the target's final (post-norm) hidden state at the last cached position; head k
    predicts the token k+1 positions after the root. A static tree from ``choices`` (a chain = all zeros)."""

    def __init__(self, head: MedusaHead, num_target_layers: int, choices: list[tuple[int, ...]]):
        self.head = head
        self.hidden_layers = [num_target_layers]
        self.parents, heads, ranks = static_tree(choices)
        if max(heads, default=0) >= head.config.num_heads:
            raise ValueError(f"medusa_choices reach depth {max(heads) + 1} but the head has {head.config.num_heads} heads")
        dev = head.d2t.device
        self.node_head, self.node_rank = torch.tensor(heads, device=dev), torch.tensor(ranks, device=dev)
        self.top = max(ranks, default=-1) + 1   # 0: no tree (eval.tree.total_tokens=1), plain decoding
        self.vocab = head.draft_ids()

    def update(self, ids: list[int], hidden: dict[int, torch.Tensor]) -> None:
        self.hidden = hidden[self.hidden_layers[0]][:, -1]

    def propose(self, ids: list[int]) -> DraftTree:
        if not self.top:
            return DraftTree([], [])
        top = self.head(self.hidden.to(self.head.lm_heads[0].weight.dtype))[:, 0].topk(self.top, -1).indices
        return DraftTree(self.vocab[top[self.node_head, self.node_rank]].tolist(), self.parents)


class HybridDrafter:
    """A head's tree with the prompt-lookup chain merged in as one more branch from the root."""

    def __init__(self, head_drafter: Eagle3Drafter | MedusaDrafter, ngram: NGramDrafter):
        self.head_drafter, self.ngram = head_drafter, ngram
        self.hidden_layers = head_drafter.hidden_layers

    def reset(self, sampling: Sampling) -> None:
        self.head_drafter.reset(sampling)

    def update(self, ids: list[int], hidden: dict[int, torch.Tensor]) -> None:
        self.head_drafter.update(ids, hidden)

    def propose(self, ids: list[int]) -> DraftTree:
        return self.head_drafter.propose(ids).merge(self.ngram.propose(ids))


def medusa_choices(ecfg, num_heads: int, chain: bool = False) -> list[tuple[int, ...]]:
    """The Medusa tree: top-1 of each head (up to ``chain_k``) for a chain, else ``eval.medusa_choices``
    (``auto``: :func:`default_medusa_choices` of ``eval.tree.total_tokens`` tokens, the root included)."""
    if chain:
        return [(0,) * d for d in range(1, min(ecfg.chain_k, num_heads) + 1)]
    if ecfg.medusa_choices in (None, "auto"):
        return default_medusa_choices(num_heads, int(ecfg.tree.total_tokens) - 1)
    return [tuple(c) for c in ecfg.medusa_choices]


def build_drafter(method: str, head: nn.Module | None, num_target_layers: int, ecfg) -> Drafter:
    """The drafter of a method name (see ``METHODS``) from the eval config (``tree.total_tokens`` resolved)."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; valid: {METHODS}")
    ngram = NGramDrafter(ecfg.ngram.min, ecfg.ngram.max, ecfg.ngram.k)
    if method == "plain":
        return PlainDrafter()
    if method == "ngram":
        return ngram
    kind, _, shape = method.partition("-")
    kind, hybrid = kind.removesuffix("+ngram"), "+ngram" in kind
    if kind == "eagle3" and isinstance(head, Eagle3Head):
        t = ecfg.tree
        total = ecfg.chain_k + 1 if shape == "chain" else int(t.total_tokens)  # a chain needs no tree size
        drafter = Eagle3Drafter(head, shape, t.top_k, t.depth, total, ecfg.chain_k)
    elif kind == "medusa" and isinstance(head, MedusaHead):
        drafter = MedusaDrafter(head, num_target_layers, medusa_choices(ecfg, head.config.num_heads, shape == "chain"))
    else:
        raise ValueError(f"method {method!r} needs a {kind} head, got {type(head).__name__}")
    return HybridDrafter(drafter, ngram) if hybrid else drafter
