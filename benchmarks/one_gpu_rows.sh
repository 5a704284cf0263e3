#!/usr/bin/env bash
# Three measurements in one device call on one GPU (issues 19 and 20), each bounded in time; a part that fails or runs
# out of time is recorded and the next one starts. Random init everywhere (no hub here): the timings and throughputs
# are those of the architectures, not of trained weights; accuracies are not comparable to pretrained runs.
#   modernbert  recipes/modernbert-ddp with config.yaml's defaults (ModernBERT-base architecture: transformers'
#               ModernBertConfig defaults; torch.compile on, micro-batch 32, seq 256 padded, eval_every 500,
#               checkpoint at the end, export) on the real ModernBERT tokenizer, 5,000 real AG News training rows
#               (156 steps per epoch, so step 157 starts epoch 2) and 2,000 real AG News evaluation rows, 300 steps:
#               the summary's startup_s (launch to the end of the first step, the compilation included), first_step_s
#               and final_eval_s, and the train records' epoch_start_wait_s next to the median data wait and step time.
#               Each modernbert part compiles with empty caches (inductor's and Triton's, in a folder of its own).
#   modernbert_layers  the same with model.compile_scope=layers (each encoder layer compiled on its own).
#   ray         recipes/two-tower-ray with config.yaml's defaults (one Ray Train worker per GPU, micro-batch 4,096,
#               10 epochs) on generated interactions (scripts/make_tiny_interactions.py at USERS x PER_USER rows, the
#               tiny set's construction: no real interaction data is offline): samples/s per GPU and recall@k of the
#               towers against the popularity baseline. Ray comes from .whl-ray/ (benchmarks/ray_wheel.sh: ray 2.60.0
#               without its Java jar, web UI, RLlib/Serve/LLM and symbol tables, plus jsonschema).
#   zero3 zero2 zero1
#               recipes/qwen-zero3-receipts with llama3.2-1b.yaml (Llama-3.2-1B architecture from its config.json,
#               micro-batch 8, one receipt per row, max_length 1024, full activation checkpointing, bf16) on the 626
#               real SROIE receipts, the Llama 3 tokenizer (chat template), ZERO_STEPS steps with zero3.json / zero2.json
#               / zero1.json (benchmarks/zero3_receipts.sh, FSDP2=false): tokens/s/GPU. On one GPU no stage shards
#               anything, so the differences are each stage's overhead (ZeRO-3's gathers and partitioning hooks), not
#               the memory or communication trade-off of several GPUs.
# Data: DATA_TAR (default .data/one-gpu-rows.tar.xz, 2.8 MB), unpacked into WORK, holds one-gpu-rows/ with
#   modernbert/{tokenizer.json,tokenizer_config.json,special_tokens_map.json}   (answerdotai/ModernBERT-base's)
#   ag_news/{hf_subset_train_5000.csv,train.csv}        (5,000 rows, HF layout; the first 2,000 rows of the original CSV)
#   sroie/sroie2019_train.jsonl                         (the 626 SROIE 2019 train receipts, {id, entities, ocr_boxes})
#   llama-3.2-1b/config.json                            (Llama-3.2-1B's) with the Llama 3 tokenizer.json and
#   llama-3.2-1b/tokenizer_config.json                  (the Llama 3 tokenizer's own, with its chat template: with
#                                                       another tokenizer_config.json beside that tokenizer.json the
#                                                       recipe counted 128,259 tokens against the model's 128,256
#                                                       rows and refused to start); made with `tar -cJf`.
# Time: BUDGET_S (default 450) bounds the whole script; each part gets min(its own limit: MODERNBERT_LIMIT_S 200,
# RAY_LIMIT_S 120, ZERO_LIMIT_S 120 per stage; what is left) and is skipped (recorded) when under 45 s would be left.
# After a part, its run's processes get 30 s to end (a timed-out launcher stops its workers after timeout returns),
# then are killed, so that no part overlaps the next.
#
#   PARTS="modernbert ray zero3 zero2 zero1" NGPU=1 bash benchmarks/one_gpu_rows.sh     # on the device
#   TINY=1 bash benchmarks/one_gpu_rows.sh          # CPU check of every code path: tiny models, few steps, NGPU unset
#
# Writes three files (a device call brings back 8 at most): $OUT/results.jsonl (one record per part: its numbers, or
# its exit status and error), $OUT/parts.log (each run's last 40 lines) and $OUT/metrics.jsonl (every run's
# metrics.jsonl records, each with its "part"); benchmarks/one_gpu_rows.py picks the numbers out of the runs.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT=${OUT:-outputs/one-gpu-rows}
WORK=${WORK:-/tmp/one-gpu-rows}
TINY=${TINY:-0}
PARTS=${PARTS:-modernbert ray zero3 zero2 zero1}
BUDGET_S=${BUDGET_S:-450}
DATA_TAR=${DATA_TAR:-.data/one-gpu-rows.tar.xz}
ZERO_STEPS=${ZERO_STEPS:-25}
USERS=${USERS:-20000}
PER_USER=${PER_USER:-20}
ITEMS=${ITEMS:-4000}
MIN_S=45
START=$SECONDS
mkdir -p "$OUT"
RESULTS="$OUT/results.jsonl"
: > "$RESULTS"
: > "$OUT/parts.log"
: > "$OUT/metrics.jsonl"
say() { echo "$(date -u +%H:%M:%S) $*"; }
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TQDM_DISABLE=1 TOKENIZERS_PARALLELISM=false
export PYTHONUNBUFFERED=1
if [[ "$TINY" == 1 ]]; then
  MB_STEPS=12; ZERO_STEPS=4; ZERO_MB=2; USERS=600; ITEMS=300; PER_USER=10  # ZERO_MB: 128,256-wide fp32 logits on CPU
else
  MB_STEPS=300; ZERO_MB=8  # llama3.2-1b.yaml's micro-batch
fi

record() {  # part exit_status log [numbers json]: one line in results.jsonl (benchmarks/one_gpu_rows.py)
  python3 benchmarks/one_gpu_rows.py record "$@" >> "$RESULTS"
}

limit() {  # part's own limit in s -> what is left of BUDGET_S, at most that; 0 when under MIN_S is left
  local left=$((BUDGET_S - (SECONDS - START)))
  (( left > $1 )) && left=$1
  (( left < MIN_S )) && left=0
  echo "$left"
}

keep() {  # part log metrics.jsonl exit_status: the log's last 40 lines into parts.log, the records into metrics.jsonl
  { echo "===== $1 (exit status $4)"; tail -n 40 "$2"; } >> "$OUT/parts.log"
  python3 benchmarks/one_gpu_rows.py tag "$1" "$3" >> "$OUT/metrics.jsonl"
}

settle() {  # folder: wait up to 30 s for the processes whose command line names a stopped run's folder, then KILL them
  # (a timed-out part: the launcher passes SIGTERM on to its workers and waits for them, after timeout has returned)
  local i pids
  for i in $(seq 30); do
    pids=$(pgrep -f -- "$1") || return 0
    sleep 1
  done
  say "killing what is left of $1: $pids"
  kill -KILL $pids 2>/dev/null
}

skip() { say "[$1] skipped: under ${MIN_S}s of BUDGET_S=${BUDGET_S}s left"; echo "{\"part\": \"$1\", \"skipped\": \"under ${MIN_S} s of the ${BUDGET_S} s budget left\"}" >> "$RESULTS"; }

say "unpacking $DATA_TAR into $WORK"
rm -rf "$WORK"
mkdir -p "$WORK"
python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter='data')" "$DATA_TAR" "$WORK" \
  || { echo '{"part": "setup", "error": "cannot unpack DATA_TAR"}' >> "$RESULTS"; exit 1; }
DATA="$WORK/one-gpu-rows"
python3 - <<'PY' 2>&1 | grep -v Warning
import importlib, torch
print(" | ".join(f"{m} {importlib.import_module(m).__version__}" for m in ("torch", "transformers", "trl", "deepspeed", "datasets")),
      "| cuda", torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")
PY

# ------------------------------------------------------------------ (a) ModernBERT start-up, final eval, epoch start
part_modernbert() {  # name [override ...]: the part's name and overrides of config.yaml's defaults
  local name=$1 run="$WORK/$1" log="$WORK/$1.log" t rc extra=("${@:2}")
  t=$(limit "${MODERNBERT_LIMIT_S:-200}"); [[ $t == 0 ]] && { skip "$name"; return; }
  python3 - "$WORK/modernbert-base" "$DATA/modernbert" "$TINY" <<'PY' || { record modernbert 1 /dev/null; return; }
import sys
from transformers import AutoTokenizer, ModernBertConfig
# ModernBERT-base's architecture is ModernBertConfig's defaults (768 hidden, 22 layers); TINY: 2 layers of 64
cfg = ModernBertConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4) \
    if sys.argv[3] == "1" else ModernBertConfig()
cfg.save_pretrained(sys.argv[1])
AutoTokenizer.from_pretrained(sys.argv[2]).save_pretrained(sys.argv[1])
PY
  # TINY: 9 steps per epoch on 2 CPU processes, so step 10 starts epoch 2
  [[ "$TINY" == 1 ]] && extra+=(model.compile=false data.max_length=64 data.num_workers=1 train.micro_batch_size=256
                                train.log_every=2)
  say "[$name] $MB_STEPS steps, config.yaml's defaults ${extra[*]} (at most ${t}s; compile caches empty)"
  # each part compiles from nothing: inductor's and Triton's caches in a folder of its own
  timeout --signal=TERM --kill-after=20 "$t" env NGPU="${NGPU:-}" MAX_RESTARTS=0 \
    TORCHINDUCTOR_CACHE_DIR="$WORK/$name-inductor" TRITON_CACHE_DIR="$WORK/$name-triton" bash recipes/modernbert-ddp/launch.sh \
    output_dir="$run" run_name="one-gpu-$name" mlflow=false model.name_or_path="$WORK/modernbert-base" \
    model.pretrained=false "data.train_files=[$DATA/ag_news/hf_subset_train_5000.csv]" \
    "data.eval_files=[$DATA/ag_news/train.csv]" train.max_steps=$MB_STEPS ${extra[@]+"${extra[@]}"} > "$log" 2>&1
  rc=$?
  settle "$run"
  keep "$name" "$log" "$run/metrics.jsonl" $rc
  record "$name" $rc "$log" "$(python3 benchmarks/one_gpu_rows.py modernbert "$run/metrics.jsonl")"
  say "[$name] exit status $rc"
}

# ------------------------------------------------------------------ (c) two-tower Ray: samples/s/GPU, recall@k
part_ray() {
  local run="$WORK/two-tower" log="$WORK/ray.log" t rc extra=()
  t=$(limit "${RAY_LIMIT_S:-120}"); [[ $t == 0 ]] && { skip ray; return; }
  python3 scripts/make_tiny_interactions.py --users "$USERS" --items "$ITEMS" --per-user "$PER_USER" \
    --out "$WORK/interactions.csv" > "$log" 2>&1 || { record ray 1 "$log"; return; }
  [[ "$TINY" == 1 ]] && extra=(train.epochs=2 train.micro_batch_size=256 train.log_every=5 ray.cpus_per_worker=1)
  say "[ray] two-tower-ray on $USERS x $PER_USER generated interactions (at most ${t}s)"
  timeout --signal=TERM --kill-after=20 "$t" bash recipes/two-tower-ray/launch.sh output_dir="$run" \
    run_name=one-gpu-two-tower mlflow=false "data.interactions=$WORK/interactions.csv" "${extra[@]}" >> "$log" 2>&1
  rc=$?
  settle "$run"
  keep ray "$log" "$run/metrics.jsonl" $rc
  record ray $rc "$log" "$(python3 benchmarks/one_gpu_rows.py ray "$run/metrics.jsonl")"
  say "[ray] exit status $rc"
}

# ------------------------------------------------------------------ (b) ZeRO-3 / ZeRO-2 / ZeRO-1, Llama-3.2-1B config
part_zero() {  # zero3 | zero2 | zero1
  local stage=$1 log="$WORK/$1.log" t rc model_config="$DATA/llama-3.2-1b/config.json" extra=()
  t=$(limit "${ZERO_LIMIT_S:-120}"); [[ $t == 0 ]] && { skip "$stage"; return; }
  if [[ "$TINY" == 1 ]]; then  # the Llama-3.2-1B config cut to 2 layers of 64 (the real tokenizer and its vocab)
    model_config="$WORK/llama-tiny.json"
    python3 -c "import json, sys; c = json.load(open(sys.argv[1])); c.update(num_hidden_layers=2, hidden_size=64,
intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16); json.dump(c, open(sys.argv[2], 'w'))" \
      "$DATA/llama-3.2-1b/config.json" "$model_config"
    extra=(data.num_workers=0 train.log_every=1)
  fi
  say "[$stage] llama3.2-1b.yaml, $ZERO_STEPS steps with $stage.json (at most ${t}s)"
  timeout --signal=TERM --kill-after=20 "$t" env CONFIG_FILE="$ROOT/recipes/qwen-zero3-receipts/llama3.2-1b.yaml" \
    MODEL_CONFIG="$model_config" TOKENIZER_DIR="$DATA/llama-3.2-1b" TRAIN_FILE="$DATA/sroie/sroie2019_train.jsonl" \
    OUT_DIR="$WORK/zero-$stage" NGPU="${NGPU:-}" MAX_RESTARTS=0 STEPS=$ZERO_STEPS SEQS=1024 PACKING=false MICRO_BATCH=$ZERO_MB \
    DS_CONFIG=$stage.json FSDP2=false SKIP_STEPS=$((ZERO_STEPS / 2)) \
    bash benchmarks/zero3_receipts.sh mlflow=false "${extra[@]}" > "$log" 2>&1
  rc=$?
  local run="$WORK/zero-$stage/$stage-seq1024-packed_false"
  settle "$WORK/zero-$stage"
  keep "$stage" "$log" "$run/metrics.jsonl" $rc
  [[ -f "$run/metrics.jsonl" ]] && python3 benchmarks/summarize.py --skip-steps $((ZERO_STEPS / 2)) \
    --json "$WORK/$stage.json" "$run" > /dev/null
  record "$stage" $rc "$log" "$(python3 benchmarks/one_gpu_rows.py zero "$WORK/$stage.json")"
  say "[$stage] exit status $rc"
}

for part in $PARTS; do
  case $part in
    modernbert) part_modernbert modernbert ;;
    modernbert_layers) part_modernbert modernbert_layers model.compile_scope=layers ;;
    ray) part_ray ;;
    zero3|zero2|zero1) part_zero "$part" ;;
    *) echo "one_gpu_rows.sh: unknown part $part" >&2 ;;
  esac
done
say "done in $((SECONDS - START))s; $RESULTS:"
cat "$RESULTS"
