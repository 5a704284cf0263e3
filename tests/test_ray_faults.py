"""Faults injected into two-tower-ray (tiny.yaml, 2 CPU workers), its driver through ``cookbook.run_main`` (as
``python train.py``) in a forked process: a full disk while Ray copies a checkpoint (workers forked without Ray,
`ray_cluster.without_ray`), a stopped worker (Ray's workers: what Ray's controller does is the point)."""

import contextlib
import os
import re
import resource
import shutil
import signal
import time
from pathlib import Path

from conftest import ROOT, read_jsonl, train_losses
from ray_cluster import ray_processes, recipe_module, registered, run_driver_forked, train_steps, wait_for, without_ray

RECIPE = "two-tower-ray"
STEPS_PER_EPOCH = 12  # tiny.yaml on 2 workers


def _driver(capfd, *overrides: str) -> tuple[int, str]:
    """The driver on tiny.yaml with `overrides`, through ``cookbook.run_main`` with train.py's user errors in a forked
    process: its exit status and stderr."""
    capfd.readouterr()
    pid = os.fork()
    if pid == 0:  # run_main ends the process with the exit status
        import cookbook

        train = recipe_module(RECIPE)
        cookbook.run_main(
            train.main,
            user_errors=(train.ConfigError, train.DataError, train.CheckpointError),
            argv=["--config", str(ROOT / "recipes" / RECIPE / "tiny.yaml"), *overrides],
        )
    status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    return status, capfd.readouterr().err


def _errors(err: str) -> list[str]:
    return [line for line in err.splitlines() if "error" in line.lower() or "Traceback" in line]


def test_a_full_disk_while_ray_copies_a_checkpoint_is_one_line_exit_2_naming_the_previous_one(
    tmp_path, capfd, monkeypatch
):
    """Epoch 2's checkpoint is copied to output_dir as Ray does it (pyarrow's ``copy_files``, inside
    ``ray.train.report``) with rank 0's file size capped below ``state.pt`` (EFBIG, as a full disk's ENOSPC;
    Python ignores SIGXFSZ): the driver prints one line naming the checkpoint, the OS error and epoch 1's
    checkpoint, and exits 2 (not restarted); the partial folder is removed, epoch 1's is intact."""
    import pyarrow.fs
    from ray.train.v2._internal.execution.storage import _pyarrow_fs_copy_files

    from cookbook.checkpoint import _mount_point

    without_ray(monkeypatch)
    copytree = shutil.copytree

    def persist(src, dst, *args, **kwargs):  # `LocalTorchTrainer`'s copy of a reported checkpoint
        if not str(dst).endswith("checkpoint_epoch_0002"):
            return copytree(src, dst, *args, **kwargs)
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (os.path.getsize(os.path.join(src, "state.pt")) // 2, limit[1]))
        try:  # Ray's StorageContext.persist_current_checkpoint
            local = pyarrow.fs.LocalFileSystem()
            local.create_dir(str(dst))
            _pyarrow_fs_copy_files(str(src), str(dst), source_filesystem=local, destination_filesystem=local)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        return dst

    monkeypatch.setattr(shutil, "copytree", persist)
    out = tmp_path / "run"
    status, err = _driver(capfd, f"output_dir={out}", "mlflow=false", "train.epochs=3")
    target, previous = out / "checkpoint_epoch_0002", out / "checkpoint_epoch_0001"
    assert status == 2, err[-3000:]
    lines = _errors(err)
    assert lines == [
        f"error: could not save the checkpoint of step {2 * STEPS_PER_EPOCH} to {target} (rank 0: EFBIG, "
        f"Error writing bytes to file. Detail: [errno 27] File too large); the previous checkpoint "
        f"{previous} is intact. Raise the file size limit (ulimit -f) or the largest file size of "
        f"{_mount_point(out)} and run the same command again: it resumes from {previous}"
    ], err[-3000:]
    assert sorted(p.name for p in out.glob("checkpoint_epoch_*")) == ["checkpoint_epoch_0001"]
    assert (previous / "state.pt").is_file() and (previous / "meta.json").is_file()
    steps = [r["step"] for r in read_jsonl(out / "metrics.jsonl") if r["event"] == "train"]
    assert steps[-1] == 2 * STEPS_PER_EPOCH  # no step after the failed save


def _log_sizes(env: dict) -> dict[Path, int]:
    """The size of every Ray worker log in the session folder now (`_rank_0` reads what follows)."""
    return {log: log.stat().st_size for log in Path(env["_RAY_TMP"]).glob("session_*/logs/worker-*.err")}


def _rank_0(env: dict, before: dict[Path, int]) -> int:
    """The pid of the running Ray Train worker of rank 0: the one whose log (in Ray's session folder) has, after its
    size in `before` (`_log_sizes` at the test's start), the run's first line, which rank 0 alone writes. Ray reuses
    worker processes: a log's earlier part can be an earlier run's rank 0 in what is now this run's rank 1."""
    workers = ray_processes(env, "RayTrainWorker")
    for log in Path(env["_RAY_TMP"]).glob("session_*/logs/worker-*.err"):
        pid = int(re.search(r"-(\d+)\.err$", log.name)[1])
        with log.open("rb") as f:
            f.seek(before.get(log, 0))
            if pid in workers and b"| starting at epoch" in f.read():
                return pid
    raise AssertionError(f"no log of rank 0 among the workers {workers}")


def test_a_stopped_worker_ends_the_run_within_the_collective_timeout_naming_it(ray_env, tmp_path):
    """Rank 0's Ray Train worker SIGSTOPped after step 5 (``train.collective_timeout_s=5``): the other worker's
    collective times out and the group's store, which rank 0's process serves, does not answer; Ray ends the run
    (``ray.max_failures=0``) within seconds, not at its ~10 min health check, and the driver prints one line
    naming the stopped worker by its pid, exit 3."""
    out, stopped, logs = tmp_path / "run", {}, _log_sizes(ray_env)

    def stop(driver: int) -> None:
        wait_for(lambda: train_steps(out), "step 5's log line")
        pid = _rank_0(ray_env, logs)
        os.kill(pid, signal.SIGSTOP)
        stopped.update(pid=pid, at=time.monotonic())

    try:
        run = run_driver_forked(
            RECIPE,
            ray_env,
            f"output_dir={out}",
            "mlflow=false",
            "train.collective_timeout_s=5",
            alongside=stop,
            timeout=300,
            run_main=True,
        )
        took = time.monotonic() - stopped["at"]
    finally:
        with contextlib.suppress(ProcessLookupError, KeyError):
            os.kill(stopped["pid"], signal.SIGCONT)
    assert run.returncode == 3, run.stderr[-4000:]
    lines = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and re.match(
        rf"error: Ray Train worker 1: a collective did not finish within 5 s \(.*\) at step \d+: rank 0 \(pid "
        rf"{stopped['pid']} on \S+\) serves the group's store, which did not answer \(.*\) - it is stalled",
        lines[0],
    ), lines
    assert took < 60, took  # 5 s, up to 7.25 s for the store (describe_stall), Ray's teardown: ~22 s on 2 busy cores


def test_a_stopped_worker_with_a_restart_left_is_restarted_and_the_run_takes_the_uninterrupted_steps(
    ray_env, tmp_path, monkeypatch, capfd
):
    """As above with ``ray.max_failures=1``, rank 0 stopped once Ray registered a checkpoint: the other worker's
    collective times out, Ray restarts the worker group (the stopped process is killed) from the newest checkpoint
    it registered, and the run finishes (exit 0) with each step's loss equal to an uninterrupted run's (the same
    worker function on 2 gloo workers without Ray: `without_ray`)."""
    common = ("mlflow=false", "train.log_every=1", "train.collective_timeout_s=10")
    with monkeypatch.context() as local:
        without_ray(local)
        status, err = _driver(capfd, f"output_dir={tmp_path / 'plain'}", *common)
    assert status == 0, err[-4000:]
    uninterrupted = train_losses(tmp_path / "plain" / "metrics.jsonl")
    assert sorted(uninterrupted) == list(range(1, 4 * STEPS_PER_EPOCH + 1))
    out, stopped, logs = tmp_path / "run", {}, _log_sizes(ray_env)

    def rank_0_found() -> bool:
        with contextlib.suppress(AssertionError, OSError):  # not up yet, or a log or process gone meanwhile
            stopped["pid"] = _rank_0(ray_env, logs)
        return "pid" in stopped

    def stop(driver: int) -> None:
        # rank 0 found first (a scan of Ray's processes and logs, slow on a busy machine): the stop follows the
        # registration within a poll, in a training step, not in a report (Ray's wait for every worker there has
        # no timeout, so a worker stopped inside it is noticed only by Ray's health check)
        wait_for(rank_0_found, "rank 0's worker")
        wait_for(lambda: registered(out) is not None, "a checkpoint registered")
        os.kill(stopped["pid"], signal.SIGSTOP)
        stopped.update(steps=len(train_steps(out)))

    try:
        run = run_driver_forked(
            RECIPE,
            ray_env,
            f"output_dir={out}",
            *common,
            "ray.max_failures=1",
            alongside=stop,
            timeout=400,
            run_main=True,
        )
    finally:
        with contextlib.suppress(ProcessLookupError, KeyError):
            os.kill(stopped["pid"], signal.SIGCONT)
    assert run.returncode == 0, run.stderr[-4000:]
    assert stopped["pid"] not in ray_processes(ray_env, "RayTrainWorker")
    resumed = re.findall(
        r"resumed from \S+/checkpoint_epoch_\d{4} \(epoch (\d), step (\d+), world_size 2\)", run.stderr
    )
    assert len(resumed) == 1, run.stderr[-4000:]  # the restarted group, from the newest registered checkpoint
    steps = train_steps(out)
    assert steps[stopped["steps"]] == int(resumed[0][1]) + 1 and steps[-1] == 4 * STEPS_PER_EPOCH, steps
    assert stopped["steps"] < len(steps) - 1 and steps[stopped["steps"] - 1] < 4 * STEPS_PER_EPOCH  # stopped mid-run
    assert train_losses(out / "metrics.jsonl") == uninterrupted
