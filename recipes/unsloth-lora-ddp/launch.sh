#!/usr/bin/env bash
# LoRA with Unsloth on this node's GPUs, one process per GPU (DDP). Extra arguments are config overrides:
#   bash launch.sh train.max_steps=100 lora.r=32
#   NGPU=2 CONFIG_FILE=tiny.yaml bash launch.sh
#   DRY_RUN=1 bash launch.sh          # print the two commands (check, then torchrun) and exit
# The config and data are checked in one process first (train.py --check), then torchrun starts NGPU workers
# (default: every visible GPU, else 2 CPU processes). Run it in the recipe's own environment (requirements.txt).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CONFIG="${CONFIG_FILE:-config.yaml}"
[[ "$CONFIG" = /* ]] || CONFIG="$HERE/$CONFIG"
NGPU=${NGPU:-$(python3 -c 'import torch; print(torch.cuda.device_count() or 2)' 2>/dev/null || echo 2)}
check=(python3 "$HERE/train.py" --config "$CONFIG" --check "$@")
run=(torchrun --standalone --nproc-per-node "$NGPU" "$HERE/train.py" --config "$CONFIG" "$@")
if [[ "${DRY_RUN:-0}" != 0 ]]; then
  printf 'check: '; printf '%q ' "${check[@]}"; echo
  printf 'run: '; printf '%q ' "${run[@]}"; echo
  exit 0
fi
"${check[@]}"
exec "${run[@]}"
