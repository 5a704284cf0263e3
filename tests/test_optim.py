"""cookbook.config.build_optimizer: the param groups, AdamW's settings and the warm-up of the schedule."""

from __future__ import annotations

import pytest
import torch

from cookbook.config import OptimConfig
from cookbook.config import build_optimizer


def test_no_decay_on_1d_tensors_and_linear_warmup():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    optim = OptimConfig(lr=1e-3, weight_decay=0.1, betas=[0.8, 0.9], eps=1e-6, scheduler="linear", warmup_ratio=0.25)
    optimizer, scheduler = build_optimizer(optim, model.parameters(), 8, fused=False, decay_1d=False)
    decayed, plain = optimizer.param_groups
    assert [tuple(p.shape) for p in decayed["params"]] == [(4, 3)]
    assert sorted(tuple(p.shape) for p in plain["params"]) == [(4,), (4,), (4,)]  # bias, norm weight and bias
    assert (decayed["weight_decay"], plain["weight_decay"]) == (0.1, 0.0)
    assert (decayed["betas"], decayed["eps"]) == ((0.8, 0.9), 1e-6)
    lrs = []
    for _ in range(8):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    # 2 warm-up steps (0.25 x 8) from 0 to lr, then linear decay to 0 at step 8
    assert lrs == pytest.approx([0.0, 5e-4, 1e-3, 5e-4 * 5 / 3, 5e-4 * 4 / 3, 5e-4, 5e-4 * 2 / 3, 5e-4 / 3], rel=1e-12)


def test_one_group_keeps_weight_decay_on_every_tensor():
    model = torch.nn.Linear(3, 4)
    optimizer, _ = build_optimizer(OptimConfig(weight_decay=0.05), model.parameters(), 10, fused=False)
    (group,) = optimizer.param_groups
    assert group["weight_decay"] == 0.05 and len(group["params"]) == 2
