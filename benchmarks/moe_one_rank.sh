#!/usr/bin/env bash
# moe-lora-fsdp2-ep at EP=1 on ONE GPU beside the frozen-base ceiling, in one command: with FSDP2 on its world of one
# (parallel.fsdp_one_rank=true), then without FSDP2 (parallel.fsdp_one_rank=false, the default), then without FSDP2
# with inductor's C++ wrapper (TORCHINDUCTOR_CPP_WRAPPER=1) and with CUDA graphs
# (TORCHINDUCTOR_CUDAGRAPHS=1). Each by benchmarks/moe_lora_speed.sh (run routed-none-layers: routed expert LoRA,
# no checkpointing, each decoder layer compiled; its set-up and environment: that script's header) into
# RESULTS_DIR/{fsdp2,plain,plain-cpp,plain-cudagraphs}/.
# VARIANTS (default "fsdp2 plain plain-cpp plain-cudagraphs"): which of the four runs, in that order; the first one
#   run also runs the ceiling.
# LAYERS=n: the architecture with its first n decoder layers only (all three runs), to fit an 80 GB GPU (48: ~101 GiB).
#   TOKENIZER_DIR=.data/qwen3 TRAIN_FILE=.data/alpaca_data_sample5000.json RESULTS_DIR=$OUT/moe bash benchmarks/moe_one_rank.sh
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
R=${RESULTS_DIR:?set RESULTS_DIR}
mkdir -p "$R"
if [ -n "${LAYERS:-}" ]; then
  python3 -c "import json, sys; c = json.load(open(sys.argv[1])); c['num_hidden_layers'] = int(sys.argv[2]); \
c.get('layer_types') and c.update(layer_types=c['layer_types'][:int(sys.argv[2])]); json.dump(c, open(sys.argv[3], 'w'))" \
    "$ROOT/recipes/moe-lora-fsdp2-ep/models/qwen3-30b-a3b/config.json" "$LAYERS" "$R/config.json"
  export MODEL_CONFIG=$R/config.json
fi
export RUNS=routed-none-layers STEPS=${STEPS:-10} SKIP_STEPS=${SKIP_STEPS:-5}
speed() { RESULTS_DIR=$R/$1 WORK_DIR=outputs/moe-one-rank-$1 bash "$ROOT/benchmarks/moe_lora_speed.sh" "${@:2}"; }
ceiling=1
for v in ${VARIANTS:-fsdp2 plain plain-cpp plain-cudagraphs}; do
  case $v in
    fsdp2) RUN_CEILING=$ceiling RUN_TIMEOUT=150 speed fsdp2 parallel.fsdp_one_rank=true ;;
    plain) RUN_CEILING=$ceiling RUN_TIMEOUT=150 speed plain parallel.fsdp_one_rank=false ;;
    plain-cpp) TORCHINDUCTOR_CPP_WRAPPER=1 RUN_CEILING=$ceiling RUN_TIMEOUT=${CPP_TIMEOUT:-200} speed plain-cpp \
      parallel.fsdp_one_rank=false ;;
    plain-cudagraphs) TORCHINDUCTOR_CUDAGRAPHS=1 RUN_CEILING=$ceiling RUN_TIMEOUT=${CUDAGRAPHS_TIMEOUT:-120} \
      speed plain-cudagraphs parallel.fsdp_one_rank=false ;;
    *) echo "VARIANTS: unknown run '$v' (fsdp2, plain, plain-cpp, plain-cudagraphs)" >&2; exit 2 ;;
  esac
  ceiling=0
done
