"""cookbook: the thin utilities every recipe of the distributed-training cookbook shares.

Layers, top to bottom (`.importlinter`; a module imports only its own layer and those below): ops (entry, launch,
launcher, torchrun), adapters (hf_trainer, ray_train), data (sft, lm, hub, tabular), the spine (the rest), errors.
What each module does: docs/cookbook.md. ``import cookbook`` first in a recipe (`cookbook.builds` words a package built for
another torch in one line).
"""

from cookbook import builds

builds.guard()  # first: a torchvision built for another torch is one line (exit 2), not a traceback

from cookbook.dist import DistInfo, all_gather_object, all_reduce_mean, all_reduce_sum, barrier, destroy_distributed
from cookbook.dist import distributed_context, get_dist_info, get_logger, init_distributed, param_fingerprint
from cookbook.entry import cli, run_main
from cookbook.launcher import WorkerError, distributed

__all__ = [
    "DistInfo",
    "WorkerError",
    "all_gather_object",
    "all_reduce_mean",
    "all_reduce_sum",
    "barrier",
    "cli",
    "destroy_distributed",
    "distributed",
    "distributed_context",
    "get_dist_info",
    "get_logger",
    "init_distributed",
    "param_fingerprint",
    "run_main",
]
