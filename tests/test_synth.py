"""Prompts written by the target (data/synth.py) and reasoning templates (data.thinking, data/template.py)."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch

import data.synth as synth
from data.formats import DataError, read_jsonl
from data.regenerate import Answer
from data.template import prompt_ids, render, set_thinking, tokenize_conversation, user_turn_prefix
from train.stages import run_stages
from train.target import _build_tiny_tokenizer, load_target, load_tokenizer

# Modelled on Qwen3's template: `enable_thinking`, <think> blocks kept only after the last user turn
# (the last assistant turn always shows one, empty if need be), stripped from earlier turns.
QWEN3_STYLE_TEMPLATE = r"""
{%- set ns = namespace(last_query_index=-1) %}
{%- for message in messages %}{%- if message.role == 'user' %}{%- set ns.last_query_index = loop.index0 %}{%- endif %}{%- endfor %}
{%- for message in messages %}
{%- if message.role == 'system' %}{{- '<|im_start|>system\n' + message.content + '<|im_end|>\n' }}
{%- elif message.role == 'user' %}{{- '<|im_start|>user\n' + message.content + '<|im_end|>\n' }}
{%- elif message.role == 'assistant' %}
{%- set content = message.content %}{%- set reasoning_content = '' %}
{%- if '</think>' in content %}
{%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
{%- set content = content.split('</think>')[-1].lstrip('\n') %}
{%- endif %}
{%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}
{{- '<|im_start|>assistant\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
{%- else %}{{- '<|im_start|>assistant\n' + content }}{%- endif %}
{{- '<|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
{%- endif %}"""

EMPTY_THINK = "<think>\n\n</think>\n\n"


@pytest.fixture
def qwen3_tok():
    tok = _build_tiny_tokenizer("chatml")
    tok.add_tokens(["<think>", "</think>"])  # added but not special, as in Qwen3's tokenizer
    tok.chat_template = QWEN3_STYLE_TEMPLATE
    yield tok
    set_thinking(None)


def conversation(reasoning: bool) -> list[dict]:
    think = (lambda r: f"<think>\n{r}\n</think>\n\n") if reasoning else (lambda r: "")
    return [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": think("Add them.") + "It is 4."},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": think("Three and three.") + "Six, of course."},
    ]


def masked_text(tok, ids, mask) -> str:
    return tok.decode([i for i, m in zip(ids, mask, strict=True) if m])


def test_thinking_off_masks_answers_and_keeps_empty_block_in_prompt(qwen3_tok):
    tok, conv = qwen3_tok, conversation(reasoning=False)
    gen_prompt = prompt_ids(tok, conv[:4], thinking=False)
    assert tok.decode(gen_prompt).endswith("<|im_start|>assistant\n" + EMPTY_THINK)
    ids, mask = tokenize_conversation(tok, conv, thinking=False)
    # What regeneration continued from is exactly the training sequence's prefix; its header and empty
    # <think> block are not trained on.
    header = len(tok("<|im_start|>assistant\n" + EMPTY_THINK, add_special_tokens=False)["input_ids"])
    assert ids[: len(gen_prompt)] == gen_prompt and not any(mask[len(gen_prompt) - header: len(gen_prompt)])
    assert masked_text(tok, ids, mask) == "It is 4.<|im_end|>Six, of course.<|im_end|>"
    assert ids == tok(render(tok, conv, thinking=False), add_special_tokens=False)["input_ids"]
    # The process default (data.thinking via set_thinking) is what renders without an explicit value use.
    set_thinking(False)
    assert prompt_ids(tok, conv[:4]) == gen_prompt
    assert tokenize_conversation(tok, conv) == (ids, mask)


def test_thinking_on_masks_reasoning_and_answer(qwen3_tok):
    tok, conv = qwen3_tok, conversation(reasoning=True)
    gen_prompt = prompt_ids(tok, conv[:4], thinking=True)
    assert tok.decode(gen_prompt).endswith("<|im_start|>assistant\n")  # the target writes <think> itself
    ids, mask = tokenize_conversation(tok, conv, thinking=True)
    assert ids[: len(gen_prompt)] == gen_prompt and not any(mask[len(gen_prompt) - 3: len(gen_prompt)])
    # The last turn's reasoning is trained on; the first turn's was stripped from history by the template.
    assert masked_text(tok, ids, mask) == (
        "It is 4.<|im_end|><think>\nThree and three.\n</think>\n\nSix, of course.<|im_end|>")
    assert "Add them." not in tok.decode(ids)
    # Exactly two masked spans, each ending with the end-of-turn token.
    starts = [j for j in range(len(mask)) if mask[j] and (j == 0 or not mask[j - 1])]
    ends = [j for j in range(len(mask)) if mask[j] and (j + 1 == len(mask) or not mask[j + 1])]
    assert len(starts) == 2 and all(tok.convert_ids_to_tokens(ids[j]) == "<|im_end|>" for j in ends)


def test_thinking_flag_is_ignored_by_plain_templates():
    tok = _build_tiny_tokenizer("chatml")
    conv = conversation(reasoning=False)
    assert {tuple(prompt_ids(tok, conv[:2], thinking=t)) for t in (None, True, False)} == {tuple(prompt_ids(tok, conv[:2]))}
    assert tokenize_conversation(tok, conv, thinking=False) == tokenize_conversation(tok, conv)


def test_user_turn_prefix():
    tok = _build_tiny_tokenizer("chatml")
    prefix, suffix = user_turn_prefix(tok)
    assert prefix == "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
    assert suffix.startswith("<|im_end|>")
    assert user_turn_prefix(tok, "Ask about cooking.")[0] == (
        "<|im_start|>system\nAsk about cooking.<|im_end|>\n<|im_start|>user\n")
    llama = _build_tiny_tokenizer("llama3")
    assert user_turn_prefix(llama)[0] == "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n"


def test_filter_drops_and_counts_duplicates():
    f = synth.PromptFilter(threshold=0.7, min_chars=10)
    texts = ["Write a poem about the sea.", "write a poem about the SEA!", "Write a poem about the sea, please.",
             "Explain how rainbows form in the sky.", "", "hi", "Explain how rainbows form in the sky above us?",
             "What is the capital city of France?"]
    assert [f.check(t) for t in texts] == [None, "duplicate", "near_duplicate", None, "empty", "too_short",
                                           "near_duplicate", None]


def test_the_minhash_estimate_skips_only_comparisons_that_would_not_match(monkeypatch):
    """Exact Jaccard comparisons only for candidates whose MinHash estimate is near the threshold: on templated prompts
    (many pairs at 0.3-0.7) the same decisions as comparing every candidate, with fewer comparisons."""
    import random

    rng = random.Random(0)
    texts = [f"Write a {rng.choice(['Python', 'Rust', 'Go'])} function that {rng.choice(['sorts', 'merges', 'parses'])} "
             f"{rng.choice(['a list', 'a CSV file', 'a tree', 'a string'])}{rng.choice(['', ' quickly', ' with tests'])}. "
             f"{rng.randint(0, 999)}" for _ in range(1500)]
    calls, real = [0], np.intersect1d

    def counted(*a, **k):
        calls[0] += 1
        return real(*a, **k)

    monkeypatch.setattr(synth.np, "intersect1d", counted)
    decisions = {}
    for margin in (1.0, synth.MINHASH_MARGIN):   # 1.0: every candidate compared
        monkeypatch.setattr(synth, "MINHASH_MARGIN", margin)
        f, calls[0] = synth.PromptFilter(), 0
        decisions[margin] = ([f.check(t) for t in texts], calls[0])
    (every, every_calls), (estimated, estimated_calls) = decisions.values()
    assert estimated == every and every.count("near_duplicate") > 500
    assert estimated_calls < every_calls   # (the figures at 50k: scripts/bench_dedup.py)


POOL = ["How do I sort a list in Python?", "how do i sort a list in python", "How do I sort a list in Python, quickly?",
        "Write a haiku about autumn leaves.", "What causes the seasons on Earth?", "", "Explain recursion to a child.",
        "Give me three tips for a job interview.", "Why is the sky blue during the day?", "Translate 'good night' into German.",
        "Suggest a name for a black cat.", "What is the boiling point of water at altitude?", "Summarise the plot of Hamlet.",
        "How many legs does a spider have?", "Plan a three-day trip to Rome.", "Write a limerick about a frog."]


@pytest.fixture
def fake_generate(monkeypatch):
    """Stands in for data.regenerate.stream: picks pool texts with each row's own generator. It takes up to ``rows``
    queued prompts at a time and finishes them last first (out of order, like real answers of different lengths).
    Returns the prompts it was given by batch (``{batch: [ids, ...]}``)."""
    calls, tok = {}, _build_tiny_tokenizer("chatml")  # the tiny targets' byte-level tokenizer

    def fake(model, queue, rows, refill, max_new_tokens, eos_ids, pad_id, temperature, top_p, generator):
        while queue:
            running = [queue.popleft() for _ in range(min(rows, len(queue)))]
            for (b, _), ids in running:
                calls.setdefault(b, []).append(ids)
            for job, _ in reversed(running):
                pick = int(torch.randint(len(POOL), (1,), generator=generator(job)))
                yield [(job, Answer(tok(POOL[pick], add_special_tokens=False)["input_ids"], True))]

    monkeypatch.setattr(synth, "stream", fake)
    return calls


class FakeModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.generation_config = None


def writer(model: torch.nn.Module) -> synth.TargetWriter:
    return synth.TargetWriter(lambda: model, rows=8, refill=2)  # two batches (batch_size 4) at once


def batches_in(path) -> dict[int, list[dict]]:
    """The batches a synth cache holds (its part files' too)."""
    return synth.BatchFiles(path).refresh()


def settings(**kw):
    return synth.settings({"type": "synth", "batch_size": 4, "min_chars": 5, **kw}, seed=0)


def test_synth_is_seeded_per_prompt_and_batched_continuously_on_the_real_target(tiny_qwen2_cfg, tmp_path):
    """The rows of several batches decode together (more rows per pass than a batch has), and each prompt is seeded
    on its own: the same prompts whatever decodes beside them (one batch's rows at a time, or three batches'),
    other prompts with another seed."""
    model, tok = load_target(tiny_qwen2_cfg), load_tokenizer(tiny_qwen2_cfg)
    widths = []
    model.register_forward_pre_hook(lambda _, args: widths.append(args[0].shape[0]))  # stream passes the ids first
    s = settings(n=12, max_new_tokens=6, max_attempts=12, min_chars=1)
    runs = {}
    for name, rows in (("alone", 4), ("together", 12)):
        widths.clear()
        synth.synthesize(synth.TargetWriter(lambda: model, rows=rows, refill=1), tok, s, tmp_path / f"{name}.jsonl")
        runs[name] = (batches_in(tmp_path / f"{name}.jsonl"), max(widths))
    assert runs["alone"][1] == 4 and runs["together"][1] == 12
    assert len(runs["alone"][0]) == 3 and runs["alone"][0] == runs["together"][0]
    synth.synthesize(writer(model), tok, {**s, "seed": 1}, tmp_path / "c.jsonl")
    assert batches_in(tmp_path / "c.jsonl") != runs["alone"][0]


def test_a_batch_comes_back_in_prompt_order_whatever_order_its_rows_finish(fake_generate):
    """The fake finishes rows last first: each batch's outputs are still its prompts' answers, in prompt order
    (the categories, cycled by position, depend on it), each row drawing from its own seed."""
    from data.engines import request_seed

    tok, s = _build_tiny_tokenizer("chatml"), settings(n=8)
    w = writer(FakeModel())
    prompts = [[1 + b, 2 + k] for b in range(3) for k in range(4)]
    got = dict(w([(b, prompts[4 * b:4 * b + 4]) for b in range(3)], tok, set(), s))
    assert sorted(got) == [0, 1]   # the rows of two batches at a time (rows=8): batch 2 is still queued
    got.update(w([(2, prompts[8:])], tok, set(), s))
    for b in range(3):
        expected = [POOL[int(torch.randint(len(POOL), (1,), generator=torch.Generator().manual_seed(
            request_seed(s["seed"], f"synth-{b}", k))))].strip() for k in range(4)]
        assert [o["text"] for o in got[b]] == expected
    assert [ids for b in range(3) for ids in fake_generate[b]] == prompts


def test_per_row_sampling_follows_the_distribution_and_ignores_the_rows_beside(monkeypatch):
    from data.regenerate import next_tokens

    probs = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    logits = probs.log().expand(4000, -1)   # log 0 = -inf: a true zero
    gens = [torch.Generator().manual_seed(i) for i in range(4000)]
    picks = next_tokens(logits, 1.0, 1.0, gens)
    freq = torch.bincount(picks, minlength=5) / 4000
    assert (freq - probs).abs().max() < 0.03 and freq[4] == 0
    assert set(next_tokens(logits[:500], 1.0, 0.6, gens[:500]).tolist()) == {0, 1}   # top-p keeps 0.5 + 0.3
    # Each row draws from its own generator only: 64 rows together pick what each picks alone.
    together = next_tokens(logits[:64], 1.0, 1.0, [torch.Generator().manual_seed(s) for s in range(64)])
    alone = [next_tokens(logits[:1], 1.0, 1.0, [torch.Generator().manual_seed(s)]).item() for s in range(64)]
    assert together.tolist() == alone and len(set(alone)) > 1
    # The draw's ends: u = 0 never picks a zero-probability first token, u -> 1 never a zero-probability last one.
    edge = torch.tensor([[0.0, 0.6, 0.4, 0.0]]).log()
    for u, token in ((0.0, 1), (1 - 2 ** -53, 2)):
        monkeypatch.setattr(torch, "rand", lambda *a, u=u, **k: torch.full((1,), u, dtype=torch.float64))
        assert next_tokens(edge, 1.0, 1.0, [torch.Generator()]).item() == token


def test_synth_dedups_resumes_and_counts_calls(fake_generate, tmp_path):
    tok = _build_tiny_tokenizer("chatml")
    model = FakeModel()
    fresh, fresh_stats = synth.synthesize(writer(model), tok, settings(n=10), tmp_path / "fresh.jsonl")
    assert len(fresh) == 10 and len({synth._normalise(p["prompt"]) for p in fresh}) == 10
    dropped = fresh_stats["dropped"]
    assert sum(dropped.values()) + 10 == fresh_stats["attempts"] and dropped.get("duplicate", 0) > 0
    assert fresh_stats["near_duplicate_rate"] == round(dropped.get("near_duplicate", 0) / fresh_stats["attempts"], 4)
    assert len(fake_generate) == fresh_stats["batches_generated"]

    # Interrupted after a few prompts (a smaller n), then a crash tears a line; the rerun with n=10 replays
    # the cached batches and generates only the missing ones, and gets the uninterrupted run's prompts.
    path = tmp_path / "resumed.jsonl"
    fake_generate.clear()
    first, st = synth.synthesize(writer(model), tok, settings(n=3), path)
    assert first == fresh[:3] and st["batches_generated"] == len(fake_generate) == len(batches_in(path))
    with open(path, "a") as f:
        f.write('{"batch": 99, "outp')
    before = len(batches_in(path))
    fake_generate.clear()
    again, st = synth.synthesize(writer(model), tok, settings(n=10), path)
    assert again == fresh and st["batches_cached"] == before
    assert len(fake_generate) == fresh_stats["batches_generated"] - before == st["batches_generated"]
    assert len(batches_in(path)) == fresh_stats["batches_generated"]
    # A complete cache: nothing is generated, and the model is not even loaded.
    fake_generate.clear()
    assert synth.synthesize(synth.TargetWriter(lambda: pytest.fail("loaded")), tok, settings(n=10), path)[0] == fresh
    assert not fake_generate


def test_ranks_write_the_batches_together_and_keep_what_one_process_keeps(fake_generate, tmp_path):
    """Two ranks (threads here; DeepSpeed ranks in the slow tier): rank r generates the batches b = r mod 2 into
    its own part file, each filters all of them in order: both keep what one process keeps. A rerun in one
    process replays the parts and generates nothing."""
    import threading

    tok, model = _build_tiny_tokenizer("chatml"), FakeModel()
    alone, alone_stats = synth.synthesize(writer(model), tok, settings(n=10), tmp_path / "alone.jsonl")
    path, results = tmp_path / "two.jsonl", {}

    def rank(r: int) -> None:
        results[r] = synth.synthesize(writer(model), tok, settings(n=10), path, rank=r, world=2)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results[0][0] == results[1][0] == alone
    parts = [{row["batch"] for row in read_jsonl(synth.part_file(path, r))} for r in (0, 1)]
    assert parts[0] and parts[1] and all(b % 2 == r for r in (0, 1) for b in parts[r])
    assert set(range(alone_stats["batches_generated"])) <= parts[0] | parts[1]
    fake_generate.clear()
    assert synth.synthesize(writer(model), tok, settings(n=10), path)[0] == alone and not fake_generate


def test_a_rank_waiting_for_a_batch_of_a_rank_that_stopped_beating_stops(fake_generate, tmp_path):
    """Rank 0 of 2 needs rank 1's batches (b = 1 mod 2); rank 1 never beats (killed on another node, where no
    launcher sees it): rank 0 stops once its heartbeat is stale, naming the rank, instead of waiting forever. Its own
    batches stay in its part file."""
    from tests.conftest import make_cfg
    from train.stages import ALIVE, FAILED, stage_dir

    tok, model = _build_tiny_tokenizer("chatml"), FakeModel()
    cfg = make_cfg([f"output_root={tmp_path}"])
    stage_dir(cfg, "data").mkdir(parents=True)
    path, start = tmp_path / "two.jsonl", time.monotonic()
    with pytest.raises(synth.DataError, match=rf"rank 1 stopped writing its synth batches: its heartbeat "
                                              rf".*{ALIVE}.rank1 has not changed for 1 s"):
        synth.synthesize(writer(model), tok, settings(n=10), path, rank=0, world=2,
                         stalled=synth.rank_pulses(cfg, 0, 2, stale_s=1.0))
    assert time.monotonic() - start < 30
    assert {row["batch"] for row in read_jsonl(synth.part_file(path, 0))} >= {0}
    # rank 1 waiting on rank 0, which raised (its error in the data stage's _failed.json): stops at once, not after
    # the stale limit
    (stage_dir(cfg, "data") / FAILED).write_text(json.dumps({"error": "RuntimeError('CUDA error')"}))
    with pytest.raises(synth.DataError, match=r"rank 0 failed \(RuntimeError\('CUDA error'\)\)"):
        synth.synthesize(writer(model), tok, settings(n=10), tmp_path / "three.jsonl", rank=1, world=2,
                         stalled=synth.rank_pulses(cfg, 1, 2))


def test_two_runs_side_by_side_share_the_cache(fake_generate, tmp_path):
    """Two heads of one target started side by side (two processes on one cache file; threads here): the second
    waits for the first's lock, then replays what it wrote: every batch is generated once."""
    import threading

    tok, model = _build_tiny_tokenizer("chatml"), FakeModel()
    alone, alone_stats = synth.synthesize(writer(model), tok, settings(n=10), tmp_path / "alone.jsonl")
    fake_generate.clear()
    results = {}
    threads = [threading.Thread(target=lambda r=r: results.__setitem__(r, synth.synthesize(
        writer(model), tok, settings(n=10), tmp_path / "shared.jsonl"))) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results[0][0] == results[1][0] == alone
    assert len(fake_generate) == alone_stats["batches_generated"]


def test_synth_batches_are_heartbeat_progress(fake_generate, tmp_path):
    """Every batch, generated or replayed, advances the progress steps the heartbeats carry: ranks waiting on a
    rank-0-only data stage (vllm/openai backends) stopped after hang_minutes of a long synth as on a hung rank."""
    from train.log import STEPS

    tok, model = _build_tiny_tokenizer("chatml"), FakeModel()
    before = STEPS[0]
    _, st = synth.synthesize(writer(model), tok, settings(n=10), tmp_path / "s.jsonl")
    assert STEPS[0] - before >= st["batches_generated"] > 0
    before = STEPS[0]
    synth.synthesize(writer(model), tok, settings(n=10), tmp_path / "s.jsonl")   # all replayed
    assert STEPS[0] - before >= st["batches_generated"]


def test_synth_hints_cycle_and_steer_the_prefix(fake_generate, tmp_path):
    tok = _build_tiny_tokenizer("chatml")
    hints = [{"category": "code", "hint": "The user asks about code."}, {"category": "travel", "hint": "Travel."}]
    kept, stats = synth.synthesize(writer(FakeModel()), tok, settings(n=6, hints=hints), tmp_path / "h.jsonl")
    prompts = fake_generate[0]
    assert tok.decode(prompts[0]).endswith("The user asks about code.<|im_end|>\n<|im_start|>user\n")
    assert tok.decode(prompts[1]).endswith("Travel.<|im_end|>\n<|im_start|>user\n")
    assert all(p["category"] == ("code", "travel")[int(p["id"].split("-")[1]) % 2] for p in kept)
    assert set(stats["categories"]) <= {"code", "travel"}
    with pytest.raises(synth.DataError, match="unknown keys"):
        synth.settings({"type": "synth", "nn": 3}, 0)


def test_synth_source_through_the_data_stage(fake_generate, cfg_factory, tmp_path, monkeypatch):
    """The prompts written, then answered, by the target loaded once (twice was 1-2 min per rank at 8B)."""
    import train.target

    loads, load = [], train.target.load_target
    monkeypatch.setattr(train.target, "load_target", lambda *a, **k: loads.append(1) or load(*a, **k))
    cfg = cfg_factory("model=tiny-qwen2", "stages=[data]", "data.regen.max_new_tokens=4", "head.draft_vocab_size=40",
                      "data.sources=[{type:synth,n:6,batch_size:4,min_chars:5}]", "data.thinking=false")
    run_stages(cfg)
    stats = json.loads((tmp_path / "tiny-qwen2/eagle3/data/stats.json").read_text())
    st = stats["synth"]["synth"]
    assert st["kept"] == 6 and stats["rows_read"] == 6 and sum(stats["rows_kept"].values()) == 6
    assert stats["regeneration"]["generated"] == 6 and len(loads) == 1
    for key in ("distinct_1", "distinct_2", "near_duplicate_rate", "duplicate_rate", "words_histogram", "file"):
        assert key in st
    assert 0 < st["distinct_1"] <= 1 and sum(st["words_histogram"].values()) == 6
    assert len(batches_in(tmp_path.joinpath(st["file"]))) == st["batches_generated"] > 0


def pool_answers(tok, fallback=None):
    """A server's answer to a request: a sampled one (temperature > 0, a synth prompt) is a POOL text picked by the
    request's seed, as a seeded sampler would; a greedy one is ``fallback``'s (regeneration)."""
    import random

    def answer(body: dict) -> tuple[list[int], bool]:
        if body["temperature"] > 0:
            return tok(random.Random(body["seed"]).choice(POOL), add_special_tokens=False)["input_ids"], True
        return fallback(body)
    return answer


def test_synth_through_a_server_is_seeded_concurrent_and_resumes(tmp_path):
    """The vllm/openai backends write synth prompts through the server: the chat template's user-turn prefix as
    token ids, the synth settings and its end-of-turn among the stop ids, one seed per request; the requests of
    several batches in flight at once; the same seed gives the same prompts, a rerun asks nothing."""
    from data.engines import OpenAIClient
    from tests.test_regen_backends import Stub

    tok = _build_tiny_tokenizer("chatml")
    held = []

    def until_five_in_flight(body: dict) -> float:  # the first requests are held until 5 are in flight, or 10 s
        if not held:
            deadline = time.monotonic() + 10
            while stub.in_flight < 5 and time.monotonic() < deadline:
                time.sleep(0.01)
            held.append(stub.in_flight >= 5)
        return 0.0

    stub = Stub(None, 0, text=lambda ids: tok.decode(ids, skip_special_tokens=True), delay_s=until_five_in_flight,
                answer=pool_answers(tok))
    try:
        def run(path, **kw):
            return synth.synthesize(synth.ServerWriter(OpenAIClient(stub.url, None, 30, 0, 8), None), tok,
                                    settings(n=10, **kw), path)
        kept, st = run(tmp_path / "a.jsonl")
        asked = list(stub.requests)
        assert len(kept) == 10 and len({synth._normalise(p["prompt"]) for p in kept}) == 10
        assert st["dropped"].get("duplicate", 0) > 0 and len(asked) == 4 * st["batches_generated"]
        prefix, _ = user_turn_prefix(tok, None)
        end_of_turn = tok.convert_tokens_to_ids("<|im_end|>")
        assert all(r["prompt"] == tok(prefix, add_special_tokens=False)["input_ids"] for r in asked)
        assert all(r["max_tokens"] == 128 and r["temperature"] == 1.0 and end_of_turn in r["stop_token_ids"]
                   for r in asked)
        assert len({r["seed"] for r in asked}) == len(asked)
        assert held[0] and stub.most_in_flight > 4  # more than one batch of 4 in flight (concurrency 8: two at once)
        stub.requests.clear()
        assert run(tmp_path / "a.jsonl")[0] == kept and not stub.requests  # replayed from the cache
        assert run(tmp_path / "b.jsonl")[0] == kept                        # the same seed: the same prompts
        assert run(tmp_path / "c.jsonl", seed=1)[0] != kept
    finally:
        stub.close()


def test_a_slow_answer_does_not_idle_the_server(tmp_path):
    """The window slides: while the first batch's first request takes 2 s, the requests of later batches go on
    (twice as many batches as fill the concurrency are asked ahead), where rounds of batches would wait for it;
    and the prompts kept are those of a server that answers in order."""
    from data.engines import OpenAIClient
    from tests.test_regen_backends import Stub

    tok = _build_tiny_tokenizer("chatml")
    first, made = {}, {}

    def delay(body: dict) -> float:  # the first request is held until 12 more have come, or 30 s
        if first.setdefault("seed", body["seed"]) == body["seed"]:
            deadline = time.monotonic() + 30
            while len(made["stub"].arrived) < 13 and time.monotonic() < deadline:
                time.sleep(0.01)
            first["others"] = len(made["stub"].arrived) - 1
        return 0.0

    def run(path, **kw):
        stub = made["stub"] = Stub(None, 0, text=lambda ids: tok.decode(ids, skip_special_tokens=True),
                                   answer=pool_answers(tok), **kw)
        try:
            return synth.synthesize(synth.ServerWriter(OpenAIClient(stub.url, None, 30, 0, 8), None), tok,
                                    settings(n=20), path)[0], stub
        finally:
            stub.close()

    kept, stub = run(tmp_path / "slow.jsonl", delay_s=delay)
    assert first["others"] >= 12  # 3 more batches of 4 (rounds of 2 batches waiting for their slowest: 7 more requests)
    assert kept == run(tmp_path / "even.jsonl")[0]


def test_a_synth_request_that_fails_keeps_the_batches_before_it(tmp_path):
    """The server fails in the third batch: the two before it are in the cache, the error names the server, and the
    rerun asks only for the rest and keeps what an uninterrupted run keeps."""
    from data.engines import OpenAIClient, RegenError
    from tests.test_regen_backends import Stub

    tok = _build_tiny_tokenizer("chatml")

    def run(path, **kw):
        stub = Stub(None, 0, text=lambda ids: tok.decode(ids, skip_special_tokens=True), answer=pool_answers(tok), **kw)
        try:
            return synth.synthesize(synth.ServerWriter(OpenAIClient(stub.url, None, 30, 0, 4), None), tok,
                                    settings(n=10), path), stub
        finally:
            stub.close()

    (alone, alone_stats), _ = run(tmp_path / "alone.jsonl")
    with pytest.raises(RegenError, match="HTTP 500 .*boom"):
        run(tmp_path / "s.jsonl", fail_after=9)
    assert sorted(batches_in(tmp_path / "s.jsonl")) == [0, 1]
    (again, st), stub = run(tmp_path / "s.jsonl")
    assert again == alone and st["batches_cached"] == 2
    assert len(stub.requests) == 4 * (alone_stats["batches_generated"] - 2)


def test_a_server_backend_writes_synth_and_answers_without_loading_the_target(cfg_factory, tmp_path, monkeypatch):
    """data.regen.backend=openai: the synth prompts and their answers both come from the server, and the data stage
    never loads the target (on 8 GPUs it would hold a 7-8B copy beside the server's, and write every prompt through
    transformers on one GPU)."""
    import train.target
    from tests.test_regen_backends import Stub

    cfg = cfg_factory("model=tiny-llama", "stages=[data]", "data.regen.max_new_tokens=8", "head.draft_vocab_size=64",
                      "data.sources=[{type:synth,n:6,batch_size:4,min_chars:5}]", "data.regen.dtype=float32")
    model, tok = load_target(cfg), load_tokenizer(cfg)
    stub = Stub(model, tok.pad_token_id, text=lambda ids: tok.decode(ids, skip_special_tokens=True))
    stub.answer = pool_answers(tok, stub.generate)
    monkeypatch.setattr(train.target, "load_target", lambda *a, **k: pytest.fail("the target was loaded"))
    try:
        cfg = cfg_factory("model=tiny-llama", "stages=[data]", "data.regen.max_new_tokens=8", "head.draft_vocab_size=64",
                          "data.sources=[{type:synth,n:6,batch_size:4,min_chars:5}]", "data.regen.backend=openai",
                          f"data.regen.url={stub.url}")
        run_stages(cfg)
    finally:
        stub.close()
    stats = json.loads((tmp_path / "tiny-llama/eagle3/data/stats.json").read_text())
    assert stats["synth"]["synth"]["kept"] == 6 and stats["regeneration"]["generated"] == 6
    assert sum(stats["rows_kept"].values()) == 6
    sampled = [r for r in stub.requests if r["temperature"] > 0]
    assert len(sampled) == 4 * stats["synth"]["synth"]["batches_generated"] and len(stub.requests) > len(sampled)


def test_a_vllm_data_stage_with_everything_cached_starts_no_server(fake_generate, cfg_factory, tmp_path):
    """vLLM starts at the first request, not with the data stage: a rerun whose synth prompts and answers are all
    cached (a forced or reconfigured data stage) starts no server (minutes and a GPU's memory for a 7-8B target);
    here no vLLM exists, and the stage still completes."""
    base = ["model=tiny-qwen2", "stages=[data]", "data.regen.max_new_tokens=4", "head.draft_vocab_size=40",
            "data.sources=[{type:synth,n:6,batch_size:4,min_chars:5}]", "data.thinking=false"]
    run_stages(cfg_factory(*base))
    fake_generate.clear()
    run_stages(cfg_factory(*base, "force=[data]", "data.regen.backend=vllm", "data.regen.vllm.python=/nonexistent/python"))
    stats = json.loads((tmp_path / "tiny-qwen2/eagle3/data/stats.json").read_text())
    assert stats["regeneration"]["backend"] == "vllm" and stats["regeneration"]["generated"] == 0
    assert stats["regeneration"]["server_log"] is None and stats["synth"]["synth"]["batches_generated"] == 0
    assert not fake_generate


def test_a_written_prompt_holding_a_template_token_is_dropped(monkeypatch, tmp_path):
    """A target continuing the chat template (`<|im_start|>assistant ...`, Qwen3's `<think>`) writes no user question;
    decoding drops special tokens from the text, so the text alone cannot tell: the ids do."""
    tok = _build_tiny_tokenizer("chatml")
    marker = tok.convert_tokens_to_ids("<|im_start|>")

    def fake(model, queue, rows, refill, max_new_tokens, eos_ids, pad_id, temperature, top_p, generator):
        while queue:
            job, _ = queue.popleft()
            ids = tok(POOL[(4 * job[0] + job[1]) % len(POOL)], add_special_tokens=False)["input_ids"]
            yield [(job, Answer(([marker] if job[1] % 2 else []) + ids, True))]

    monkeypatch.setattr(synth, "stream", fake)
    kept, stats = synth.synthesize(writer(FakeModel()), tok, settings(n=4), tmp_path / "c.jsonl")
    assert len(kept) == 4 and stats["dropped"]["template_token"] >= 4
    assert all(int(p["id"].rsplit("-", 1)[1]) % 2 == 0 for p in kept)   # only the rows written without a marker


def test_template_markers_are_special_tokens_or_the_templates_own():
    """A marker: a special added token, or an added token the chat template writes (Qwen3's <think>); not an added
    token of plain text (Gemma lists newlines and runs of spaces), nor the stop the answer ended on."""
    from tokenizers import AddedToken

    tok = _build_tiny_tokenizer("chatml")
    tok.add_tokens([AddedToken("\n\n", special=False), AddedToken("<think>", special=False)])
    tok.chat_template = tok.chat_template + "{% if false %}<think>{% endif %}"
    ids = tok("How do I sort a list?", add_special_tokens=False)["input_ids"]
    eos = {tok.convert_tokens_to_ids("<|im_end|>")}
    for token, marks in (("\n\n", False), ("<think>", True), ("<|im_start|>", True), ("<|im_end|>", False)):
        assert synth.marks_template(ids + [tok.convert_tokens_to_ids(token)], tok, eos) is marks, token


def test_two_synth_sources_writing_the_same_prompts_are_refused(fake_generate, cfg_factory):
    """The same settings and seed write the same prompts: a second source (say, for validation) would get the
    first's and see them dropped as duplicates. Refused, naming the seed; with its own seed it runs."""
    base = ["model=tiny-qwen2", "stages=[data]", "data.regen.max_new_tokens=4", "head.draft_vocab_size=40",
            "data.thinking=false"]
    two = "{type:synth,n:4,batch_size:4,min_chars:5},{type:synth,name:held,split:validation,n:2,batch_size:4,min_chars:5"
    with pytest.raises(DataError, match=r"synth sources 'synth' and 'held' would write the same prompts.*own seed"):
        run_stages(cfg_factory(*base, f"data.sources=[{two}}}]"))
    run_stages(cfg_factory(*base, f"data.sources=[{two},seed:1}}]", "force=[data]"))
