"""The optimizer and learning-rate schedule that an ``optim`` section (`cookbook.config.OptimConfig`) describes."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from cookbook.config import OptimConfig


def build_optimizer(
    optim: OptimConfig, params: Iterable[Any], max_steps: int, *, fused: bool, decay_1d: bool = True
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW over `params` (tensors, or param groups as torch.optim takes them) and transformers'
    ``get_scheduler(optim.scheduler)`` over `max_steps` optimizer steps, the first ``warmup_ratio * max_steps`` of them
    warm-up. ``decay_1d=False`` (tensors only): no weight decay on 1-D tensors (biases and norms)."""
    from transformers import get_scheduler  # here: transformers imports torchvision, which a recipe checks first

    if not decay_1d:
        params = list(params)
        params = [
            {"params": [p for p in params if p.ndim >= 2]},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ]
    optimizer = torch.optim.AdamW(
        params, lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps, weight_decay=optim.weight_decay, fused=fused
    )
    warmup = int(optim.warmup_ratio * max_steps)
    scheduler = get_scheduler(optim.scheduler, optimizer, num_warmup_steps=warmup, num_training_steps=max_steps)
    return optimizer, scheduler
