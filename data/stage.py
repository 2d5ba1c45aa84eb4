"""Data stage: sources -> (regenerated) conversations -> chat-templated tokens + loss masks + token counts.

Writes into ``<run_dir>/data/`` (format documented in the README, "Files between stages"):
- ``dataset/``: a ``datasets.DatasetDict`` (train, validation) with columns id, source, category,
  key (the prompts' key, :func:`data.formats.prompt_key`), input_ids (int32), loss_mask (int8: 1 on
  assistant tokens), length;
- ``captured/``: with ``extract.source: regen``, hidden states kept while regenerating (:mod:`data.captured`);
- ``vocab.safetensors``: token counts over the model's vocabulary (int64): masked_counts and all_counts of
  the train split, validation_counts (assistant tokens of the validation split); the train stage builds the
  draft vocabulary from them (:func:`data.vocab.build_vocab`), so ``head.draft_vocab_size`` reruns neither
  this stage nor extract;
- ``stats.json``: rows read/kept/dropped per reason, training rows left out (``data.train_rows``), tokens,
  masked tokens, coverage, regeneration;
- ``manifest.json``: target and tokenizer fingerprints, sizes, ``dataset_id`` (a hash of the dataset files).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import shutil
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from safetensors.torch import save_file

from data.engines import RegenError, engine_client, generation_config, regenerate_answers
from data.formats import (
    DataError,
    conversation_key,
    humaneval_path,
    leaks,
    normalise,
    prompt_key,
    read_rows,
    read_source,
    special_text,
    to_messages,
)
from data.regenerate import cache_file, eos_ids, found_cache, read_cache
from data.synth import Synthesizer
from data.template import check_template, earlier_reasoning, set_thinking, tokenize_conversation, with_system
from data.vocab import coverage_curve
from train import dist
from train.log import log, progress
from train.stages import files_id, shares_work, stage_dir
from train.target import (
    load_config,
    load_tokenizer,
    target_fingerprint,
    target_fingerprints,
    target_snapshot,
    tokenizer_fingerprint,
)

SPLITS = ("train", "validation")
POOL_MIN_ROWS = 2000  # data.num_proc null: fewer conversations than this are done in this process
_SHARED: dict = {}  # what the per-conversation work reads (set before the pool forks: not pickled per row)


def worker_count(dcfg: DictConfig, n_rows: int, side_by_side: bool = False) -> int:
    """Processes for the per-conversation work (``data.num_proc``; null: one per CPU core, at most 32, once there
    are POOL_MIN_ROWS conversations: at 1M conversations one process renders the templates for hours). Work the
    node's ranks do ``side_by_side`` gets this rank's share of the cores: 8 ranks that each read the sources do not
    fork 8 x 32 workers; work rank 0 does alone (the others wait) gets them all."""
    if dcfg.get("num_proc") is not None:
        return max(1, int(dcfg.num_proc))
    cores = dist.cpus() // (dist.local_world_size() if side_by_side else 1)
    return 1 if n_rows < POOL_MIN_ROWS else max(1, min(32, cores))


def pool_map(fn: Callable, items: list, workers: int, desc: str, **shared) -> Iterator:
    """``fn(item)`` for each of ``items``, in order, with a progress bar, over ``workers`` forked processes (1: in
    this process); ``shared`` is what ``fn`` reads from ``_SHARED`` (inherited by the fork)."""
    _SHARED.clear()
    _SHARED.update(shared)
    bar = progress(total=len(items), desc=desc, unit="conv")
    try:
        if workers <= 1:
            for item in items:
                yield fn(item)
                bar.update()
            return
        before = os.environ.get("TOKENIZERS_PARALLELISM")
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # its threads and fork do not mix (it warns per worker)
        try:
            with multiprocessing.get_context("fork").Pool(workers) as pool:
                for out in pool.imap(fn, items, chunksize=max(1, min(256, len(items) // (8 * workers)))):
                    yield out
                    bar.update()
        finally:
            if before is None:
                os.environ.pop("TOKENIZERS_PARALLELISM", None)
            else:
                os.environ["TOKENIZERS_PARALLELISM"] = before
    finally:
        bar.close()
        _SHARED.clear()


def _leaks(conv: dict) -> bool:
    return leaks(conv["messages"], _SHARED["eval_prompts"])


def before_empty_answer(messages: list[dict]) -> list[dict]:
    """``messages`` up to the user turn of their first empty answer (a target that ended its turn at once): the
    turns before it stay trained on; all of them when no answer is empty."""
    empty = next((i for i, m in enumerate(messages) if m["role"] == "assistant" and not m["content"].strip()), None)
    if empty is None:
        return messages
    return messages[:max((i for i in range(empty) if messages[i]["role"] == "user"), default=0)]


def _training_rows(conv: dict) -> tuple[list[dict], list[str]]:
    """(training rows, notes) of one conversation: its row and, in the train split, those of the reasoning its row's
    render drops (:func:`data.template.earlier_reasoning` of the turns the row kept; noted ``rows_of_earlier_reasoning``
    each), and the notes of its row (:func:`_training_row`)."""
    row, notes, messages = _training_row(conv)
    if row is None or conv["split"] != "train":   # (validation: data.validation_max_rows stays a cap on its rows)
        return [row] if row else [], notes
    rows = [row]
    for ids, mask in earlier_reasoning(_SHARED["tokenizer"], messages):
        if len(ids) > _SHARED["max_length"]:
            if _SHARED["overflow"] == "drop":
                continue
            ids, mask = ids[: _SHARED["max_length"]], mask[: _SHARED["max_length"]]
        if any(mask):
            rows.append({**row, "id": f"{row['id']}#{len(rows)}", "input_ids": np.asarray(ids, dtype=np.int32),
                         "loss_mask": np.asarray(mask, dtype=np.int8), "length": len(ids)})
            notes.append("rows_of_earlier_reasoning")
    return rows, notes


def _training_row(conv: dict) -> tuple[dict | None, list[str], list[dict]]:
    """(training row, notes, the messages it holds) of one conversation: the row (input_ids int32, loss_mask int8)
    and what was changed
    (stats keys: ``truncated_to_max_length``, ``conversations_cut_at_empty_answer``, ``conversations_cut_to_fit``:
    ``data.overflow=drop`` keeps the turns up to its last whole answer within ``data.max_length``), or None and why
    it is dropped (a stats key, or ``template: <error>``)."""
    if not any(m["role"] == "assistant" for m in conv["messages"]):
        return None, ["dropped_no_assistant_turn"], []
    messages, notes = before_empty_answer(conv["messages"]), []
    if len(messages) < len(conv["messages"]):
        if not any(m["role"] == "assistant" for m in messages):
            return None, ["dropped_empty_answer"], []
        notes.append("conversations_cut_at_empty_answer")
    try:
        ids, mask = tokenize_conversation(_SHARED["tokenizer"], messages)
    except Exception as e:  # the template refuses the conversation (jinja's raise_exception, ...)
        return None, [f"template: {e}"], []
    if len(ids) > _SHARED["max_length"]:
        if _SHARED["overflow"] == "drop":   # cut back to its last whole answer that fits (a long last turn, a capped
            for end in reversed([i for i, m in enumerate(messages[:-1]) if m["role"] == "assistant"]):   # answer)
                ids, mask = tokenize_conversation(_SHARED["tokenizer"], messages[:end + 1])
                if len(ids) <= _SHARED["max_length"]:
                    notes.append("conversations_cut_to_fit")
                    messages = messages[:end + 1]
                    break
            else:
                return None, ["dropped_too_long"], []
        else:
            ids, mask = ids[: _SHARED["max_length"]], mask[: _SHARED["max_length"]]
            notes.append("truncated_to_max_length")
    if not any(mask):
        return None, ["dropped_no_assistant_tokens"], []
    # the key of the whole conversation: the states kept while regenerating it may cover a cut one (data/captured.py)
    return {"id": conv["id"], "source": conv["source"], "category": conv["category"],
            "key": conv.get("key") or prompt_key(conv["messages"]), "input_ids": np.asarray(ids, dtype=np.int32),
            "loss_mask": np.asarray(mask, dtype=np.int8), "length": len(ids)}, notes, messages


def eval_prompt_set(cfg: DictConfig) -> set[str]:
    """Normalised user prompts of the evaluation sets that training must not see."""
    prompts = set()
    if "humaneval" in cfg.data.exclude_eval:
        for _, row in read_rows(humaneval_path(), "raise", Counter()):
            prompts.add(normalise(to_messages(row, "humaneval")[0]["content"]))
            prompts.add(normalise(row["prompt"]))
    if cfg.eval.get("questions"):
        for _, row in read_rows(cfg.eval.questions, "raise", Counter()):
            prompts.update(normalise(m["content"]) for m in to_messages(row, "auto") if m["role"] == "user")
    return prompts


def seeded_order(convs: list[dict], tag: str) -> list[dict]:
    """``convs`` sorted by a hash of ``tag`` and their id: a seeded order that does not depend on the file's."""
    return sorted(convs, key=lambda c: random.Random(f"{tag}-{c['id']}").random())


def validation_count(n: int, fraction: float, max_rows: int | None) -> int:
    """How many of ``n`` rows without a split of their own are held out: round(fraction x n), at least 1 when
    fraction > 0 and n >= 2, at most ``max_rows``."""
    n_val = max(1, round(fraction * n)) if fraction > 0 and n >= 2 else 0
    return min(n_val, max_rows) if max_rows is not None else n_val


def assign_splits(convs: list[dict], fraction: float, seed: int, max_rows: int | None = None) -> None:
    """Rows with a split of their own keep it. Of the rows without one, ``data.validation_fraction``
    (default 5%) go to validation (:func:`validation_count`; ``max_rows``: ``data.validation_max_rows``), the
    first by a seeded hash of their id (a row's split does not depend on the order of its file; a smaller cap
    keeps a subset of a larger one's rows)."""
    free = []
    for conv in convs:
        if conv["split"] is None:
            free.append(conv)
        elif conv["split"] not in SPLITS:
            raise DataError(f"row {conv['id']}: split must be train or validation, got {conv['split']!r}")
    n_val = validation_count(len(free), fraction, max_rows)
    for i, conv in enumerate(seeded_order(free, str(seed))):
        conv["split"] = "validation" if i < n_val else "train"


def sample_train_rows(convs: list[dict], n: int | None, seed: int) -> list[dict]:
    """``data.train_rows``: a seeded random ``n`` of the training rows (nested: a smaller ``n`` keeps a subset of
    a larger one's rows), every validation row, in their order; all rows when ``n`` is None."""
    train = [c for c in convs if c["split"] == "train"]
    if n is None or n >= len(train):
        return convs
    kept = {id(c) for c in seeded_order(train, f"{seed}-rows")[:n]}
    return [c for c in convs if c["split"] != "train" or id(c) in kept]


def read_conversations(cfg: DictConfig, synth: Synthesizer, tokenizer) -> tuple[list[dict], Counter, int]:
    """The conversations of ``data.sources`` this run trains and validates on (eval overlaps, turns holding a special
    token's text (:func:`data.formats.special_text`) and copies dropped, splits assigned, ``data.train_rows``
    applied), the counts of what was dropped or changed, and the training rows ``data.train_rows`` left out."""
    dcfg = cfg.data
    counts = Counter()
    convs = []
    for source in dcfg.sources:
        source = OmegaConf.to_container(source, resolve=True) if OmegaConf.is_config(source) else dict(source)
        convs.extend(read_source(source, dcfg.on_error, counts, synth=synth))
    eval_prompts = eval_prompt_set(cfg)
    kept = []
    workers = worker_count(dcfg, len(convs), side_by_side=shares_work(cfg, "data"))
    leaked = (list(pool_map(_leaks, convs, workers, "eval overlap", eval_prompts=eval_prompts))
              if eval_prompts else [False] * len(convs))
    prompts, special = set(), special_text(tokenizer, eos_ids(tokenizer, generation_config(cfg)))
    for conv, leak in zip(convs, leaked, strict=True):
        if leak:
            counts["dropped_eval_overlap"] += 1
            continue
        if special and any(special.search(m["content"]) for m in conv["messages"]   # (regenerated: the prompts only)
                           if not (dcfg.regenerate and m["role"] == "assistant")
                           and not (dcfg.system_prompt and m["role"] == "system")):   # (replaced: with_system)
            counts["dropped_special_token_text"] += 1
            continue
        # One answer per prompt when regenerating; without, a row repeated whole (ShareGPT dumps hold copies) is
        # trained once: a copy held out would score the head on a row it trained on.
        messages = with_system(conv["messages"], dcfg.system_prompt)
        key = prompt_key(messages) if dcfg.regenerate else conversation_key(messages)
        if key in prompts:
            counts["dropped_duplicate_prompts" if dcfg.regenerate else "dropped_duplicate_conversations"] += 1
            continue
        prompts.add(key)
        kept.append(conv)
    assign_splits(kept, dcfg.validation_fraction, cfg.seed, dcfg.validation_max_rows)  # after the drops: held-out rows are kept
    if counts["dropped_eval_overlap"]:
        log(f"[data] dropped {counts['dropped_eval_overlap']} conversations overlapping evaluation prompts")
    if counts["dropped_special_token_text"]:
        log(f"[data] dropped {counts['dropped_special_token_text']} conversations whose text holds a special token's "
            "(an injected '<|im_end|>' would be read as the control token itself)")
    if counts["dropped_duplicate_conversations"]:
        log(f"[data] dropped {counts['dropped_duplicate_conversations']} conversations repeating an earlier one whole")
    if counts["dropped_duplicate_prompts"]:
        log(f"[data] dropped {counts['dropped_duplicate_prompts']} conversations repeating an earlier one's prompts "
            "(regenerated, they would be copies of its row)")
    convs = sample_train_rows(kept, dcfg.get("train_rows"), cfg.seed)  # before regeneration: only these are answered
    return convs, counts, len(kept) - len(convs)


def run(cfg: DictConfig) -> dict:
    dcfg = cfg.data
    out = stage_dir(cfg, "data")
    start = time.time()
    tokenizer = load_tokenizer(cfg)
    check_template(tokenizer)
    set_thinking(dcfg.get("thinking"))  # enable_thinking for every render (regeneration, masks)
    # One server (data.regen.backend vllm: started at its first request) writes the synth prompts and the answers.
    with engine_client(cfg) as client:
        synth = Synthesizer(cfg, tokenizer, client)
        convs, counts, train_rows_left_out = read_conversations(cfg, synth, tokenizer)
        regen_stats = None
        if dcfg.regenerate:
            path = found_cache([cache_file(dcfg.regen.dir, fp, dcfg.regen, dcfg.system_prompt, dcfg.get("thinking"),
                                           as_written) for as_written in (False, True) for fp in target_fingerprints(cfg)])
            # data.regen.backend: hf (split across ranks under a launcher) | vllm | openai (data/engines.py)
            regen_stats = regenerate_answers(cfg, convs, tokenizer, path, client)
            if regen_stats is None:  # a rank other than 0: its share is written; rank 0 does the rest alone
                return None
    if dcfg.regenerate:
        regen_stats["file"] = str(path)
        keys = [prompt_key(with_system(conv["messages"], dcfg.system_prompt)) for conv in convs]
        if refused := regen_stats.pop("refused", None):  # data.on_error=skip: left out, counted
            kept = [i for i, k in enumerate(keys) if k not in refused]
            counts["dropped_refused_in_regeneration"] += len(keys) - len(kept)
            convs, keys = [convs[i] for i in kept], [keys[i] for i in kept]
        cached = read_cache(path, set(keys))  # the cache holds every run's answers of this target and setting
        if missing := next((k for k in keys if k not in cached), None):
            raise RegenError(f"the answer to conversation {missing} is missing from {path} (a torn line?); "
                             "a rerun regenerates it")
        for conv, key in zip(convs, keys, strict=True):
            row = cached[key]
            conv["messages"], conv["key"] = row["messages"], key   # (a conversation cut at max_length lacks the
            #                                                           later user turns its cache key was made of)
            # answers the target did not end (not the one cut at max_length, a conversation_cut_at_max_length)
            counts["answers_truncated"] += sum(bool(m.get("truncated")) for m in row["messages"]) - ("capped" in row)
            counts["conversations_cut_at_max_length"] += int("cut_at_length" in row)
    else:
        for conv in convs:
            conv["messages"] = with_system(conv["messages"], dcfg.system_prompt)

    rows = {s: [] for s in SPLITS}
    made = pool_map(_training_rows, convs, worker_count(dcfg, len(convs)), "tokenize", tokenizer=tokenizer,
                    max_length=dcfg.max_length, overflow=dcfg.overflow)
    for conv, (made_rows, notes) in zip(convs, made, strict=True):
        for note in notes:
            if note.startswith("template: "):
                if dcfg.on_error != "skip":
                    made.close()
                    raise DataError(f"conversation {conv['id']} ({conv['source']}): the chat template cannot render "
                                    f"it: {note.removeprefix('template: ')}. Fix the row or set data.on_error=skip to "
                                    "skip and count it.")
                counts["dropped_template_error"] += 1
            else:
                counts[note] += 1
        rows[conv["split"]].extend(made_rows)
    if not rows["train"]:
        raise DataError(
            f"the dataset is empty after filtering ({dict(counts)}). Prompt-only sources need "
            "data.regenerate=true; check data.sources, data.max_length and data.overflow."
        )

    # Keyed on the model's vocabulary (its embedding rows), which padded vocabularies (Qwen2.5, Qwen3) make
    # larger than the tokenizer: heads, exports and engines all use the model's size.
    vocab_size = model_vocab_size(cfg, tokenizer)
    tally = {}
    for split in SPLITS:
        masked, every = np.zeros(vocab_size, dtype=np.int64), np.zeros(vocab_size, dtype=np.int64)
        for i in range(0, len(rows[split]), 4096):  # one count per 4096 rows: 15x faster than per row (2.2 min at 800k)
            chunk = rows[split][i:i + 4096]
            ids = np.concatenate([r["input_ids"] for r in chunk])
            every += np.bincount(ids, minlength=vocab_size)
            masked += np.bincount(ids[np.concatenate([r["loss_mask"] for r in chunk]).astype(bool)], minlength=vocab_size)
        tally[split] = (torch.from_numpy(masked), torch.from_numpy(every))
    held_out = (tally["validation"] if rows["validation"] else tally["train"])[0].clone()  # a copy: safetensors refuses tensors that share memory

    tmp = out / "dataset.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    save_dataset(rows, tmp)
    shutil.rmtree(out / "dataset", ignore_errors=True)
    tmp.rename(out / "dataset")
    save_file({"masked_counts": tally["train"][0], "all_counts": tally["train"][1], "validation_counts": held_out},
              str(out / "vocab.safetensors"))

    stats = {
        "rows_read": counts.pop("rows_read", 0),
        "train_rows_left_out": train_rows_left_out,  # data.train_rows
        "rows_kept": {s: len(rows[s]) for s in SPLITS},
        "dropped": {k: v for k, v in counts.items() if k.startswith("dropped") or k in ("bad_row", "malformed_json")},
        "modified": {k: v for k, v in counts.items() if k in (
            "truncated_to_max_length", "answers_truncated", "conversations_cut_at_max_length",
            "conversations_cut_at_empty_answer", "conversations_cut_to_fit", "rows_of_earlier_reasoning",
            "conversations_cut_at_tool_turn", "empty_turns_dropped", "assistant_turns_out_of_order_dropped")},
        "tokens": {s: int(tally[s][1].sum()) for s in SPLITS},
        "masked_tokens": {s: int(tally[s][0].sum()) for s in SPLITS},
        "validation_coverage_by_size": coverage_curve(tally["train"][0], held_out, tally["train"][1]),
        "regeneration": regen_stats,
        "synth": synth.stats or None,  # per synth source: filtering, diversity, cache
        "wall_s": round(time.time() - start, 1),
    }
    (out / "stats.json").write_text(json.dumps(stats, indent=2))
    manifest = {
        "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
        "target_fingerprint": target_fingerprint(cfg),
        "target_snapshot": target_snapshot(cfg),   # a Hub target's "<repo id>@<commit>" (None: a local folder)
        "vocab_size": vocab_size,
        "rows": stats["rows_kept"],
        "tokens": stats["tokens"],
        "dataset_id": files_id(out, ["dataset/*/*.arrow"]),  # identical datasets of sibling runs (extract.reuse)
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    log(f"[data] train {len(rows['train'])} rows / {stats['tokens']['train']} tokens "
        f"({stats['masked_tokens']['train']} assistant), validation {len(rows['validation'])} rows; "
        + ("held-out" if rows["validation"] else "(no validation rows: in-sample) training") +
        " answer tokens covered by draft vocabularies of "
        + (", ".join(f"{size}: {share:.1%}" for size, share in stats["validation_coverage_by_size"].items())
           or "any size below the vocabulary: -"))
    return {"stats": str(out / "stats.json"), **{k: stats[k] for k in ("rows_kept", "tokens")}}


def model_vocab_size(cfg: DictConfig, tokenizer) -> int:
    """The target's ``config.vocab_size``; every tokenizer id must be below it."""
    config = load_config(cfg)
    size = getattr(config, "text_config", config).vocab_size
    if len(tokenizer) > size:
        raise DataError(f"the tokenizer has {len(tokenizer)} tokens but the model only {size} embedding rows: "
                        "they do not belong together (check model.path / model.hub_id)")
    return size


def save_dataset(rows: dict[str, list[dict]], path: Path) -> None:
    """Write the splits as a ``datasets.DatasetDict``; an empty split gets one (empty) file, without which
    ``datasets`` cannot load it back."""
    _to_datasets(rows).save_to_disk(str(path), num_shards={s: None if rows[s] else 1 for s in SPLITS})


def _to_datasets(rows: dict[str, list[dict]]):
    import datasets

    features = datasets.Features({
        "id": datasets.Value("string"), "source": datasets.Value("string"), "category": datasets.Value("string"),
        "key": datasets.Value("string"),
        "input_ids": datasets.Sequence(datasets.Value("int32")), "loss_mask": datasets.Sequence(datasets.Value("int8")),
        "length": datasets.Value("int32"),
    })
    # Column-wise: an empty split is a valid empty Dataset (from_list([]) loses the features).
    return datasets.DatasetDict({s: datasets.Dataset.from_dict({k: [r[k] for r in rows[s]] for k in features},
                                                               features=features) for s in SPLITS})


def load_dataset(cfg: DictConfig):
    """The data stage's DatasetDict (train, validation); rows come as numpy arrays."""
    import datasets

    return datasets.load_from_disk(str(Path(stage_dir(cfg, "data")) / "dataset")).with_format("numpy")


def row_lengths(split) -> list[int]:
    """Token count of every row of one split of :func:`load_dataset`."""
    return split.data.column("length").to_pylist()
