"""What the Ray recipes share around Ray Train (https://docs.ray.io/en/latest/train/train.html); each recipe's
``train.py`` builds its own ``TorchTrainer`` and its workers report with ``ray.train.report``. The driver
(`cookbook.ray_train.driver`): `RayDriver`, the checks before Ray starts, ``with driver.started():`` and
`RayDriver.finish`. The workers (`cookbook.ray_train.worker`): `worker_entry`, `config_from_dict`, `worker_info`
and `WorkerRun`. ``python -m cookbook.ray_train.launch``: what each ``launch.sh`` runs.
"""

from cookbook.ray_train.driver import (EPOCH_MAY_CHANGE, EpochRunConfig, EpochTrainConfig, RayConfig, RayDriver,
                                       plan_workers)
from cookbook.ray_train.worker import RecipeError, WorkerRun, config_from_dict, load_checkpoint, worker_entry, worker_info

__all__ = ["EPOCH_MAY_CHANGE", "EpochRunConfig", "EpochTrainConfig", "RayConfig", "RayDriver", "RecipeError",
           "WorkerRun", "config_from_dict", "load_checkpoint", "plan_workers", "worker_entry", "worker_info"]
