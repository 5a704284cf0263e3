#!/usr/bin/env bash
# Expert parallelism on or off: recipes/moe-lora-fsdp2-ep with a MoE architecture from MODEL_CONFIG (e.g. Qwen3-30B-A3B's
# config.json), random init, bf16 base, LoRA, a real tokenizer (TOKENIZER_DIR) and real instruction rows (TRAIN_FILE),
# at each EP degree in EPS on NGPU GPUs of this node; then one table of the medians (benchmarks/summarize.py).
# Rows are packed to SEQ tokens (Qwen3-MoE; keep PACKING=false for nemotron_h), MICRO_BATCH rows per GPU.
#
#   MODEL_CONFIG=recipes/moe-lora-fsdp2-ep/models/qwen3-30b-a3b/config.json TOKENIZER_DIR=qwen3-tokenizer \
#     TRAIN_FILE=alpaca_data.json NGPU=2 STEPS=12 bash benchmarks/moe_ep.sh [extra overrides]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT=${OUT_DIR:-outputs/bench-moe-ep}
STEPS=${STEPS:-12}
SEQ=${SEQ:-2048}
MICRO_BATCH=${MICRO_BATCH:-2}
PACKING=${PACKING:-true}
: "${MODEL_CONFIG:?set MODEL_CONFIG to a MoE model config.json}"
: "${TOKENIZER_DIR:?set TOKENIZER_DIR to a folder with the tokenizer files}"
: "${TRAIN_FILE:?set TRAIN_FILE to a JSON / JSONL file of chat or Alpaca rows}"
source "$ROOT/benchmarks/model_dir.sh"  # MODEL_DIR: tokenizer files + MODEL_CONFIG
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}  # CPU threads per rank
runs=()
for ep in ${EPS:-1 2}; do
  run="$OUT/ep${ep}"
  rm -rf "$run"
  NGPU=${NGPU:-} CONFIG_FILE=qwen3-30b-a3b.yaml bash "$ROOT/recipes/moe-lora-fsdp2-ep/launch.sh" output_dir="$run" \
    run_name="bench-ep${ep}" mlflow=false model.name_or_path="$MODEL_DIR" model.pretrained=false parallel.ep=$ep \
    "data.train_files=[$TRAIN_FILE]" data.max_length=$SEQ data.packing=$PACKING data.eval_fraction=0 \
    train.micro_batch_size=$MICRO_BATCH train.grad_accum_steps=1 train.max_steps=$STEPS train.log_every=2 \
    checkpoint.every_steps=-1 checkpoint.export_adapter=false "$@"
  runs+=("$run")
done
python3 "$ROOT/benchmarks/summarize.py" --skip-steps ${SKIP_STEPS:-4} "${runs[@]}"
