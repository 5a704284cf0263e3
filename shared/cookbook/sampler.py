"""A data position that belongs to the whole job, not to a rank: resume a run on another number of ranks.

`torch.utils.data.DistributedSampler` (``shuffle=True``, ``seed``) orders epoch ``e`` by
``torch.randperm(len(dataset), generator=seeded(seed + e))`` and gives rank ``r`` of ``W`` the indices
``order[r::W]``. After each rank has taken ``k`` indices, the job has consumed exactly ``order[:k * W]``,
whatever ``W`` is. So one number, the samples the job consumed in the epoch, says where the data is, and a
job of ``M`` ranks can continue from it: rank ``r`` takes ``order[consumed + r :: M]``. Nothing is skipped or
repeated beyond the tail that ``drop_last`` drops (fewer than one global batch), as in any epoch.

`ResizableSampler` is that sampler: a `DistributedSampler` (the same order and the same split from the start of
an epoch, so a fresh run is unchanged) that can start an epoch at a global position. `DataPosition` is the
checkpoint entry that saves that position in the checkpoint's global (not per-rank) state and restores it, on
any number of ranks:

.. code-block:: python

    sampler = ResizableSampler(train_ds, num_replicas=info.world_size, rank=info.rank, seed=cfg.train.seed,
                               drop_last=True)
    loader = StatefulDataLoader(train_ds, batch_size=cfg.train.micro_batch_size, sampler=sampler, drop_last=True)
    ckpt_state = {..., "data": DataPosition(loader),
                  "rank_local": RankLocalState(dataloader=loader, rng=RNGState())}

`cookbook.checkpoint.Checkpointer.load` restores the per-rank state only when the world size is the one that wrote
the checkpoint; on another one it restores the model and optimizer (resharded by DCP) and the `DataPosition`, and
drops the per-rank state, with one line saying so.

How torchdata's `StatefulDataLoader` (0.11) keeps a sampler's state, which this relies on: a sampler with
``state_dict``/``load_state_dict`` (a `Stateful`) is saved inside the loader's own ``state_dict()`` and, on
``load_state_dict``, restored through its ``load_state_dict`` instead of the loader fast-forwarding it. With
``num_workers > 0`` the loader's main process draws indices ahead of the batches it has yielded (``prefetch_factor
x num_workers`` batches), so the sampler's own count runs ahead of what training consumed; the loader therefore
snapshots the sampler's state when it sends each batch's indices and reports, in its ``state_dict()``, the
snapshot of the last batch it yielded. `DataPosition` reads the position from there, never from the sampler
directly, so prefetched batches are not counted as consumed. When the world size is unchanged the loader's
per-rank copy restores the same position as the global one (they are the same number), so neither overrides
the other with something different.

Reference: https://github.com/pytorch/data/tree/main/torchdata/stateful_dataloader
"""

from __future__ import annotations

import math
from typing import Any, Iterator, Mapping

import torch
from torch.utils.data import DistributedSampler

STATE_TAG = "cookbook.ResizableSampler"  # marks this sampler's state inside a data loader's state_dict


class ResizableSampler(DistributedSampler):
    """`DistributedSampler` whose position in the epoch is global: the number of samples the whole job consumed.

    From the start of an epoch it yields exactly what `DistributedSampler` yields with the same arguments (the
    same ``order``: ``torch.randperm`` seeded ``seed + epoch``, or ``range`` without shuffling; rank ``r`` takes
    ``order[r::num_replicas]``). After `load_state_dict` with ``consumed = c``, the pass yields ``order[c + r ::
    num_replicas]``, cut (``drop_last``) or padded from the epoch's start (``drop_last=False``) so that every rank
    yields the same number of indices, as `DistributedSampler` does. For a pass that starts at ``c = k x
    num_replicas`` this is what the same `DistributedSampler` yields after its first ``k`` indices, so a resume on
    the same number of ranks is unchanged too.

    Args:
        dataset, num_replicas, rank, shuffle, seed, drop_last: as for `DistributedSampler`.

    Call ``set_epoch(e)`` before each pass, as with `DistributedSampler`: a new epoch starts at position 0.
    ``len(sampler)`` is the number of indices this rank yields in the current pass.
    """

    def __init__(self, dataset, num_replicas: int | None = None, rank: int | None = None, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = False) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
        self.start = 0  # samples of this epoch the whole job consumed before the current pass
        self.yielded = 0  # indices this rank has yielded in the current pass

    def set_epoch(self, epoch: int) -> None:
        """Use the order of `epoch`; another epoch than the current one starts at position 0."""
        if epoch != self.epoch:
            self.start = 0
        super().set_epoch(epoch)

    def order(self) -> list[int]:
        """The whole epoch's order of dataset indices (the same as `DistributedSampler`'s before it splits)."""
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            return torch.randperm(len(self.dataset), generator=g).tolist()
        return list(range(len(self.dataset)))

    def _per_rank(self) -> int:
        left = len(self.dataset) - self.start
        return left // self.num_replicas if self.drop_last else math.ceil(left / self.num_replicas)

    def __len__(self) -> int:
        return max(self._per_rank(), 0)

    def __iter__(self) -> Iterator[int]:
        order = self.order()
        indices = order[self.start:]
        total = len(self) * self.num_replicas
        if len(indices) < total:  # drop_last=False: pad from the epoch's start, as DistributedSampler does
            indices += (order * math.ceil((total - len(indices)) / len(order)))[: total - len(indices)]
        mine = indices[:total][self.rank::self.num_replicas]
        self.yielded = 0
        return self._count(mine)

    def _count(self, indices: list[int]) -> Iterator[int]:
        for index in indices:
            self.yielded += 1
            yield index

    @property
    def consumed(self) -> int:
        """Samples of the current epoch that the job has drawn, counted from this rank's draws (every rank draws
        alike): ``start + yielded x num_replicas``. With loader workers this runs ahead of training; see
        `DataPosition`."""
        return self.start + self.yielded * self.num_replicas

    def state_dict(self) -> dict[str, Any]:
        """``{STATE_TAG: {"epoch", "consumed", "num_replicas"}}``: the epoch and the samples of it the job drew."""
        return {STATE_TAG: {"epoch": self.epoch, "consumed": self.consumed, "num_replicas": self.num_replicas}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue epoch ``state["epoch"]`` at global position ``state["consumed"]``, on this sampler's ranks.

        Raises:
            ValueError: a state without this sampler's tag, or a negative position.
        """
        position = state.get(STATE_TAG) if isinstance(state, Mapping) else None
        if not isinstance(position, Mapping) or int(position.get("consumed", -1)) < 0:
            raise ValueError(f"not a {STATE_TAG} state: {state!r}")
        self.epoch, self.start, self.yielded = int(position["epoch"]), int(position["consumed"]), 0


def _find_tagged(state: Any) -> Mapping[str, Any] | None:
    """The first mapping in `state` (nested dicts and lists) that holds `STATE_TAG`, or ``None``."""
    if isinstance(state, Mapping):
        if STATE_TAG in state:
            return state
        children = state.values()
    elif isinstance(state, (list, tuple)):
        children = state
    else:
        return None
    for child in children:
        found = _find_tagged(child)
        if found is not None:
            return found
    return None


class DataPosition:
    """DCP `Stateful`: the global data position of a loader whose sampler is a `ResizableSampler`.

    Saved as one entry of the checkpoint's global state (the same on every rank), so a checkpoint written by
    ``N`` ranks gives ``M`` ranks the epoch and the number of its samples consumed. The position is read from the
    loader's ``state_dict()`` (the snapshot of the last batch it yielded: prefetched batches do not count, see the
    module docstring); `load_state_dict` sets the sampler, whose next pass starts there.

    Args:
        loader: a torchdata ``StatefulDataLoader`` (any loader with ``state_dict()`` that keeps a `Stateful`
            sampler's state in it) whose ``sampler`` is a `ResizableSampler`.

    Raises:
        TypeError: the loader's sampler is not a `ResizableSampler`.
    """

    def __init__(self, loader) -> None:
        if not isinstance(getattr(loader, "sampler", None), ResizableSampler):
            raise TypeError(f"DataPosition needs a loader whose sampler is a ResizableSampler, got "
                            f"{type(getattr(loader, 'sampler', None)).__name__}")
        self.loader, self.sampler = loader, loader.sampler

    def state_dict(self) -> dict[str, Any]:
        """The sampler's state as of the last batch the loader yielded.

        Raises:
            RuntimeError: the loader's ``state_dict()`` holds no `ResizableSampler` state.
        """
        found = _find_tagged(self.loader.state_dict())
        if found is None:
            raise RuntimeError(f"{type(self.loader).__name__}.state_dict() holds no {STATE_TAG} state: use torchdata's "
                               f"StatefulDataLoader, which keeps a stateful sampler's state")
        return {STATE_TAG: dict(found[STATE_TAG])}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Set the sampler to `state`'s position, and drop an iterator the loader made before (its
        ``state_dict()`` makes one, and DCP's load calls it), which drew its indices from the old position."""
        self.sampler.load_state_dict(state)
        self.loader.load_state_dict({})  # no state of its own: only forgets that iterator (torchdata's {} case)

    def describe(self) -> str:
        """Where the data continues, for a log line: ``"epoch 0 at sample 1280 of 1600"``."""
        return f"epoch {self.sampler.epoch} at sample {self.sampler.start} of {len(self.sampler.dataset)}"
