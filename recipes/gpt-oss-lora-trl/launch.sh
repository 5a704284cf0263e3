#!/usr/bin/env bash
# LoRA of GPT-OSS with TRL on this node's GPUs, one process per GPU (DDP for config.yaml, FSDP2 for
# gpt-oss-120b.yaml). Extra arguments are config overrides:
#   bash launch.sh train.max_steps=100 lora.r=32
#   CONFIG_FILE=gpt-oss-120b.yaml NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 bash launch.sh   # NODE_RANK=1 on the second
#   NGPU=2 CONFIG_FILE=tiny.yaml bash launch.sh
#   DRY_RUN=1 bash launch.sh          # print the two commands (check, then torchrun) and exit
# The config and data are checked in one process first (train.py --check), then torchrun starts NGPU workers per
# node (default: every visible GPU, else 2 CPU processes).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CONFIG="${CONFIG_FILE:-config.yaml}"
[[ "$CONFIG" = /* ]] || CONFIG="$HERE/$CONFIG"
NGPU=${NGPU:-$(python3 -c 'import torch; print(torch.cuda.device_count() or 2)' 2>/dev/null || echo 2)}
NNODES=${NNODES:-1}
if [[ "$NNODES" = 1 ]]; then
  rdzv=(--standalone)
else
  rdzv=(--nnodes "$NNODES" --node-rank "${NODE_RANK:-0}" --master-addr "${MASTER_ADDR:?set MASTER_ADDR}"
        --master-port "${MASTER_PORT:-29500}")
fi
check=(env COOKBOOK_WORLD_SIZE=$((NGPU * NNODES)) python3 "$HERE/train.py" --config "$CONFIG" --check "$@")
run=(torchrun "${rdzv[@]}" --nproc-per-node "$NGPU" "$HERE/train.py" --config "$CONFIG" "$@")
if [[ "${DRY_RUN:-0}" != 0 ]]; then
  printf 'check: '; printf '%q ' "${check[@]}"; echo
  printf 'run: '; printf '%q ' "${run[@]}"; echo
  exit 0
fi
"${check[@]}"
exec "${run[@]}"
