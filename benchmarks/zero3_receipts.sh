#!/usr/bin/env bash
# Throughput of recipes/qwen-zero3-receipts (TRL SFTTrainer + DeepSpeed): a model architecture from MODEL_CONFIG
# (e.g. Qwen3-8B's config.json), random init, a real tokenizer (TOKENIZER_DIR) and real SROIE receipts
# (TRAIN_FILE: {id, entities, ocr_boxes} JSONL), at each sequence length in SEQS, micro-batch MICRO_BATCH per GPU,
# bf16, gradient checkpointing; then a table of the medians. PACKING=true (default) packs receipts into rows of
# exactly SEQ tokens (documents kept apart by position ids, no attention mask: the FSDP2 recipe's layout), so
# "seq 2048" means 2048 tokens per row; PACKING=false trains one receipt per row, padded to the longest in the
# micro-batch (~300-600 Qwen3 tokens, whatever SEQ says). DS_CONFIG picks zero3.json / zero2.json / zero1.json.
#
# FSDP2=true (default) then runs recipes/qwen-fsdp2-sft on the same receipts (as chat rows, benchmarks/receipts_to_chat.py)
# at the same sequence length and micro-batch, packed, with its default attention, so one table compares both.
#
#   MODEL_CONFIG=qwen3-8b/config.json TOKENIZER_DIR=qwen3-tokenizer \
#     TRAIN_FILE=sroie2019_train.jsonl NGPU=2 STEPS=40 bash benchmarks/zero3_receipts.sh
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT=${OUT_DIR:-outputs/bench-zero3-receipts}
STEPS=${STEPS:-40}
PACKING=${PACKING:-true}
MICRO_BATCH=${MICRO_BATCH:-4}
DS_CONFIG=${DS_CONFIG:-zero3.json}
: "${MODEL_CONFIG:?set MODEL_CONFIG to a model config.json}"
: "${TOKENIZER_DIR:?set TOKENIZER_DIR to a folder with the tokenizer files}"
: "${TRAIN_FILE:?set TRAIN_FILE to an SROIE JSONL file ({id, entities, ocr_boxes} rows)}"
source "$ROOT/benchmarks/model_dir.sh"  # MODEL_DIR: tokenizer files + MODEL_CONFIG
runs=()
for seq in ${SEQS:-2048}; do
  run="$OUT/${DS_CONFIG%.json}-seq${seq}-packed_${PACKING}"
  rm -rf "$run"
  NGPU=${NGPU:-} bash "$ROOT/recipes/qwen-zero3-receipts/launch.sh" output_dir="$run" run_name="bench-$(basename "$run")" \
    model.name_or_path="$MODEL_DIR" model.pretrained=false "data.train_files=[$TRAIN_FILE]" data.max_length=$seq \
    data.packing=$PACKING data.eval_fraction=0 deepspeed.config=$DS_CONFIG train.micro_batch_size=$MICRO_BATCH \
    train.grad_accum_steps=1 train.max_steps=$STEPS train.log_every=5 checkpoint.every_steps=-1 \
    checkpoint.export_hf=false "$@"
  runs+=("$run")
done
if [ "${FSDP2:-true}" = true ]; then
  python3 "$ROOT/benchmarks/receipts_to_chat.py" "$TRAIN_FILE" "$OUT/receipts_chat.jsonl"
  for seq in ${SEQS:-2048}; do
    run="$OUT/fsdp2-seq${seq}"
    rm -rf "$run"
    NGPU=${NGPU:-} bash "$ROOT/recipes/qwen-fsdp2-sft/launch.sh" output_dir="$run" run_name="bench-fsdp2-seq${seq}" mlflow=false \
      model.name_or_path="$MODEL_DIR" model.pretrained=false "data.train_files=[$OUT/receipts_chat.jsonl]" \
      data.max_length=$seq data.eval_fraction=0 train.micro_batch_size=$MICRO_BATCH train.grad_accum_steps=1 \
      train.max_steps=$STEPS train.log_every=5 checkpoint.every_steps=-1 checkpoint.export_hf=false
    runs+=("$run")
  done
fi
python3 "$ROOT/benchmarks/summarize.py" --skip-steps ${SKIP_STEPS:-10} "${runs[@]}"
