#!/usr/bin/env bash
# Launch train.py with torchrun on this node. Extra arguments are config overrides:
#   ./launch.sh train.max_steps=100 optim.lr=3e-5
#   CONFIG_FILE=tiny.yaml NGPU=2 ./launch.sh
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 ./launch.sh   # then NODE_RANK=1 on the second node
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CONFIG_FILE=${CONFIG_FILE:-"$HERE/config.yaml"}
[[ -f "$CONFIG_FILE" || "$CONFIG_FILE" = /* ]] || CONFIG_FILE="$HERE/$CONFIG_FILE"
GPUS=$(python3 -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)') ||
  { echo "error: python3 cannot import torch: activate the environment that has the requirements installed" >&2; exit 2; }
NGPU=${NGPU:-$([ "$GPUS" -gt 0 ] && echo "$GPUS" || echo 2)}  # CPU: 2 processes with gloo
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
for v in NGPU NNODES; do
  [[ "${!v}" =~ ^[1-9][0-9]*$ ]] || { echo "error: $v=${!v} is not a positive integer" >&2; exit 2; }
done
if [ "$GPUS" -gt 0 ] && [ "$NGPU" -gt "$GPUS" ]; then
  echo "error: NGPU=$NGPU but this node has $GPUS GPU(s)" >&2; exit 2
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # one thread per process unless told otherwise
# Validate config, data and resume in one process before any worker starts.
COOKBOOK_WORLD_SIZE=$((NGPU * NNODES)) python3 "$HERE/train.py" --config "$CONFIG_FILE" --check "$@"
if [ "$NNODES" -eq 1 ] && [ -z "${MASTER_PORT:-}" ]; then
  RDZV=(--standalone)  # one node: torchrun picks a free port
else
  RDZV=(--nnodes "$NNODES" --node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR" --master-port "${MASTER_PORT:-29500}")
fi
exec python3 -m cookbook.torchrun "${RDZV[@]}" --nproc-per-node "$NGPU" "$HERE/train.py" --config "$CONFIG_FILE" "$@"
