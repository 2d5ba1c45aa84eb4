"""Which training levers pay on a small CPU budget: short trainings that differ in one setting each,
compared by validation accuracy, simulated tau and ``decode_tau`` (on held-out prompts; ``decode_tau`` is
what a chain decoder drafting the served k tokens per pass accepts on them, what vLLM's check measures).

Each variant trains for the same wall-clock budget in a scratch copy of a finished run's data and
extract stages (the same data for every row). Default variants (:data:`VARIANTS`): the default config,
then one lever per row -- positions, lm_head init, TTT depth, tap noise, a random start instead of the
draft layer started from target layer N-3 with the last-tap fc (the defaults), the other objectives (TV,
LK-alpha, LK-lambda, HASS's top-K; KL alone for EAGLE-3, whose default adds the reverse KL, and that mix for
Medusa), dropout, (EAGLE-3) the reach mask of the training-time test, the head's forward in bf16
under autocast (``train.autocast``), a moving average of the weights (``train.ema``), (EAGLE-3) EAGLE-1's
feature regression (``head.feature_loss``) and Muon (``train.optimizer``).

    .venv/bin/python scripts/bench_levers.py [--minutes 6] [--head eagle3|medusa] [--variant "name:key=value,key=value" ...] [key=value ...]

Extra ``key=value`` arguments are Hydra overrides of the run read (and of every variant), e.g.
``model=tiny-llama output_root=/tmp/x`` (the smoke test in tests/test_scripts.py).
"""

from __future__ import annotations

import argparse
import json
import logging

from _bench import scratch_run

# "name:overrides" per head; the first row is the baseline the others are compared with.
OBJECTIVE_VARIANTS = ["TV loss:head.loss=tv", "LK-alpha loss:head.loss=lk_alpha", "LK-lambda loss:head.loss=lk_lambda",
                      "KL + top-10 (HASS):head.loss=kl_topk"]
VARIANTS = {
    "eagle3": [
        "default:",
        "assistant-only positions:train.positions=assistant",
        "no lm_head init:head.init_from_target=false",
        "TTT 7 steps:head.ttt_steps=7",
        "tap noise 0.05:head.tap_noise=0.05",
        "random start (no layer init, random fc):head.layer_init=null,head.fc_init=random",
        "layer init, random fc:head.fc_init=random",
        "layer init, token path from zero:head.layer_init_embed=zero",
        *OBJECTIVE_VARIANTS,
        "KL alone:head.loss=kl",
        "dropout 0.1:head.dropout=0.1",
        "reach mask, top 1 (GRIFFIN):head.ttt_reach_topk=1",
        "reach mask, top 4 (GRIFFIN):head.ttt_reach_topk=4",
        "bf16 autocast:train.autocast=bfloat16",
        "EMA of the weights 0.99:train.ema=0.99",
        "feature regression 1.0 (EAGLE-1):head.feature_loss=1.0",
        "Muon on the hidden matrices:train.optimizer=muon",
    ],
    "medusa": ["default:", "assistant-only positions:train.positions=assistant", *OBJECTIVE_VARIANTS,
               "forward + reverse KL:head.loss=kl_mix", "dropout 0.1:head.dropout=0.1",
               "bf16 autocast:train.autocast=bfloat16", "EMA of the weights 0.99:train.ema=0.99",
               "Muon on the hidden matrices:train.optimizer=muon"],
}


def train_variant(overrides: list[str], minutes: float, head: str, source: list[str] = ()) -> dict:
    from train.stages import run_stages, stage_dir

    with scratch_run([f"head={head}", *source], ["data", "extract"],
                     ["stages=[train]", f"train.max_minutes={minutes}", "train.patience=1000", *overrides]) as (cfg, _):
        run_stages(cfg)
        return json.loads((stage_dir(cfg, "train") / "summary.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=6.0)
    parser.add_argument("--head", default="eagle3")
    parser.add_argument("--variant", action="append", help="'name:key=value,key=value' (repeatable)")
    args, source = parser.parse_known_args()
    logging.basicConfig(level=logging.WARNING)
    rows = []
    for spec in args.variant or VARIANTS[args.head]:
        name, _, overrides = spec.partition(":")
        summary = train_variant([o for o in overrides.split(",") if o], args.minutes, args.head, source)
        rows.append((name, summary))
        best = summary["best"]
        print(f"{name}: steps {summary['steps']}, {summary['tokens_per_s']:.0f} tok/s, best sim_tau "
              f"{best['sim_tau']:.3f} chain_tau {best['chain_tau']:.3f} decode_tau {best['decode_tau']:.3f}", flush=True)
    print(f"\n== training levers: {args.head}, {args.minutes} min each, validation (held-out prompts) ==")
    print(f"{'variant':<36} {'steps':>6} {'tok/s':>6} {'acc_0':>6} {'acc_1':>6} {'acc_2':>6} {'sim_tau':>8} "
          f"{'vs first':>8} {'chain_tau':>9} {'decode_tau':>10}")
    base = rows[0][1]["best"]["sim_tau"]
    for name, s in rows:
        b = s["best"]
        print(f"{name:<36} {s['steps']:6d} {s['tokens_per_s']:6.0f} {b['acc_0']:6.3f} {b.get('acc_1', 0):6.3f} "
              f"{b.get('acc_2', 0):6.3f} {b['sim_tau']:8.3f} {b['sim_tau'] - base:+8.3f} {b['chain_tau']:9.3f} "
              f"{b['decode_tau']:10.3f}")


if __name__ == "__main__":
    main()
