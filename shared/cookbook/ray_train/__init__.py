"""What the Ray recipes share around Ray Train (https://docs.ray.io/en/latest/train/train.html); each recipe's
``train.py`` builds its own ``TorchTrainer`` and reports to Ray with ``ray.train.report``.

- the driver (``python train.py``, `cookbook.ray_train.driver`): `RayDriver`, the checks before Ray starts
  (output folder, resume, worker count), ``with driver.started():`` (Ray started or joined, the worker group
  sized, SIGTERM / SIGUSR1 turned into a stop request) and `RayDriver.finish` (how the run ended);
- the workers (`cookbook.ray_train.worker`): `worker_entry` (imports the recipe and calls its ``train_loop``),
  `config_from_dict`, `worker_info` and `WorkerRun`, the bookkeeping around the step body (resume, metrics,
  the checkpoint the recipe hands to ``ray.train.report``, summary);
- ``python -m cookbook.ray_train.launch`` (what each ``launch.sh`` runs): one node, a cluster it bootstraps, or
  ``RAY_ADDRESS``.
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
    init_ray,
    plan_workers,
    resolve_workers,
    worker_entry,
)
from cookbook.ray_train.worker import WorkerRun, config_from_dict, load_checkpoint, worker_info, worker_summary

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
    "init_ray",
    "load_checkpoint",
    "plan_workers",
    "resolve_workers",
    "worker_entry",
    "worker_info",
    "worker_summary",
]
