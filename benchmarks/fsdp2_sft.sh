#!/usr/bin/env bash
# Throughput of recipes/qwen-fsdp2-sft: a model architecture from MODEL_CONFIG (e.g. Qwen3-8B's
# config.json), random init, a real tokenizer (TOKENIZER_DIR) and real rows (TRAIN_FILE: Alpaca /
# chat JSON), packed to each sequence length in SEQS, bf16; then a table of the medians.
#
#   MODEL_CONFIG=qwen3-8b/config.json TOKENIZER_DIR=qwen3-tokenizer TRAIN_FILE=alpaca_data.json \
#     NGPU=2 SEQS="2048 4096" STEPS=40 bash benchmarks/fsdp2_sft.sh [extra overrides]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT=${OUT_DIR:-outputs/bench-fsdp2-sft}
STEPS=${STEPS:-40}
: "${MODEL_CONFIG:?set MODEL_CONFIG to a model config.json}"
: "${TOKENIZER_DIR:?set TOKENIZER_DIR to a folder with the tokenizer files}"
: "${TRAIN_FILE:?set TRAIN_FILE to a JSON / JSONL file of chat or Alpaca rows}"
source "$ROOT/benchmarks/model_dir.sh"  # MODEL_DIR: tokenizer files + MODEL_CONFIG
runs=()
for seq in ${SEQS:-2048}; do
  run="$OUT/seq${seq}"
  rm -rf "$run"
  NGPU=${NGPU:-} bash "$ROOT/recipes/qwen-fsdp2-sft/launch.sh" output_dir="$run" run_name="bench-seq${seq}" \
    model.name_or_path="$MODEL_DIR" model.pretrained=false "data.train_files=[$TRAIN_FILE]" data.max_length=$seq \
    train.max_steps=$STEPS train.log_every=5 checkpoint.every_steps=-1 checkpoint.export_hf=false \
    data.eval_fraction=0 "$@"
  runs+=("$run")
done
python3 "$ROOT/benchmarks/summarize.py" --skip-steps ${SKIP_STEPS:-10} "${runs[@]}"
