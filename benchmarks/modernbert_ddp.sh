#!/usr/bin/env bash
# Throughput of recipes/modernbert-ddp: ModernBERT-base architecture (random init), the real
# ModernBERT tokenizer, real AG News rows, bf16, micro-batch 64 per GPU, sequence length 256.
# Runs each padding in PADDINGS (default: max_length longest) for each GPU count in NGPUS and each
# entry of VARIANTS (name:override,override...; default "default:", the config as it is), then prints
# a table. Extra arguments are config overrides for every run (e.g. model.compile=true with PADDINGS=max_length).
#
#   TOKENIZER_DIR=/path/to/modernbert-tokenizer TRAIN_FILE=train.csv EVAL_FILE=test.csv \
#     NGPUS="1 2" bash benchmarks/modernbert_ddp.sh [extra overrides]
#   # DDP's settings at 2 GPUs beside 1 (per-GPU scaling), compiled, one call:
#   NGPUS="1 2" PADDINGS=max_length VARIANTS="default: bucket100:ddp.bucket_cap_mb=100 \
#     view:ddp.gradient_as_bucket_view=true static:ddp.static_graph=true" ... bash benchmarks/modernbert_ddp.sh model.compile=true
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT=${OUT_DIR:-outputs/bench-modernbert-ddp}
STEPS=${STEPS:-200}
: "${TOKENIZER_DIR:?set TOKENIZER_DIR to a folder with the ModernBERT tokenizer files}"
: "${TRAIN_FILE:?set TRAIN_FILE to an AG News CSV}"
: "${EVAL_FILE:?set EVAL_FILE to an AG News CSV}"
MODEL_DIR="$OUT/modernbert-base"
# ModernBERT-base's architecture is transformers' ModernBertConfig defaults (768 hidden, 22 layers).
python3 - "$MODEL_DIR" "$TOKENIZER_DIR" <<'PY'
import sys
from transformers import AutoTokenizer, ModernBertConfig
ModernBertConfig().save_pretrained(sys.argv[1])
AutoTokenizer.from_pretrained(sys.argv[2]).save_pretrained(sys.argv[1])
PY
runs=()
for ngpu in ${NGPUS:-2}; do
  for padding in ${PADDINGS:-max_length longest}; do
    for variant in ${VARIANTS:-default:}; do
      name=${variant%%:*} overrides=()
      [[ $variant == *:?* ]] && IFS=, read -r -a overrides <<< "${variant#*:}"
      run="$OUT/${padding}-${ngpu}gpu"; [[ $name == default ]] || run="$run-$name"
      rm -rf "$run"
      NGPU=$ngpu bash "$ROOT/recipes/modernbert-ddp/launch.sh" output_dir="$run" run_name="bench-$(basename "$run")" \
        model.name_or_path="$MODEL_DIR" model.pretrained=false "data.train_files=[$TRAIN_FILE]" "data.eval_files=[$EVAL_FILE]" \
        data.padding=$padding data.max_length=256 train.micro_batch_size=64 train.max_steps=$STEPS train.log_every=10 \
        train.eval_every=0 checkpoint.every_steps=-1 checkpoint.resume=none "${overrides[@]}" "$@"
      runs+=("$run")
    done
  done
done
python3 "$ROOT/benchmarks/summarize.py" --skip-steps 20 "${runs[@]}"
