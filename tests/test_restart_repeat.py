"""``python -m cookbook.torchrun --max-restarts N``: a worker failure that repeats the previous attempt's (the same
error after the same step) ends the job instead of using up the restarts; one that moves on is restarted."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

WORKER = textwrap.dedent("""
    import os, sys
    import cookbook
    from cookbook.dist import record_progress

    def main(argv):
        attempt = int(os.environ["COOKBOOK_RESTART_COUNT"])
        with open(sys.argv[1], "a") as f:
            f.write(f"{attempt}\\n")
        step = 3 if sys.argv[2] == "same" else 3 + attempt   # 'moves': each attempt gets further
        record_progress(step)
        raise RuntimeError("boom in the step body")

    cookbook.run_main(main, argv=[])
""")


def _launch(tmp_path, mode, restarts):
    script, attempts = tmp_path / "worker.py", tmp_path / f"attempts-{mode}.txt"
    script.write_text(WORKER)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "cookbook.torchrun",
            "--nproc-per-node",
            "1",
            "--max-restarts",
            str(restarts),
            str(script),
            str(attempts),
            mode,
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    return proc, attempts.read_text().split()


def test_a_failure_that_repeats_at_the_same_step_is_not_restarted_again(tmp_path):
    proc, attempts = _launch(tmp_path, "same", 3)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert attempts == ["0", "1"], proc.stderr[-3000:]  # before: 0 1 2 3, three restarts into the same crash
    assert [line for line in proc.stderr.splitlines() if line.startswith("restart ")] == [
        "restart 1 of 3: rank 0 failed (exit status 1: a failure, its traceback is above); the workers resume from the newest checkpoint"
    ]
    assert "the same error as before restart 1, after the same step (3): not restarted again" in proc.stderr


def test_a_failure_at_a_later_step_each_time_uses_every_restart(tmp_path):
    proc, attempts = _launch(tmp_path, "moves", 1)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert attempts == ["0", "1"], proc.stderr[-3000:]
    assert "(after 1 restart)" in proc.stderr and "not restarted again" not in proc.stderr


SLEEPER = textwrap.dedent("""
    import sys, time
    import cookbook

    def main(argv):
        open(sys.argv[1], "w").close()
        time.sleep(120)

    cookbook.run_main(main, argv=[])
""")


@pytest.mark.parametrize("to_group", [False, True], ids=["the-launcher", "the-process-group"])
def test_ctrl_c_ends_the_job_with_one_line_and_status_130(tmp_path, to_group):
    """Ctrl-C in a terminal (SIGINT to the process group) or to the launcher alone: exit status 130, one line saying
    how to resume, no traceback (before: torch's SignalException traceback and status 1)."""
    script, ready = tmp_path / "worker.py", tmp_path / "ready"
    script.write_text(SLEEPER)
    proc = subprocess.Popen(
        [sys.executable, "-m", "cookbook.torchrun", "--nproc-per-node", "1", str(script), str(ready)],
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while not ready.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert ready.exists(), proc.communicate(timeout=30)[1][-3000:]
    os.killpg(proc.pid, signal.SIGINT) if to_group else proc.send_signal(signal.SIGINT)
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 130, err[-3000:]
    assert (
        "interrupted (Ctrl-C): the workers were stopped; run the same command again to resume from the newest "
        "checkpoint, if one was saved (Ctrl-C saves none, SIGTERM does) (exit status 130)"
        in err
        and "Traceback" not in err
    ), err[-3000:]
    assert not [line for line in err.splitlines() if not line.strip()], err[-3000:]  # no worker's empty line
