"""scripts/slurm: the sbatch examples' logic without Slurm. Fake `scontrol` and `srun` on PATH (srun runs each task
here, with its SLURM_PROCID) and a stand-in launch.sh that records what each node would run; the rest is the real
script: the variables derived from SLURM_*, node 0 in the batch shell, the other nodes through srun, the preemption
signal passed to node 0's launcher and the requeue after exit status 75."""

import os
import signal
import subprocess
import time

import pytest
from conftest import ROOT

SLURM = ROOT / "scripts" / "slurm"

FAKE_SCONTROL = """#!/usr/bin/env bash
echo "scontrol $*" >> "$FAKE_LOG"
if [[ "$1 $2" == "show hostnames" ]]; then printf 'localhost\\nnode-b\\nnode-c\\n'; fi
"""
FAKE_SRUN = """#!/usr/bin/env bash
echo "srun $*" >> "$FAKE_LOG"
n=1; while [[ "$1" == --* ]]; do [[ "$1" == --ntasks=* ]] && n=${1#--ntasks=}; shift; done
for ((i = 0; i < n; i++)); do SLURM_PROCID=$i "$@" & done
wait
"""
FAKE_LAUNCH = """#!/usr/bin/env bash
echo "NODE_RANK=$NODE_RANK NNODES=$NNODES MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT args=$*" > "$FAKE_OUT/node$NODE_RANK"
if [[ $NODE_RANK == 0 && -n "${FAKE_PREEMPT:-}" ]]; then  # a launcher that stops with a checkpoint on SIGUSR1
  trap 'echo USR1 >> "$FAKE_OUT/node0"; exit 75' USR1
  touch "$FAKE_OUT/started"
  while :; do sleep 0.1; done
fi
"""


@pytest.fixture
def slurm(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    launch = tmp_path / "launch.sh"
    launch.write_text(FAKE_LAUNCH)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "FAKE_LOG": str(tmp_path / "log"),
        "FAKE_OUT": str(tmp_path),
        "SLURM_JOB_NODELIST": "localhost,node-[b-c]",
        "SLURM_JOB_NUM_NODES": "3",
        "SLURM_JOB_ID": "4242",
        "SLURM_SUBMIT_DIR": str(ROOT),
        "LAUNCH": str(launch),
    }
    for name in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "NNODES", "RECIPE", "DRY_RUN", "ROOT"):
        env.pop(name, None)
    return env


def test_the_scripts_parse():
    for script in ("torchrun.sbatch", "ray.sbatch", "run_on_nodes.sh"):
        assert subprocess.run(["bash", "-n", str(SLURM / script)]).returncode == 0, script
    for script in ("torchrun.sbatch", "ray.sbatch"):
        text = (SLURM / script).read_text()
        assert "#SBATCH --ntasks-per-node=1\n" in text and "#SBATCH --signal=B:USR1@120\n" in text


def test_a_dry_run_prints_the_rendezvous_and_the_command_of_each_node(slurm):
    env = {**slurm, "DRY_RUN": "1", "RECIPE": "qwen-fsdp2-sft"}
    env.pop("LAUNCH")
    done = subprocess.run(
        ["bash", str(SLURM / "torchrun.sbatch"), "train.max_steps=5"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    launch = ROOT / "recipes" / "qwen-fsdp2-sft" / "launch.sh"
    assert done.stdout.splitlines() == [
        f"slurm job 4242: NNODES=3 MASTER_ADDR=127.0.0.1 (localhost) MASTER_PORT=24242 LAUNCH={launch}",
        f"node 0: env NODE_RANK=0 bash {launch} train.max_steps=5 ",
        "nodes 1-2: srun --nodes=2 --ntasks=2 --ntasks-per-node=1 --exclude=localhost --kill-on-bad-exit=1 bash -c "
        'export\\ NODE_RANK=\\$\\(\\(SLURM_PROCID\\ +\\ 1\\)\\)\\;\\ exec\\ bash\\ \\"\\$0\\"\\ \\"\\$@\\" '
        f"{launch} train.max_steps=5 ",
    ]
    env["RECIPE"] = "no-such-recipe"
    done = subprocess.run(["bash", str(SLURM / "ray.sbatch")], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 2
    assert done.stderr.strip() == (
        f"error: {ROOT}/recipes/no-such-recipe/launch.sh not found: submit from the "
        f"repository root, or set ROOT or LAUNCH"
    )


def test_every_node_runs_launch_sh_with_its_rank(slurm, tmp_path):
    done = subprocess.run(
        ["bash", str(SLURM / "ray.sbatch"), "train.epochs=2"], env=slurm, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    for rank in range(3):
        assert (tmp_path / f"node{rank}").read_text() == (
            f"NODE_RANK={rank} NNODES=3 MASTER_ADDR=127.0.0.1 MASTER_PORT=24242 args=train.epochs=2\n"
        )
    assert "requeue" not in (tmp_path / "log").read_text()


def test_the_time_limit_warning_reaches_node_0s_launcher_and_a_preempted_job_requeues(slurm, tmp_path):
    script = subprocess.Popen(
        ["bash", str(SLURM / "torchrun.sbatch")],
        env={**slurm, "FAKE_PREEMPT": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 30
    while not (tmp_path / "started").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    script.send_signal(signal.SIGUSR1)  # what `#SBATCH --signal=B:USR1@120` sends to the batch shell
    out, err = script.communicate(timeout=60)
    assert script.returncode == 75, err
    assert (tmp_path / "node0").read_text().endswith("USR1\n")
    assert "preempted (exit status 75): requeueing job 4242" in out
    log = (tmp_path / "log").read_text().splitlines()
    assert log[-1] == "scontrol requeue 4242"


def test_outside_slurm_or_with_dry_run_0_it_says_so_or_runs(slurm, tmp_path):
    """DRY_RUN=0 runs (as unset does); without scontrol on the PATH: one line, exit 2."""
    env = {**slurm, "DRY_RUN": "0", "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_NODELIST": "localhost"}
    done = subprocess.run(
        ["bash", str(SLURM / "run_on_nodes.sh"), "train.max_steps=5"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0 and "node 0: " not in done.stdout, (done.stdout, done.stderr)
    assert (tmp_path / "node0").read_text().startswith("NODE_RANK=0 NNODES=1 ") and "args=train.max_steps=5" in (
        tmp_path / "node0"
    ).read_text()
    no_slurm = {**env, "PATH": os.environ["PATH"]}
    done = subprocess.run(
        ["bash", str(SLURM / "run_on_nodes.sh")], env=no_slurm, capture_output=True, text=True, timeout=30
    )
    assert (done.returncode, done.stderr) == (
        2,
        "error: scontrol (Slurm's) is not on the PATH: run this inside a Slurm job\n",
    )
