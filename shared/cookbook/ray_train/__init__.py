"""What the Ray recipes share around Ray Train; each recipe's ``train.py`` builds its own ``TorchTrainer`` and its
workers call ``ray.train.report``. The driver: `RayDriver`; the workers: `worker_entry`, `WorkerRun`;
``python -m cookbook.ray_train.launch``: what each ``launch.sh`` runs."""

# ruff: noqa: F401  (the package's public names)

from cookbook.ray_train.driver import EPOCH_MAY_CHANGE, EpochRunConfig, EpochTrainConfig, RayConfig, RayDriver
from cookbook.ray_train.driver import plan_workers
from cookbook.ray_train.worker import RecipeError, WorkerRun, config_from_dict, worker_entry, worker_info
