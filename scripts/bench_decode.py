"""Decode benchmark: what speculation costs and gains on this machine.

    .venv/bin/python scripts/bench_decode.py [--run-dir outputs/smollm2-135m/eagle3] [--prompts 4]
        [--model tiny-llama] [--head medusa] [--max-new-tokens 64] [--cudnn-attention] [key=value ...]

Prints (1) the target's verify time against the number of tree tokens, (2) per-step draft times of a
head (the trained one under ``<run-dir>/train/head``, else a random-weight one) and of the n-gram
drafter, (3) tau / tokens/s / speedup over plain decoding, greedy, on a few built-in validation prompts.
Extra ``key=value`` arguments are Hydra overrides of conf/config.yaml (e.g. ``eval.tree.total_tokens=8``,
``eval.num_threads=1`` on a machine shared with other jobs, ``eval.dtype=bfloat16``). The target decodes in
the eval stage's precision (``eval.dtype``; ``auto`` may time float32 against bfloat16 first).
``--cudnn-attention`` (GPU) decodes with cuDNN attention, which the decoder switches off (a plan built per key
length): run it with and without to see what that costs on the machine at hand.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from eval.bench import random_head  # noqa: E402
from eval.decoder import SpecDecoder  # noqa: E402
from eval.drafters import build_drafter  # noqa: E402
from eval.prompts import load_prompts  # noqa: E402
from eval.report import aggregate  # noqa: E402
from eval.stage import context_ids, eos_token_ids, eval_target, evaluate, resolve_methods, size_tree, sized  # noqa: E402
from eval.treesize import draft_times  # noqa: E402
from heads.io import head_type, load_head  # noqa: E402
from train.config import compose  # noqa: E402
from train.target import load_tokenizer  # noqa: E402


def parse() -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-dir", help="a run directory with a trained head in train/head/")
    parser.add_argument("--prompts", type=int, default=4, help="built-in validation prompts to decode")
    parser.add_argument("--model", help="model preset (conf/model/*.yaml); default: the config's")
    parser.add_argument("--head", help="head preset (eagle3 | medusa) of the random head without --run-dir")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--cudnn-attention", action="store_true", help="GPU: decode with cuDNN attention on")
    return parser.parse_known_args()


def main() -> None:
    args, overrides = parse()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    presets = [f"model={args.model}"] * bool(args.model) + [f"head={args.head}"] * bool(args.head)
    cfg = compose(["tracking=none", *presets, "eval.datasets=[builtin]", f"eval.limit={args.prompts}", "eval.warmup=1",
                   f"eval.max_new_tokens={args.max_new_tokens}", "eval.temperatures=[0.0]", *overrides])
    if cfg.eval.num_threads:
        torch.set_num_threads(cfg.eval.num_threads)
    tokenizer = load_tokenizer(cfg)
    target = eval_target(cfg, tokenizer).model   # eval.dtype, as the eval stage decodes
    if args.run_dir:
        head = load_head(Path(args.run_dir) / "train" / "head", target).to(target.device, target.dtype)
        source = f"trained head from {args.run_dir}"
    else:
        head = random_head(cfg.head.type, target, cfg.head)
        source = "random-weight head"
    kind = head_type(head)
    decoder = SpecDecoder(target, eos_token_ids(target, tokenizer))
    if args.cudnn_attention:
        torch.backends.cuda.enable_cudnn_sdp(True)
    prompts = load_prompts(cfg)
    print(f"target {cfg.model.name} on {target.device} ({target.dtype}); {kind} {source}; {len(prompts)} prompts")
    if target.device.type == "cuda":
        print(f"cuDNN {torch.backends.cudnn.version()}, cuDNN attention {torch.backends.cuda.cudnn_sdp_enabled()}")

    tree = size_tree(cfg, decoder, head, tokenizer)
    print(f"\nverify time vs tree tokens (context {cfg.eval.tree.context} tokens):")
    print("  tokens " + "".join(f"{s:>8}" for s in tree["verify_ms"]))
    print("  ms     " + "".join(f"{ms:>8.1f}" for ms in tree["verify_ms"].values()))
    if "acceptance_curve" in tree:
        print("  draft  " + "".join(f"{tree['draft_ms'].get(s, float('nan')):>8.1f}" for s in tree["verify_ms"]))
        print("  tau    " + "".join(f"{v:>8.2f}" for v in tree["acceptance_curve"].values()))
        print("  pred.x " + "".join(f"{tree['predicted_speedup'].get(s, float('nan')):>8.2f}" for s in tree["verify_ms"]))
    if kind == "eagle3":
        print(f"  EAGLE tree total_tokens = {tree['total_tokens']} ({tree['total_tokens_source']})")
    else:
        print(f"  Medusa tree: {tree['medusa_nodes']} nodes ({tree['total_tokens_source']})")

    ecfg = sized(cfg.eval, tree)
    methods = resolve_methods("auto", kind)
    drafters = {m: build_drafter(m, head, target.config.num_hidden_layers, ecfg) for m in methods}
    context = context_ids(tokenizer, prompts, cfg.eval.tree.context)
    layers = sorted({layer for d in drafters.values() for layer in d.hidden_layers})
    _, _, hidden = decoder.prefill(context[:-1], layers)
    print(f"\ndraft step times (ms, context {len(context)} tokens; update = 3 new rows):")
    for method, drafter in drafters.items():
        if method != "plain":
            times = draft_times(decoder, drafter, context, hidden)
            print(f"  {method:<20} update {times['update']:7.2f}   propose {times['propose']:7.2f}")

    results = aggregate(evaluate(cfg, decoder, drafters, tokenizer, prompts, 0.0))
    print(f"\ngreedy, {args.max_new_tokens} new tokens, {len(prompts)} prompts (plain interleaved):")
    print(f"  {'method':<20}{'tau':>7}{'tok/s':>9}{'plain':>9}{'speedup':>9}{'draft%':>8}  identical")
    for r in results:
        if r["category"] == "all":
            print(f"  {r['method']:<20}{r['tau']:>7.2f}{r['tokens_per_s']:>9.1f}{r['plain_tokens_per_s']:>9.1f}"
                  f"{r['speedup']:>9.2f}{100 * r['draft_time_share']:>7.0f}%  {r['identical_to_plain']}")


if __name__ == "__main__":
    main()
