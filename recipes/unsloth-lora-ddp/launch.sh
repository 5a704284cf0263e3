#!/usr/bin/env bash
# LoRA with Unsloth on this node's GPUs, one process per GPU (DDP). Extra arguments are config overrides:
#   bash launch.sh train.max_steps=100 lora.r=32
#   NGPU=2 CONFIG_FILE=tiny.yaml bash launch.sh
#   DRY_RUN=1 bash launch.sh          # print the two commands (check, then torchrun) and exit
# NGPU processes per node (default: every GPU, else 2 CPU processes); the config and data are checked in one
# process first (train.py --check), then torchrun starts the workers (python -m cookbook.launch). Run it in the
# recipe's own environment (requirements.txt, which installs cookbook from shared/).
# A worker killed (SIGKILL, out of memory) or crashed mid-run restarts the whole group, which resumes from the
# newest checkpoint: MAX_RESTARTS times at most (default 3, as torchrun's fault-tolerant example; 0: none).
# Bad input (exit 2), a divergence (4), a preemption (75), Ctrl-C (130) and SIGTERM to this script are never restarted.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python3 -c 'import importlib.util as u, sys; sys.exit(not u.find_spec("cookbook"))' ||
  { echo "error: python3 cannot import cookbook: activate the environment that has the requirements installed" >&2; exit 2; }
exec python3 -m cookbook.launch --ngpu "${NGPU:-}" --nnodes "${NNODES:-1}" --node-rank "${NODE_RANK:-0}" \
  --master-addr "${MASTER_ADDR:-127.0.0.1}" --master-port "${MASTER_PORT:-}" --max-restarts "${MAX_RESTARTS:-3}" \
  "$HERE/train.py" --config "${CONFIG_FILE:-$HERE/config.yaml}" "$@"
