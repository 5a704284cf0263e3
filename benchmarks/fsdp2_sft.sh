#!/usr/bin/env bash
# Throughput of recipes/qwen-fsdp2-sft: a model architecture from MODEL_CONFIG (e.g. Qwen3-8B's
# config.json), random init, a real tokenizer (TOKENIZER_DIR) and real rows (TRAIN_FILE: Alpaca /
# chat JSON), packed to each sequence length in SEQS, bf16; then a table of the medians.
#
#   MODEL_CONFIG=qwen3-8b/config.json TOKENIZER_DIR=qwen3-tokenizer TRAIN_FILE=alpaca_data.json \
#     NGPU=2 SEQS="2048 4096" STEPS=40 bash benchmarks/fsdp2_sft.sh [extra overrides]
#
# VARIANTS runs several settings at each length, one after the other on the same GPUs, each
# NAME:override,override,... (the extra overrides apply to all of them), e.g. the loss on 1 H200:
#
#   MODEL_CONFIG=tests/data/config_Qwen3-4B.json ... NGPU=1 STEPS=10 SKIP_STEPS=4 RUN_TIMEOUT_S=160 \
#     VARIANTS="full:train.loss=full chunked4096:train.loss=chunked chunked1024:train.loss=chunked,train.loss_chunk_size=1024" \
#     JSON=results.jsonl bash benchmarks/fsdp2_sft.sh train.activation_checkpointing=selective
#
# RUN_TIMEOUT_S bounds each run (SIGTERM, the launcher stops its workers); a run that fails or runs
# out of time is reported (one line on stderr and, with JSON, one {"run", "failed", "exit_code"}
# line) and the next one still runs. JSON gets each run's table row as soon as it ends
# (benchmarks/summarize.py --json), so a call cut short keeps the runs that finished. DEADLINE_S (seconds
# from the script's start) cuts the last runs to the time left and skips those with under 45 s.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT=${OUT_DIR:-outputs/bench-fsdp2-sft}
STEPS=${STEPS:-40}
: "${MODEL_CONFIG:?set MODEL_CONFIG to a model config.json}"
: "${TOKENIZER_DIR:?set TOKENIZER_DIR to a folder with the tokenizer files}"
: "${TRAIN_FILE:?set TRAIN_FILE to a JSON / JSONL file of chat or Alpaca rows}"
source "$ROOT/benchmarks/model_dir.sh"  # MODEL_DIR: tokenizer files + MODEL_CONFIG
runs=()
for seq in ${SEQS:-2048}; do
  for variant in ${VARIANTS:-:}; do  # ":" one run without a name or options
    name=${variant%%:*}
    options=()
    [[ $variant == *:* ]] && IFS=, read -ra options <<< "${variant#*:}"
    run="$OUT/${name:+$name-}seq${seq}"
    rm -rf "$run"
    rc=0
    limit=${RUN_TIMEOUT_S:-}
    if [[ -n ${DEADLINE_S:-} ]]; then
      left=$((DEADLINE_S - SECONDS))
      if ((left < 45)); then
        echo "fsdp2_sft.sh: run $run skipped (${left} s left of DEADLINE_S=$DEADLINE_S)" >&2
        [[ -n ${JSON:-} ]] && echo "{\"run\": \"$(basename "$run")\", \"skipped\": true}" >> "$JSON"
        continue
      fi
      [[ -z $limit || $limit -gt $left ]] && limit=$left
    fi
    ${limit:+timeout --kill-after=30 "$limit"} env NGPU="${NGPU:-}" \
      bash "$ROOT/recipes/qwen-fsdp2-sft/launch.sh" output_dir="$run" run_name="bench-${name:+$name-}seq${seq}" \
      model.name_or_path="$MODEL_DIR" model.pretrained=false "data.train_files=[$TRAIN_FILE]" data.max_length=$seq \
      train.max_steps=$STEPS train.log_every=5 checkpoint.every_steps=-1 checkpoint.export_hf=false \
      data.eval_fraction=0 "$@" ${options[@]+"${options[@]}"} || rc=$?
    if [[ $rc -eq 0 && -s "$run/metrics.jsonl" ]]; then
      runs+=("$run")
      [[ -n ${JSON:-} ]] && python3 "$ROOT/benchmarks/summarize.py" --skip-steps ${SKIP_STEPS:-10} --json "$JSON" "$run" >/dev/null || true
    else
      why="exit $rc"; [[ $rc -eq 124 || $rc -eq 137 ]] && why="$why: over its limit of ${limit} s"
      echo "fsdp2_sft.sh: run $run failed ($why)" >&2
      [[ -n ${JSON:-} ]] && mkdir -p "$(dirname "$JSON")" && \
        echo "{\"run\": \"$(basename "$run")\", \"failed\": true, \"exit_code\": $rc}" >> "$JSON"
    fi
  done
done
[[ ${#runs[@]} -gt 0 ]] || { echo "fsdp2_sft.sh: no run finished" >&2; exit 1; }
python3 "$ROOT/benchmarks/summarize.py" --skip-steps ${SKIP_STEPS:-10} "${runs[@]}"
