"""``@distributed``: run a function on N local processes, from a notebook or a script.

    from cookbook import distributed

    @distributed(nproc=2)
    def train(lr):
        info = cookbook.get_dist_info()          # rank, world size, device
        ...
        return final_loss

    result = train(3e-4)   # runs on 2 ranks, returns rank 0's return value

Built on torch's elastic launcher (the engine behind torchrun,
https://pytorch.org/docs/stable/elastic/run.html): each worker gets RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT, the process group is created before the function
runs and destroyed after it, also when it raises. Workers are forked, so functions defined
in a notebook cell work without pickling; do not touch CUDA in the parent before the call
(a forked child cannot use a CUDA context its parent created).
"""

from __future__ import annotations

import functools
import os
import uuid
from typing import Any, Callable, TypeVar

import torch

from cookbook.dist import distributed_context

F = TypeVar("F", bound=Callable[..., Any])


def _worker(fn: Callable[..., Any], args: tuple, kwargs: dict, threads: int) -> Any:
    # Like torchrun, one intra-op thread per worker by default. It also matters for safety: a
    # forked child that inherits the parent's OpenMP thread pool can hang in its first parallel op.
    torch.set_num_threads(threads)
    with distributed_context():
        return fn(*args, **kwargs)


def distributed(nproc: int | None = None, start_method: str = "fork", max_restarts: int = 0) -> Callable[[F], F]:
    """Decorator: calling the function runs it on `nproc` processes of this machine.

    Args:
        nproc: number of processes; default one per visible GPU, else 2 (CPU, gloo).
        start_method: ``"fork"`` (default, notebook friendly) or ``"spawn"`` (the function
            and its arguments must then be picklable).
        max_restarts: times the whole group is restarted after a worker fails.

    Returns:
        A wrapper whose call returns rank 0's return value.

    Raises:
        ValueError: `nproc` < 1, or larger than the number of visible GPUs on a GPU machine.
        torch.distributed.elastic.multiprocessing.errors.ChildFailedError: a worker raised;
            the message holds the worker's traceback.
    """

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            from torch.distributed.launcher.api import LaunchConfig, elastic_launch

            gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
            n = nproc if nproc is not None else (gpus or 2)
            if n < 1:
                raise ValueError(f"nproc must be >= 1, got {n}")
            if gpus and n > gpus and os.environ.get("COOKBOOK_DEVICE", "").lower() != "cpu":
                raise ValueError(f"nproc={n} but only {gpus} GPU(s) are visible")
            config = LaunchConfig(
                min_nodes=1,
                max_nodes=1,
                nproc_per_node=n,
                run_id=f"cookbook-{uuid.uuid4().hex[:8]}",
                rdzv_backend="c10d",
                rdzv_endpoint="127.0.0.1:0",
                max_restarts=max_restarts,
                start_method=start_method,
                monitor_interval=0.1,
            )
            threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
            results = elastic_launch(config, _worker)(fn, args, kwargs, threads)
            return results[0]

        return wrapper  # type: ignore[return-value]

    return decorate
