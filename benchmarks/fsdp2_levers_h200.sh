#!/usr/bin/env bash
# recipes/qwen-fsdp2-sft on one GPU, Qwen3-4B architecture, seq 2048, micro-batch 4, selective checkpointing,
# chunked loss, per-layer compile, expandable_segments: the levers one run each, one after the other (bf16
# gradient reduction, gradient accumulation, no reshard after forward), two of them with one profiled step
# (step 9, summed by benchmarks/trace_summary.py; its time stays in the medians, one of 7 steps).
#   OUT=<folder> bash benchmarks/fsdp2_levers_h200.sh   (data in .data/: qwen3 tokenizer, Alpaca sample)
# Writes to OUT: levers.jsonl (one row per run: benchmarks/summarize.py --json, startup_s, losses),
# metrics-all.jsonl (every run's metrics.jsonl lines, each with its "run"), trace-<run>.json, ops-<run>.txt.
# DEADLINE_S (default 520) bounds the runs together (benchmarks/fsdp2_sft.sh).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
export OUT_DIR=${BENCH_DIR:-/tmp/bench} MODEL_CONFIG=$ROOT/tests/data/config_Qwen3-4B.json TOKENIZER_DIR=$ROOT/.data/qwen3
export TRAIN_FILE=$ROOT/.data/alpaca_data_sample5000.json NGPU=1 STEPS=${STEPS:-12} SKIP_STEPS=${SKIP_STEPS:-5}
export RUN_TIMEOUT_S=${RUN_TIMEOUT_S:-110} DEADLINE_S=${DEADLINE_S:-520} JSON=$OUT/levers.jsonl
VARIANTS=${VARIANTS:-"base:train.profile_step=9 bf16r-acc2:fsdp.reduce_dtype=bf16,train.grad_accum_steps=2
  bf16r-nores-acc2:fsdp.reduce_dtype=bf16,fsdp.reshard_after_forward=false,train.grad_accum_steps=2,train.profile_step=9
  acc2:train.grad_accum_steps=2 bf16r-acc4:fsdp.reduce_dtype=bf16,train.grad_accum_steps=4
  bf16r-nores:fsdp.reduce_dtype=bf16,fsdp.reshard_after_forward=false"} \
  bash "$ROOT/benchmarks/fsdp2_sft.sh" mlflow=false train.micro_batch_size=4 train.grad_accum_steps=1 train.log_every=1 \
  train.activation_checkpointing=selective train.loss=chunked train.compile=true "$@"
for m in "$OUT_DIR"/*/metrics.jsonl; do
  run=$(basename "$(dirname "$m")")
  sed "s/^{/{\"run\": \"$run\", /" "$m" >> "$OUT/metrics-all.jsonl"
done
for t in "$OUT_DIR"/*/profile/trace_rank0.json; do
  [[ -f $t ]] || continue
  run=$(basename "$(dirname "$(dirname "$t")")")
  python3 "$ROOT/benchmarks/trace_summary.py" "$t" --json "$OUT/trace-$run.json"
  cp "$(dirname "$t")/ops_rank0.txt" "$OUT/ops-$run.txt"
done
