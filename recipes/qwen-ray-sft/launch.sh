#!/usr/bin/env bash
# Run train.py with Ray Train. Extra arguments are config overrides:
#   ./launch.sh train.epochs=20                               # this node: a local Ray instance, all its GPUs
#   CONFIG_FILE=tiny.yaml ./launch.sh                         # tiny Qwen2 and data, CPU, offline
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 ./launch.sh    # node 0: Ray head + driver (waits for NNODES nodes)
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 ./launch.sh    # other nodes: join, exit when the head goes
#   RAY_ADDRESS=10.0.0.1:6379 ./launch.sh                     # an existing Ray cluster
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CONFIG_FILE=${CONFIG_FILE:-"$HERE/config.yaml"}
export NNODES=${NNODES:-1} NODE_RANK=${NODE_RANK:-0} MASTER_ADDR=${MASTER_ADDR:-} RAY_PORT=${RAY_PORT:-6379}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # Ray sets it per worker too; this covers the driver's checks
python3 -c 'import importlib.util as u, sys; sys.exit(not (u.find_spec("ray") and u.find_spec("cookbook")))' ||
  { echo "error: python3 cannot import ray.train and cookbook: activate the environment that has the requirements installed" >&2; exit 2; }
exec python3 -m cookbook.ray_train.launch "$HERE/train.py" --config "$CONFIG_FILE" "$@"
