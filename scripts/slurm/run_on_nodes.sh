#!/usr/bin/env bash
# Run a recipe's launch.sh once on every node of a Slurm job, with the rendezvous the launch scripts read (NNODES,
# NODE_RANK, MASTER_ADDR, MASTER_PORT) taken from Slurm's environment. Sourced by torchrun.sbatch and ray.sbatch:
# the same launch.sh runs on every node and takes its role from NODE_RANK.
#   RECIPE=qwen-fsdp2-sft      the recipe folder under recipes/ (or LAUNCH=/path/to/launch.sh, a copied recipe)
#   DRY_RUN=1                  print the variables and the commands instead of running them
#   REQUEUE=0                  do not requeue the job after a preemption (exit status 75)
# Arguments pass through to launch.sh as config overrides (train.max_steps=100).
#
# Node 0 (the batch script's node, the first of the job) runs launch.sh itself; the other nodes run it through one
# srun task each. The warning Slurm sends to the batch shell before the time limit (--signal=B:USR1@120) is passed
# to node 0's launcher alone: torchrun passes it to node 0's workers and every rank stops after the same step (they
# agree on it), with a checkpoint; a Ray driver has every worker stop the same way. The run exits 75, and the job
# requeues itself; the requeued job resumes from that checkpoint. Exit status: node 0's launch.sh's.
set -euo pipefail
ROOT=${ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}  # sbatch runs a copy of the script: the repository is where it was submitted
LAUNCH=${LAUNCH:-$ROOT/recipes/${RECIPE:?set RECIPE to a folder of recipes/ (or LAUNCH to a launch.sh)}/launch.sh}
[[ -f "$LAUNCH" ]] || { echo "error: $LAUNCH not found: submit from the repository root, or set ROOT or LAUNCH" >&2; exit 2; }
: "${SLURM_JOB_NODELIST:?not inside a Slurm job (sbatch or salloc)}"
export NNODES=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:?}}
command -v scontrol >/dev/null || { echo "error: scontrol (Slurm's) is not on the PATH: run this inside a Slurm job" >&2; exit 2; }
HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | awk "NR == 1")  # awk reads it all: no SIGPIPE
if [[ -z "${MASTER_ADDR:-}" ]]; then  # node 0's address: Ray's head needs an IP address, torchrun takes either
  MASTER_ADDR=$(getent ahostsv4 "$HEAD_NODE" 2>/dev/null | awk 'NR == 1 {print $1}' || true)
  MASTER_ADDR=${MASTER_ADDR:-$HEAD_NODE}
fi
export MASTER_ADDR MASTER_PORT=${MASTER_PORT:-$((20000 + ${SLURM_JOB_ID:-0} % 20000))}  # one port per job
echo "slurm job ${SLURM_JOB_ID:-}: NNODES=$NNODES MASTER_ADDR=$MASTER_ADDR ($HEAD_NODE) MASTER_PORT=$MASTER_PORT LAUNCH=$LAUNCH"
head_cmd=(env NODE_RANK=0 bash "$LAUNCH" "$@")
rest_cmd=()
if (( NNODES > 1 )); then  # one task on each other node; its NODE_RANK: 1 + its task's index
  rest_cmd=(srun --nodes=$((NNODES - 1)) --ntasks=$((NNODES - 1)) --ntasks-per-node=1 --exclude="$HEAD_NODE"
            --kill-on-bad-exit=1 bash -c 'export NODE_RANK=$((SLURM_PROCID + 1)); exec bash "$0" "$@"' "$LAUNCH" "$@")
fi
if [[ "${DRY_RUN:-0}" != 0 ]]; then
  printf 'node 0: '; printf '%q ' "${head_cmd[@]}"; echo
  if (( NNODES > 1 )); then printf 'nodes 1-%d: ' $((NNODES - 1)); printf '%q ' "${rest_cmd[@]}"; echo; fi
  exit 0
fi
rest=""
if (( NNODES > 1 )); then "${rest_cmd[@]}" & rest=$!; fi
"${head_cmd[@]}" & head=$!
trap 'echo "SIGUSR1: passed on to node 0'"'"'s launcher (stop at the next step with a checkpoint)"; kill -USR1 "$head" 2>/dev/null || true' USR1
status=0
while :; do  # a trapped signal ends `wait` early: wait again until node 0's launcher has exited
  wait "$head" && status=0 || status=$?
  kill -0 "$head" 2>/dev/null || break
done
trap - USR1
if [[ -n "$rest" ]]; then  # the other nodes end with node 0's job; give them a minute, then end their step
  for _ in $(seq 60); do kill -0 "$rest" 2>/dev/null || break; sleep 1; done
  kill "$rest" 2>/dev/null || true
  wait "$rest" 2>/dev/null || true
fi
if [[ $status -eq 75 && "${REQUEUE:-1}" != 0 && -n "${SLURM_JOB_ID:-}" ]]; then
  echo "preempted (exit status 75): requeueing job $SLURM_JOB_ID; it resumes from the checkpoint saved at the stop"
  scontrol requeue "$SLURM_JOB_ID"
fi
exit "$status"
