"""cookbook: the thin utilities every recipe of the distributed-training cookbook shares.

Layers, top to bottom (`.importlinter`; a module imports only its own layer and those below): ops (entry, launch,
launcher, torchrun), adapters (hf_trainer, ray_train), data (sft, lm), the spine (the rest), errors.

- `cookbook.errors`: exit statuses, `OneLineError`, `ConfigError`, the launcher's environment variables.
- `cookbook.requirements`: the trackers' and a recipe's packages, and the one line for a failed import.
- `cookbook.dist`: process group from torchrun's environment, rank helpers, all-reduce.
- `cookbook.config`: typed YAML configs with dotted overrides (OmegaConf structured configs).
- `cookbook.checkpoint`: atomic DCP checkpoints, resume (on the same or, for a global data position, another world size), Hugging Face export.
- `cookbook.sampler`: `ResizableSampler` (DistributedSampler's order, with a position of the whole job) and `DataPosition`, its checkpoint entry: a run resumes on another number of ranks.
- `cookbook.metrics`: tokens/s, MFU, memory; console, JSONL, MLflow, TensorBoard and W&B sinks (``trackers`` in the config).
- `cookbook.progress`: rank 0's progress bar on a terminal (steps, loss, throughput, time left); plain log lines elsewhere.
- `cookbook.loop`: the bookkeeping around a recipe's own step body: step counting, metric windows, eval and checkpoint cadence, stop and resume, the final eval, export and summary.
- `cookbook.sft`: supervised fine-tuning of language models: chat / Alpaca / ShareGPT data, packing, collate, token-level loss.
- `cookbook.entry`: ``run_main``, the end of every recipe's ``train.py``: errors from whichever rank found them, exit statuses, an exit that cannot hang.
- `cookbook.torchrun`: ``python -m cookbook.torchrun``, torchrun with a one-line failure report.
- `cookbook.hub`: a model's local folder from a path or a Hugging Face Hub id (through the hub cache), offline at once when the hub cannot be reached, the push of the final export (``checkpoint.push_to_hub``).
- `cookbook.lm`: causal-LM model helpers: real-token counts, world-size-independent init of FSDP2 shards, activation checkpointing of chosen modules.
- `cookbook.tabular`: CSV / TSV / JSON(L) / parquet rows with their file and 1-based line, BOMs, CRLF and `3.0` integers accepted.
- `cookbook.hf_trainer`: Hugging Face Trainer / TRL callbacks (metrics windows, published checkpoints, stop-at-step, preemption, non-finite steps, stalls, failed saves), DeepSpeed JSON checks, export.
- `cookbook.builds`: a package built for another torch (PyPI's torchvision beside a CPU torch) is one line naming the build to install, in every recipe (``import cookbook`` first).
- `cookbook.launcher`: the ``@distributed`` decorator (``fn.distributed(...)`` runs ``fn`` once per GPU) for notebooks and scripts.
"""

from cookbook import builds

builds.guard()  # first: a torchvision built for another torch is one line (exit 2), not a traceback

from cookbook.dist import (
    DistInfo,
    all_gather_object,
    all_reduce_mean,
    all_reduce_sum,
    barrier,
    destroy_distributed,
    distributed_context,
    get_dist_info,
    get_logger,
    init_distributed,
    param_fingerprint,
)
from cookbook.entry import run_main
from cookbook.launcher import WorkerError, distributed

__all__ = [
    "DistInfo",
    "WorkerError",
    "all_gather_object",
    "all_reduce_mean",
    "all_reduce_sum",
    "barrier",
    "destroy_distributed",
    "distributed",
    "distributed_context",
    "get_dist_info",
    "get_logger",
    "init_distributed",
    "param_fingerprint",
    "run_main",
]
