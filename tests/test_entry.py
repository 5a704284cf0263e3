"""``cookbook.run_main`` and ``python -m cookbook.torchrun`` with real worker processes (2 gloo ranks): a user
error found by rank 1 alone reaches the user as rank 1's one line, first, with no traceback, and the job exits
with status 2; a worker killed by a signal is named; a DDP job exits 0 within seconds, run after run; a diverged
run is one line with status 4; a rank stopped mid-run is named by the rank whose collective times out (status 3)."""

from __future__ import annotations

import inspect
import os
import re
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import free_port

from cookbook.entry import peer_lost
from cookbook.torchrun import describe_failure

SCRIPT = textwrap.dedent("""
    import os, sys, time
    import torch, torch.distributed as dist
    import cookbook

    class DataError(ValueError):
        pass

    def main(argv):
        info = cookbook.init_distributed()
        mode = argv[0]
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 16))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            model(torch.randn(4, 16)).sum().backward()
            opt.step()
            opt.zero_grad()
        if mode == "bad-row" and info.rank == 1:
            raise DataError("data.train_files: rows.csv line 913: field 'label' is empty")
        if mode == "killed" and info.rank == 1:
            os.kill(os.getpid(), 9)
        cookbook.all_reduce_sum({"x": 1.0}, info.device)  # rank 0 waits here for the rank that failed
        cookbook.all_gather_object(info.rank)  # the collective whose clean-up a gloo thread was still doing
        print(f"done: rank {info.rank} at {time.time():.3f}", flush=True)
        cookbook.destroy_distributed()  # the DDP model, a local, is freed when main returns

    if __name__ == "__main__":
        cookbook.run_main(main, user_errors=(DataError,))
""")


def _torchrun(tmp_path: Path, mode: str, timeout: float = 240) -> tuple[subprocess.CompletedProcess, float]:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COOKBOOK_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    t0 = time.perf_counter()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "cookbook.torchrun",
            "--nnodes",
            "1",
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
            str(script),
            mode,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc, time.perf_counter() - t0


def test_a_user_error_on_rank_1_reaches_the_user_first_in_one_line(tmp_path):
    proc, _ = _torchrun(tmp_path, "bad-row")
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert errors[0] == "error: [rank 1] data.train_files: rows.csv line 913: field 'label' is empty", proc.stderr
    assert errors[-1].startswith("error: rank 1 failed first (exit status 2: bad configuration, data or checkpoint)")
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr, proc.stderr
    assert "done:" not in proc.stdout


def test_a_killed_worker_is_named_with_its_signal(tmp_path):
    proc, _ = _torchrun(tmp_path, "killed")
    assert proc.returncode == 128 + 9, proc.stderr[-3000:]
    assert "error: rank 1 was killed by SIGKILL; the other ranks were stopped" in proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


def test_a_ddp_job_exits_zero_within_seconds_run_after_run(tmp_path):
    # Freeing a DDP model in Python's interpreter shutdown once deadlocked with a gloo thread; run_main exits
    # without that shutdown. Three runs of a DDP job, each must end by itself well inside its timeout.
    for _ in range(3):
        proc, seconds = _torchrun(tmp_path, "ok", timeout=120)
        ended = time.time()
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert sorted(re.findall(r"done: rank \d", proc.stdout)) == [
            "done: rank 0",
            "done: rank 1",
        ]  # lines may interleave
        done = max(float(t) for t in re.findall(r"done: rank \d at ([\d.]+)", proc.stdout))
        # done to exit, not start-up (slow under load): 1.3 s at load 10 on 2 cores; 15 s is 10x that, and fails a hang
        assert ended - done < 15, (ended - done, seconds)


@pytest.mark.parametrize(
    "exitcode, line, status",
    [
        (
            2,
            "error: rank 3 failed first (exit status 2: bad configuration, data or checkpoint); the other ranks were stopped",
            2,
        ),
        (
            1,
            "error: rank 3 failed first (exit status 1: a failure, its traceback is above); the other ranks were stopped",
            1,
        ),
        (-15, "error: rank 3 was killed by SIGTERM; the other ranks were stopped", 143),
    ],
)
def test_describe_failure(exitcode, line, status):
    assert describe_failure(3, exitcode) == (line, status)


def test_the_last_line_repeats_the_cause_the_failed_worker_recorded():
    from types import SimpleNamespace

    from cookbook.torchrun import _cause

    recorded = {"message": {"message": "DataError: rows.txt line 13: bad\nmore", "extraInfo": {}}}
    assert _cause(SimpleNamespace(exitcode=2, error_file_data=recorded)) == "rows.txt line 13: bad"
    assert _cause(SimpleNamespace(exitcode=-9, error_file_data=recorded)) is None  # a signal: no record of its own
    assert _cause(SimpleNamespace(exitcode=1, error_file_data={"message": "<NONE>"})) is None
    assert describe_failure(3, 2, "rows.txt line 13: bad")[0] == (
        "error: rank 3 failed first (exit status 2: bad configuration, data or checkpoint): rows.txt line 13: bad; "
        "the other ranks were stopped"
    )


def test_peer_lost_reads_the_cause_chain():
    try:
        try:
            raise RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:41234")
        except RuntimeError as exc:
            raise ValueError("all_reduce failed") from exc
    except ValueError as outer:
        assert peer_lost(outer)
    assert not peer_lost(RuntimeError("CUDA out of memory"))


def _run_main_here(monkeypatch, capsys, main, world: int = 1, rank: int = 0) -> tuple[int, str]:
    """`run_main(main)` in this process, with its exit replaced by a return: (status, what it printed to stderr)."""
    import cookbook.entry

    class Exited(Exception):
        pass

    statuses = []

    def fake_exit(status, wait=0.0):
        statuses.append(status)
        raise Exited

    monkeypatch.setattr(cookbook.entry, "_exit", fake_exit)
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setattr(cookbook.entry, "_QUIET_RANK_WAIT_S", 0.0)
    with pytest.raises(Exited):
        cookbook.entry.run_main(main, argv=[])
    return statuses[0], capsys.readouterr().err


def test_a_diverged_run_is_one_line_with_status_4(monkeypatch, capsys):
    from cookbook.loop import NonFiniteError

    def main(argv):
        raise NonFiniteError("the gradient norm of step 7 is nan: the step was not applied and the run stops")

    status, err = _run_main_here(monkeypatch, capsys, main, world=2)
    assert (status, err) == (
        4,
        "error: [rank 0] the gradient norm of step 7 is nan: the step was not applied and the run stops\n",
    )
    # every rank decided alike and raises alike: the user reads it once, from rank 0
    assert _run_main_here(monkeypatch, capsys, main, world=2, rank=1) == (4, "")


def test_a_missing_or_broken_package_is_one_line_with_status_2_and_never_restarted(monkeypatch, capsys, tmp_path):
    """A restart cannot install a package: an ImportError is bad input (2), which the launcher does not restart, in
    one line that names the module (or, through transformers' wrapping, the innermost cause) and the install line
    of the requirements.txt beside the recipe's train.py."""
    from cookbook.torchrun import should_restart

    (tmp_path / "requirements.txt").write_text("torchvision==0.28.0\n")
    recipe = {}
    exec(compile("def main(argv):\n    import cookbook_no_such_package\n", str(tmp_path / "train.py"), "exec"), recipe)
    status, err = _run_main_here(monkeypatch, capsys, recipe["main"], world=2, rank=1)
    assert (status, err) == (
        2,
        "error: [rank 1] importing cookbook_no_such_package failed (No module named "
        "'cookbook_no_such_package'): a restart cannot install or repair a package; install "
        f"the recipe's requirements (`pip install -r {tmp_path / 'requirements.txt'}`)\n",
    )
    assert not should_restart(status, [status, status])

    def main(argv):  # what `from transformers import get_scheduler` raises beside a torchvision built for another torch
        try:
            raise RuntimeError("operator torchvision::nms does not exist")
        except RuntimeError as exc:
            raise ModuleNotFoundError(
                "Could not import module 'get_scheduler'. Are this object's requirements defined correctly?"
            ) from exc

    assert _run_main_here(monkeypatch, capsys, main) == (
        2,
        "error: an import failed (RuntimeError: operator torchvision::nms does not exist): a restart cannot install "
        "or repair a package; install the recipe's requirements (its README's install line)\n",
    )


def test_a_collective_timeout_outside_the_loop_is_one_line_with_status_3(monkeypatch, capsys):
    import torch.distributed

    import cookbook.dist

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)  # no group (and no store) here
    monkeypatch.setattr(
        cookbook.dist, "_STALL", {**cookbook.dist._STALL, "timeout_s": None, "store": None, "step": None}
    )  # no step recorded (an earlier test in this process may have)

    def main(argv):
        raise RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 10000ms for recv operation")

    status, err = _run_main_here(monkeypatch, capsys, main, world=2)
    assert status == 3 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("error: [rank 0] a collective timed out (`raise RuntimeError(") and "test_entry.py:" in err
    assert err.endswith("): which rank is behind is not known (no process group store to read their progress from)\n")


STALL_TIMEOUT_S = 4


def _stalling_rank(rank: int, port: int, out: Path) -> None:
    """One of 2 ranks training a DDP model with `TrainLoop`; rank 1 stops itself (SIGSTOP) as step 4 begins."""
    import signal

    import torch

    import cookbook
    from cookbook.checkpoint import TrainState
    from cookbook.loop import TrainLoop
    from cookbook.metrics import MetricsLogger

    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        COOKBOOK_DEVICE="cpu",
        TORCHELASTIC_ERROR_FILE=str(out / f"error{rank}.json"),
    )
    sys.stderr = open(out / f"stderr{rank}.txt", "w", buffering=1)  # run_main's line and the log: this rank's file
    os.dup2(sys.stderr.fileno(), 2)

    def main(argv):
        info = cookbook.init_distributed(STALL_TIMEOUT_S, debug_dir=out / "debug")
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        metrics = MetricsLogger(out, info, mlflow=False, max_steps=50, count_tokens=False)
        with TrainLoop(state=TrainState(), max_steps=50, metrics=metrics, log_every=1) as loop:
            for step in loop.steps():
                if info.rank == 1 and step == 4:
                    (out / "pid1").write_text(str(os.getpid()))
                    os.kill(os.getpid(), signal.SIGSTOP)
                loss = model(torch.randn(4, 8)).pow(2).mean()
                loss.backward()  # DDP's gradient all-reduce: rank 0 waits here for the stopped rank
                optimizer.step()
                optimizer.zero_grad()
                loop.end_step(loss, lr=0.01)

    cookbook.run_main(main, argv=[])


def test_a_stalled_rank_is_named_by_the_rank_whose_collective_times_out(tmp_path, monkeypatch, capsys):
    """2 gloo ranks for real: rank 1 is stopped (SIGSTOP) at step 4; rank 0's gradient all-reduce times out after
    train.collective_timeout_s and its one line names rank 1, its pid, where rank 0 waited and the step; so does the
    launcher's restart line, from rank 0's error file."""
    import multiprocessing
    import signal

    import psutil
    import torch  # noqa: F401 - imported here, once: the forked ranks inherit it

    import cookbook.loop  # noqa: F401

    ctx = multiprocessing.get_context("fork")  # the ranks inherit this process's imports: no interpreter start-up
    port = free_port()
    ranks = [ctx.Process(target=_stalling_rank, args=(r, port, tmp_path)) for r in (0, 1)]
    t0 = time.perf_counter()
    for p in ranks:
        p.start()
    try:
        ranks[0].join(timeout=120)
        seconds = time.perf_counter() - t0
        err = (tmp_path / "stderr0.txt").read_text()
        assert ranks[0].exitcode == 3, err[-3000:]
        assert seconds < STALL_TIMEOUT_S + 40, seconds
        pid = int((tmp_path / "pid1").read_text())
        assert psutil.Process(pid).status() == psutil.STATUS_STOPPED
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        lines, first = inspect.getsourcelines(_stalling_rank)
        backward = first + next(i for i, line in enumerate(lines) if "loss.backward()" in line)
        assert errors == [
            f"error: [rank 0] a collective did not finish within {STALL_TIMEOUT_S} s (a gradient collective in "
            f"backward: `loss.backward()`, test_entry.py:{backward}) at step 4: "
            f"rank 1 (pid {pid} on {socket.gethostname()}) did not reach it (every rank last finished step 3, but it "
            f"did not time out with this rank within {STALL_TIMEOUT_S / 4:g} s) - it is stalled (stopped, hung, or much slower); "
            f"`py-spy dump --pid {pid}` on {socket.gethostname()} shows where it is; this rank's stacks: "
            f"{tmp_path / 'debug' / 'stacks_rank0.txt'}"
        ], err[-3000:]
        assert "Traceback" not in err
        # The launcher (`cookbook.torchrun.main` around a stand-in agent whose group fails once with rank 0's real
        # record) names the stalled rank 1. Before: "restart 1 of 1: rank 0 failed (exit status 3: ...)".
        import torch.distributed.run as torchrun_module
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

        import cookbook.torchrun as torchrun

        record = ProcessFailure(local_rank=0, pid=ranks[0].pid, exitcode=3, error_file=str(tmp_path / "error0.json"))
        attempts = []

        def run(args):
            attempts.append(args)
            if len(attempts) == 1:
                raise ChildFailedError("train.py", {0: record})

        monkeypatch.setattr(torchrun_module, "run", run)
        monkeypatch.setattr(torchrun, "_stop_asked", False)
        capsys.readouterr()
        assert torchrun.main(["--nproc-per-node", "2", "--max-restarts", "1", "train.py"]) == 0
        assert [line for line in capsys.readouterr().err.splitlines() if line.startswith("restart ")] == [
            "restart 1 of 1: rank 1 stalled (rank 0's collective timed out waiting for it); the workers resume from "
            "the newest checkpoint"
        ]
    finally:
        for p in ranks:
            if p.is_alive():
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
            p.join(timeout=30)
    assert not psutil.pid_exists(ranks[1].pid) or psutil.Process(ranks[1].pid).status() == psutil.STATUS_ZOMBIE


def test_cli_runs_preflight_for_check_with_the_world_launch_sh_starts_and_main_otherwise(monkeypatch, capsys, tmp_path):
    """``--check`` prints ``config OK: <config> (<preflight's answer>)`` for NGPU x NNODES processes and never runs
    main; ``--show-examples N`` prints what `show_examples` returns; without either, main gets the loaded config."""
    import cookbook

    calls = []
    load = lambda path, overrides: {"path": path, "overrides": overrides}  # noqa: E731
    preflight = lambda cfg, world_size: calls.append(("preflight", world_size)) or f"{world_size} ranks"  # noqa: E731

    @cookbook.cli(load, preflight, lambda cfg, n: f"{n} rows of {cfg['path']}")
    def main(cfg):
        calls.append(("main", cfg))

    for var, value in (("COOKBOOK_WORLD_SIZE", None), ("NGPU", "3"), ("NNODES", "2"), ("CUDA_VISIBLE_DEVICES", "")):
        monkeypatch.delenv(var, raising=False) if value is None else monkeypatch.setenv(var, value)
    main(["--config", "a.yaml", "--check", "x=1"])
    main(["--config", "a.yaml", "--show-examples", "2"])
    main(["--config", "a.yaml", "x=1"])
    assert capsys.readouterr().out == "config OK: a.yaml (6 ranks)\n2 rows of a.yaml\n"
    assert calls == [("preflight", 6), ("main", {"path": "a.yaml", "overrides": ["x=1"]})]
