#!/usr/bin/env bash
# One call, one GPU, one model: LoRA of the Llama-3.2-3B architecture (random init from
# recipes/unsloth-lora-ddp/models/llama-3.2-3b/config.json, bf16, the Llama-3 tokenizer, real Alpaca rows) through
#   (b) the TRL path: recipes/unsloth-lora-ddp/train.py model.loader=transformers (AutoModelForCausalLM + PEFT's
#       get_peft_model under TRL's SFTTrainer, transformers' gradient checkpointing), run first; all paths load one
#       random-init checkpoint written before them (benchmarks/axolotl_bench_config.py --init-only: seed 42,
#       built on the GPU in bf16), so all train the same weights;
#   (b') PATHS entry trl-compile: the TRL path with train.compile=true (each decoder layer a torch.compile region),
#       run after (b);
#   (a) Unsloth: the same train.py, model.loader=unsloth (FastLanguageModel.from_pretrained / get_peft_model, its
#       gradient checkpointing);
#   (c) Axolotl 0.19.0: `axolotl train` (torchrun -m axolotl.cli.train, what `axolotl train --launcher torchrun`
#       runs) of a YAML written here: the same checkpoint and tokenizer, the same rows converted to chat JSONL by
#       recipes/axolotl-lora-ddp/prepare_data.py (the same cookbook.sft.to_messages), chat_template
#       tokenizer_default with the loss on the assistant turn, sequence_len SEQ, PACKING=1 (default): sample_packing
#       true, pad_to_sequence_len true, attn_implementation sdpa (Axolotl's sdpa_varlen: varlen_attn over the packed
#       documents), as the TRL path's data.packing=true (TRL's bfd, padding-free, attn_implementation varlen);
#       PACKING=0: sample_packing false and pad_to_sequence_len false (each batch padded to its longest row, as TRL
#       pads), pad token = EOS when the
#       tokenizer has none (as train.py), adapter lora r 16 / alpha 32 / dropout 0 on q,k,v,o,gate,up,down,
#       micro-batch 4, lr 2e-4 cosine, warmup 10, adamw_torch_fused (TRL's default), bf16, gradient checkpointing
#       with use_reentrant false (both libraries' default), seed 42, STEPS steps; Axolotl's own defaults elsewhere
#       (its LoRA Triton kernels, which it turns on for this set-up on a GPU; AXO_LORA_KERNELS=0 turns them off).
#       Both shuffle the rows with seed 42, but not into the same order, so per-step losses agree in level only.
#       Its numbers come from recipes/axolotl-lora-ddp/cookbook_metrics.py, an Axolotl plugin that writes the same
#       metrics.jsonl as train.py: real tokens = attention_mask.sum() of each micro-batch, step time between two
#       optimizer steps after torch.cuda.synchronize, peak = torch.cuda.max_memory_allocated/reserved.
# Same rows, seq 2048 (packed unless PACKING=0), LoRA r 16 / alpha 32 on q,k,v,o,gate,up,down, micro-batch 4, STEPS steps.
# Environments (each path its own --target folder on top of the image's torch 2.11, transformers 5.17,
# accelerate 1.15, peft 0.21.0, numba, llvmlite, triton):
#   trl (and unsloth): .whl/*.whl less deepspeed (bash ../shared/device/wheels.sh: trl 1.16, datasets 5.2,
#       pydantic, dill, multiprocess; plus omegaconf 2.3.0 and antlr4 4.9.3) and .whl-axo's xxhash; with unsloth in
#       PATHS also .whl-ft/ (bash benchmarks/unsloth_wheels.sh: unsloth 2026.10.9 without studio/, unsloth_zoo,
#       cut_cross_entropy) and .whl-axo's bitsandbytes 0.50.2;
#   axolotl: .whl-axo/ (bash benchmarks/axolotl_wheels.sh: axolotl 0.19.0 and its pins transformers 5.16.1,
#       trl 1.9.0, peft 0.20.0, accelerate 1.13.0, datasets 4.8.4, huggingface_hub 1.17.0, tokenizers 0.23.1,
#       pydantic 2.12.5, bitsandbytes 0.50.2 with its CPU and CUDA 13.0 libraries only, wandb 0.31.0 without its
#       Go service binaries, ~30 more; 27 MB; tokenizers is the image's) plus omegaconf/antlr4 of .whl/ for the repository's cookbook.
# Each record names its transformers/trl/peft versions, its model (MODEL) and adapter.
# MODEL=olmo3-7b: the OLMo-3 7B architecture (recipes/axolotl-lora-ddp/models/olmo-3-7b/config.json, random init,
#   Axolotl's recipe model) instead of Llama-3.2-3B. OLMo-3's tokenizer is not available offline and the Llama-3
#   tokenizer's 128,256 ids overflow its 100,278 embedding rows, so benchmarks/olmo3_tokenizer.py first builds
#   one that fits from TOKENIZER_SRC (.data/llama-3-tokenizer): Llama-3's cl100k_base ids 0..100255 and their
#   merges, OLMo-3's EOS (100257) and pad (100277) ids, ChatML turns; it checks on TRAIN_FILE that every id fits.
#   Axolotl 0.19.0's LoRA QKV/O kernels cannot patch OLMo-3's attention (its source rewrite asserts "Original QKV
#   code not found": q_norm wraps q_proj), so axolotl_bench_config.py turns those two off and the MLP kernel on.
# ADAPTERS="lora qlora" (default lora): also QLoRA (4-bit NF4 base through bitsandbytes, double quantization, bf16
#   compute: Axolotl's load_in_4bit, as recipes/axolotl-lora-ddp/qlora.yaml) after the LoRA runs: Axolotl's run
#   (record axolotl-qlora) and the TRL path's (trl-qlora: train.py model.load_in_4bit=true, which its transformers
#   loader refuses at config time, "model.load_in_4bit needs model.loader=unsloth": the record carries that error).
# BUDGET_S (default 570): seconds of the whole call; each path gets at most RUN_TIMEOUT and what is left of
#   BUDGET_S less 20 s, and a path with less than 60 s left is recorded as skipped, so results.jsonl is written
#   before the device's 600 s limit. train.py writes no checkpoint and no merged copy (checkpoint.every_steps=-1,
#   export_merged=false), as Axolotl's save_strategy "no": both save the adapter only.
#   bash benchmarks/unsloth_axolotl_vs_trl.sh          # on the device, from the repository root
#   PATHS="trl axolotl" STEPS=40 SKIP_STEPS=10 RUN_TIMEOUT=260 OUT=$OUT bash benchmarks/unsloth_axolotl_vs_trl.sh
#     carry .whl (21M) .whl-axo (27M, bash benchmarks/axolotl_wheels.sh) .data/alpaca_data_sample5000.json (2.0M)
#     .data/llama-3-tokenizer (~9M): about 59 MB of the 64 MiB (recipes/axolotl-lora-ddp/README.md)
#   Issue 17, OLMo-3 7B LoRA and QLoRA, one call (run timeout_s=600), not run on a GPU yet:
#   MODEL=olmo3-7b ADAPTERS="lora qlora" PATHS="trl axolotl" STEPS=30 SKIP_STEPS=10 RUN_TIMEOUT=240 BUDGET_S=570 \
#     OUT=$OUT bash benchmarks/unsloth_axolotl_vs_trl.sh
#     carry .whl (21M) .whl-axo (27M) .data/alpaca_data_sample5000.json (2.0M) .data/llama-3-tokenizer (8.8M),
#     du -sh: 59 MB of the 64 MiB. Four records in this order: trl, axolotl, trl-qlora (the refusal, seconds),
#     axolotl-qlora; an estimate, not a measurement: ~1.5 min installs, ~1 min for the random init (built on the
#     GPU, its 15 GB checkpoint written), ~2 min per run of 30 steps (most of it loading); BUDGET_S records
#     axolotl-qlora as skipped if the others leave it under 60 s, and then
#     MODEL=olmo3-7b ADAPTERS=qlora PATHS=axolotl STEPS=30 SKIP_STEPS=10 OUT=$OUT bash benchmarks/unsloth_axolotl_vs_trl.sh
#     (carry .whl .whl-axo .data/alpaca_data_sample5000.json .data/llama-3-tokenizer) runs it alone.
#   TINY=1 SKIP_INSTALL=1 PYTHON=... AXO_SITE=... bash benchmarks/unsloth_axolotl_vs_trl.sh   # CPU check, tiny
#     models (the 2-layer Llama of recipes/qwen-fsdp2-sft/tiny, seq 128, 4 steps, fp32); Unsloth: 'not run on CPU'
#     With MODEL=olmo3-7b: the 4-layer olmo3 of recipes/axolotl-lora-ddp/tiny/olmo3 and that 512-id tokenizer
#     (the tokenizer build is checked on its own: python benchmarks/olmo3_tokenizer.py SRC DEST --check FILE);
#     ADAPTERS="lora qlora" runs Axolotl's QLoRA on the CPU too (bitsandbytes 0.50.2's CPU backend: NF4 Linear4bit
#     forward and backward).
# Writes $OUT/results.jsonl (one record per path: tokens/s/GPU median, MFU, peak memory, losses, or the error),
# $OUT/{trl,unsloth,axolotl,axolotl-qlora}.log (each run's last lines), $OUT/<run>-metrics.jsonl and
# $OUT/axolotl.yaml (and axolotl-qlora.yaml).
set -uo pipefail
if (( $# )); then  # every setting is an environment variable (above); train.py overrides would reach one path only
  echo "error: $(basename "$0") takes no arguments (got: $*); set its environment variables instead (train.py overrides: TRAIN_ARGS)" >&2
  exit 2
fi
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT=${OUT:-outputs/bench-unsloth}
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
RUNS=${RUNS_DIR:-/tmp/bench-unsloth}
PATHS=${PATHS:-trl unsloth axolotl}         # which paths to run, in this order of dependence: trl first
PYTHON=${PYTHON:-python3}
TINY=${TINY:-0}
MODEL=${MODEL:-llama3-3b}                   # llama3-3b | olmo3-7b
read -ra TRAIN_ARGS <<< "${TRAIN_ARGS:-}"   # more train.py overrides, trl and unsloth paths only (in each record)
ADAPTERS=${ADAPTERS:-lora}                  # lora and/or qlora
BUDGET_S=${BUDGET_S:-570}
PACKING=${PACKING:-1}                       # 1: packed 2,048-token rows on every path (the shipped setting); 0: unpacked
case "$MODEL" in
  llama3-3b) tiny_config=qwen-fsdp2-sft/tiny/llama/config.json; full_config=unsloth-lora-ddp/models/llama-3.2-3b/config.json ;;
  olmo3-7b) tiny_config=axolotl-lora-ddp/tiny/olmo3/config.json; full_config=axolotl-lora-ddp/models/olmo-3-7b/config.json ;;
  *) echo "MODEL must be llama3-3b or olmo3-7b, got $MODEL" >&2; exit 2 ;;
esac
if [[ "$TINY" != 0 ]]; then                 # CPU check of the whole script: tiny model, tiny Alpaca rows
  STEPS=${STEPS:-4}; SKIP_STEPS=${SKIP_STEPS:-1}; SEQ=${SEQ:-128}
  MODEL_CONFIG=${MODEL_CONFIG:-$ROOT/recipes/$tiny_config}
  TOKENIZER_DIR=${TOKENIZER_DIR:-$ROOT/recipes/qwen-fsdp2-sft/tiny/llama}
  TRAIN_FILE=${TRAIN_FILE:-$ROOT/recipes/qwen-fsdp2-sft/tiny/data/alpaca.json}
fi
STEPS=${STEPS:-60}
SKIP_STEPS=${SKIP_STEPS:-10}
SEQ=${SEQ:-2048}
RUN_TIMEOUT=${RUN_TIMEOUT:-240}             # seconds per path, model saving and loading included
SITE=${FT_SITE:-/tmp/ft}                    # the TRL / Unsloth environment
AXO_SITE=${AXO_SITE:-/tmp/axo-site}         # the Axolotl environment
MODEL_CONFIG=${MODEL_CONFIG:-$ROOT/recipes/$full_config}
TOKENIZER_SRC=${TOKENIZER_SRC:-$ROOT/.data/llama-3-tokenizer}
[[ "$MODEL" == olmo3-7b ]] && TOKENIZER_DIR=${TOKENIZER_DIR:-$RUNS/olmo3-tokenizer}  # built below
TOKENIZER_DIR=${TOKENIZER_DIR:-$TOKENIZER_SRC}
TRAIN_FILE=${TRAIN_FILE:-$ROOT/.data/alpaca_data_sample5000.json}
RESULTS="$OUT/results.jsonl"
: > "$RESULTS"
say() { echo "$(date -u +%H:%M:%S) $*"; }
wants() { [[ " $PATHS " == *" $1 "* ]]; }
adapter() { [[ " $ADAPTERS " == *" $1 "* ]]; }
timeout_s() {  # seconds the next path may run: RUN_TIMEOUT, or what BUDGET_S leaves (less 20 s), if smaller
  local left=$((BUDGET_S - SECONDS - 20))
  echo $((left < RUN_TIMEOUT ? left : RUN_TIMEOUT))
}
fail() {  # path error: one JSON line in results.jsonl
  "$PYTHON" -c "import json,sys; print(json.dumps({'path': sys.argv[1], 'error': sys.argv[2]}))" "$1" "$2" >> "$RESULTS"
}
TRL_PP="$SITE:$ROOT/shared"
AXO_PP="$AXO_SITE:$ROOT/recipes/axolotl-lora-ddp:$ROOT/shared"
pip_target() { "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$@"; }
cookbook_wheels=()  # the repository's cookbook needs omegaconf (and its antlr4 4.9.3) in every environment
for w in .whl/omegaconf-*.whl .whl/antlr4_python3_runtime-*.whl; do [[ -f "$w" ]] && cookbook_wheels+=("$w"); done

if [[ "${SKIP_INSTALL:-0}" == 0 ]]; then
  if wants trl || wants trl-compile || wants unsloth; then
    trl_wheels=()  # .whl without deepspeed (accelerate would import it, and the TRL path has no use for it)
    for w in .whl/*.whl .whl-axo/xxhash-*.whl; do [[ "$w" == .whl/deepspeed-* ]] || trl_wheels+=("$w"); done
    if wants unsloth && ls .whl-ft/*.whl >/dev/null 2>&1; then  # Unsloth on top (its bitsandbytes: .whl-axo's)
      trl_wheels+=(.whl-ft/*.whl .whl-axo/bitsandbytes-*.whl)
    fi
    say "installing ${#trl_wheels[@]} wheels into $SITE (the TRL path in the repository's environment)"
    pip_target "$SITE" "${trl_wheels[@]}" || fail setup "pip install of .whl failed"  # datasets needs xxhash
  fi
  if wants axolotl; then
    say "installing .whl-axo/*.whl and omegaconf/antlr4 of .whl/ into $AXO_SITE"
    pip_target "$AXO_SITE" .whl-axo/*.whl "${cookbook_wheels[@]}" || fail axolotl "pip install of .whl-axo failed"
  fi
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1 TQDM_DISABLE=1
export TOKENIZERS_PARALLELISM=false AXOLOTL_DO_NOT_TRACK=1
versions='import importlib.metadata as md, torch
print(" ".join(f"{m} {md.version(m)}" for m in ("transformers", "peft", "trl", "datasets", "accelerate", "torch")),
      "| cuda", torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")'
wants trl || wants unsloth && { printf 'trl/unsloth environment: '; PYTHONPATH="$TRL_PP" "$PYTHON" -c "$versions"; }
wants axolotl && { printf 'axolotl environment: '; PYTHONPATH="$AXO_PP" "$PYTHON" -c "$versions"; }

rm -rf "$RUNS"
mkdir -p "$RUNS/model"
init_pp="$TRL_PP"  # the environment of the set-up steps: the TRL path's, or Axolotl's when it runs alone
wants trl || wants unsloth || init_pp="$AXO_PP"
if [[ "$TOKENIZER_DIR" == "$RUNS/olmo3-tokenizer" ]]; then
  say "building the OLMo-3-sized tokenizer from $TOKENIZER_SRC"
  PYTHONPATH="$init_pp" "$PYTHON" benchmarks/olmo3_tokenizer.py "$TOKENIZER_SRC" "$TOKENIZER_DIR" --check "$TRAIN_FILE" \
    || { fail setup "benchmarks/olmo3_tokenizer.py failed"; cat "$RESULTS"; exit 1; }
fi
cp "$TOKENIZER_DIR"/* "$RUNS/model/"
cp "$MODEL_CONFIG" "$RUNS/model/config.json"
INIT="$RUNS/random-init"  # the one random init (seed 42) every path loads
init_cpu=()
[[ "$TINY" != 0 ]] && init_cpu=(--cpu)
say "random init of $MODEL_CONFIG in $INIT"
PYTHONPATH="$init_pp" "$PYTHON" benchmarks/axolotl_bench_config.py --init-only --model "$INIT" --init-from "$RUNS/model" \
  "${init_cpu[@]}" || { fail setup "random init failed"; cat "$RESULTS"; exit 1; }
# no checkpoints and only the adapter at the end (as Axolotl's save_strategy "no"): no merged 16-bit copy written
packing=false axo_packing=()
[[ "$PACKING" == 1 ]] && { packing=true; axo_packing=(--packing); }
common=("data.train_files=[$TRAIN_FILE]" "data.max_length=$SEQ" "data.packing=$packing" train.micro_batch_size=4
        train.grad_accum_steps=1 "train.max_steps=$STEPS" train.log_every=1 train.gradient_checkpointing=true
        checkpoint.every_steps=-1 checkpoint.export_merged=false)

record() {  # name loader rc pythonpath run_dir [limit_s]: the summarize.py record (with versions) or the error
  local name=$1 loader=$2 rc=$3 pp=$4 dir=$5 limit=${6:-$RUN_TIMEOUT} adapter=lora
  [[ $name == *-qlora ]] && adapter=qlora
  tail -n 60 "$RUNS/$name.log" > "$OUT/$name.log"
  [[ -f "$dir/metrics.jsonl" ]] && cp "$dir/metrics.jsonl" "$OUT/$name-metrics.jsonl"
  if [[ $rc -eq 0 && -f "$dir/metrics.jsonl" ]]; then
    PYTHONPATH="$pp" "$PYTHON" benchmarks/summarize.py --skip-steps "$SKIP_STEPS" --json "$RUNS/$name.json" "$dir" > /dev/null \
      && PYTHONPATH="$pp" "$PYTHON" -c "
import importlib.metadata as md, json, sys
r = json.loads(open(sys.argv[1]).readline())
r.update(path=sys.argv[2], loader=sys.argv[3], steps_run=int(sys.argv[4]), seq=int(sys.argv[5]),
         model=sys.argv[6], adapter=sys.argv[7], packing=sys.argv[8] == 'true')
if sys.argv[9:] and sys.argv[3] != 'axolotl':
    r['train_args'] = sys.argv[9:]
for m in ('trl', 'peft', 'accelerate', 'datasets', 'axolotl', 'unsloth'):
    try:
        r[m] = md.version(m)
    except md.PackageNotFoundError:
        pass
print(json.dumps(r))" "$RUNS/$name.json" "$name" "$loader" "$STEPS" "$SEQ" "$MODEL" "$adapter" "$packing" "${TRAIN_ARGS[@]}" >> "$RESULTS" \
      || fail "$name" "summarize.py failed"
  else
    local why="exit status $rc"
    [[ $rc -eq 124 || $rc -eq 137 ]] && why="timed out after ${limit}s"
    fail "$name" "$why: $(grep -E '^(\[rank[0-9]+\]: )?[[:space:]]*[A-Za-z_][A-Za-z0-9_.]*(Error|Exception): ' "$RUNS/$name.log" \
      | sed -E 's/^(\[rank[0-9]+\]: )?[[:space:]]*//' | grep -v ChildFailedError | awk '!seen[$0]++' | tail -n 2 \
      | tr '\n' ' ' | cut -c1-600)"
  fi
  say "[$name] exit status $rc"
}

run_path() {  # name loader model pretrained [override ...]
  local name=$1 loader=$2 model=$3 pretrained=$4 rc limit
  shift 4
  limit=$(timeout_s)
  if [[ $limit -lt 60 ]]; then fail "$name" "skipped: ${limit}s left of BUDGET_S=${BUDGET_S}"; return; fi
  say "[$name] model.loader=$loader $*, $STEPS steps (at most ${limit}s)"
  PYTHONPATH="$TRL_PP" timeout --signal=TERM --kill-after=20 "$limit" \
    "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node 1 recipes/unsloth-lora-ddp/train.py \
      --config recipes/unsloth-lora-ddp/config.yaml "output_dir=$RUNS/$name" "run_name=bench-$name" \
      "model.loader=$loader" "model.name_or_path=$model" "model.pretrained=$pretrained" "${common[@]}" "$@" \
      "${TRAIN_ARGS[@]}" \
      > "$RUNS/$name.log" 2>&1
  rc=$?
  record "$name" "$loader" "$rc" "$TRL_PP" "$RUNS/$name" "$limit"
}

run_axolotl() {  # name adapter: `axolotl train` on the checkpoint every path loads
  local name=$1 adapter=$2 dir="$RUNS/$1" model="$INIT" rc limit cpu=()
  [[ "$TINY" != 0 ]] && cpu=(--cpu)
  [[ "${AXO_LORA_KERNELS:-1}" == 0 ]] && cpu+=(--no-lora-kernels)
  mkdir -p "$dir"
  limit=$(timeout_s)
  if [[ $limit -lt 60 ]]; then fail "$name" "skipped: ${limit}s left of BUDGET_S=${BUDGET_S}"; return; fi
  say "[$name] axolotl train, adapter $adapter, $STEPS steps on $model (at most ${limit}s)"
  PYTHONPATH="$AXO_PP" "$PYTHON" benchmarks/axolotl_bench_config.py --model "$model" \
      --rows "$TRAIN_FILE" --run-dir "$dir" --seq "$SEQ" --steps "$STEPS" --adapter "$adapter" \
      --prepared "$RUNS/axolotl-prepared" "${cpu[@]}" "${axo_packing[@]}" > "$RUNS/$name.log" 2>&1
  rc=$?
  if [[ $rc -eq 0 ]]; then
    cp "$dir/axolotl.yaml" "$OUT/$name.yaml"
    limit=$(timeout_s)
    (cd "$dir" && PYTHONPATH="$AXO_PP" timeout --signal=TERM --kill-after=20 "$limit" \
      "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node 1 -m axolotl.cli.train "$dir/axolotl.yaml") \
      >> "$RUNS/$name.log" 2>&1
    rc=$?
  fi
  record "$name" axolotl "$rc" "$AXO_PP" "$dir/$name" "$limit"
}

if adapter lora; then
  wants trl && run_path trl transformers "$INIT" true
  wants trl-compile && run_path trl-compile transformers "$INIT" true train.compile=true
  if wants unsloth; then
    if [[ "$TINY" != 0 ]]; then
      fail unsloth "not run on CPU (TINY=1): Unsloth's kernels need a CUDA GPU"
    else
      run_path unsloth unsloth "$INIT" true
    fi
  fi
  wants axolotl && run_axolotl axolotl lora
fi
if adapter qlora; then  # train.py refuses 4-bit with its transformers loader at config time: a few seconds
  wants trl && run_path trl-qlora transformers "$INIT" true model.load_in_4bit=true
  wants axolotl && run_axolotl axolotl-qlora qlora
fi
say "results ($RESULTS):"
cat "$RESULTS"
done_runs=()
for r in trl trl-compile unsloth; do [[ -f "$RUNS/$r/metrics.jsonl" ]] && done_runs+=("$RUNS/$r"); done
for r in axolotl axolotl-qlora; do [[ -f "$RUNS/$r/$r/metrics.jsonl" ]] && done_runs+=("$RUNS/$r/$r"); done
[[ ${#done_runs[@]} -gt 0 ]] && PYTHONPATH="$TRL_PP" "$PYTHON" benchmarks/summarize.py --skip-steps "$SKIP_STEPS" "${done_runs[@]}" || true
