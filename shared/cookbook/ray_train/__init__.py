"""Ray Train plumbing shared by the Ray recipes (https://docs.ray.io/en/latest/train/train.html).

A Ray recipe's ``train.py`` has two halves, and so has this package:

- the driver (``python train.py``, `cookbook.ray_train.driver`): `RayDriver` checks the config's
  output folder, the resume and the worker count before Ray starts, then runs the recipe's
  ``train_loop`` with ``TorchTrainer`` (one DDP process per GPU) on a local Ray instance or the
  cluster at ``RAY_ADDRESS``;
- the workers (``train_loop(config)``, `cookbook.ray_train.worker`): `config_from_dict`, `worker_info`,
  and `WorkerRun`, the bookkeeping around the recipe's step body (resume, metrics, checkpoints through
  ``ray.train.report``, summary).

``python -m cookbook.ray_train.launch train.py --config ...`` (`cookbook.ray_train.launch`, what each
``launch.sh`` runs) starts the driver on one node, bootstraps a cluster of several, or joins one.
An exception of a class defined in the recipe reaches the driver as `RecipeError`.

Faults: a re-run resumes from the newest checkpoint Ray registered (the driver names it, the workers
check it); ``ray.max_failures`` restarts the worker group from it when a worker dies; SIGTERM or SIGUSR1
to the driver stops every worker after the same step with a checkpoint, and the driver exits 75.
"""

from cookbook.ray_train.driver import (
    EPOCH_MAY_CHANGE,
    EpochCheckpointConfig,
    EpochRunConfig,
    EpochTrainConfig,
    RayConfig,
    RayDriver,
    RecipeError,
    check_output_dir,
    check_shared_storage,
    fit,
    init_ray,
    plan_workers,
    resolve_workers,
)
from cookbook.ray_train.worker import WorkerRun, config_from_dict, load_checkpoint, report, worker_info, worker_summary

__all__ = [
    "EPOCH_MAY_CHANGE",
    "EpochCheckpointConfig",
    "EpochRunConfig",
    "EpochTrainConfig",
    "RayConfig",
    "RayDriver",
    "RecipeError",
    "WorkerRun",
    "check_output_dir",
    "check_shared_storage",
    "config_from_dict",
    "fit",
    "init_ray",
    "load_checkpoint",
    "plan_workers",
    "report",
    "resolve_workers",
    "worker_info",
    "worker_summary",
]
