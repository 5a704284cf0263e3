#!/usr/bin/env bash
# Issue 37 item 5 in one call on one GPU: TRL + ZeRO-3 (benchmarks/sft_side_by_side.sh, the reference, first), then
# recipes/qwen-fsdp2-sft as config.yaml ships it (selective checkpointing, chunked loss, per-layer compile), then
# two variants of it: with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, and with fsdp.reshard_after_forward=false.
# Qwen3-4B architecture, seq 2048, micro-batch 4, no accumulation (8,192 token slots per step on both paths),
# 12 steps, medians over the 2-step windows after step 4.
#   OUT=<folder> bash benchmarks/fsdp2_side_by_side_h200.sh   (data in .data/: qwen3 tokenizer, Alpaca sample)
# Writes to OUT: side-by-side.jsonl (benchmarks/summarize.py --json: one row per run, startup_s, losses) and
# metrics-all.jsonl (every run's metrics.jsonl lines, each with its "run").
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export OUT_DIR=${BENCH_DIR:-/tmp/sbs} MODEL_CONFIG=$ROOT/tests/data/config_Qwen3-4B.json TOKENIZER_DIR=$ROOT/.data/qwen3
export TRAIN_FILE=$ROOT/.data/alpaca_data_sample5000.json NGPU=1 STEPS=${STEPS:-12} SKIP_STEPS=${SKIP_STEPS:-4}
common=(train.activation_checkpointing=selective train.loss=chunked train.compile=true train.log_every=2)
SEQS=2048 bash "$ROOT/benchmarks/sft_side_by_side.sh" "${common[@]}"
export RUN_TIMEOUT_S=${RUN_TIMEOUT_S:-120}
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True VARIANTS="expandable:" \
  bash "$ROOT/benchmarks/fsdp2_sft.sh" mlflow=false train.micro_batch_size=4 train.grad_accum_steps=1 "${common[@]}"
VARIANTS="nores:fsdp.reshard_after_forward=false" \
  bash "$ROOT/benchmarks/fsdp2_sft.sh" mlflow=false train.micro_batch_size=4 train.grad_accum_steps=1 "${common[@]}"
runs=("$OUT_DIR"/trl-zero3-seq2048 "$OUT_DIR"/fsdp2-seq2048 "$OUT_DIR"/expandable-seq2048 "$OUT_DIR"/nores-seq2048)
have=(); for r in "${runs[@]}"; do [[ -s $r/metrics.jsonl ]] && have+=("$r"); done
python3 "$ROOT/benchmarks/summarize.py" --skip-steps "$SKIP_STEPS" --json "$OUT/side-by-side.jsonl" "${have[@]}"
for r in "${have[@]}"; do sed "s/^{/{\"run\": \"$(basename "$r")\", /" "$r/metrics.jsonl" >> "$OUT/metrics-all.jsonl"; done
