"""A data position that belongs to the whole job, not to a rank: resume a run on another number of ranks.
`DistributedSampler` gives rank ``r`` of ``W`` the indices ``order[r::W]`` of a seeded epoch order, so the samples the
whole job consumed say where the data is, whatever ``W``: ``M`` ranks continue with ``order[consumed + r :: M]``
(`ResizableSampler`); `DataPosition` is its checkpoint entry. How it relies on torchdata's loader:
docs/notes.md#a-resizable-data-position-and-torchdatas-statefuldataloader-torchdata-011."""

from __future__ import annotations

import math
from typing import Any, Iterator, Mapping

import torch
from torch.utils.data import DistributedSampler

STATE_TAG = "cookbook.ResizableSampler"  # marks this sampler's state inside a data loader's state_dict


class ResizableSampler(DistributedSampler):
    """`DistributedSampler` (same arguments) whose position in the epoch is global: from an epoch's start the same;
    after `load_state_dict` at ``consumed = c`` a pass yields ``order[c + r :: num_replicas]``, cut or padded alike."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
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

    def __len__(self) -> int:
        left = len(self.dataset) - self.start
        return max(left // self.num_replicas if self.drop_last else math.ceil(left / self.num_replicas), 0)

    def __iter__(self) -> Iterator[int]:
        order = self.order()
        indices = order[self.start :]
        total = len(self) * self.num_replicas
        if len(indices) < total:  # drop_last=False: pad from the epoch's start, as DistributedSampler does
            indices += (order * math.ceil((total - len(indices)) / len(order)))[: total - len(indices)]
        mine = indices[:total][self.rank :: self.num_replicas]
        self.yielded = 0
        return self._count(mine)

    def _count(self, indices: list[int]) -> Iterator[int]:
        for index in indices:
            self.yielded += 1
            yield index

    @property
    def consumed(self) -> int:
        """Samples of the current epoch the job has drawn: ``start + yielded x num_replicas`` (ahead with workers)."""
        return self.start + self.yielded * self.num_replicas

    def state_dict(self) -> dict[str, Any]:
        """``{STATE_TAG: {"epoch", "consumed", "num_replicas"}}``: the epoch and the samples of it the job drew."""
        return {STATE_TAG: {"epoch": self.epoch, "consumed": self.consumed, "num_replicas": self.num_replicas}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue epoch ``state["epoch"]`` at global position ``state["consumed"]``; ValueError: not such a state."""
        position = state.get(STATE_TAG) if isinstance(state, Mapping) else None
        if not isinstance(position, Mapping) or int(position.get("consumed", -1)) < 0:
            raise ValueError(f"not a {STATE_TAG} state: {state!r}")
        self.epoch, self.start, self.yielded = int(position["epoch"]), int(position["consumed"]), 0


def _find_tagged(state: Any) -> Mapping[str, Any] | None:
    """The first mapping in `state` (nested dicts and lists) that holds `STATE_TAG`, or ``None``."""
    if isinstance(state, Mapping) and STATE_TAG in state:
        return state
    children = state.values() if isinstance(state, Mapping) else state if isinstance(state, (list, tuple)) else ()
    return next((found for child in children if (found := _find_tagged(child)) is not None), None)


class DataPosition:
    """DCP ``Stateful``: the global data position of a ``StatefulDataLoader`` whose sampler is a `ResizableSampler`
    (TypeError if not), read from the loader's ``state_dict()`` (prefetched batches do not count)."""

    def __init__(self, loader) -> None:
        if not isinstance(getattr(loader, "sampler", None), ResizableSampler):
            raise TypeError(
                f"DataPosition needs a loader whose sampler is a ResizableSampler, got "
                f"{type(getattr(loader, 'sampler', None)).__name__}"
            )
        self.loader, self.sampler = loader, loader.sampler

    def state_dict(self) -> dict[str, Any]:
        """The sampler's state as of the last batch the loader yielded; RuntimeError: the loader keeps none."""
        found = _find_tagged(self.loader.state_dict())
        if found is None:
            raise RuntimeError(
                f"{type(self.loader).__name__}.state_dict() holds no {STATE_TAG} state: use torchdata's "
                f"StatefulDataLoader, which keeps a stateful sampler's state"
            )
        return {STATE_TAG: dict(found[STATE_TAG])}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Set the sampler to `state`'s position, and drop the loader's iterator of the old position."""
        self.sampler.load_state_dict(state)
        self.loader.load_state_dict({})  # no state of its own: only forgets that iterator (torchdata's {} case)

    def describe(self) -> str:
        """Where the data continues, for a log line: ``"epoch 0 at sample 1280 of 1600"``."""
        return f"epoch {self.sampler.epoch} at sample {self.sampler.start} of {len(self.sampler.dataset)}"
