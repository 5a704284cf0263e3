#!/usr/bin/env bash
# LoRA / QLoRA with Axolotl on this node's GPUs, one process per GPU (DDP). Run it in the recipe's own environment
# (requirements.txt); Axolotl runs from this folder, so the config's relative paths are the recipe's.
#   bash launch.sh                                  # config.yaml (LoRA) on every GPU
#   CONFIG_FILE=qlora.yaml NGPU=2 bash launch.sh    # the 4-bit variant on 2 GPUs
#   LAUNCHER=accelerate bash launch.sh              # accelerate launch instead of torchrun
#   DRY_RUN=1 bash launch.sh                        # print the two commands (check, then axolotl) and exit
# check.py validates the config and builds the data set first (one process, no GPU); then `axolotl train`
# starts NGPU workers through its launcher. Extra arguments go to `axolotl train` (e.g. --max-steps 20).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CONFIG="${CONFIG_FILE:-config.yaml}"
[[ "$CONFIG" = /* ]] || CONFIG="$HERE/$CONFIG"
NGPU=${NGPU:-$(python3 -c 'import torch; print(torch.cuda.device_count() or 1)' 2>/dev/null || echo 1)}
LAUNCHER=${LAUNCHER:-torchrun}
# Axolotl sends usage telemetry unless told not to; offline it retries for seconds. Set AXOLOTL_DO_NOT_TRACK=0 to allow it.
export AXOLOTL_DO_NOT_TRACK="${AXOLOTL_DO_NOT_TRACK:-1}"
case "$LAUNCHER" in
  torchrun) launcher_args=(--nproc_per_node "$NGPU" --nnodes 1) ;;
  accelerate) launcher_args=(--num_processes "$NGPU" --num_machines 1) ;;
  *) echo "error: LAUNCHER must be torchrun or accelerate, got '$LAUNCHER'" >&2; exit 2 ;;
esac
check=(python3 "$HERE/check.py" "$CONFIG")
run=(axolotl train "$CONFIG" --launcher "$LAUNCHER" "$@" -- "${launcher_args[@]}")
if [[ "${DRY_RUN:-0}" != 0 ]]; then
  printf 'check: '; printf '%q ' "${check[@]}"; echo
  printf 'run (in %s): ' "$HERE"; printf '%q ' "${run[@]}"; echo
  exit 0
fi
"${check[@]}"
cd "$HERE"
exec "${run[@]}"
