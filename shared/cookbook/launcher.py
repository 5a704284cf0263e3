"""``@distributed``: run a function once per GPU (or on 2 CPU processes) from a notebook or a script, inside a
process group (docs/cookbook.md#in-a-notebook-cookbookdistributed). ``backend="torch"``: torch's elastic launcher
on this machine, the call sent with cloudpickle; ``backend="ray"``: the train loop of Ray Train's ``TorchTrainer``
at ``RAY_ADDRESS``. A worker's exception comes back as one `WorkerError`, the other workers stopped.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import importlib.machinery
import io
import linecache
import logging
import multiprocessing
import os
import pickle
import signal
import sys
import tempfile
import threading
import time
import traceback
import types
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Generic, ParamSpec, TypeVar

import cloudpickle
import torch

from cookbook.dist import distributed_context
from cookbook.errors import first_line, killed_by
from cookbook.run_lock import die_with_parent
from cookbook.torchrun import STOP_SIGNALS, environ_kept

P = ParamSpec("P")
_R = TypeVar("_R")

_BACKENDS = ("torch", "ray")
_START_METHODS = ("spawn", "forkserver", "fork")


@dataclasses.dataclass(repr=False, eq=False)
class WorkerError(RuntimeError):
    """A worker of ``fn.distributed(...)`` raised or died: ``rank`` (first to fail), ``exc_type`` (None: no Python
    exception), ``worker_traceback``, ``exitcode`` (negative: that signal), ``exception`` (rebuilt here, or None)."""

    message: str
    rank: int | None = None
    exc_type: str | None = None
    worker_traceback: str = ""
    exitcode: int | None = None
    exception: BaseException | None = None

    def __post_init__(self) -> None:
        super().__init__(self.message)


@dataclasses.dataclass(repr=False, eq=False)
class _DistributedFunction(Generic[P, _R]):
    """What `distributed` returns: the function, callable as before, plus ``.distributed(...)``."""

    fn: Callable[P, _R]
    num_processes: int | None
    backend: str
    start_method: str
    timeout_minutes: float

    def __post_init__(self) -> None:
        functools.update_wrapper(self, self.fn)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> _R:
        return self.fn(*args, **kwargs)

    def distributed(self, *args: P.args, **kwargs: P.kwargs) -> list[_R]:
        """Run the function once per process; its return values in rank order. Raises `WorkerError` (a worker
        failed), ValueError (more processes than GPUs), KeyboardInterrupt (Ctrl-C: every worker stopped)."""
        if getattr(multiprocessing.current_process(), "_inheriting", False):  # what multiprocessing itself checks
            raise RuntimeError(
                f"{self.__qualname__}.distributed(...) was called while a spawned worker imported "  # type: ignore[attr-defined]
                'the caller\'s script: in a script, call it under `if __name__ == "__main__":`'
            )
        if self.backend == "ray":
            return _run_ray(self.fn, args, kwargs, self.num_processes, self.timeout_minutes)
        n = local_num_processes(self.num_processes)
        return _run_local(self.fn, args, kwargs, n, self.start_method, self.timeout_minutes)

    def __repr__(self) -> str:
        return (
            f"<distributed function {self.__qualname__} (backend={self.backend!r}, num_processes={self.num_processes})>"  # type: ignore[attr-defined]
        )


def distributed(
    fn: Callable[P, _R] | None = None,
    *,
    num_processes: int | None = None,
    backend: str = "torch",
    start_method: str = "spawn",
    timeout_minutes: float = 30.0,
) -> Any:
    """Decorator: ``fn.distributed(*args, **kwargs)`` runs `fn` once per process; ``fn(...)`` still runs it here.
    `num_processes` None: one per visible GPU, else 2 (Ray: the cluster's GPUs); `timeout_minutes`: collectives'.
    Raises TypeError for ``@distributed(2)``, ValueError for an unknown `backend` / `start_method`, a bad count."""
    if backend not in _BACKENDS:
        raise ValueError(f"backend={backend!r}: use one of {', '.join(_BACKENDS)}")
    if start_method not in _START_METHODS:
        raise ValueError(f"start_method={start_method!r}: use one of {', '.join(_START_METHODS)}")
    if fn is not None and not callable(fn):
        raise TypeError(
            f"distributed({fn!r}): pass the number of processes by keyword, @distributed(num_processes={fn!r})"
        )
    if num_processes is not None and (
        isinstance(num_processes, bool) or not isinstance(num_processes, int) or num_processes < 1
    ):
        raise ValueError(f"num_processes must be a positive integer or None, got {num_processes!r}")

    def decorate(f: Callable[P, _R]) -> _DistributedFunction[P, _R]:
        return _DistributedFunction(f, num_processes, backend, start_method, timeout_minutes)

    return decorate(fn) if fn is not None else decorate


def local_num_processes(num_processes: int | None) -> int:
    """The number of local workers (``None``: every visible GPU, else 2). Raises ValueError: more than the GPUs,
    unless ``COOKBOOK_DEVICE=cpu``."""
    force_cpu = os.environ.get("COOKBOOK_DEVICE", "").lower() == "cpu"
    gpus = torch.cuda.device_count() if torch.cuda.is_available() and not force_cpu else 0
    n = num_processes if num_processes is not None else (gpus or 2)
    if gpus and n > gpus:
        raise ValueError(
            f"num_processes={n} but only {gpus} GPU(s) are visible: one process per GPU, so at most "
            f"{gpus} (set COOKBOOK_DEVICE=cpu to run {n} CPU processes with gloo instead)"
        )
    return n


# ----------------------------------------------------------------------------- the call (both backends), local workers
def _call(payload: bytes | tuple, rank: int, timeout_minutes: float, report: Callable[[dict], None]) -> bytes:
    """Run the call in a process group and return its cloudpickled result; an exception is given to `report` as an
    error record for the caller, then re-raised (the launcher then stops the other workers)."""
    group = contextlib.ExitStack()
    try:
        fn, args, kwargs = cloudpickle.loads(payload) if isinstance(payload, bytes) else payload
        if not torch.distributed.is_initialized():  # else Ray Train made the group; it also tears it down
            group.enter_context(distributed_context(timeout_minutes))
        result = fn(*args, **kwargs)
        group.close()
        try:
            return _dumps(result)
        except Exception as exc:
            raise TypeError(
                f"rank {rank}'s return value ({type(result).__name__}) cannot be pickled to send it back: "
                f"{exc}. Return plain data (numbers, lists, dicts, CPU tensors)"
            ) from exc
    except BaseException as exc:  # before the group is torn down: the earliest record is the root cause
        report(_error_record(rank, exc))
        raise
    finally:
        group.close()


def _worker(payload: bytes | tuple, error_dir: str, threads: int, timeout_minutes: float) -> bytes:
    """One elastic worker: `_call`, its error record written to `error_dir`."""
    torch.set_num_threads(threads)  # as torchrun; a fork that inherits an OpenMP pool can hang in its first op
    die_with_parent()
    rank = int(os.environ.get("RANK", "0"))
    path = Path(error_dir) / f"rank{rank:05d}.pkl"

    def save(record: dict) -> None:
        path.with_suffix(".tmp").write_bytes(pickle.dumps(record))
        path.with_suffix(".tmp").rename(path)

    return _call(payload, rank, timeout_minutes, save)


def _run_local(fn: Callable, args: tuple, kwargs: dict, n: int, start_method: str, timeout_minutes: float) -> list:
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if start_method == "fork" and torch.distributed.is_available() and torch.distributed.is_initialized():
        # A forked worker would inherit this group without its threads: its first collective would never return.
        raise RuntimeError(
            "start_method='fork' from a process that has a process group (init_process_group or "
            "cookbook.init_distributed ran here): the forked workers would inherit it and hang in their first "
            "collective; call cookbook.destroy_distributed() first, or use start_method='spawn'"
        )
    script = getattr(sys.modules["__main__"], "__file__", None)
    if start_method != "fork" and script is not None and not os.path.isfile(script):  # python - < file.py
        raise RuntimeError(
            f"the caller's script {script} is not a file (read from standard input?), and spawned workers import "
            f"it again: save it to a file and run that, or use start_method='fork'"
        )
    payload = (fn, args, kwargs) if start_method == "fork" else _dumps_call(fn, args, kwargs)
    # Seconds between SIGTERM and SIGKILL for workers that do not stop (torch >= 2.12; 30 before).
    extra = {"shutdown_timeout": 10} if "shutdown_timeout" in {f.name for f in dataclasses.fields(LaunchConfig)} else {}
    threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
    with tempfile.TemporaryDirectory(prefix="cookbook-distributed-", ignore_cleanup_errors=True) as workdir:
        errors = Path(workdir) / "errors"
        errors.mkdir()
        config = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=n,
            run_id=f"cookbook-{uuid.uuid4().hex[:8]}",
            rdzv_backend="c10d",
            rdzv_endpoint="127.0.0.1:0",  # a free port on this machine
            max_restarts=0,
            start_method=start_method,
            monitor_interval=0.1,
            logs_specs=DefaultLogsSpecs(log_dir=str(Path(workdir) / "logs")),
            **extra,
        )
        with _around_agent(), environ_kept("TORCHELASTIC_SIGNALS_TO_HANDLE"):
            try:
                returned = elastic_launch(config, _worker)(payload, str(errors), threads, timeout_minutes)
            except ChildFailedError as exc:
                rank, failure = exc.get_first_failure()
                error = _worker_error(
                    [pickle.loads(p.read_bytes()) for p in errors.glob("*.pkl")], n, rank, failure.exitcode
                )
                raise error from error.exception
            except SignalException as exc:  # the agent's handler turned Ctrl-C / SIGTERM into this; workers are stopped
                if exc.sigval == signal.SIGINT:  # one line, as cookbook.torchrun's (run_main: that line, status 130)
                    raise KeyboardInterrupt("interrupted (Ctrl-C): every worker was stopped") from None
                raise
    return [cloudpickle.loads(returned[rank]) for rank in range(n)]


@contextlib.contextmanager
def _around_agent() -> Iterator[None]:
    """Only critical messages of the elastic agent's loggers meanwhile (the `WorkerError` says a failure once); then
    the caller's signal handlers back (the agent leaves its own)."""
    main = threading.current_thread() is threading.main_thread()
    saved = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS} if main else {}
    prefixes = ("torch.distributed.elastic", "torch.multiprocessing")  # each module's logger has its own level
    loggers = list(logging.root.manager.loggerDict.items())
    levels = {log: log.level for name, log in loggers if name.startswith(prefixes) and isinstance(log, logging.Logger)}
    for log in levels:
        log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for log, level in levels.items():
            log.setLevel(level)
        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, handler)


# ----------------------------------------------------------------------------- Ray Train workers
def _ray_loop(config: dict) -> None:
    """Ray Train's per-worker function, `_call`: ``(rank, result)`` or ``(None, error record)`` to the queue."""
    rank, queue = int(os.environ.get("RANK", "0")), config["queue"]  # (Ray Train's torch backend sets RANK)
    result = _call(config["payload"], rank, config["timeout_minutes"], lambda record: queue.put((None, record)))
    queue.put((rank, result))


def _run_ray(fn: Callable, args: tuple, kwargs: dict, num_processes: int | None, timeout_minutes: float) -> list:
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    from ray.util.queue import Queue

    from cookbook.ray_train import RayConfig, plan_workers

    started = not ray.is_initialized()
    if started:  # join RAY_ADDRESS, or start a local instance for this call only
        ray.init(address=os.environ.get("RAY_ADDRESS") or None, include_dashboard=False, log_to_driver=True)
    storage = tempfile.TemporaryDirectory(prefix="cookbook-distributed-ray-", ignore_cleanup_errors=True)
    queue = None
    try:
        res = ray.cluster_resources()
        n, use_gpu = plan_workers(
            RayConfig(num_workers=num_processes or -1), int(res.get("GPU", 0)), int(res.get("CPU", 0))
        )
        queue = Queue(actor_options={"num_cpus": 0})
        trainer = TorchTrainer(
            _ray_loop,
            train_loop_config={
                "payload": _dumps_call(fn, args, kwargs),
                "queue": queue,
                "timeout_minutes": timeout_minutes,
            },
            scaling_config=ScalingConfig(
                num_workers=n, use_gpu=use_gpu, resources_per_worker={"CPU": 1.0, **({"GPU": 1} if use_gpu else {})}
            ),
            run_config=RunConfig(name="run", storage_path=storage.name, failure_config=FailureConfig(max_failures=0)),
        )
        try:
            trainer.fit()
        except Exception as exc:
            errors = [record for rank, record in queue.get_nowait_batch(queue.qsize()) if rank is None]
            if not errors:
                raise
            error = _worker_error(errors, n, None, None)
            raise error from error.exception or exc
        results = dict(queue.get_nowait_batch(queue.qsize()))
        missing = sorted(set(range(n)) - set(results))
        if missing:
            raise WorkerError(f"Ray Train finished but rank(s) {missing} of {n} returned nothing")
        return [cloudpickle.loads(results[rank]) for rank in range(n)]
    finally:
        if queue is not None:
            queue.shutdown()
        storage.cleanup()
        if started:
            ray.shutdown()


# ----------------------------------------------------------------------------- pickling and error records
def _code_reduce(code: types.CodeType) -> tuple:
    constructor, args = cloudpickle.cloudpickle._code_reduce(code)
    return constructor, tuple(code.co_filename if a == "<dynamic-code>" else a for a in args)


class _Pickler(cloudpickle.Pickler):
    """cloudpickle, but code sent by value keeps its file name (not ``<dynamic-code>``) for the worker's traceback."""

    dispatch_table = collections.ChainMap({types.CodeType: _code_reduce}, cloudpickle.Pickler.dispatch_table)


def _dumps(obj: Any) -> bytes:
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle.DEFAULT_PROTOCOL).dump(obj)
    return buffer.getvalue()


def _dumps_call(fn: Callable, args: tuple, kwargs: dict) -> bytes:
    """cloudpickle the call; a module the workers could not import by name (loaded from a file path) by value."""
    module = sys.modules.get(getattr(fn, "__module__", None) or "")
    top = module.__name__.split(".")[0] if module else ""
    by_value = (
        top not in ("__main__", *sys.builtin_module_names)
        and getattr(module, "__file__", None) is not None
        and importlib.machinery.PathFinder.find_spec(top, sys.path) is None
    )
    if by_value:
        cloudpickle.register_pickle_by_value(module)
    try:
        return _dumps((fn, args, kwargs))
    finally:
        if by_value:
            cloudpickle.unregister_pickle_by_value(module)


def _error_record(rank: int, exc: BaseException) -> dict:
    # The traceback without the launcher's own frames on top: it starts in the user's function.
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    kind = type(exc)
    name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    try:
        pickled = _dumps(exc)
        cloudpickle.loads(pickled)
    except Exception:
        pickled = None
    frames = [(f.filename, f.lineno, f.name, f.line) for f in traceback.extract_tb(tb)]
    return {
        "rank": rank,
        "time": time.time(),
        "type": name,
        "message": str(exc),
        "first_line": first_line(exc),
        "frames": frames,
        "exception": "".join(traceback.format_exception_only(kind, exc)),
        "pickled": pickled,
    }


def _worker_error(records: list[dict], world: int, rank: int | None, exitcode: int | None) -> WorkerError:
    """One `WorkerError` for the first failure: the earliest error record, else the agent's first failed process."""
    if not records:
        how = f"exit code {exitcode}" if exitcode is None or exitcode >= 0 else killed_by(-exitcode)
        return WorkerError(
            f"rank {rank} of {world} died without a Python exception ({how}): before the function "
            f"started (its output above says why; a script that calls .distributed(...) outside "
            f'`if __name__ == "__main__":` dies so), or killed (out of memory?), a crash in native '
            f"code, os._exit",
            rank=rank,
            exitcode=exitcode,
        )
    first, *later = sorted(records, key=lambda r: r["time"])
    message = f"rank {first['rank']} of {world} failed: {first['type']}: {first['message']}"
    if later:
        message += (
            "\n(afterwards also failed: "
            + "; ".join(f"rank {r['rank']}: {r['type']}: {r['first_line']}" for r in later)
            + ")"
        )
    # The worker's traceback, with the lines the worker could not read (a notebook cell's) from this process.
    frames = [
        (file, line, name, text or linecache.getline(file, line or 0).strip())
        for file, line, name, text in first["frames"]
    ]
    tb = (
        "Traceback (most recent call last):\n"
        + "".join(traceback.StackSummary.from_list(frames).format())
        + first["exception"]
    )
    message += f"\n\nTraceback of rank {first['rank']}:\n{tb.rstrip()}"
    exception = cloudpickle.loads(first["pickled"]) if first["pickled"] is not None else None
    return WorkerError(
        message,
        rank=first["rank"],
        exc_type=first["type"],
        worker_traceback=tb,
        exitcode=exitcode if rank == first["rank"] else None,
        exception=exception,
    )
