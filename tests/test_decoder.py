"""The speculative tree decoder is lossless at temperature 0: every drafter reproduces plain greedy
decoding and ``transformers`` ``generate(do_sample=False)`` token for token (tiny random targets; the
real default target under ``-m integration``). Also: tree structures, the drafters' own computations,
EOS inside an accepted path, the max_new_tokens boundary, and tree sizing."""

from __future__ import annotations

import io
import math
import random
import types

import pytest
import torch
from omegaconf import OmegaConf
from tqdm import tqdm

from data.template import prompt_ids
from eval import (
    METHODS,
    DraftTree,
    Eagle3Drafter,
    Generation,
    HybridDrafter,
    NGramDrafter,
    Sampling,
    SpecDecoder,
    accept,
    acceptance_curve,
    build_drafter,
    choice_order,
    choose_total_tokens,
    default_medusa_choices,
    measure_verify_time,
    monotone,
    static_tree,
    warp,
)
from eval import decoder as decoder_module
from eval.bench import random_head
from eval.drafters import MedusaDrafter
from eval.stage import eos_token_ids
from eval.treesize import draft_times
from heads.eagle3 import KVCache
from train.target import load_target, load_tokenizer

PROMPTS = [
    "Write a haiku about autumn leaves.",
    "What is 17 times 23? Explain step by step.",
    "def fibonacci(n):\n    # complete this function",
    "Summarise: the the cat sat on the mat and the cat sat on the mat again.",
]
MEDUSA_CFG = OmegaConf.create({"num_heads": 3, "num_layers": 1, "draft_vocab_size": 200})
NEW_TOKENS = 32


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models are overhead-bound: one thread avoids contention on a shared 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def eval_cfg(**tree):
    return OmegaConf.create({"chain_k": 3, "medusa_choices": "auto", "ngram": {"min": 2, "max": 4, "k": 4},
                             "tree": {"top_k": 4, "depth": 4, "total_tokens": 10, **tree}})


def hf_greedy(target, ids: list[int], new_tokens: int, eos: set[int]) -> list[int]:
    out = target.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=new_tokens, do_sample=False, eos_token_id=sorted(eos),
                          pad_token_id=sorted(eos)[0])
    return out[0, len(ids):].tolist()


class Setup:
    """A target with a decoder, random heads and greedy references for PROMPTS."""

    def __init__(self, cfg, kept: torch.Tensor):
        self.target = load_target(cfg)
        self.tokenizer = load_tokenizer(cfg)
        self.decoder = SpecDecoder(self.target, eos_token_ids(self.target, self.tokenizer))
        self.heads = {"eagle3": random_head("eagle3", self.target, cfg.head, kept),
                      "medusa": random_head("medusa", self.target, MEDUSA_CFG, kept)}
        self.prompts = [prompt_ids(self.tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS]
        with torch.inference_mode():
            self.reference = [hf_greedy(self.target, p, NEW_TOKENS, self.decoder.eos) for p in self.prompts]

    def drafter(self, method: str, **tree):
        head = self.heads["medusa" if method.startswith("medusa") else "eagle3"]
        return build_drafter(method, head, self.target.config.num_hidden_layers, eval_cfg(**tree))


@pytest.fixture(scope="module", params=["tiny_llama_cfg", "tiny_qwen2_cfg"])
def tiny(request) -> Setup:
    cfg = request.getfixturevalue(request.param)
    vocab = load_target(cfg).config.vocab_size
    # Llama: a random sorted draft vocabulary (d2t offsets vary); Qwen2: the first 200 ids.
    kept = torch.randperm(vocab, generator=torch.Generator().manual_seed(0))[:200].sort().values
    return Setup(cfg, kept if request.param == "tiny_llama_cfg" else torch.arange(200))


# ---------------------------------------------------------------------------------------------------
# Structures


def test_draft_tree_structure():
    tree = DraftTree([5, 6, 7, 8], [0, 0, 1, 3])
    assert tree.depths() == [0, 1, 1, 2, 3]
    assert tree.children() == [[1, 2], [3], [], [4], []]
    expected = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 1, 0, 1, 1]])
    assert torch.equal(tree.ancestor_mask().long(), expected)
    gen = torch.Generator().manual_seed(0)
    for size in (1, 2, 7, 64):   # random trees and a 64-deep chain: each row's ancestors, walked up one by one
        parents = [int(torch.randint(0, i + 1, (1,), generator=gen)) for i in range(size)]
        for t in (DraftTree(list(range(size)), parents), DraftTree.chain(list(range(size)))):
            walked = torch.zeros(size + 1, size + 1, dtype=torch.bool)
            for i in range(size + 1):
                j = i
                while True:
                    walked[i, j] = True
                    if j == 0:
                        break
                    j = t.parents[j - 1]
            assert torch.equal(t.ancestor_mask(), walked)
    merged = tree.merge(DraftTree.chain([5, 7, 9]))   # 5 -> 7 exist (nodes 1, 3); 9 is new under node 3
    assert merged.tokens == [5, 6, 7, 8, 9] and merged.parents == [0, 0, 1, 3, 3]
    merged = tree.merge(DraftTree.chain([6, 1]))
    assert merged.tokens[-1:] == [1] and merged.parents[-1] == 2
    with pytest.raises(ValueError):
        tree.merge(DraftTree.chain([1], q=torch.ones(1, 10)))


def test_static_tree_and_default_choices():
    parents, heads, ranks = static_tree([(1,), (0, 0), (0,), (0, 1), (0, 0, 0)])
    # sorted: (0,) (1,) (0,0) (0,1) (0,0,0)
    assert parents == [0, 0, 1, 1, 3] and heads == [0, 0, 1, 1, 2] and ranks == [0, 1, 0, 1, 0]
    with pytest.raises(ValueError, match="prefix"):
        static_tree([(0,), (1, 0)])
    for n in (1, 3, 5):
        choices = default_medusa_choices(n)
        assert 10 <= len(choices) <= 20 and max(map(len, choices)) <= n
        static_tree(choices)   # every prefix present


def test_default_medusa_trees_grow_by_their_likeliest_paths():
    """A smaller default tree is the first paths of a larger one, so one decode with the largest tree measures
    every size: of an accepted path of the large tree, the nodes a small tree keeps (``choice_order`` below T)
    are exactly the path's nodes present in the small tree, and they are its first ones."""
    rng = random.Random(0)
    for heads in (1, 2, 3, 5):
        large = default_medusa_choices(heads, 63)
        assert len(large) == 63 and len(set(large)) == 63
        for size in range(1, 64):
            assert default_medusa_choices(heads, size) == large[:size]
        parents, _, _ = static_tree(large)
        order, paths = choice_order(large), sorted(set(large), key=lambda c: (len(c), c))
        for _ in range(50):   # a random root-to-node path of the large tree
            node, path = rng.randrange(1, 64), []
            while node:
                path.insert(0, node)
                node = parents[node - 1]
            for tokens in (2, 4, 9, 17, 64):
                kept = set(default_medusa_choices(heads, tokens - 1))
                present = [paths[n - 1] in kept for n in path]
                assert present == sorted(present, reverse=True)           # the path's first nodes
                assert sum(present) == sum(order[n] < tokens for n in path)
    gens = [Generation([0] * 4, cycles=2, paths=[[1, 3]])]   # node 3 entered the tree second (place 2)
    assert acceptance_curve(gens, (2, 3, 4), order=[0, 1, 3, 2]) == {2: 2.0, 3: 3.0, 4: 3.0}
    assert acceptance_curve(gens, (2, 3, 4)) == {2: 2.0, 3: 2.0, 4: 3.0}    # places = node numbers (EAGLE's)


def test_ngram_lookup():
    ngram = NGramDrafter(min_n=2, max_n=4, k=3)
    # suffix [1, 2, 3] matches at 0 (-> 9, 9) and the 2-gram [2, 3] later (-> 7): the longer match wins
    assert ngram.lookup([1, 2, 3, 9, 9, 5, 2, 3, 7, 0, 1, 2, 3]) == [9, 9, 5]
    assert ngram.lookup([4, 1, 2, 8, 4, 1, 2, 6, 1, 2]) == [6, 1, 2]    # the latest occurrence
    assert ngram.lookup([1, 2, 3, 4, 5]) == []
    assert ngram.lookup([5, 7, 7, 7, 7, 7, 7, 7, 7]) == [7, 7, 7]   # a run: not the latest occurrence (one token after it)
    assert ngram.lookup([5, 6, 5, 6]) == [5, 6]   # none with k after it: the latest, what follows it
    assert ngram.propose([1, 2, 3, 1, 2]).parents == [0, 1, 2]


def test_warp_matches_transformers():
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 3
    for temperature, top_p, top_k in ((1.0, 1.0, 0), (0.7, 0.9, 0), (1.3, 0.5, 0), (0.6, 0.95, 20), (1.0, 1.0, 3)):
        scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
        if top_k:
            scores = TopKLogitsWarper(top_k)(None, scores)
        scores = TopPLogitsWarper(top_p)(None, scores)
        torch.testing.assert_close(warp(logits, temperature, top_p, top_k), torch.softmax(scores, -1))


def test_typical_acceptance_is_opt_in_and_follows_its_rule():
    """Medusa typical acceptance (lossy): a child is accepted iff p(x) > min(eps, delta * exp(-H(p)));
    only used when asked for, and never at temperature 0."""
    logits = torch.tensor([[4.0, 3.0, 0.0, -2.0, -2.0, -2.0]]).repeat(4, 1)
    p = torch.softmax(logits[0], -1)
    threshold = min(0.09, 0.3 * float(torch.exp(-(p * p.log()).sum())))
    assert p[2] < threshold < p[1]
    tree = DraftTree([2, 1, 0], [0, 0, 2])     # root -> {2 (atypical), 1 (typical) -> 0 (typical)}
    sampling = Sampling(1.0, 1.0, torch.Generator().manual_seed(0))
    for _ in range(20):
        path, bonus = accept(tree, logits, sampling, typical=True)
        assert path == [2, 3] and p[bonus] > threshold
    assert accept(tree, logits, Sampling(), typical=True) == ([], 0)   # greedy stays exact: argmax is 0
    sampled = {tuple(accept(tree, logits, sampling)[0]) for _ in range(200)}
    assert () in sampled and (2, 3) in sampled   # the exact rule sometimes rejects typical children


# ---------------------------------------------------------------------------------------------------
# Greedy: token-identical to plain decoding and to transformers' generate


@pytest.mark.parametrize("method", METHODS)
def test_greedy_identical_to_plain_and_generate(tiny: Setup, method: str):
    drafter = tiny.drafter(method)
    for ids, reference in zip(tiny.prompts, tiny.reference, strict=True):
        out = tiny.decoder.generate(ids, drafter, NEW_TOKENS)
        assert out.tokens == reference, method
        assert out.cycles == 1 + len(out.paths) and sum(out.accept_lengths) + out.cycles >= len(out.tokens)
        if method == "plain":
            assert out.tau == 1.0 and out.accept_lengths == [0] * (NEW_TOKENS - 1)


def test_greedy_long_context(tiny: Setup):
    ids = prompt_ids(tiny.tokenizer, [{"role": "user", "content": " ".join(PROMPTS) * 9}])
    assert len(ids) > 1500
    with torch.inference_mode():
        reference = hf_greedy(tiny.target, ids, 24, tiny.decoder.eos)
    for method in ("ngram", "eagle3+ngram-tree", "medusa-tree"):
        assert tiny.decoder.generate(ids, tiny.drafter(method), 24).tokens == reference, method


# ---------------------------------------------------------------------------------------------------
# Long accepted paths: an oracle drafter that knows the greedy continuation


class OracleDrafter(NGramDrafter):
    """Proposes the true greedy continuation (``depth`` tokens) as the LAST child at every level, after
    a junk child with a junk grandchild, so accepted KV rows are never a prefix of the tree."""

    def __init__(self, reference: list[int], prompt_len: int, depth: int, vocab: int):
        self.reference, self.prompt_len, self.depth, self.vocab = reference, prompt_len, depth, vocab

    def propose(self, ids: list[int]) -> DraftTree:
        tokens, parents, parent = [], [], 0
        for true in self.reference[len(ids) - self.prompt_len:][: self.depth]:
            junk = (true + 1) % self.vocab
            tokens += [junk, (junk + 1) % self.vocab, true]
            parents += [parent, len(tokens) - 2, parent]
            parent = len(tokens)
        return DraftTree(tokens, parents)


def test_oracle_paths_and_max_new_tokens(tiny: Setup):
    ids, depth = tiny.prompts[0], 4
    oracle = OracleDrafter(tiny.reference[0], len(ids), depth, tiny.target.config.vocab_size)
    for n in (1, 2, 5, 6, 7, 13, NEW_TOKENS - depth):
        out = tiny.decoder.generate(ids, oracle, n)
        assert out.tokens == tiny.reference[0][:n]
        assert out.accept_lengths == [depth] * len(out.paths)          # every cycle takes the whole path
        assert out.cycles == 1 + math.ceil((n - 1) / (depth + 1))      # ... truncated at the budget


def test_eos_inside_accepted_path(tiny: Setup):
    depth = 4
    # an "EOS" id that first occurs in the middle of a cycle (cycles commit tokens 1-5, 6-10, ...), in the first prompt
    # whose answer has one (a random twin's greedy answer may repeat one token)
    ids, reference, j = next((ids, ref, j) for ids, ref in zip(tiny.prompts, tiny.reference, strict=True)
                             for j in range(2, len(ref) - depth) if ref[j] not in ref[:j] and j % 5)
    decoder = SpecDecoder(tiny.target, [reference[j]])
    out = decoder.generate(ids, OracleDrafter(reference, len(ids), depth, tiny.target.config.vocab_size), NEW_TOKENS)
    assert out.tokens == reference[: j + 1]
    assert sum(out.accept_lengths) + len(out.paths) + 1 > len(out.tokens)   # the path went past EOS
    with torch.inference_mode():
        assert hf_greedy(tiny.target, ids, NEW_TOKENS, {reference[j]}) == out.tokens
    assert decoder.generate(ids, tiny.drafter("eagle3+ngram-tree"), NEW_TOKENS).tokens == out.tokens


# ---------------------------------------------------------------------------------------------------
# The drafters compute what they claim


class Recorder:
    """Delegates to a drafter and remembers the committed sequence of its last update."""

    def __init__(self, drafter):
        self.drafter, self.hidden_layers = drafter, drafter.hidden_layers

    def reset(self, sampling):
        self.drafter.reset(sampling)

    def update(self, ids, hidden):
        self.ids = list(ids)
        self.drafter.update(ids, hidden)

    def propose(self, ids):
        return self.drafter.propose(ids)


def recompute_eagle3(setup: Setup, ids: list[int], path: list[int] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """From scratch: draft rows t = 0..n-2 (taps of target position t, token x[t+1], position t), then the
    tokens (target ids) of ``path`` one by one; returns (last output feature, its logits)."""
    head = setup.heads["eagle3"]
    with torch.inference_mode():
        hidden = setup.target(torch.tensor([ids[:-1]]), output_hidden_states=head.config.aux_layers).hidden_states
        taps = torch.cat([hidden[i] for i in head.config.aux_layers], -1)
        cache, rows = KVCache(), len(ids) - 1
        feature = head(head.project(taps), torch.tensor([ids[1:]]), torch.arange(rows)[None], cache)[:, -1:]
        cache.commit()
        for depth, token in enumerate(path, 1):
            feature = head(feature, torch.tensor([[token]]), torch.tensor([[rows - 1 + depth]]), cache)
        return feature, head.logits(feature)[0, -1]


def test_eagle3_draft_cache_matches_recompute(tiny: Setup):
    """After cycles with long, non-prefix accepted paths, the draft KV and feature equal a from-scratch run."""
    ids = tiny.prompts[2]
    oracle = OracleDrafter(tiny.reference[2], len(ids), 3, tiny.target.config.vocab_size)
    eagle = Eagle3Drafter(tiny.heads["eagle3"], "tree", top_k=2, depth=2, total_tokens=4)
    spy = Recorder(HybridDrafter(eagle, oracle))
    out = tiny.decoder.generate(ids, spy, 30)
    assert out.tokens == tiny.reference[2][:30] and max(out.accept_lengths) == 3
    assert len(eagle.cache) == len(spy.ids) - 1
    feature, logits = recompute_eagle3(tiny, spy.ids)
    torch.testing.assert_close(eagle.feature, feature, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(eagle.logits, logits.float(), atol=1e-4, rtol=1e-4)


def test_eagle3_tree_matches_recompute(tiny: Setup):
    """Every expanded node's children are the top-k of the draft run along its own path (tree mask,
    positions and fed-back features); nodes come in score order (parents first); depth is respected."""
    k, depth = 3, 3
    ids = tiny.prompts[0] + tiny.reference[0][:5]
    drafter = Eagle3Drafter(tiny.heads["eagle3"], "tree", top_k=k, depth=depth, total_tokens=1 + k + 2 * k * k)
    layers = drafter.hidden_layers
    with torch.inference_mode():
        _, _, hidden = tiny.decoder.prefill(ids[:-1], layers)
        drafter.reset(Sampling())
        drafter.update(ids, {layer: hidden[layer] for layer in layers})
        tree = drafter.propose(ids)
    assert len(tree) == k + 2 * k * k and max(tree.depths()) == depth
    assert all(p < i for i, p in enumerate(tree.parents, 1))
    vocab = tiny.heads["eagle3"].draft_ids()
    depths, kids = tree.depths(), tree.children()
    for node, children in enumerate(kids):
        if not children:
            continue
        path, v = [], node
        while v:
            path.insert(0, tree.tokens[v - 1])
            v = tree.parents[v - 1]
        assert len(path) == depths[node]
        _, logits = recompute_eagle3(tiny, ids, path)
        assert [tree.tokens[c - 1] for c in children] == vocab[logits.topk(k).indices].tolist()


def test_eagle3_tree_stops_when_no_deeper_node_can_enter(tiny: Setup, monkeypatch):
    """A small tree stops drafting once the frontier cannot beat its last node: fewer draft forwards, and
    exactly the first nodes of the full-depth tree (nodes in score order)."""
    ids = tiny.prompts[1] + tiny.reference[1][:4]
    layers = tiny.heads["eagle3"].config.aux_layers
    with torch.inference_mode():
        _, _, hidden = tiny.decoder.prefill(ids[:-1], layers)
    trees, steps = {}, {}
    for total in (8, 1 + 4 + 4 * 16):  # the second keeps every node of 5 levels: it never stops early
        drafter = Eagle3Drafter(tiny.heads["eagle3"], "tree", top_k=4, depth=5, total_tokens=total)
        calls = []
        monkeypatch.setattr(drafter, "_step", lambda *a, d=drafter, c=calls: c.append(1) or Eagle3Drafter._step(d, *a))
        with torch.inference_mode():
            drafter.reset(Sampling())
            drafter.update(ids, {layer: hidden[layer] for layer in layers})
            trees[total], steps[total] = drafter.propose(ids), len(calls)
    small, full = trees[8], trees[69]
    assert steps[69] == 4 and steps[8] < 4 and max(full.depths()) == 5
    assert small.tokens == full.tokens[:7] and small.parents == full.parents[:7]


def test_medusa_drafter(tiny: Setup):
    head = tiny.heads["medusa"]
    n = tiny.target.config.num_hidden_layers
    ids = tiny.prompts[3]
    with torch.inference_mode():
        final = tiny.target(torch.tensor([ids[:-1]]), output_hidden_states=[n]).hidden_states[n]
        top = head(final[:, -1])[:, 0]                                       # [heads, draft vocab]
        chain = build_drafter("medusa-chain", head, n, eval_cfg())
        chain.update(ids, {n: final})
        tree = chain.propose(ids)
    assert tree.parents == [0, 1, 2] and tree.tokens == head.draft_ids()[top.argmax(-1)].tolist()
    drafter = MedusaDrafter(head, n, default_medusa_choices(3))
    drafter.update(ids, {n: final})
    with torch.inference_mode():
        tree = drafter.propose(ids)
    ranks = top.argsort(-1, descending=True)
    parents, heads, node_ranks = static_tree(default_medusa_choices(3))
    assert tree.parents == parents
    assert tree.tokens == [int(head.draft_ids()[ranks[h, r]]) for h, r in zip(heads, node_ranks, strict=True)]
    for children in tree.children():
        assert len({tree.tokens[c - 1] for c in children}) == len(children)


# ---------------------------------------------------------------------------------------------------
# Tree sizing


def test_acceptance_curve_and_choice():
    gens = [Generation([0] * 6, cycles=3, paths=[[2, 5, 9], [1]]), Generation([0] * 2, cycles=2, paths=[[]])]
    curve = acceptance_curve(gens, (1, 2, 3, 6, 10))
    # tree of T tokens keeps nodes 1..T-1: path [2, 5, 9] keeps 0, 1, 1, 2, 3 of them; [1] keeps 0, 1, 1, 1, 1
    assert curve == {1: 1.0, 2: 1 + 1 / 3, 3: 1 + 2 / 3, 6: 1 + 3 / 3, 10: 1 + 4 / 3}
    verify = {1: 10.0, 2: 11.0, 3: 12.0, 6: 13.0, 10: 30.0}
    draft = {2: 1.0, 3: 2.0, 6: 2.0, 10: 2.0}
    best, predicted = choose_total_tokens(verify, curve, draft)
    assert set(predicted) == {2, 3, 6, 10}    # the root alone (plain decoding) is no tree
    # speedup(T) = tau(T) * verify(1) / (verify(T) + draft(T)): 1.11, 1.19, 1.33, 0.73
    assert predicted[6] == pytest.approx(2.0 * 10 / 15) and best == 6


def test_tree_sizing_fits_costs_that_never_fall_with_more_tokens():
    """Verify and draft times are fitted non-decreasing before the choice: a size timed below a smaller one (noise)
    is not taken at its lucky time, which made it look best."""
    assert monotone({1: 5.0, 2: 3.0, 4: 4.0, 8: 10.0, 16: 9.0}) == {1: 4.0, 2: 4.0, 4: 4.0, 8: 9.5, 16: 9.5}
    assert monotone({1: 1.0, 2: 2.0}) == {1: 1.0, 2: 2.0} and monotone({4: 7.0}) == {4: 7.0}
    assert monotone({8: 1.0, 1: 5.0, 2: 4.0, 4: 3.0}) == {1: 3.25, 2: 3.25, 4: 3.25, 8: 3.25}   # merges cascade
    # a 2-token tree timed under one token is taken at one token's time, which stays as measured
    best, predicted = choose_total_tokens({1: 10.0, 2: 9.0, 4: 12.0}, {1: 1.0, 2: 1.5, 4: 1.6}, {2: 0.0, 4: 0.0})
    assert predicted == {2: pytest.approx(1.5), 4: pytest.approx(1.6 * 10 / 12)} and best == 2
    tau = {1: 1.0, 2: 1.3, 4: 1.62, 8: 1.8, 16: 1.85}
    verify = {1: 20.0, 2: 22.0, 4: 24.0, 8: 30.0, 16: 26.0}   # 16 tokens timed 4 ms under 8
    draft = {2: 1.0, 4: 1.0, 8: 1.2, 16: 0.8}                 # pooled: 1 each
    best, predicted = choose_total_tokens(verify, tau, draft)
    assert predicted[16] == pytest.approx(1.85 * 20 / (28 + 1)) and predicted[8] == pytest.approx(1.8 * 20 / (28 + 1))
    assert best == 4 and predicted[4] == pytest.approx(1.62 * 20 / 25)
    raw = {t: tau[t] * verify[1] / (verify[t] + draft[t]) for t in predicted}
    assert max(raw, key=raw.get) == 16   # what the lucky time chose without the fit


def test_measure_verify_time_and_draft_times(tiny: Setup):
    context = tiny.prompts[0] + tiny.reference[0]
    timings = measure_verify_time(tiny.decoder, context, (1, 4, 16), repeats=1,
                                  hidden_layers=tiny.heads["eagle3"].config.aux_layers)
    assert list(timings) == [1, 4, 16] and all(ms > 0 for ms in timings.values())
    drafter = tiny.drafter("eagle3-tree")
    _, _, hidden = tiny.decoder.prefill(context[:-1], drafter.hidden_layers)
    times = draft_times(tiny.decoder, drafter, context, hidden, repeats=1)
    assert set(times) == {"update", "propose"} and all(ms > 0 for ms in times.values())


class TimedDecoder:
    """A decoder whose verify pass over ``T`` tree tokens takes ``cost(T, passes before it)`` seconds of its
    own clock (no model): what :func:`measure_verify_time` sees on a machine whose speed moves."""

    class Cache:
        def get_seq_length(self) -> int:
            return 0

        def crop(self, n: int) -> None:
            assert n == 0

    def __init__(self, cost):
        self.cost, self.now, self.passes = cost, 0.0, 0

    def clock(self) -> float:
        return self.now

    def prefill(self, ids, layers):
        return self.Cache(), None, None

    def verify(self, cache, token, tree, layers):
        self.now += self.cost(len(tree) + 1, self.passes)
        self.passes += 1


def test_measure_verify_time_is_fair_to_every_size_on_a_drifting_machine():
    """A machine that slows down steadily while the sizes are timed (each pass 1 ms plus 1% per pass before
    it, whatever its size) gives every size about the same verify time: the sizes are interleaved in rounds
    of alternating order, each beside a 1-token pass, not timed one block after another (which made the last
    sizes look dear)."""
    sizes = (1, 2, 4, 8, 16, 32)
    bar = tqdm(total=len(sizes), file=io.StringIO())
    timings = measure_verify_time(TimedDecoder(lambda size, passes: 1e-3 * (1 + 0.01 * passes)), list(range(40)),
                                  sizes, bar=bar)
    assert list(timings) == list(sizes) and bar.n == len(sizes)
    assert all(ms == pytest.approx(timings[1], rel=0.02) for ms in timings.values())


@pytest.mark.parametrize("seed", range(8))
def test_measure_verify_time_recovers_each_size_s_cost_on_a_swinging_machine(seed: int):
    """A VM whose speed swings (3x slower for stretches of ~10 passes, at random) still gives each size's
    cost relative to one token: each size is timed right beside a 1-token pass, and both see the same
    machine (the medians of unpaired passes, timed before, put a size 50% off for half of these seeds)."""
    rng, slow = random.Random(seed), [False]

    def cost(size: int, passes: int) -> float:
        slow[0] ^= rng.random() < 0.1
        return 1e-3 * (1 + 0.05 * (size - 1)) * (3 if slow[0] else 1)

    sizes = (1, 2, 4, 8, 16, 32)
    timings = measure_verify_time(TimedDecoder(cost), list(range(40)), sizes)
    assert all(timings[s] / timings[1] == pytest.approx(1 + 0.05 * (s - 1), rel=0.05) for s in sizes)


def slow_choices(decoder: SpecDecoder, monkeypatch) -> list[list[str]]:
    """The decoder's clock made fake, and its choices of a layout each made to take 0.2 s of it (which the clock
    must not see); returns the list the names of each choice's candidates are appended to."""
    chosen, fastest, now = [], decoder._fastest, [100.0]
    monkeypatch.setattr(decoder_module, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))

    def slow_fastest(runs):
        chosen.append(list(runs))
        now[0] += 0.2
        return fastest(runs)

    monkeypatch.setattr(decoder, "_fastest", slow_fastest)
    return chosen


def test_lm_head_layouts_agree_and_are_timed_once_per_row_count(tiny: Setup, monkeypatch):
    decoder = SpecDecoder(tiny.target)   # no layout chosen yet
    assert decoder.plain_head
    chosen = slow_choices(decoder, monkeypatch)
    weight = decoder.lm_head
    for rows in (1, 3, 3, 8):
        h = torch.randn(rows, weight.shape[1])
        start = decoder.clock()
        assert torch.allclose(decoder.logits(h), h @ weight.T, atol=1e-5)
        assert decoder.clock() == start and decoder.tuning_s == pytest.approx(0.2 * len(chosen))
        assert decoder.layouts[rows] in ("linear", "mm")
        for layout in ("linear", "mm"):
            decoder.layouts[rows] = layout
            assert torch.allclose(decoder.logits(h), h @ weight.T, atol=1e-5)
    assert chosen == [["linear", "mm"]] * 3 and list(decoder.layouts) == [1, 3, 8]


def test_verify_passes_run_the_layers_in_the_layout_timed_for_their_rows(tiny: Setup, monkeypatch):
    """On the CPU a verify pass (a tree's, or the root's alone: plain decoding is timed like for like) runs every
    linear layer of the target's decoder layers in the GEMM layout timed faster for its number of rows (the first
    time, on the pass itself, whose rows the timing leaves out of the cache and the clock); the layers are then
    back as they were. Either layout gives the target's logits, and decoding with every pass in the ``mm`` layout
    is lossless."""
    decoder = SpecDecoder(tiny.target, tiny.decoder.eos)
    assert len(decoder.linears) == 7 * tiny.target.config.num_hidden_layers   # q k v o, gate up down
    chosen, calls, mm_forward = slow_choices(decoder, monkeypatch), [], decoder_module._mm_forward
    monkeypatch.setattr(decoder_module, "_mm_forward", lambda layer, x: calls.append(layer) or mm_forward(layer, x))
    ids, reference = tiny.prompts[0], tiny.reference[0]
    with torch.inference_mode():
        full = tiny.target(torch.tensor([ids + reference[:4]])).logits[0, len(ids):]
        cache, _, _ = decoder.prefill(ids, [])
        past = cache.get_seq_length()
        for tree in (DraftTree.chain(reference[1:4]), DraftTree([], [])):
            rows = len(tree.tokens) + 1
            for layout in (None, "linear", "mm"):
                if layout:
                    decoder.pass_layouts[rows] = layout
                start, calls[:] = decoder.clock(), []
                logits, _ = decoder.verify(cache, reference[0], tree, [])
                if layout:   # every layer once in the pass's layout (the first pass also ran both, timed)
                    assert calls == (decoder.linears if layout == "mm" else [])
                assert decoder.clock() == start and cache.get_seq_length() == past + rows
                cache.crop(-rows)
                torch.testing.assert_close(logits, full[:rows], rtol=1e-4, atol=1e-4)
                assert not any("forward" in vars(layer) for layer in decoder.linears)
    assert chosen == [["linear", "mm"]] * 4   # the lm_head's and the pass's layouts, at 4 rows and at 1
    assert decoder.tuning_s == pytest.approx(0.2 * len(chosen))
    decoder.pass_layouts.update(dict.fromkeys(range(1, 4 * 3 + 2), "mm"))   # every tree OracleDrafter proposes
    oracle = OracleDrafter(reference, len(ids), 4, tiny.target.config.vocab_size)
    out = decoder.generate(ids, oracle, NEW_TOKENS - 4)   # (the oracle's whole path every cycle)
    assert out.tokens == reference[:NEW_TOKENS - 4] and out.accept_lengths == [4] * len(out.paths)
    assert decoder.generate(ids, tiny.drafter("plain"), NEW_TOKENS).tokens == reference
    assert sorted(decoder.pass_layouts) == list(range(1, 4 * 3 + 2))   # no other pass: nothing more timed


def test_only_checked_architectures_on_the_cpu_swap_their_layers_layout(tiny: Setup, monkeypatch):
    """The layout swap is for the modeling code known to take either layout (PLAIN_HEAD); other architectures and
    GPUs keep F.linear, with nothing timed."""
    monkeypatch.setattr(decoder_module, "PLAIN_HEAD", set())
    decoder = SpecDecoder(tiny.target, tiny.decoder.eos)
    assert decoder.linears == []
    assert decoder.generate(tiny.prompts[0], tiny.drafter("ngram"), NEW_TOKENS).tokens == tiny.reference[0]
    assert decoder.pass_layouts == {}


@pytest.mark.parametrize("config, masked", [
    ({}, True),
    ({"num_key_value_heads": 4}, False),                                      # no grouped heads to pack
    ({"layer_types": ["sliding_attention", "full_attention"], "use_sliding_window": True}, False),
])
def test_the_root_is_masked_only_where_it_packs_grouped_heads(config, masked):
    """Only grouped-query targets with full attention in every layer: a sliding-window layer attends fewer keys than
    an all-ones mask names. Plain decoding equals transformers' greedy generate (the decoder's cache rollback
    does not run past a sliding window: transformers' sliding layers refuse `crop` there)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(**{"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                         "num_attention_heads": 4, "num_key_value_heads": 2, "sliding_window": 6, **config})
    cfg._attn_implementation = "sdpa"
    target = Qwen2ForCausalLM(cfg).eval()
    decoder = SpecDecoder(target, [63])
    assert decoder.mask_root is masked
    if "layer_types" in config:
        return
    ids = list(range(3, 23))
    with torch.inference_mode():
        reference = hf_greedy(target, ids, 10, {63})
    assert decoder.generate(ids, build_drafter("plain", None, 0, eval_cfg()), 10).tokens == reference


def test_a_medusa_tree_of_one_token_is_plain_decoding(tiny: Setup):
    drafter = tiny.drafter("medusa-tree", total_tokens=1)
    out = tiny.decoder.generate(tiny.prompts[0], drafter, NEW_TOKENS)
    assert out.tokens == tiny.reference[0] and out.tau == 1.0


def test_plain_step_on_the_cpu_attends_grouped_heads_packed(tiny: Setup, monkeypatch):
    """The root alone (plain decoding) on the CPU passes an all-ones mask, so transformers hands SDPA each layer's
    single query packed as [kv heads, group, dim] (4x faster in bf16 than SDPA's own grouped-query kernel, which
    it takes without a mask); the logits and hidden states equal the unmasked pass's."""
    config = tiny.target.config
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    assert kv < heads  # the tiny twins are grouped-query, like the presets
    decoder = SpecDecoder(tiny.target)
    assert decoder.mask_root
    decoder.pass_layouts[1] = "linear"   # (no layouts timed: the one pass spied on)
    calls, sdpa = [], torch.nn.functional.scaled_dot_product_attention

    def spy(query, *args, **kwargs):
        calls.append((query.shape[1], kwargs.get("enable_gqa", False)))
        return sdpa(query, *args, **kwargs)

    layers = [1, config.num_hidden_layers]
    with torch.inference_mode():
        cache, _, _ = decoder.prefill(tiny.prompts[0], layers)
        unmasked = decoder.forward(torch.tensor([[7]]), layers, cache)
        cache.crop(-1)
        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
        logits, hidden = decoder.verify(cache, 7, DraftTree([], []), layers)
    assert calls == [(kv, False)] * config.num_hidden_layers
    assert torch.allclose(logits, unmasked[0], atol=1e-5)
    assert all(torch.allclose(hidden[i], unmasked[1][i], atol=1e-5) for i in layers)


# ---------------------------------------------------------------------------------------------------
# The real default target (SmolLM2-135M-Instruct)


@pytest.mark.integration
def test_default_target_greedy_lossless(default_cfg):
    target, tokenizer = load_target(default_cfg), load_tokenizer(default_cfg)
    decoder = SpecDecoder(target, eos_token_ids(target, tokenizer))
    head = random_head("eagle3", target, default_cfg.head)
    drafters = {m: build_drafter(m, head, target.config.num_hidden_layers, eval_cfg(total_tokens=8))
                for m in ("ngram", "eagle3-tree", "eagle3+ngram-tree")}
    for prompt in ("List three uses of a paperclip.",
                   "Repeat after me exactly: the quick brown fox jumps over the lazy dog. the quick brown fox"):
        ids = prompt_ids(tokenizer, [{"role": "user", "content": prompt}])
        with torch.inference_mode():
            reference = hf_greedy(target, ids, NEW_TOKENS, decoder.eos)
        assert decoder.generate(ids, build_drafter("plain", None, 0, eval_cfg()), NEW_TOKENS).tokens == reference
        for method, drafter in drafters.items():
            assert decoder.generate(ids, drafter, NEW_TOKENS).tokens == reference, method


@pytest.mark.parametrize("impl", ["flash_attention_2", "flex_attention"])
def test_decoder_refuses_an_attention_that_would_not_apply_the_tree_mask(impl):
    """transformers hands the tree's 4D mask to the kernel as it is: flash attention reads it as padding, flex
    attention adds the booleans to the scores (nothing masked, not lossless). Only sdpa and eager verify trees."""
    from types import SimpleNamespace

    from train.errors import ConfigError

    target = SimpleNamespace(config=SimpleNamespace(_attn_implementation=impl), parameters=lambda: iter([torch.zeros(1)]))
    with pytest.raises(ConfigError, match=f"sdpa or eager, not '{impl}'"):
        SpecDecoder(target)
