"""Draft trees: the nodes a drafter proposes below the root (the newest committed token).

Node 0 is the root; drafted nodes are 1..m, parents before children, the children of a node in draft
rank order (the order the sibling-walk acceptance tries them) and with distinct tokens. A chain is a
tree with one child per node; static trees (Medusa's ``medusa_choices``) are described by their paths.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DraftTree:
    tokens: list[int]               # target ids of nodes 1..m
    parents: list[int]              # parents[i - 1] = parent of node i (0 = the root)
    q: torch.Tensor | None = None   # [m, vocab]: the distribution each token was SAMPLED from (chains only);
                                    # None = deterministic picks (top-k, n-gram), accepted by the sibling walk

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def chain(cls, tokens: list[int], q: torch.Tensor | None = None) -> DraftTree:
        return cls(list(tokens), list(range(len(tokens))), q)

    def depths(self) -> list[int]:
        """Depth of nodes 0..m (the root has depth 0)."""
        depth = [0]
        for p in self.parents:
            depth.append(depth[p] + 1)
        return depth

    def children(self) -> list[list[int]]:
        """Children of nodes 0..m, in rank order."""
        kids: list[list[int]] = [[] for _ in range(len(self.tokens) + 1)]
        for i, p in enumerate(self.parents, 1):
            kids[p].append(i)
        return kids

    def ancestor_mask(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """[m+1, m+1] bool: row i is True at i and at its ancestors (root included). Built on the CPU and copied once:
        a verify pass is timed with it, and one small GPU kernel per level was ~1 ms at depth 63."""
        up = torch.tensor([0, *self.parents])
        mask, reach = torch.eye(len(self.tokens) + 1, dtype=torch.bool), 0
        while reach < max(self.depths()):   # pointer jumping: ancestors up to 2 * reach + 1 levels up
            mask, up, reach = mask | mask[up], up[up], 2 * reach + 1
        return mask.to(device)

    def merge(self, other: DraftTree) -> DraftTree:
        """This tree plus ``other``'s nodes under the same parents; a token that already is a child of
        the same parent is reused, new children rank after the existing ones."""
        if self.q is not None or other.q is not None:
            raise ValueError("only deterministic trees can be merged (sampled chains carry q)")
        tokens, parents = list(self.tokens), list(self.parents)
        child = {(p, t): i for i, (p, t) in enumerate(zip(parents, tokens, strict=True), 1)}
        where = [0]  # node of ``other`` -> node of the merged tree
        for p, t in zip(other.parents, other.tokens, strict=True):
            key = (where[p], t)
            if key not in child:
                tokens.append(t)
                parents.append(where[p])
                child[key] = len(tokens)
            where.append(child[key])
        return DraftTree(tokens, parents)


def _node_paths(choices: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """The distinct paths of ``choices`` in node order (1..m): by length then value, so parents come first."""
    return sorted({tuple(int(r) for r in c) for c in choices}, key=lambda c: (len(c), c))


def static_tree(choices: list[tuple[int, ...]]) -> tuple[list[int], list[int], list[int]]:
    """Medusa paths -> (parents, head, rank) of nodes 1..m: node (a, b, c) is the c-th choice of head 2
    (0-based) under node (a, b). Paths sorted by length then value, so parents come first."""
    paths = _node_paths(choices)
    index = {(): 0} | {c: i for i, c in enumerate(paths, 1)}
    missing = [c for c in paths if c[:-1] not in index]
    if missing:
        raise ValueError(f"medusa_choices must contain every prefix of each path; missing parents of {missing}")
    return [index[c[:-1]] for c in paths], [len(c) - 1 for c in paths], [c[-1] for c in paths]


def choice_order(choices: list[tuple[int, ...]]) -> list[int]:
    """For node i of :func:`static_tree` (root 0), the 1-based position of its path in ``choices``: of a tree grown
    choice by choice (:func:`default_medusa_choices`), the first T - 1 choices are its nodes below T."""
    position = {tuple(int(r) for r in c): i for i, c in enumerate(choices, 1)}
    return [0] + [position[c] for c in _node_paths(choices)]


def default_medusa_choices(num_heads: int, size: int = 15) -> list[tuple[int, ...]]:
    """A sparse tree of ``size`` nodes: the paths most likely to be accepted under a simple prior (each
    head is right with probability 0.6 / (rank + 1) ** 1.5), the same shape as Medusa's published trees, in the
    order they are added: a smaller ``size`` gives the first ``size`` paths of a larger one."""
    def prior(path: tuple[int, ...]) -> float:
        out = 1.0
        for rank in path:
            out *= 0.6 / (rank + 1) ** 1.5
        return out

    frontier, chosen = [(r,) for r in range(size)], []
    while frontier and len(chosen) < size:
        best = max(frontier, key=lambda c: (prior(c), -len(c)))
        frontier.remove(best)
        chosen.append(best)
        if len(best) < num_heads:
            frontier += [(*best, r) for r in range(size)]
    return chosen
