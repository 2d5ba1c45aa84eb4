"""Prompts written by the target itself (Magpie-style): the ``synth`` data source.

``data.sources: [{type: synth, n: N}]``: the target's own chat template is rendered up to where a user
turn's content starts (``data.template.user_turn_prefix``: a sentinel user message, cut before it; e.g.
ChatML ``<|im_start|>system\\n...<|im_end|>\\n<|im_start|>user\\n``) and the target continues it; the
text up to its end-of-turn token is a prompt. Optional ``hints: [{category, hint}]`` replace the system
turn of that prefix to steer topics (cycled over the attempts). The regeneration backend writes them
(temperature/top-p sampling), the prompts of several batches at once, one seed per prompt from (seed, batch,
index): ``hf``, the target in this process (:class:`TargetWriter`, continuously batched); ``vllm`` and ``openai``,
the data stage's server (:class:`ServerWriter`, the prompts in flight as requests). The same seed and backend
give the same prompts, and a resumed run the prompts an uninterrupted one gets, up to rounding with ``hf``: which
rows decode together (it changes with a resume, the rank count or ``data.regen.batch_size``) changes the logits'
last bits, and a draw that lands on a boundary with them.

Filtering, in attempt order: ``truncated`` (no end-of-turn within max_new_tokens), ``empty``,
``too_short`` (< min_chars), ``duplicate`` (equal normalised text), ``near_duplicate`` (character
5-gram Jaccard >= ``near_duplicate`` with a kept prompt; candidates found by MinHash-LSH, then checked
exactly). The first ``n`` kept prompts are the source's rows; they are prompt-only conversations whose
answers the data stage regenerates.

Resume: every generated batch is one line appended to a cache file (flushed and fsync'd) keyed by the
target and the generation settings, not by ``n``: a rerun, or a larger ``n``, replays the cached
batches through the filter and generates only the batches after them (whichever backend wrote them: both
sample the target with the same settings). Line:
``{"batch": b, "outputs": [{"text", "category", "tokens", "hit_eos"}, ...]}`` (a line torn by a crash is sealed by
a newline, then ignored).

Under a launcher (``hf`` regeneration: every rank reads the sources) the ranks write the batches together:
rank r generates the batches b = r mod world into its own part file (``<cache>.part<r>.jsonl``), running at
most ``LOOKAHEAD`` rounds (or its writer's window, if larger) ahead of the batches every rank has, and each rank
filters the same batches in batch order: the same prompts on every rank (as one process, up to rounding). A rerun
on any rank count reads the cache and every part file.
"""

from __future__ import annotations

import concurrent.futures as futures
import functools
import hashlib
import json
import os
import re
import statistics
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from contextlib import closing
from pathlib import Path

import numpy as np
import torch
from filelock import FileLock

from data.formats import DataError, appending
from data.regenerate import Answer, check_snapshot, eos_ids, found_cache, refill_rows, request_seed, stream
from data.template import user_turn_prefix
from train import dist
from train.log import log, progress

DEFAULTS = {
    "n": 100,               # prompts wanted (kept after filtering)
    "batch_size": 32,       # attempts per batch: the unit cached, filtered in order, and shared out among ranks
    "max_new_tokens": 128,  # per prompt; longer ones are dropped as truncated
    "temperature": 1.0,
    "top_p": 1.0,
    "seed": None,           # None: the run's seed
    "hints": [],            # [{category, hint}]: system turns steering the topic, cycled
    "near_duplicate": 0.7,  # Jaccard of character 5-grams at or above which a prompt is a near-duplicate
    "min_chars": 10,        # shorter prompts are dropped
    "max_attempts": None,   # None: 4 x n + batch_size (stops a target that keeps repeating itself)
}
HIST_BINS = (1, 5, 10, 20, 40, 80, 160)
MINHASH_MARGIN = 0.2  # candidates whose MinHash estimate is this far below the threshold are not compared exactly
LOOKAHEAD = 2  # rounds of batches a rank may generate ahead of the first batch not yet written by any


def _normalise(text: str) -> str:
    return re.sub(r"\W+", " ", text.lower()).strip()


class PromptFilter:
    """Exact (normalised) and near-duplicate (character n-gram Jaccard, MinHash-LSH candidates) filter."""

    def __init__(self, threshold: float = 0.7, min_chars: int = 10, ngram: int = 5, bands: int = 16, rows: int = 4):
        self.threshold, self.min_chars, self.ngram, self.bands, self.rows = threshold, min_chars, ngram, bands, rows
        rng = np.random.default_rng(0)
        # Multiply-shift hashing mod 2**64 (odd 64-bit multipliers; the top 32 bits of the wrapped product).
        self.a = rng.integers(0, 2**64, bands * rows, dtype=np.uint64, endpoint=False) | np.uint64(1)
        self.b = rng.integers(0, 2**64, bands * rows, dtype=np.uint64, endpoint=False)
        self.exact: set[str] = set()
        self.shingles: list[np.ndarray] = []  # per kept prompt: its n-grams' sorted 64-bit hashes (8 bytes each)
        self.signatures = np.empty((0, bands * rows), dtype=np.uint64)   # per kept prompt (rows past len: free)
        self.buckets: dict[tuple, list[int]] = {}

    def _shingles(self, norm: str) -> np.ndarray:
        """The distinct character n-grams of ``norm`` as sorted 64-bit hashes (a set of strings took ~50 KB a
        prompt: GBs at 200k prompts)."""
        n = self.ngram
        grams = {norm[i: i + n] for i in range(len(norm) - n + 1)} if len(norm) > n else {norm}
        return np.unique(np.array([int.from_bytes(hashlib.blake2b(g.encode(), digest_size=8).digest(), "little")
                                   for g in grams], dtype=np.uint64))

    def _signature(self, x: np.ndarray) -> np.ndarray:
        return ((self.a[:, None] * x[None, :] + self.b[:, None]) >> np.uint64(32)).min(1)  # wraps mod 2**64

    def check(self, text: str) -> str | None:
        """None and remember ``text`` when it is kept, else the reason it is dropped."""
        if not text.strip():
            return "empty"
        if len(text.strip()) < self.min_chars:
            return "too_short"
        norm = _normalise(text)
        if norm in self.exact:
            return "duplicate"
        shingles = self._shingles(norm)
        sig = self._signature(shingles)
        keys = [(band, sig[band * self.rows: (band + 1) * self.rows].tobytes()) for band in range(self.bands)]
        candidates = np.fromiter({j for k in keys for j in self.buckets.get(k, ())}, dtype=np.int64)
        # The signatures' agreement estimates each candidate's Jaccard (std ~0.06 at 64 hashes): only those within
        # MINHASH_MARGIN of the threshold are compared exactly, likeliest first (templated prompts made every candidate
        # an exact comparison: ~170 per prompt at 50k, the filter's whole cost)
        estimate = (self.signatures[candidates] == sig).mean(1)
        order = np.argsort(-estimate, kind="stable")   # the likeliest first: a near-duplicate is found at once
        for j in candidates[order][estimate[order] >= self.threshold - MINHASH_MARGIN]:
            other = self.shingles[j]
            common = np.intersect1d(shingles, other, assume_unique=True).size
            if common / (shingles.size + other.size - common) >= self.threshold:
                return "near_duplicate"
        self.exact.add(norm)
        self.shingles.append(shingles)
        if len(self.shingles) > len(self.signatures):
            self.signatures = np.resize(self.signatures, (2 * len(self.shingles), sig.size))
        self.signatures[len(self.shingles) - 1] = sig
        for k in keys:
            self.buckets.setdefault(k, []).append(len(self.shingles) - 1)
        return None


def diversity(prompts: list[str], tokenizer=None) -> dict:
    """distinct-1/2 (unique / total word n-grams), word-length histogram and mean tokens of ``prompts``."""
    words = [p.lower().split() for p in prompts]
    uni = [w for ws in words for w in ws]
    bi = [tuple(ws[i: i + 2]) for ws in words for i in range(len(ws) - 1)]
    lengths = [len(ws) for ws in words]
    edges = [*HIST_BINS, float("inf")]
    hist = {(f"{lo}-{hi - 1}" if hi != float("inf") else f"{lo}+"): sum(lo <= n < hi for n in lengths)
            for lo, hi in zip(edges[:-1], edges[1:], strict=True)}
    out = {
        "distinct_1": round(len(set(uni)) / max(len(uni), 1), 4),
        "distinct_2": round(len(set(bi)) / max(len(bi), 1), 4),
        "words_mean": round(statistics.fmean(lengths), 1) if lengths else 0.0,
        "words_median": statistics.median(lengths) if lengths else 0,
        "words_histogram": hist,
    }
    if tokenizer is not None and prompts:
        out["tokens_mean"] = round(statistics.fmean(len(tokenizer(p, add_special_tokens=False)["input_ids"])
                                                    for p in prompts), 1)
    return out


def settings(source: dict, seed: int) -> dict:
    """The source's settings with defaults; unknown keys are an error."""
    known = {*DEFAULTS, "type", "name", "split", "limit", "format"}
    unknown = sorted(set(source) - known)
    if unknown:
        raise DataError(f"synth source: unknown keys {unknown} (known: {sorted(known)})")
    s = {**DEFAULTS, **{k: v for k, v in source.items() if k in DEFAULTS}}
    s["seed"] = seed if s["seed"] is None else s["seed"]
    s["hints"] = [dict(h) for h in s["hints"] or []]
    for h in s["hints"]:
        if not h.get("hint") or not h.get("category"):
            raise DataError(f"synth source: each hint needs category and hint, got {h}")
    if s["max_attempts"] is None:
        s["max_attempts"] = 4 * s["n"] + s["batch_size"]
    return s


def cache_file(directory: str | Path, target_fp: str, s: dict, as_written: bool = False) -> Path:
    """Keyed by the target and everything that changes the generated text, not by n; temperature and top-p by value
    (``as_written``: as the source writes them, the key before 2026-12-07)."""
    digest = hashlib.sha256(json.dumps([target_fp, synth_settings(s, as_written)], sort_keys=True).encode()).hexdigest()
    return Path(directory) / f"{digest[:16]}.jsonl"


def synth_settings(s: dict, as_written: bool = False) -> dict:
    """What names a cache of prompts beside the target (:func:`cache_file`)."""
    key = {k: s[k] for k in ("batch_size", "max_new_tokens", "temperature", "top_p", "seed", "hints")}
    if not as_written:
        key.update(temperature=float(key["temperature"]), top_p=float(key["top_p"]))
    return key


def part_file(path: Path, rank: int) -> Path:
    return path.with_name(f"{path.stem}.part{rank}.jsonl")


class BatchFiles:
    """The batches written so far to a synth cache and its part files (ranks of this or an earlier run), read
    incrementally: each file's complete lines after the ones already read (the files are only appended to)."""

    def __init__(self, path: Path):
        self.path, self.offsets, self.batches = path, {}, {}

    def refresh(self) -> dict[int, list[dict]]:
        for file in [self.path, *sorted(self.path.parent.glob(f"{self.path.stem}.part*.jsonl"))]:
            if not file.exists():
                continue
            with open(file, "rb") as f:
                f.seek(self.offsets.get(file, 0))
                data = f.read()
            end = data.rfind(b"\n") + 1  # complete lines only: a rank may be writing the next one
            self.offsets[file] = self.offsets.get(file, 0) + end
            for line in data[:end].splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:  # a line torn by a crash (sealed by a newline since)
                    continue
                if isinstance(row, dict) and isinstance(row.get("batch"), int) and "outputs" in row:
                    self.batches.setdefault(row["batch"], row["outputs"])
        return self.batches


def marks_template(ids: list[int], tokenizer, eos: set[int]) -> bool:
    """Whether a written prompt's ``ids`` hold a template marker other than its stops: a special added token (a
    chat-template marker, a reserved token) or an added token the chat template writes (Qwen3's ``<think>``). The
    model continued the template instead of writing a user's question, and decoding would drop (special tokens) or
    keep (``<think>``) the marker in the prompt's text. Added tokens of plain text (Gemma's newlines and spaces) are
    not markers."""
    return not (set(ids) & _template_marks(tokenizer)).issubset(eos)


@functools.lru_cache(maxsize=8)
def _template_marks(tokenizer) -> frozenset[int]:
    """The ids :func:`marks_template` looks for, once per tokenizer (not per prompt: 256 added tokens for Llama-3)."""
    template = str(getattr(tokenizer, "chat_template", None) or "")
    return frozenset(i for i, t in tokenizer.added_tokens_decoder.items()
                     if t.special or (t.content.strip() and t.content in template))


def _eos_ids(generation_config, tokenizer, suffix: str) -> set[int]:
    """EOS ids (as regeneration stops) plus the token that ends a user turn (the first special token after
    the user content)."""
    special = set(tokenizer.all_special_ids) | {
        i for i, t in tokenizer.added_tokens_decoder.items() if getattr(t, "special", False)}
    end_of_turn = [i for i in tokenizer(suffix, add_special_tokens=False)["input_ids"] if i in special][:1]
    return eos_ids(tokenizer, generation_config) | set(end_of_turn)


Jobs = list[tuple[int, list[list[int]]]]  # (batch index, the prompts' token ids) to generate


class TargetWriter:
    """Batches written by the target in this process (the ``hf`` backend): ``load()`` gives it, called on first
    use only (a cache holding enough loads nothing). The rows of several batches decode together, continuously
    batched (:func:`data.regenerate.stream`: ``rows`` at once, new ones joining as ``refill`` rows free up), so a
    batch's short prompts do not wait for its longest (one batch of 32 at a time averaged 14 rows per pass). Each
    row samples with its own generator seeded from (seed, batch, index), as the server backends' requests do: a
    prompt does not depend on which rows decoded beside it. A sliding window like :class:`ServerWriter`'s: each
    call queues the batches it is given, returns once the first is done, with every other batch done by then; the
    rest keep decoding at the next call. :meth:`close` drops what is queued and not needed."""

    def __init__(self, load: Callable[[], torch.nn.Module], rows: int = 64, refill: int = 16):
        self.load, self.model, self.rows, self.refill = load, None, rows, refill
        self.queue: deque[tuple[tuple[int, int], list[int]]] = deque()
        self.stream: Iterator | None = None
        self.asked: dict[int, int] = {}                   # batch -> its rows
        self.done: dict[int, dict[int, Answer]] = {}      # batch -> row -> answer
        self.generators: dict[tuple[int, int], torch.Generator] = {}

    def target(self) -> torch.nn.Module:
        if self.model is None:
            self.model = self.load()
        return self.model

    def generation_config(self):
        return getattr(self.target(), "generation_config", None)

    def at_once(self, batch_size: int) -> int:
        return 4 * max(1, -(-self.rows // batch_size))  # queued ahead: rows join the moment rows free up

    def close(self) -> None:
        """Let the target go (the data stage's :class:`data.engines.LocalTarget` keeps it for the answers)."""
        if self.stream is not None:
            self.stream.close()
        self.model, self.stream = None, None
        self.queue.clear()
        self.asked, self.done, self.generators = {}, {}, {}

    def __call__(self, jobs: Jobs, tokenizer, eos: set[int], s: dict) -> Iterator[tuple[int, list[dict]]]:
        model = self.target()
        for b, prompts in jobs:
            if b not in self.asked:
                self.asked[b] = len(prompts)
                for k, ids in enumerate(prompts):
                    seed = request_seed(s["seed"], f"synth-{b}", k)
                    self.generators[b, k] = torch.Generator().manual_seed(seed)  # CPU: see next_tokens
                    self.queue.append(((b, k), ids))
        first = jobs[0][0]
        while len(self.done.get(first, ())) < self.asked[first]:
            if self.stream is None:
                pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
                self.stream = stream(model, self.queue, self.rows, self.refill, s["max_new_tokens"], eos, pad,
                                     s["temperature"], s["top_p"], self.generators.__getitem__)
            finished = next(self.stream, None)
            if finished is None:  # nothing left to decode: rows queued later start a new stream
                self.stream = None
                continue
            for (b, k), answer in finished:
                self.done.setdefault(b, {})[k] = answer
                del self.generators[b, k]
        for b in sorted(self.done):  # the first job's batch first: no batch before it is missing
            if b != first and len(self.done[b]) < self.asked[b]:
                continue
            answers = self.done.pop(b)
            del self.asked[b]
            yield b, [{"text": tokenizer.decode(a.tokens, skip_special_tokens=True).strip(), "tokens": len(a.tokens),
                       "hit_eos": a.hit_eos, "template_token": marks_template(a.tokens, tokenizer, eos)}
                      for a in (answers[k] for k in range(len(answers)))]


class ServerWriter:
    """Batches written through the data stage's server (the ``openai`` and ``vllm`` backends,
    :func:`data.engines.engine_client`), each request seeded from (seed, batch, index); answers checked and decoded
    as regeneration's (:meth:`data.engines.OpenAIClient.answer`). A vLLM server starts at the first batch to
    generate.

    A sliding window: the requests of up to twice as many batches as fill ``client.concurrency`` are asked ahead,
    ``client.concurrency`` of them in flight and the rest queued, and each call returns once the first batch it is
    given is answered. An answer still running at the window's head does not leave the server idle, as it would if
    rounds of batches waited for their slowest request (with 128-token prompts beside 20-token ones, most of a
    round). Which prompts are kept does not depend on the order answers come in (seeds are per request, the filter
    reads batches in order). :meth:`close` drops what is asked and not needed."""

    def __init__(self, client, generation_config):
        self.client, self.config = client, generation_config
        self.pool: futures.ThreadPoolExecutor | None = None
        self.asked: dict[int, list[futures.Future]] = {}

    def generation_config(self):
        return self.config

    def at_once(self, batch_size: int) -> int:
        return 2 * max(1, -(-self.client.concurrency // batch_size))

    def __call__(self, jobs: Jobs, tokenizer, eos: set[int], s: dict) -> Iterator[tuple[int, list[dict]]]:
        """Asks for the batches of ``jobs`` not asked yet; yields the first once answered, then every other batch
        asked and already answered (one no longer in ``jobs`` too: its answers are kept)."""
        client = self.client
        if self.pool is None:
            client.resolve_model()  # from this thread (a vLLM server starts here); an unreachable server fails here
            self.pool = futures.ThreadPoolExecutor(max_workers=client.concurrency)
        for b, prompts in jobs:
            if b not in self.asked:
                self.asked[b] = [self.pool.submit(client.complete, ids, eos, request_seed(s["seed"], f"synth-{b}", k),
                                                  s["max_new_tokens"], s["temperature"], s["top_p"],
                                                  route=f"synth-{b}-{k}")
                                 for k, ids in enumerate(prompts)]
        for b in sorted(self.asked):  # the first job's batch first: no batch before it is missing
            if b != jobs[0][0] and not all(answer.done() for answer in self.asked[b]):
                continue
            outs = []
            for answer in self.asked[b]:
                message, n, hit_eos = client.answer(answer.result(), tokenizer, eos)
                outs.append({"text": message["content"].strip(), "tokens": n, "hit_eos": hit_eos,
                             "template_token": marks_template(answer.result().get("token_ids") or [], tokenizer, eos)})
            del self.asked[b]
            yield b, outs

    def close(self) -> None:
        """Drop the requests not started; wait for the ones in flight, without their retries (after a failure each
        would otherwise wait out its back-off: minutes)."""
        if self.pool is not None:
            self.client.halt.set()
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.client.halt.clear()
        self.pool, self.asked = None, {}


def synthesize(writer: TargetWriter | ServerWriter, tokenizer, s: dict, path: Path, name: str = "synth",
               rank: int = 0, world: int = 1, stalled: Callable[[int], str | None] | None = None
               ) -> tuple[list[dict], dict]:
    """The first ``s["n"]`` kept prompts ``[{id, prompt, category}]`` and the source's stats. ``writer``
    generates the batches the cache does not hold yet. With ``world`` > 1 this is rank ``rank`` of ``world``
    processes writing the batches together (every one calls it); waiting for rank r's batch, it stops with
    ``stalled(r)`` when that says why (r stopped beating or hangs: :func:`rank_pulses`). The file this process appends to is locked
    from before it is read (runs of two heads of one target side by side share the cache: the second waits,
    then reads what the first wrote)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    mine = path if world == 1 else part_file(path, rank)
    with FileLock(str(mine) + ".lock"), closing(writer):
        return _synthesize(writer, tokenizer, s, path, mine, name, rank, world, stalled)


def rank_pulses(cfg, rank: int, world: int, stale_s: float | None = None) -> Callable[[int], str | None]:
    """``stalled`` of :func:`synthesize` for rank ``rank`` of ``world`` under a launcher: why rank r has stopped
    writing its batches (:class:`train.stages.Pulse` on its heartbeat, rank 0's the stage's own), or None."""
    from train.stages import FAILED, STALE_S, rank_pulse, stage_dir

    failed = stage_dir(cfg, "data") / FAILED
    pulses = {r: rank_pulse(cfg, "data", r, stale_s or STALE_S) for r in range(world) if r != rank}

    def stalled(r: int) -> str | None:
        if failed.exists():   # rank 0 raised (its error in that file): no need to wait until stale
            return f"rank 0 failed ({json.loads(failed.read_text())['error']}); this rank stops too"
        return pulses[r].problem(f"rank {r}", "writing its synth batches")

    return stalled


def _synthesize(writer: TargetWriter | ServerWriter, tokenizer, s: dict, path: Path, mine: Path, name: str,
                rank: int, world: int, stalled: Callable[[int], str | None] | None) -> tuple[list[dict], dict]:
    files = BatchFiles(path)
    batches = files.refresh()
    hints = s["hints"] or [{"category": "general", "hint": None}]
    prefixes, suffix = {}, ""
    for h in hints:
        prefix, suffix = user_turn_prefix(tokenizer, h["hint"])
        prefixes[h["hint"]] = tokenizer(prefix, add_special_tokens=False)["input_ids"]
    filt = PromptFilter(s["near_duplicate"], s["min_chars"])
    kept, dropped, tokens = [], Counter(), []
    bs, generated, start = s["batch_size"], 0, time.time()
    cached = len(batches)
    eos: set[int] | None = None  # known once the writer is asked for its first batch (hf: the target loaded)
    last = -(-s["max_attempts"] // bs)  # batches at most
    at_once = writer.at_once(bs)

    def categories(b: int) -> list[dict]:
        return [hints[(b * bs + k) % len(hints)] for k in range(bs)]

    def write(f, todo: list[int]) -> None:
        """Generate the batches ``todo`` (the first at least) and append each to this process's file as it is done."""
        nonlocal eos, generated
        if eos is None:
            eos = _eos_ids(writer.generation_config(), tokenizer, suffix)
        jobs = [(b, [prefixes[h["hint"]] for h in categories(b)]) for b in todo]
        with closing(writer(jobs, tokenizer, eos, s)) as made:
            for b, outs in made:
                batches[b] = [{**o, "category": h["category"]} for h, o in zip(categories(b), outs, strict=True)]
                f.write(json.dumps({"batch": b, "outputs": batches[b]}) + "\n")
                f.flush()
                os.fsync(f.fileno())
                generated += 1
                log(f"[data] synth: batch {b} generated ({len(kept)} of {s['n']} prompts kept before batch "
                    f"{todo[0]}, {time.time() - start:.0f} s)")

    b = 0
    # A bar over the batches (replayed or generated): its steps are the heartbeat's progress, so ranks waiting on a
    # rank-0-only data stage (vllm/openai backends) see a long synth as busy, not hung (hang_minutes).
    bar = progress(total=last, desc="synth", unit="batch")
    with appending(mine) as f, bar:
        while len(kept) < s["n"] and b < last:
            if b not in batches:
                ahead = [c for c in range(b, min(last, b + max(LOOKAHEAD, at_once) * world))
                         if c % world == rank and c not in batches]
                if ahead:  # this rank's next batches (batch b first when it is this rank's), no more than n needs
                    write(f, ahead[:max(1, min(at_once, -(-(s["n"] - len(kept)) // bs)))])
                else:      # another rank's batch: written soon, unless that rank stopped or hangs
                    if stalled is not None and (why := stalled(b % world)):
                        raise DataError(f"{why} (the batches written so far are kept in {path}'s part files)")
                    time.sleep(0.5)
                    files.refresh()
                continue
            outs = batches[b]
            for k, o in enumerate(outs):
                if len(kept) >= s["n"]:
                    break
                reason = ("truncated" if not o["hit_eos"] else "template_token" if o.get("template_token")
                          else filt.check(o["text"]))   # (batches cached before template_token: as then)
                if reason:
                    dropped[reason] += 1
                    continue
                kept.append({"id": f"{name}-{b * bs + k}", "prompt": o["text"], "category": o["category"]})
                tokens.append(o["tokens"])
            b += 1
            bar.update()
            bar.set_postfix(kept=f"{len(kept)}/{s['n']}")
    attempts = len(kept) + sum(dropped.values())
    if len(kept) < s["n"]:
        log(f"[data] synth: only {len(kept)} of {s['n']} prompts after {attempts} attempts "
            f"(max_attempts={s['max_attempts']}); dropped {dict(dropped)}")
    stats = {
        "requested": s["n"], "kept": len(kept), "attempts": attempts,
        "dropped": dict(sorted(dropped.items())),
        "duplicate_rate": round(dropped["duplicate"] / max(attempts, 1), 4),
        "near_duplicate_rate": round(dropped["near_duplicate"] / max(attempts, 1), 4),
        "batches_cached": min(cached, b), "batches_generated": generated,
        "categories": dict(Counter(p["category"] for p in kept)),
        **diversity([p["prompt"] for p in kept]),
        "tokens_mean": round(statistics.fmean(tokens), 1) if tokens else 0.0,
        "file": str(path), "seconds": round(time.time() - start, 1),
    }
    return kept, stats


class Synthesizer:
    """What ``read_source`` calls for ``type: synth``: returns rows, and keeps each source's stats
    (``stats[name]``) for ``stats.json``. The batches are written by ``client``'s server (the ``openai`` and
    ``vllm`` backends, :func:`data.engines.engine_client`), else by the target loaded in this process on first use."""

    def __init__(self, cfg, tokenizer, client=None):
        self.cfg, self.tokenizer, self.client, self.stats = cfg, tokenizer, client, {}
        self.sources: dict[Path, str] = {}   # cache -> the source that wrote it in this run

    def __call__(self, source: dict, name: str) -> Iterator[tuple[str, dict]]:
        from data.engines import LocalTarget, OpenAIClient, generation_config
        from train.stages import on_stage_main, shares_work
        from train.target import target_fingerprints

        dcfg = self.cfg.data
        s = settings(source, int(self.cfg.seed))
        directory = dcfg.get("synth_dir") or Path(dcfg.regen.dir).parent / "synth"
        path = found_cache([cache_file(directory, fp, s, as_written) for as_written in (False, True)
                            for fp in target_fingerprints(self.cfg)])
        if path in self.sources:   # the same settings and seed write the same prompts: the second source's rows
            raise DataError(f"synth sources {self.sources[path]!r} and {name!r} would write the same prompts (the same "
                            f"settings and seed, one cache {path}), and the second's be dropped as duplicates: give "
                            "one its own seed (e.g. seed: 1), or make them one source")
        self.sources[path] = name
        path.parent.mkdir(parents=True, exist_ok=True)
        check = functools.partial(check_snapshot, self.cfg, path, json.dumps(synth_settings(s), sort_keys=True),
                                  lambda fp: cache_file(directory, fp, s))
        on_stage_main(self.cfg, "data", check)   # (every rank sharing the sources' work gets rank 0's refusal)
        # Under a launcher with hf regeneration every rank reads the sources: they write the batches together
        # (rank r the batches b = r mod world) and each filters all of them (every rank has the same prompts).
        world = dist.world_size() if shares_work(self.cfg, "data") else 1
        if isinstance(self.client, OpenAIClient):
            writer = ServerWriter(self.client, generation_config(self.cfg))
        else:  # the target in this process: engine_client's, shared with the answers
            writer = TargetWriter(self.client or LocalTarget(self.cfg), dcfg.regen.batch_size,
                                  refill_rows(dcfg.regen))
        rank = dist.rank() if world > 1 else 0
        kept, self.stats[name] = synthesize(writer, self.tokenizer, s, path, name, rank, world,
                                            rank_pulses(self.cfg, rank, world) if world > 1 else None)
        st = self.stats[name]
        log(f"[data] synth: {st['kept']} prompts ({st['attempts']} attempts, {st['batches_generated']} batches "
            f"generated, {st['batches_cached']} cached; near-duplicates {st['near_duplicate_rate']:.1%}; "
            f"distinct-1 {st['distinct_1']}, distinct-2 {st['distinct_2']})")
        for p in kept:
            yield f"{path}:{p['id']}", p
