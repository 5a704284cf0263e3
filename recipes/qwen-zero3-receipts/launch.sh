#!/usr/bin/env bash
# Launch train.py with torchrun on this node (DeepSpeed is configured by the JSON named in the YAML config,
# deepspeed.config; the Trainer builds accelerate's DeepSpeed state from it, so `accelerate launch train.py
# --config ...` runs the same script). Extra arguments are config overrides:
#   ./launch.sh train.max_steps=100 lora.enabled=true deepspeed.config=zero2.json
#   CONFIG_FILE=tiny.yaml NGPU=2 ./launch.sh
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 ./launch.sh   # then NODE_RANK=1 on the second node
# NGPU processes per node (default: every GPU, else 2 CPU processes); the config and data are checked in one
# process first (train.py --check), then torchrun starts the workers (python -m cookbook.launch).
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
