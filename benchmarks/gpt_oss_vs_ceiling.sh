#!/usr/bin/env bash
# Issue 37 item 3: GPT-OSS 20B LoRA through the recipe (benchmarks/gpt_oss_lora.sh, RUNS default: no activation
# checkpointing, micro-batch 1 x 4,096, flex_attention) and, in the same call on the same model config, the frozen-base
# ceiling (benchmarks/moe_ceiling.py: forward + backward of every layer, no LoRA, optimizer or trainer; flex_attention;
# transformers' grouped_mm and eager experts), then the recipe's tokens/s over the faster ceiling.
#   OUT=$OUT bash benchmarks/gpt_oss_vs_ceiling.sh      # on the device; carry .whl .data (qwen3, alpaca sample)
# Writes $OUT/results.jsonl and $OUT/<run>.log (gpt_oss_lora.sh), $OUT/ceiling.jsonl, $OUT/ratio.json.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT=${OUT:-outputs/bench-gpt-oss-ceiling}
mkdir -p "$OUT"
export RUNS_DIR=${RUNS_DIR:-/tmp/bench-gpt-oss}
RUNS=${RUNS:-"noac:none:1"} STEPS=${STEPS:-20} SKIP_STEPS=${SKIP_STEPS:-5} RUN_TIMEOUT=${RUN_TIMEOUT:-240} OUT=$OUT \
  bash benchmarks/gpt_oss_lora.sh
export PYTHONPATH=${PYTHONPATH:-/tmp/site:$ROOT/shared}
timeout "${CEILING_TIMEOUT:-200}" python3 benchmarks/moe_ceiling.py --config "$RUNS_DIR/model/config.json" \
  --tokens "${SEQ:-4096}" --seq-len "${SEQ:-4096}" --experts grouped_mm eager --attn flex_attention --warmup 3 \
  --steps 5 --out "$OUT/ceiling.jsonl"
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
runs = [json.loads(l) for l in (out / "results.jsonl").read_text().splitlines() if l.strip()]
ceil = [json.loads(l) for l in (out / "ceiling.jsonl").read_text().splitlines()] if (out / "ceiling.jsonl").is_file() else []
best = max(ceil, key=lambda r: r["tokens_per_s"]) if ceil else None
rows = []
for r in runs:
    tps = r.get("tokens/s/device")
    rows.append({"run": r.get("run"), "tokens_per_s": tps,
                 "ceiling": best and {"experts": best["experts_implementation"], "tokens_per_s": best["tokens_per_s"]},
                 "of_ceiling": tps / best["tokens_per_s"] if tps and best else None})
print(json.dumps(rows, indent=1))
(out / "ratio.json").write_text(json.dumps(rows) + "\n")
PY
