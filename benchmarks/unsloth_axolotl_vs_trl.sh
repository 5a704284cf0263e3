#!/usr/bin/env bash
# One call, one GPU, one model: LoRA of the Llama-3.2-3B architecture (random init from
# recipes/unsloth-lora-ddp/models/llama-3.2-3b/config.json, bf16, the Llama-3 tokenizer, real Alpaca rows) through
#   (b) the TRL path: recipes/unsloth-lora-ddp/train.py model.loader=transformers (AutoModelForCausalLM + PEFT's
#       get_peft_model under TRL's SFTTrainer, transformers' gradient checkpointing), run first; it writes the
#       random-init checkpoint that (a) then loads, so both train the same weights;
#   (a) Unsloth: the same train.py, model.loader=unsloth (FastLanguageModel.from_pretrained / get_peft_model, its
#       gradient checkpointing);
#   (c) Axolotl: not run (see the record it writes: its pins need another transformers, peft, trl and accelerate
#       than the image's, and ~60 more packages, beyond what one call can bring).
# Same rows, seq 2048 (no packing), LoRA r 16 / alpha 32 on q,k,v,o,gate,up,down, micro-batch 4, STEPS steps.
# Both run in one environment: the image's torch 2.11, transformers 5.17, accelerate 1.15, peft 0.21.0, plus
# .whl-ft/ (unsloth 2026.10.9 without its studio/ web UI, unsloth_zoo, trl 1.15.0, datasets 4.8.4, cut_cross_entropy,
# xxhash) and omegaconf/pydantic/dill/multiprocess from .whl/, installed into their own --target (not .whl's
# transformers 5.24 / trl 1.16 / datasets 5.2, which Unsloth refuses). No bitsandbytes, no xformers: 16-bit LoRA.
#   bash benchmarks/unsloth_axolotl_vs_trl.sh          # on the device, from the repository root
#   STEPS=60 SKIP_STEPS=10 OUT=/tmp/out bash benchmarks/unsloth_axolotl_vs_trl.sh
# Writes $OUT/results.jsonl (one record per path: tokens/s/GPU median, MFU, peak memory, losses, or the error),
# $OUT/{trl,unsloth}.log (each run's last lines) and $OUT/{trl,unsloth}-metrics.jsonl.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT=${OUT:-outputs/bench-unsloth}
mkdir -p "$OUT"
RUNS=${RUNS_DIR:-/tmp/bench-unsloth}
STEPS=${STEPS:-60}
SKIP_STEPS=${SKIP_STEPS:-10}
SEQ=${SEQ:-2048}
RUN_TIMEOUT=${RUN_TIMEOUT:-240}             # seconds per path, model saving and loading included
SITE=${FT_SITE:-/tmp/ft}
MODEL_CONFIG=${MODEL_CONFIG:-$ROOT/recipes/unsloth-lora-ddp/models/llama-3.2-3b/config.json}
TOKENIZER_DIR=${TOKENIZER_DIR:-$ROOT/.data/llama-3-tokenizer}
TRAIN_FILE=${TRAIN_FILE:-$ROOT/.data/alpaca_data_sample5000.json}
RESULTS="$OUT/results.jsonl"
: > "$RESULTS"
say() { echo "$(date -u +%H:%M:%S) $*"; }

if [[ "${SKIP_INSTALL:-0}" == 0 ]]; then
  say "installing .whl-ft/*.whl and omegaconf/pydantic/dill/multiprocess of .whl/ into $SITE"
  extra=()
  for w in .whl/omegaconf-*.whl .whl/antlr4_python3_runtime-*.whl .whl/pydantic-*.whl .whl/pydantic_core-*.whl \
           .whl/annotated_types-*.whl .whl/typing_inspection-*.whl .whl/dill-*.whl .whl/multiprocess-*.whl; do
    [[ -f "$w" ]] && extra+=("$w")
  done
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    .whl-ft/*.whl "${extra[@]}" || { echo '{"path": "setup", "error": "pip install of .whl-ft failed"}' >> "$RESULTS"; exit 1; }
fi
export PYTHONPATH="$SITE:$ROOT/shared"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1 TQDM_DISABLE=1
export TOKENIZERS_PARALLELISM=false
python3 - <<'EOF'
import importlib, torch
for m in ("transformers", "peft", "trl", "datasets", "accelerate", "torch"):
    print(m, importlib.import_module(m).__version__, flush=True)
print("cuda", torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")
EOF

rm -rf "$RUNS"
mkdir -p "$RUNS/model"
cp "$TOKENIZER_DIR"/* "$RUNS/model/"
cp "$MODEL_CONFIG" "$RUNS/model/config.json"
common=("data.train_files=[$TRAIN_FILE]" "data.max_length=$SEQ" data.packing=false train.micro_batch_size=4
        train.grad_accum_steps=1 "train.max_steps=$STEPS" train.log_every=1 train.gradient_checkpointing=true)

run_path() {  # name loader model pretrained
  local name=$1 loader=$2 model=$3 pretrained=$4 rc
  say "[$name] model.loader=$loader, $STEPS steps (at most ${RUN_TIMEOUT}s)"
  timeout --signal=TERM --kill-after=20 "$RUN_TIMEOUT" \
    torchrun --standalone --nproc-per-node 1 recipes/unsloth-lora-ddp/train.py \
      --config recipes/unsloth-lora-ddp/config.yaml "output_dir=$RUNS/$name" "run_name=bench-$name" \
      "model.loader=$loader" "model.name_or_path=$model" "model.pretrained=$pretrained" "${common[@]}" \
      > "$RUNS/$name.log" 2>&1
  rc=$?
  tail -n 60 "$RUNS/$name.log" > "$OUT/$name.log"
  [[ -f "$RUNS/$name/metrics.jsonl" ]] && cp "$RUNS/$name/metrics.jsonl" "$OUT/$name-metrics.jsonl"
  if [[ $rc -eq 0 ]]; then
    python3 benchmarks/summarize.py --skip-steps "$SKIP_STEPS" --json "$RUNS/$name.json" "$RUNS/$name" > /dev/null \
      && python3 -c "import json,sys; r=json.loads(open(sys.argv[1]).readline()); r.update(path=sys.argv[2], loader=sys.argv[3]); print(json.dumps(r))" \
         "$RUNS/$name.json" "$name" "$loader" >> "$RESULTS" \
      || echo "{\"path\": \"$name\", \"error\": \"summarize.py failed\"}" >> "$RESULTS"
  else
    python3 -c "import json,sys; print(json.dumps({'path': sys.argv[1], 'loader': sys.argv[2], 'exit_status': int(sys.argv[3]), 'error': sys.argv[4]}))" \
      "$name" "$loader" "$rc" "$(grep -E 'Error|error' "$RUNS/$name.log" | tail -n 3 | tr '\n' ' ' | cut -c1-600)" >> "$RESULTS"
  fi
  say "[$name] exit status $rc"
}

run_path trl transformers "$RUNS/model" false
init="$RUNS/trl/random-init"
if [[ -f "$init/config.json" ]]; then
  run_path unsloth unsloth "$init" true
else
  run_path unsloth unsloth "$RUNS/model" false
fi
echo '{"path": "axolotl", "error": "not run: axolotl 0.19.0 pins transformers==5.16.1, peft==0.20.0, trl==1.9.0, accelerate==1.13.0, datasets==4.8.4 and ~60 more packages (numba, gradio, lm_eval, ...); its CPU preprocess needed 222 MB of extra packages here"}' >> "$RESULTS"
say "results ($RESULTS):"
cat "$RESULTS"
python3 benchmarks/summarize.py --skip-steps "$SKIP_STEPS" $(for r in trl unsloth; do [[ -f "$RUNS/$r/metrics.jsonl" ]] && echo "$RUNS/$r"; done) || true
