#!/usr/bin/env bash
# The first GPU runs of both MoE LoRA recipes, in one command on ONE GPU: EP=1, random init from the architectures
# shipped in the recipes' models/, bf16 base, LoRA r 16 on q/k/v/o and the experts, each recipe's config.yaml otherwise
# (full activation checkpointing, eager, routed expert LoRA); RUNS (default both, in this order):
#   nemotron  recipes/moe-lora-fsdp2-ep, Nemotron 3 Nano 30B-A3B (nemotron_h: Mamba-2 + attention + MoE), the Llama 3
#             tokenizer (128,256 tokens: fits its 131,072 embedding rows, Qwen3's 151,669 do not; its template's
#             assistant turns are what cookbook.sft labels), the first TEXT_ROWS Alpaca rows, right-padded (packing
#             stays off for nemotron_h), TEXT_MICRO_BATCH rows per step;
#   qwen3-vl  recipes/moe-lora-fsdp2-ep/qwen3-vl-30b-a3b.yaml, Qwen3-VL-30B-A3B, the Qwen3 tokenizer with the tiny twin's chat template
#             (ChatML, image parts as <|vision_start|><|image_pad|><|vision_end|>) and image processor settings
#             (Qwen2-VL processor, patch 16, merge 2, temporal 2: the 30B vision config's), the image + text rows of
#             DATA_DIR/vl/vl.jsonl (benchmarks/vl_rows.py), VL_MICRO_BATCH rows per step, images capped at 512 x 512.
# STEPS steps each, medians of the steps after SKIP_STEPS (benchmarks/summarize.py: tokens/s/GPU, MFU, peak memory).
# A run that fails or passes RUN_TIMEOUT seconds is recorded and the next one starts. The recipes log how long the
# random init took and, for nemotron_h, whether mamba_ssm / causal_conv1d import or transformers' PyTorch path runs.
# TINY=1: the same commands on CPU (one gloo process), the configs shrunk to their tiny twins' sizes with the
# published vocabularies (benchmarks/tiny_config.py): a dry run of this script.
#
#   DATA_DIR=.data RESULTS_DIR=<folder> bash benchmarks/moe_first_gpu_runs.sh [config overrides for both runs]
#
# DATA_DIR: llama-3-tokenizer/, qwen3/ (tokenizer files), alpaca_data_sample5000.json, and vl/ made once with
#   python benchmarks/vl_rows.py --images ../shared/data/datasets/images/hymenoptera_data/train \
#     --alpaca .data/alpaca_data_sample5000.json --out .data/vl
# TEXT_ARGS / VL_ARGS: more overrides for one run (a word list). Writes into RESULTS_DIR: moe-first-gpu-runs.jsonl
# (per run summarize.py's row and the loss of every step, or {"run", "failed": exit status; 124: cut by
# RUN_TIMEOUT}), metrics-<run>.jsonl, <run>.log. Run folders stay in WORK_DIR.
# On the project's GPU machine (carry [".whl", ".data"]; benchmarks/README.md has the call), expected about 4 minutes:
# per run the launcher's check and the workers' start (imports, tokenizing, decoding: tens of seconds), the random
# init on the GPU (seconds), the first step, then about a second (qwen3-vl) to a few (nemotron, PyTorch Mamba) per step.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORK=${WORK_DIR:-outputs/bench-moe-first-gpu-runs}
RESULTS=${RESULTS_DIR:-$WORK/results}
DATA=$(realpath "${DATA_DIR:-$ROOT/.data}")
RUNS=${RUNS:-nemotron qwen3-vl}
TEXT_ROWS=${TEXT_ROWS:-1024}
TEXT_RECIPE=$ROOT/recipes/moe-lora-fsdp2-ep
VL_RECIPE=$TEXT_RECIPE  # the image + text variant: its qwen3-vl-30b-a3b.yaml
TEXT_CONFIG=$TEXT_RECIPE/models/nemotron-3-nano-30b-a3b/config.json
VL_CONFIG=$VL_RECIPE/models/qwen3-vl-30b-a3b/config.json
mkdir -p "$RESULTS" "$WORK"
if [ "${TINY:-0}" = 1 ]; then  # CPU dry run: tiny twins' sizes, fewer rows per step, one loader worker
  STEPS=${STEPS:-4} SKIP_STEPS=${SKIP_STEPS:-2} RUN_TIMEOUT=${RUN_TIMEOUT:-600}
  TEXT_MICRO_BATCH=${TEXT_MICRO_BATCH:-4} VL_MICRO_BATCH=${VL_MICRO_BATCH:-2} TINY_ARGS="data.num_workers=1"
  python3 "$ROOT/benchmarks/tiny_config.py" "$TEXT_CONFIG" "$TEXT_RECIPE/tiny/nemotron-h/config.json" "$WORK/tiny/nemotron.json"
  python3 "$ROOT/benchmarks/tiny_config.py" "$VL_CONFIG" "$VL_RECIPE/tiny/qwen3-vl-moe/config.json" "$WORK/tiny/qwen3-vl.json"
  TEXT_CONFIG=$WORK/tiny/nemotron.json VL_CONFIG=$WORK/tiny/qwen3-vl.json
fi
STEPS=${STEPS:-10} SKIP_STEPS=${SKIP_STEPS:-4} RUN_TIMEOUT=${RUN_TIMEOUT:-240}
TEXT_MICRO_BATCH=${TEXT_MICRO_BATCH:-32} VL_MICRO_BATCH=${VL_MICRO_BATCH:-8}
export PYTHONPATH="$ROOT/shared${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
python3 -c "import torch, transformers, peft; print('torch', torch.__version__, '| transformers', transformers.__version__, '| peft', peft.__version__)"

# Model folders (config.json + tokenizer files; the VL one also a chat template and an image processor config).
rm -rf "$WORK/models"
OUT=$WORK/models/nemotron TOKENIZER_DIR=$DATA/llama-3-tokenizer MODEL_CONFIG=$TEXT_CONFIG source "$ROOT/benchmarks/model_dir.sh"
TEXT_MODEL=$MODEL_DIR
OUT=$WORK/models/qwen3-vl TOKENIZER_DIR=$DATA/qwen3 MODEL_CONFIG=$VL_CONFIG source "$ROOT/benchmarks/model_dir.sh"
VL_MODEL=$MODEL_DIR
cp "$VL_RECIPE/tiny/qwen3-vl-moe/chat_template.jinja" "$VL_RECIPE/tiny/qwen3-vl-moe/preprocessor_config.json" "$VL_MODEL/"
TEXT_FILE=$WORK/alpaca-$TEXT_ROWS.json
python3 -c "import json, sys; json.dump(json.load(open(sys.argv[1]))[:int(sys.argv[3])], open(sys.argv[2], 'w'))" \
  "$DATA/alpaca_data_sample5000.json" "$TEXT_FILE" "$TEXT_ROWS"

source "$ROOT/benchmarks/record_runs.sh"  # record_run, summarize_runs
for run in $RUNS; do
  case $run in
    nemotron) recipe=$TEXT_RECIPE; config=config.yaml; args=(model.name_or_path="$TEXT_MODEL" "data.train_files=[$TEXT_FILE]" data.packing=false
                train.micro_batch_size="$TEXT_MICRO_BATCH" ${TEXT_ARGS:-}) ;;
    qwen3-vl) recipe=$VL_RECIPE; config=qwen3-vl-30b-a3b.yaml; args=(model.name_or_path="$VL_MODEL" "data.train_files=[$DATA/vl/vl.jsonl]"
                train.micro_batch_size="$VL_MICRO_BATCH" ${VL_ARGS:-}) ;;
    *) echo "unknown run $run (nemotron, qwen3-vl)" >&2; exit 2 ;;
  esac
  dir=$WORK/$run
  rm -rf "$dir"
  rc=0
  # -k: SIGKILL if the launcher has not stopped 60 s after SIGTERM (its workers die with it)
  # shellcheck disable=SC2086  # TINY_ARGS is a word list
  CONFIG_FILE=$recipe/$config MAX_RESTARTS=0 NGPU=1 timeout -k 60 "$RUN_TIMEOUT" bash "$recipe/launch.sh" output_dir="$dir" run_name="first-$run" \
    mlflow=false model.pretrained=false parallel.ep=1 data.eval_fraction=0 train.grad_accum_steps=1 \
    train.max_steps="$STEPS" train.log_every=1 checkpoint.every_steps=-1 checkpoint.export_adapter=false \
    ${TINY_ARGS:-} "${args[@]}" "$@" 2>&1 | tee "$RESULTS/$run.log" || rc=$?
  record_run "$run" "$dir" "$rc" "$RESULTS/moe-first-gpu-runs.jsonl"
done
summarize_runs "$RESULTS/moe-first-gpu-runs.jsonl"
