#!/usr/bin/env bash
# train.float8=true (torchao Float8Linear in the decoder layers) against bf16 in recipes/qwen-fsdp2-sft, one after the
# other on the same GPUs, everything else equal (compiled, full activation checkpointing: float8 is refused with the
# shipped selective checkpointing; chunked loss; random init, a real tokenizer and real rows):
#   (1) speed and loss: STEPS steps of MODEL_CONFIG each (benchmarks/fsdp2_sft.sh VARIANTS), then one line with the
#       tokens/s ratio and the mean loss of the last LAST steps of each;
#   (2) export: the same config cut to 2 layers, 6 steps each with checkpoint.export_hf=true, then
#       benchmarks/compare_exports.py on the two final/ folders (names, shapes, dtypes; both reload cleanly).
#
#   MODEL_CONFIG=tests/data/config_Qwen3-4B.json TOKENIZER_DIR=.data/qwen3 TRAIN_FILE=$PWD/.data/alpaca_data_sample5000.json \
#     NGPU=1 STEPS=200 OUT_DIR=/tmp/float8 JSON=$OUT/float8.jsonl bash benchmarks/float8_vs_bf16.sh [extra overrides]
#
# Needs torchao (requirements/float8.txt) and a GPU of compute capability 8.9+. RUN_TIMEOUT_S bounds each speed run.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT=${OUT_DIR:-outputs/bench-float8}
JSON=${JSON:-$OUT/float8.jsonl}
STEPS=${STEPS:-200}
LAST=${LAST:-20}
: "${MODEL_CONFIG:?set MODEL_CONFIG to a model config.json}"
common=(mlflow=false train.compile=true train.float8=false train.activation_checkpointing=full train.micro_batch_size=4
        train.grad_accum_steps=1 train.log_every=1)
mkdir -p "$OUT" "$(dirname "$JSON")"

OUT_DIR="$OUT/speed" STEPS=$STEPS SKIP_STEPS=${SKIP_STEPS:-20} JSON="$JSON" \
  VARIANTS="bf16:train.float8=false float8:train.float8=true" bash "$ROOT/benchmarks/fsdp2_sft.sh" "${common[@]}" "$@"
python3 - "$JSON" "$LAST" <<'PY'
import json, statistics, sys
rows = {r["run"].split("-")[0]: r for r in map(json.loads, open(sys.argv[1])) if "losses" in r}
if {"bf16", "float8"} <= rows.keys():
    last = int(sys.argv[2])
    mean = {k: statistics.mean(list(r["losses"].values())[-last:]) for k, r in rows.items()}
    print(json.dumps({"float8_over_bf16_tokens_per_s": rows["float8"]["tokens/s/device"] / rows["bf16"]["tokens/s/device"],
                      f"mean_loss_last_{last}": mean, "loss_change_%": 100 * (mean["float8"] / mean["bf16"] - 1)}))
PY

cut="$OUT/cut-2-layers.json"
python3 -c "import json, sys; c = json.load(open(sys.argv[1])); c.update(num_hidden_layers=2); c.pop('layer_types', None)
json.dump(c, open(sys.argv[2], 'w'))" "$MODEL_CONFIG" "$cut"
for name in bf16 float8; do
  OUT_DIR="$OUT/export-$name" MODEL_CONFIG="$cut" STEPS=6 SKIP_STEPS=2 JSON= \
    VARIANTS="$name:train.float8=$([[ $name == float8 ]] && echo true || echo false)" \
    bash "$ROOT/benchmarks/fsdp2_sft.sh" "${common[@]}" "$@" checkpoint.export_hf=true > "$OUT/export-$name.log" 2>&1 \
    || { echo "float8_vs_bf16.sh: the $name export run failed (its log: $OUT/export-$name.log)" >&2; tail -5 "$OUT/export-$name.log" >&2; }
done
python3 "$ROOT/benchmarks/compare_exports.py" "$OUT/export-bf16/bf16-seq2048/final" "$OUT/export-float8/float8-seq2048/final" \
  | tee -a "$JSON"
