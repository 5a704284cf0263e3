"""``python -m cookbook.launch``: what every torchrun recipe's ``launch.sh`` does, written once.

    python -m cookbook.launch --ngpu "${NGPU:-}" --nnodes "${NNODES:-1}" --node-rank "${NODE_RANK:-0}" \\
        --master-addr "${MASTER_ADDR:-127.0.0.1}" --master-port "${MASTER_PORT:-}" \\
        --max-restarts "${MAX_RESTARTS:-3}" recipes/x/train.py --config tiny.yaml train.max_steps=100

It checks the process counts (`plan`), runs ``train.py --check`` (without GPUs: in this process, `_run_script`; with
GPUs: in a process of its own while the workers start and import, `workers_during_check`) and the workers with
`cookbook.torchrun`, restarted up to ``--max-restarts`` times (default 3) when a restart can cure
the failure. ``--dry-run`` (or ``DRY_RUN`` not ``0``) prints the ``check:`` and ``run:`` commands instead. A relative
``--config`` is also looked up beside ``train.py``. Exit status: the check's or the workers'.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from cookbook import run_lock
from cookbook.config import config_beside
from cookbook.errors import EXIT_BUG, EXIT_INTERRUPTED, EXIT_OK, EXIT_PREEMPTED, EXIT_USER_ERROR, LAUNCH_TIME_ENV
from cookbook.errors import VERDICT_ENV
from cookbook.torchrun import environ_kept


_WORLD_SIZE_ENV = "COOKBOOK_WORLD_SIZE"  # the check's world size (NGPU x NNODES), set for train.py --check


def _positive(name: str, value: str, least: int = 1) -> int:
    if not value.isdigit() or int(value) < least:
        what = "a positive integer" if least else "a whole number (0 or more)"
        raise SystemExit(f"error: {name}={value} is not {what}")
    return int(value)


def plan(ngpu: str, nnodes: str, gpus: int) -> tuple[int, int]:
    """``(processes per node, nodes)`` from `ngpu` (``""``: every GPU of this node, or 2 without one) and `nnodes`.
    Raises SystemExit naming the variable: not a positive integer, or more processes than `gpus`."""
    per_node = _positive("NGPU", ngpu) if ngpu else (gpus if gpus > 0 else 2)
    nodes = _positive("NNODES", nnodes)
    if gpus > 0 and per_node > gpus:
        raise SystemExit(f"error: NGPU={per_node} but this node has {gpus} GPU(s)")
    return per_node, nodes


def check_world_size() -> int:
    """The world size a recipe's ``--check`` plans for: ``COOKBOOK_WORLD_SIZE``, else ``NGPU`` x ``NNODES`` as
    launch.sh reads them. Raises SystemExit: not a positive integer (naming the variable)."""
    if os.environ.get(_WORLD_SIZE_ENV):
        return _positive(_WORLD_SIZE_ENV, os.environ[_WORLD_SIZE_ENV])
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    per_node, nodes = plan(os.environ.get("NGPU", ""), os.environ.get("NNODES", "1") or "1", gpus)
    return per_node * nodes


def main(argv: list[str] | None = None) -> int:
    """Check, then launch; returns the exit status."""
    started = time.time()
    parser = argparse.ArgumentParser(
        prog="python -m cookbook.launch", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ngpu", default="", help="processes on this node (default: one per GPU, else 2)")
    parser.add_argument("--nnodes", default="1")
    parser.add_argument("--node-rank", default="0")
    parser.add_argument("--master-addr", default="127.0.0.1")
    parser.add_argument("--master-port", default="", help="default: a free port on one node, 29500 on several")
    parser.add_argument("--max-restarts", default="3", help="restarts of the group after a killed or crashed worker")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        default=os.environ.get("DRY_RUN", "0") not in ("", "0"),
        help="print the check's and torchrun's commands and exit 0 (default: on when DRY_RUN is set and not 0)",
    )
    parser.add_argument("script", help="the recipe's train.py")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="--config FILE and config overrides")
    args = parser.parse_args(argv)
    script = Path(args.script).resolve()
    script_args = config_beside(script, args.script_args)  # a relative config from the recipe's folder too

    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    try:
        per_node, nodes = plan(args.ngpu, args.nnodes, gpus)
        restarts = _positive("MAX_RESTARTS", args.max_restarts, least=0)
    except SystemExit as exc:
        print(exc, file=sys.stderr)
        return EXIT_USER_ERROR
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # one thread per process (the check's and torchrun's)
    if gpus == 0:  # DeepSpeed (the ZeRO recipe) otherwise warns in every process that it found no accelerator
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    world_size = str(per_node * nodes)
    check_args = ["--check", *script_args]
    if nodes == 1 and not args.master_port:
        rdzv = ["--standalone"]  # one node: torchrun picks a free port
    else:
        rdzv = ["--nnodes", str(nodes), "--node-rank", args.node_rank, "--master-addr", args.master_addr]
        rdzv += ["--master-port", args.master_port or "29500"]
    torchrun_args = [*rdzv, "--nproc-per-node", str(per_node), "--max-restarts", str(restarts), str(script)]
    torchrun_args += script_args
    if args.dry_run:
        check = ["env", f"{_WORLD_SIZE_ENV}={world_size}", sys.executable, str(script), *check_args]
        print(f"check: {shlex.join(check)}")
        print(f"run: {shlex.join([sys.executable, '-m', 'cookbook.torchrun', *torchrun_args])}")
        return 0
    # LAUNCH_TIME_ENV as it was afterwards (also called in-process, by tests)
    with environ_kept(LAUNCH_TIME_ENV), tempfile.TemporaryDirectory(prefix="cookbook-check-") as tmp:
        os.environ.setdefault(LAUNCH_TIME_ENV, repr(started))  # the workers' startup_s counts from here
        env = {_WORLD_SIZE_ENV: world_size, run_lock.OUTPUT_DIR_FILE_ENV: str(Path(tmp) / "output_dir")}
        return _check_and_run(script, check_args, env, torchrun_args, args.node_rank, workers_during_check(gpus))


checking = False  # while `_run_script` runs: `cookbook.run_main` raises SystemExit(status), not ending the process


def _run_script(script: Path, argv: list[str], env: dict[str, str]) -> int:
    """Run `script` in this process as ``python script *argv`` with `env` added would; returns its exit status.
    Put back afterwards: the environment, ``sys.argv`` / ``path`` / streams, the working folder, signal handlers,
    warnings filters, the root logger, torch's threads, the modules imported from the script's folder. A `script`
    that is not a file runs in a process of its own (python's own error)."""
    if not script.is_file():
        return subprocess.run([sys.executable, str(script), *argv], env={**os.environ, **env}).returncode
    import logging
    import runpy
    import signal
    import traceback
    import warnings

    import torch

    from cookbook.builds import broken_build_in

    folder, environ, saved = str(script.parent), dict(os.environ), (sys.argv, sys.path, sys.stdout, sys.stderr)
    cwd, threads, modules, root = os.getcwd(), torch.get_num_threads(), set(sys.modules), logging.getLogger()
    handlers = {s: signal.getsignal(s) for s in signal.valid_signals()}
    logs = (root.level, list(root.handlers), logging.root.manager.disable)
    # python -m put the working folder first on sys.path, where python script puts the script's folder
    from_cwd = (
        getattr(sys.modules["__main__"], "__spec__", None) is not None
        and not sys.flags.safe_path
        and bool(sys.path)
        and os.path.abspath(sys.path[0] or ".") == cwd
    )
    os.environ.update(env)
    sys.argv, sys.path = [str(script), *argv], [folder, *sys.path[1 if from_cwd else 0 :]]
    if os.environ.get("OMP_NUM_THREADS", "").isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # what a new process's torch reads at import
    global checking
    checking = True
    signal.signal(signal.SIGTERM, _stop_check)
    try:
        with warnings.catch_warnings():
            runpy.run_path(str(script), run_name="__main__")
        status = EXIT_OK
    except SystemExit as exc:  # as the interpreter reads it
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
        status = exc.code if isinstance(exc.code, int) else (EXIT_OK if exc.code is None else EXIT_BUG)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        status = EXIT_INTERRUPTED
    except BaseException as exc:  # noqa: BLE001 - raised before run_main (an import): as python (cookbook.builds' hook)
        if (broken := broken_build_in(exc)) is not None:
            print(f"error: {broken}", file=sys.stderr)
            status = EXIT_USER_ERROR
        else:
            traceback.print_exc()
            status = EXIT_BUG
    finally:
        checking = False
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        sys.argv, sys.path, sys.stdout, sys.stderr = saved
        os.environ.clear()
        os.environ.update(environ)
        os.chdir(cwd)
        for sig, handler in handlers.items():
            if handler is not None and signal.getsignal(sig) is not handler:
                signal.signal(sig, handler)
        root.setLevel(logs[0])
        root.handlers[:] = logs[1]
        logging.disable(logs[2])
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        for name in set(sys.modules) - modules:  # the recipe's own modules: another script may have its own "data"
            if str(getattr(sys.modules[name], "__file__", None) or "").startswith(folder + os.sep):
                del sys.modules[name]
    return status


def _stop_check(signum: int, frame) -> None:
    """SIGTERM (a scheduler's stop) during the in-process check: one line, then exit status 75 (nothing to save)."""
    print(
        f"preempted (SIGTERM) during the check, before any worker started: nothing to save; run the same command "
        f"again to start (exit status {EXIT_PREEMPTED})",
        file=sys.stderr,
        flush=True,
    )
    raise SystemExit(EXIT_PREEMPTED)


def workers_during_check(gpus: int) -> bool:
    """Whether torchrun starts the workers while the check runs (on GPU nodes): they import their modules meanwhile
    and wait for its verdict (`cookbook.errors.check_passed`); on CPU the check runs first, in this process."""
    return gpus > 0


def _check_and_run(script: Path, argv: list[str], env: dict[str, str], run: list[str], rank: str, beside: bool) -> int:
    """The check (``script *argv``, `env` added), then torchrun (`run`). `beside`: the check in a process of its own
    while torchrun runs here, and a thread writes its verdict for the workers: "stop" (they exit 0, unseen) or "go";
    else the check first, in this process. Returns the check's status if it stopped the run, else the workers'."""
    from cookbook.torchrun import main as torchrun  # here: tests replace it

    reported = env[run_lock.OUTPUT_DIR_FILE_ENV]
    verdict = Path(reported).with_name("verdict")
    ended: list[int] = []  # the status to end with, once the check stopped the run
    locks: list[int] = []  # the output_dir's run lock, held until this process ends (SIGKILL too)

    def decide(status: int) -> None:
        """End with the check's `status` if it failed or found the run complete; else take the output_dir's run lock
        (one run per output_dir), or end with 2 if another run holds it."""
        if status != 0 or run_lock.reported_complete(reported):
            ended.append(status)
        elif (output_dir := run_lock.read_reported(reported)) is not None:
            try:
                locks.append(run_lock.acquire(output_dir, rank))
            except run_lock.RunLocked as exc:
                print(f"error: {exc}", file=sys.stderr)
                ended.append(EXIT_USER_ERROR)
        verdict.with_suffix(".tmp").write_text("stop" if ended else "go")
        os.replace(verdict.with_suffix(".tmp"), verdict)

    check = waiter = None
    if beside:
        check = subprocess.Popen([sys.executable, str(script), *argv], env={**os.environ, **env})
        waiter = threading.Thread(target=lambda: decide(check.wait()), daemon=True)
        waiter.start()
    else:
        decide(_run_script(script, argv, env))
    try:
        # COOKBOOK_CHECKED: the workers need not repeat what the check printed (a damaged checkpoint)
        with environ_kept("COOKBOOK_CHECKED", VERDICT_ENV):  # (also called in-process, by tests)
            os.environ.update({"COOKBOOK_CHECKED": "1", VERDICT_ENV: str(verdict)})
            status = torchrun(run) if beside or not ended else ended[0]
    finally:
        stopped = check is not None and check.poll() is None  # torchrun ended first (a signal): the check ends too
        if stopped:
            check.terminate()
        if waiter is not None:
            waiter.join()
        for fd in locks:
            os.close(fd)
    return status if stopped or not ended else ended[0]


if __name__ == "__main__":  # the module's own copy: cookbook.run_main's exit reads `checking` there
    from cookbook.launch import main as launch

    sys.exit(launch())
