"""Decode steps of the ``hf`` backend's batching on a real workload: replays the answer lengths of a
regeneration cache through the scheduler that generates them (``data.regenerate.stream``, the real one)
with a stand-in target that answers every prompt with its recorded length, for several ``data.regen.refill``.

    .venv/bin/python scripts/bench_batching.py                   # the default run's cache (run the data stage first)
    .venv/bin/python scripts/bench_batching.py --cache F.jsonl --batch-size 256 model=qwen2.5-7b

Prints, per refill: decode steps, rows per step and prefills (one per admission of new prompts). No target runs, so it takes seconds;
where a decode step costs about the same at 2 rows as at 64 (a GPU decoding a 7-8B target is bound by
reading the weights), steps are time. On the 2-core CPU a step's cost grows with its rows (the README,
"Continuous batching", has both measured). Prompts are queued as ``data.regenerate.regenerate`` queues
them (shortest first, a conversation's next turn once its previous answer is done); the template tails of
kept states (1-2 steps per conversation) are left out.
"""

from __future__ import annotations

import argparse
import sys
from collections import deque
from pathlib import Path
from types import SimpleNamespace

import torch
from transformers import LlamaConfig

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from data import regenerate  # noqa: E402
from data.template import prompt_ids  # noqa: E402
from train.config import compose  # noqa: E402
from train.target import load_tokenizer  # noqa: E402

EOS = 0


class Replay(torch.nn.Module):
    """A stand-in target: the prompt's last id is its answer's length + 1, and each step answers the id it
    is fed minus one, so a prompt gets that many tokens, then EOS. Counts the rows of each call."""

    def __init__(self, vocab: int):
        super().__init__()
        self.config = LlamaConfig(num_hidden_layers=1, hidden_size=2, num_attention_heads=1, num_key_value_heads=1,
                                  vocab_size=vocab, head_dim=2)
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # the device
        self.steps: list[int] = []    # rows of each decode step
        self.prefills: list[int] = []  # rows of each prefill

    def forward(self, input_ids: torch.Tensor, cache, **_) -> SimpleNamespace:
        (self.steps if input_ids.shape[1] == 1 else self.prefills).append(input_ids.shape[0])
        kv = input_ids.new_zeros((*input_ids.shape[:1], 1, input_ids.shape[1], 2), dtype=torch.float32)
        cache.update(kv, kv, 0)
        logits = torch.nn.functional.one_hot((input_ids[:, -1:] - 1).clamp(min=EOS), self.config.vocab_size)
        return SimpleNamespace(logits=logits.float(), hidden_states=None)


def turns(tokenizer, path: Path, max_new_tokens: int) -> list[list[tuple[int, int]]]:
    """Per cached conversation, (prompt length, answer length) of each turn, the answer re-tokenised (a cut
    answer: max_new_tokens)."""
    out = []
    for row in regenerate.read_cache(path).values():
        messages, conv = [], []
        for m in row["messages"]:
            if m["role"] == "assistant":
                n = len(tokenizer(m["content"], add_special_tokens=False)["input_ids"])
                conv.append((len(prompt_ids(tokenizer, messages)), min(n, max_new_tokens)))
            messages.append(m)
        out.append(conv)
    return out


def replay(convs: list[list[tuple[int, int]]], batch_size: int, refill: float, max_new_tokens: int) -> dict:
    """Runs ``stream`` over the conversations' turns as the data stage would; steps and prefills."""
    model = Replay(max_new_tokens + 8)

    def prompt(c: int, t: int) -> list[int]:
        length, answer = convs[c][t]
        cut = answer >= max_new_tokens  # runs to max_new_tokens without EOS
        return [1] * (length - 1) + [max_new_tokens + 6 if cut else answer + 1]

    queue = deque(sorted((((c, 0), prompt(c, 0)) for c in range(len(convs))), key=lambda item: len(item[1])))
    answered = 0
    for finished in regenerate.stream(model, queue, batch_size, max(1, round(refill * batch_size)), max_new_tokens,
                                      {EOS}, 0):
        for (c, t), answer in finished:
            assert len(answer.tokens) == convs[c][t][1], "the stand-in target did not replay the answer"
            answered += 1
            if t + 1 < len(convs[c]):
                queue.append(((c, t + 1), prompt(c, t + 1)))
    return {"answers": answered, "steps": len(model.steps), "row_steps": sum(model.steps),
            "prefills": len(model.prefills)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", type=Path, help="a regeneration cache (.jsonl); default: the largest of the run's")
    ap.add_argument("--batch-size", type=int, help="default: data.regen.batch_size")
    ap.add_argument("--refill", type=lambda s: [float(x) for x in s.split(",")], default=[1.0, 0.5, 0.25, 0.125],
                    help="comma-separated data.regen.refill values; the first is the baseline (default 1.0,0.5,0.25,0.125)")
    ap.add_argument("overrides", nargs="*", help="pipeline overrides, e.g. model=qwen2.5-7b")
    args = ap.parse_args()
    cfg = compose(["tracking=none", *args.overrides])
    rcfg = cfg.data.regen
    path = args.cache or max(Path(rcfg.dir).glob("*.jsonl"), key=lambda p: p.stat().st_size, default=None)
    if path is None:
        sys.exit(f"no regeneration cache in {rcfg.dir}: run `python train/run.py stages=[data]` first, or pass --cache")
    convs = [c for c in turns(load_tokenizer(cfg), path, rcfg.max_new_tokens) if c]
    batch_size = args.batch_size or rcfg.batch_size
    print(f"{path}: {len(convs)} conversations, {sum(map(len, convs))} answers, "
          f"{sum(a for c in convs for _, a in c)} answer tokens; batch_size {batch_size}, max_new_tokens "
          f"{rcfg.max_new_tokens}\n")
    print(f"{'refill':>7} {'decode steps':>12} {'rows/step':>9} {'prefills':>8}  steps vs refill {args.refill[0]}")
    static = None
    for refill in args.refill:
        r = replay(convs, batch_size, refill, rcfg.max_new_tokens)
        static = static or r["steps"]
        print(f"{refill:>7} {r['steps']:>12} {r['row_steps'] / r['steps']:>9.1f} {r['prefills']:>8}  "
              f"{r['steps'] / static:.2f}")


if __name__ == "__main__":
    main()
