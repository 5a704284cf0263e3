"""What a checkpoint holds: DCP `Stateful` wrappers for model and optimizer (`ModelOptimizerState`), per-rank state
(`RankLocalState`), the RNG streams (`RNGState`, `seed_per_rank`, `rng_kept`) and the step and epoch (`TrainState`).
`cookbook.checkpoint` re-exports them."""

from __future__ import annotations

import contextlib
import random
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict
from torch.distributed.checkpoint.state_dict import set_state_dict

try:
    import numpy as np
except ImportError:  # RNGState and seed_per_rank leave NumPy out
    np = None


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class ModelOptimizerState:
    """DCP ``Stateful`` for a model and its optimizer (DDP, FSDP2 or plain) through ``get_state_dict`` /
    ``set_state_dict``: no DDP ``module.`` prefix, FSDP2 parameters as sharded DTensors, optimizer state by name."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        options: StateDictOptions | None = None,
    ):
        self.model, self.optimizer, self.options = model, optimizer, options  # options: e.g. ignore_frozen_params

    def state_dict(self) -> dict[str, Any]:
        if self.optimizer is None:
            return {"model": get_model_state_dict(self.model, options=self.options)}
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self.options)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        optimizers, optim = ([], {}) if self.optimizer is None else (self.optimizer, state.get("optim", {}))
        set_state_dict(
            self.model, optimizers, model_state_dict=state["model"], optim_state_dict=optim, options=self.options
        )


class RankLocalState:
    """DCP ``Stateful`` for per-rank state (`items`: name -> a ``StatefulDataLoader``, `RNGState()`, ...), stored
    under ``rank<i>`` and restored to the same rank only."""

    def __init__(self, **items: Any):
        self.items = items

    def state_dict(self) -> dict[str, Any]:
        return {f"rank{_rank()}": {name: obj.state_dict() for name, obj in self.items.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, obj in self.items.items():
            obj.load_state_dict(state[f"rank{_rank()}"][name])


class RNGState:
    """The RNG streams of this process (Python, NumPy if installed, torch CPU and CUDA) as a `Stateful`."""

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
        if np is not None:
            state["numpy"] = np.random.get_state()
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        random.setstate(state["python"])
        torch.set_rng_state(state["torch"].cpu())
        if "numpy" in state:
            np.random.set_state(state["numpy"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"].cpu())


def seed_per_rank(seed: int, rank: int) -> None:
    """Seed this process's random streams (Python, NumPy, torch CPU and CUDA) with ``seed + rank``: each rank its own
    dropout masks. Call after the model's initialisation (the same on every rank) and before a resume."""
    random.seed(seed + rank)
    if np is not None:
        np.random.seed(seed + rank)
    torch.manual_seed(seed + rank)  # also seeds every CUDA device


@contextlib.contextmanager
def rng_kept() -> Iterator[None]:
    """Leave this process's random streams (`RNGState`) as they were before the block (an evaluation)."""
    saved = RNGState().state_dict()
    try:
        yield
    finally:
        RNGState().load_state_dict(saved)


class TrainState:
    """Optimizer steps done and the current epoch, as a DCP `Stateful` (``step``, ``epoch``)."""

    def __init__(self) -> None:
        self.step, self.epoch = 0, 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "epoch": self.epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step, self.epoch = int(state["step"]), int(state["epoch"])
