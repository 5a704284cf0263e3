#!/usr/bin/env bash
# Expert LoRA speed on ONE GPU, in one command: the one-GPU ceiling (benchmarks/moe_ceiling.py: frozen base,
# transformers' grouped_mm experts, no LoRA), then recipes/moe-lora-fsdp2-ep at EP=1 for each entry of RUNS,
# <expert_lora>-<activation_checkpointing>[-<compile>]: PEFT's expert LoRA (peft: base + B @ A folded for every expert
# in every forward, the old path) against LoRA on the routed tokens (routed: grouped GEMMs, the default), with the
# activation checkpointing named and train.compile (none when left out; moe: each MoE block's router and routed
# experts; layers: each decoder layer). Qwen3-30B-A3B architecture (MODEL_CONFIG), random init, bf16, LoRA r 16 on q/k/v/o
# and the experts, a real tokenizer (TOKENIZER_DIR) and real rows (TRAIN_FILE) packed to SEQ tokens, MICRO_BATCH rows
# per step (the ceiling gets the same tokens per step), STEPS steps, medians of the windows after SKIP_STEPS.
# PROFILE_STEP > 0: torch.profiler over that step of every run (train.profile_step; keep it <= SKIP_STEPS, out of
# the medians), its operator table copied to RESULTS_DIR/ops-<run>.txt.
#
#   TOKENIZER_DIR=<qwen3 tokenizer folder> TRAIN_FILE=<alpaca_data_sample5000.json> RESULTS_DIR=<folder> \
#     bash benchmarks/moe_lora_speed.sh [config overrides for every recipe run]
#
# Writes into RESULTS_DIR: moe-ceiling.jsonl (one line per CEILING_EXPERTS setting), moe-lora-speed.jsonl (one line
# per run: step_ms, tokens/s/device, MFU, peak memory, the loss of every logged step, or {"run", "failed": exit
# status}), metrics-<run>.jsonl (each run's metrics.jsonl), ops-<run>.txt (PROFILE_STEP). Run folders stay in WORK_DIR.
# A run that fails (out of memory, say) is recorded and the next one starts; RUN_TIMEOUT (s) bounds each run.
#
# The project's GPU machine (torch 2.11, transformers 5.17, peft 0.21.0; no torchdata, omegaconf) needs wheels and
# the data carried in ignored folders of the repo root, prepared here once:
#   bash ../shared/device/wheels.sh transformers==5.24.0 torchdata==0.11.0 omegaconf==2.3.0 peft==0.21.2
#   pip wheel --no-deps -w .whl antlr4-python3-runtime==4.9.3
#   mkdir -p .data && cp -r ../shared/data/models/qwen3 .data/ && cp ../shared/data/datasets/alpaca/alpaca_data_sample5000.json .data/
# then, with carry [".whl", ".data"], one call on one H200 (the ceiling and the 3 default runs; the 3 eager runs of
# the earlier default took about 6 minutes; the two compiled runs add inductor's build, not yet timed on the GPU,
# and each run is cut at RUN_TIMEOUT seconds, a cut run recorded as failed):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
#     && export PYTHONPATH=/tmp/site || exit; TOKENIZER_DIR=.data/qwen3 TRAIN_FILE=.data/alpaca_data_sample5000.json \
#     RESULTS_DIR=$OUT bash benchmarks/moe_lora_speed.sh 2>&1 | tee $OUT/log.txt
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORK=${WORK_DIR:-outputs/bench-moe-lora-speed}
RESULTS=${RESULTS_DIR:-$WORK/results}
SEQ=${SEQ:-2048}
MICRO_BATCH=${MICRO_BATCH:-2}
STEPS=${STEPS:-8}
SKIP_STEPS=${SKIP_STEPS:-4}
RUNS=${RUNS:-routed-none routed-none-moe routed-none-layers}
PROFILE_STEP=${PROFILE_STEP:-0}
CEILING_EXPERTS=${CEILING_EXPERTS:-grouped_mm}
RUN_TIMEOUT=${RUN_TIMEOUT:-150}
MODEL_CONFIG=${MODEL_CONFIG:-$ROOT/recipes/moe-lora-fsdp2-ep/models/qwen3-30b-a3b/config.json}
: "${TOKENIZER_DIR:?set TOKENIZER_DIR to a folder with the tokenizer files}"
: "${TRAIN_FILE:?set TRAIN_FILE to a JSON / JSONL file of chat or Alpaca rows}"
TRAIN_FILE=$(realpath "$TRAIN_FILE")
mkdir -p "$RESULTS" "$WORK"
OUT=$WORK source "$ROOT/benchmarks/model_dir.sh"  # MODEL_DIR: tokenizer files + MODEL_CONFIG, in WORK_DIR
export PYTHONPATH="$ROOT/shared${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
python3 -c "import torch, transformers, peft; print('torch', torch.__version__, '| transformers', transformers.__version__, '| peft', peft.__version__)"

# shellcheck disable=SC2086  # CEILING_EXPERTS and CEILING_ARGS are word lists
[ "${RUN_CEILING:-1}" = 0 ] || python3 "$ROOT/benchmarks/moe_ceiling.py" --config "$MODEL_CONFIG" --experts $CEILING_EXPERTS --seq-len "$SEQ" \
  --tokens $((SEQ * MICRO_BATCH)) --out "$RESULTS/moe-ceiling.jsonl" ${CEILING_ARGS:-}

source "$ROOT/benchmarks/record_runs.sh"  # record_run, summarize_runs
for run in $RUNS; do
  dir="$WORK/$run"
  rm -rf "$dir"
  rc=0
  IFS=- read -r expert_lora checkpointing compiled <<< "$run"
  MAX_RESTARTS=0 NGPU=${NGPU:-1} CONFIG_FILE=qwen3-30b-a3b.yaml timeout "$RUN_TIMEOUT" \
    bash "$ROOT/recipes/moe-lora-fsdp2-ep/launch.sh" output_dir="$dir" run_name="bench-$run" mlflow=false \
    model.name_or_path="$MODEL_DIR" model.pretrained=false parallel.ep=1 \
    lora.expert_lora="$expert_lora" train.activation_checkpointing="$checkpointing" train.compile="${compiled:-none}" \
    train.profile_step="$PROFILE_STEP" \
    "data.train_files=[$TRAIN_FILE]" data.max_length="$SEQ" data.packing=true data.eval_fraction=0 \
    train.micro_batch_size="$MICRO_BATCH" train.grad_accum_steps=1 train.max_steps="$STEPS" train.log_every=2 \
    checkpoint.every_steps=-1 checkpoint.export_adapter=false "$@" || rc=$?
  [ -f "$dir/profile/ops_rank0.txt" ] && cp "$dir/profile/ops_rank0.txt" "$RESULTS/ops-$run.txt"
  record_run "$run" "$dir" "$rc" "$RESULTS/moe-lora-speed.jsonl"
done
summarize_runs "$RESULTS/moe-lora-speed.jsonl"
