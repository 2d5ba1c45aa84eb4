"""Speculative SAMPLING is exact: on a tiny target with a 6-token vocabulary, the empirical distribution of
generated length-3 sequences matches the exact distribution (enumerated from the target's warped
probabilities) under a chi-square goodness-of-fit test (alpha = 0.001, fixed seeds), for imperfect
drafters: a deterministic tree (sibling walk, with temperature and top-p), a sampled chain (p/q rule)
and the real EAGLE-3 chain drafter with a random head (p/q with the head's own q). A subtly wrong
acceptance rule must fail the same test: the test has power."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch
from omegaconf import OmegaConf
from transformers import LlamaConfig, LlamaForCausalLM

import eval.decoder
from eval import DraftTree, Eagle3Drafter, Sampling, SpecDecoder, warp
from eval.bench import random_head

VOCAB, LENGTH, SAMPLES, ALPHA = 6, 3, 400, 1e-3   # significance level of every goodness-of-fit test
PROMPT = [1, 4, 2]


@pytest.fixture(scope="module")
def target():
    """A 3-layer Llama over 6 tokens with peaked (large) random weights."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.6 if "embed" in name or "lm_head" in name else 0.3)
    return model


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class TableDrafter:
    """An imperfect drafter without a model: q(next | last token) from a fixed random table. ``tree``:
    the top-2 children at each of 2 levels (deterministic); ``chain``: 2 tokens sampled from q (with q)."""

    hidden_layers: list[int] = []

    def __init__(self, mode: str):
        self.mode = mode
        self.table = torch.softmax(torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(1)) * 1.5, -1)

    def reset(self, sampling: Sampling) -> None:
        self.sampling = sampling

    def update(self, ids, hidden) -> None:
        pass

    def propose(self, ids: list[int]) -> DraftTree:
        if self.mode == "tree":
            first = self.table[ids[-1]].topk(2).indices.tolist()
            second = [self.table[t].topk(2).indices.tolist() for t in first]
            return DraftTree(first + second[0] + second[1], [0, 0, 1, 1, 2, 2])
        tokens, qs = [ids[-1]], []
        for _ in range(2):
            qs.append(self.table[tokens[-1]])
            tokens.append(int(torch.multinomial(qs[-1], 1, generator=self.sampling.generator)))
        return DraftTree.chain(tokens[1:], torch.stack(qs))


def exact_distribution(target, temperature: float, top_p: float, top_k: int = 0) -> dict[tuple[int, ...], float]:
    """P(x1 x2 x3 | PROMPT) for all VOCAB**3 continuations, from one batched forward."""
    seqs = torch.tensor(list(itertools.product(range(VOCAB), repeat=LENGTH)))
    ids = torch.cat([torch.tensor(PROMPT).expand(len(seqs), -1), seqs], 1)
    with torch.no_grad():
        logits = target(ids).logits[:, len(PROMPT) - 1: -1]
    probs = warp(logits, temperature, top_p, top_k).gather(-1, seqs[..., None])[..., 0].prod(-1)
    return {tuple(s): float(p) for s, p in zip(seqs.tolist(), probs, strict=True)}


def chi_square_pvalue(samples: list[tuple[int, ...]], exact: dict[tuple[int, ...], float]) -> float:
    """Pearson's goodness of fit; bins with expected count < 5 are pooled (and the pool merged into the
    last bin when it is itself < 5). p-value = Q(df / 2, stat / 2)."""
    n, counts = len(samples), Counter(samples)
    big = sorted((s for s, p in exact.items() if p * n >= 5), key=exact.get)
    observed = [counts[s] for s in big] + [n - sum(counts[s] for s in big)]
    expected = [exact[s] * n for s in big] + [n - sum(exact[s] * n for s in big)]
    if expected[-1] < 5:
        observed[-2] += observed.pop()
        expected[-2] += expected.pop()
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected, strict=True))
    df = torch.tensor((len(observed) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(df, torch.tensor(stat / 2, dtype=torch.float64)))


def sample(decoder: SpecDecoder, drafter, temperature: float, top_p: float, top_k: int = 0) -> list[tuple[int, ...]]:
    return [tuple(decoder.generate(PROMPT, drafter, LENGTH, temperature, top_p, seed=i, top_k=top_k).tokens)
            for i in range(SAMPLES)]


def eagle3_chain(target) -> Eagle3Drafter:
    head_cfg = OmegaConf.create({"aux_layers": [0, 1, 2], "draft_vocab_size": VOCAB})
    head = random_head("eagle3", target, head_cfg, torch.arange(VOCAB), seed=3)
    return Eagle3Drafter(head, "chain", chain_k=2)


CASES = {
    "tree-sibling-walk-top-p": (lambda t: TableDrafter("tree"), 0.8, 0.9, 0),
    "chain-p/q": (lambda t: TableDrafter("chain"), 1.0, 1.0, 0),
    "eagle3-chain-p/q-top-p": (eagle3_chain, 0.7, 0.8, 0),
    "tree-sibling-walk-top-k": (lambda t: TableDrafter("tree"), 1.0, 1.0, 3),   # eval.top_k (Qwen3's 20)
    "eagle3-chain-p/q-top-k-top-p": (eagle3_chain, 1.0, 0.9, 3),
}


@pytest.mark.parametrize("case", CASES)
def test_speculative_sampling_is_exact(target, case: str):
    make, temperature, top_p, top_k = CASES[case]
    exact = exact_distribution(target, temperature, top_p, top_k)
    samples = sample(SpecDecoder(target), make(target), temperature, top_p, top_k)
    assert all(exact[s] > 0 for s in samples), "a sequence the target cannot produce was generated"
    assert chi_square_pvalue(samples, exact) > ALPHA


def test_wrong_acceptance_rule_is_detected(target, monkeypatch):
    """Power: a sibling walk that forgets to remove rejected children before drawing the bonus token
    (a classic bug, biased against the drafter's picks) must fail the same test."""

    def no_residual(tree, logits, sampling, typical=False):
        kids, path, node = tree.children(), [], 0
        while True:
            p = warp(logits[node], sampling.temperature, sampling.top_p)
            child = next((c for c in kids[node] if torch.rand((), generator=sampling.generator) < p[tree.tokens[c - 1]]),
                         None)
            if child is None:
                return path, int(torch.multinomial(p, 1, generator=sampling.generator))
            path.append(child)
            node = child

    monkeypatch.setattr(eval.decoder, "accept", no_residual)
    exact = exact_distribution(target, 1.0, 1.0)
    assert chi_square_pvalue(sample(SpecDecoder(target), TableDrafter("tree"), 1.0, 1.0), exact) < ALPHA
