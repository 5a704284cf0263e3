#!/usr/bin/env bash
# One benchmark run, two paths, same model, tokenizer, rows and GPUs:
#   1. the usual library path: TRL SFTTrainer + DeepSpeed ZeRO-3 (benchmarks/trl_zero3_reference.py),
#      seq 2048 packed, micro-batch 4, gradient checkpointing;
#   2. recipes/qwen-fsdp2-sft at each sequence length in SEQS, with the same tokens per step
#      (micro-batch 4 at 2048, 2 at 4096), no activation checkpointing, per-layer torch.compile.
# Then one table of the medians (benchmarks/summarize.py).
#
#   MODEL_CONFIG=qwen3-8b/config.json TOKENIZER_DIR=qwen3-tokenizer TRAIN_FILE=alpaca_data.json \
#     NGPU=2 STEPS=10 bash benchmarks/sft_side_by_side.sh [extra FSDP2 overrides]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT=${OUT_DIR:-outputs/bench-sft}
STEPS=${STEPS:-10}
NGPU=${NGPU:-$(python3 -c 'import torch; print(torch.cuda.device_count())')}
: "${MODEL_CONFIG:?set MODEL_CONFIG to a model config.json}"
: "${TOKENIZER_DIR:?set TOKENIZER_DIR to a folder with the tokenizer files}"
: "${TRAIN_FILE:?set TRAIN_FILE to a JSON / JSONL file of chat or Alpaca rows}"
source "$ROOT/benchmarks/model_dir.sh"  # MODEL_DIR: tokenizer files + MODEL_CONFIG
rm -rf "$OUT/trl-zero3-seq2048"
torchrun --standalone --nproc-per-node "$NGPU" "$ROOT/benchmarks/trl_zero3_reference.py" --model-dir "$MODEL_DIR" \
  --train-file "$TRAIN_FILE" --seq 2048 --micro-batch 4 --steps "$STEPS" --out "$OUT/trl-zero3-seq2048"
runs=("$OUT/trl-zero3-seq2048")
for seq in ${SEQS:-2048 4096}; do
  run="$OUT/fsdp2-seq${seq}"
  rm -rf "$run"
  NGPU=$NGPU bash "$ROOT/recipes/qwen-fsdp2-sft/launch.sh" output_dir="$run" run_name="bench-seq${seq}" mlflow=false \
    model.name_or_path="$MODEL_DIR" model.pretrained=false "data.train_files=[$TRAIN_FILE]" data.max_length=$seq \
    data.eval_fraction=0 train.micro_batch_size=$((8192 / seq)) train.grad_accum_steps=1 train.max_steps=$STEPS \
    train.log_every=2 train.activation_checkpointing=none train.compile=true checkpoint.every_steps=-1 \
    checkpoint.export_hf=false "$@"
  runs+=("$run")
done
python3 "$ROOT/benchmarks/summarize.py" --skip-steps ${SKIP_STEPS:-4} "${runs[@]}"
