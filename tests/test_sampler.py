"""cookbook.sampler: a data position that is the whole job's, mapped from N ranks to M (no process group needed:
each rank's sampler is built with its rank and the number of ranks, as DistributedSampler allows)."""

import itertools

import pytest
from torch.utils.data import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from cookbook.sampler import STATE_TAG, DataPosition, ResizableSampler


def samplers(data, world: int, epoch: int = 0, **kw):
    out = [ResizableSampler(data, num_replicas=world, rank=r, seed=7, **kw) for r in range(world)]
    for s in out:
        s.set_epoch(epoch)
    return out


@pytest.mark.parametrize("world, drop_last, shuffle", itertools.product((1, 2, 3, 4), (True, False), (True, False)))
def test_a_fresh_epoch_is_what_distributed_sampler_yields(world, drop_last, shuffle):
    data = range(23)
    for epoch in (0, 1):
        for rank in range(world):
            ours = ResizableSampler(data, num_replicas=world, rank=rank, shuffle=shuffle, seed=7, drop_last=drop_last)
            torch_s = DistributedSampler(
                data, num_replicas=world, rank=rank, shuffle=shuffle, seed=7, drop_last=drop_last
            )
            ours.set_epoch(epoch)
            torch_s.set_epoch(epoch)
            assert list(ours) == list(torch_s) and len(ours) == len(torch_s)


@pytest.mark.parametrize("n, m", [(2, 1), (1, 2), (2, 3), (3, 2), (4, 3), (3, 4), (2, 2)])
@pytest.mark.parametrize("taken", [0, 1, 3, 7])
def test_the_position_maps_from_n_ranks_to_m_with_nothing_skipped_or_repeated(n, m, taken):
    """N ranks each take `taken` indices; M ranks continue from the saved state: every index of the epoch is taken
    once, except a tail of fewer than M (drop_last), and the first part is exactly the epoch's first taken x N."""
    data = range(50)
    first = samplers(data, n, epoch=1, drop_last=True)
    before = [list(itertools.islice(iter(s), taken)) for s in first]
    state = first[0].state_dict()
    assert state[STATE_TAG] == {"epoch": 1, "consumed": taken * n, "num_replicas": n}
    assert all(s.state_dict() == state for s in first)  # every rank holds the same global position
    second = samplers(data, m, epoch=0, drop_last=True)  # epoch 0 until the state says otherwise
    for s in second:
        s.load_state_dict(state)
        s.set_epoch(1)  # what EpochBatches calls on resume: the same epoch keeps the position
    after = [list(s) for s in second]
    taken_all = [i for part in before + after for i in part]
    assert len(taken_all) == len(set(taken_all))  # nothing repeated
    assert 0 <= len(data) - len(taken_all) < m  # nothing skipped beyond the tail drop_last drops
    epoch_order = first[0].order()
    assert sorted(i for part in before for i in part) == sorted(epoch_order[: taken * n])
    assert sorted(i for part in after for i in part) == sorted(epoch_order[taken * n : taken * n + len(after[0]) * m])
    assert len({len(a) for a in after}) == 1  # every rank of M yields the same count
    if n == m:  # the same number of ranks: the continuation of the uninterrupted sampler, index for index
        again = samplers(data, n, epoch=1, drop_last=True)
        assert [list(s)[taken:] for s in again] == after
    second[0].set_epoch(2)  # a new epoch starts at 0
    assert len(second[0]) == len(data) // m


def test_without_drop_last_the_remainder_is_padded_from_the_epochs_start():
    first = samplers(range(10), 3, drop_last=False)
    for s in first:
        list(itertools.islice(iter(s), 2))
    second = samplers(range(10), 4, drop_last=False)
    for s in second:
        s.load_state_dict(first[0].state_dict())
    after = [list(s) for s in second]
    epoch_order = second[0].order()
    assert {len(a) for a in after} == {1}  # 4 left over 4 ranks
    assert sorted(i for a in after for i in a) == sorted(epoch_order[6:10])
    with pytest.raises(ValueError, match="not a cookbook.ResizableSampler state"):
        second[0].load_state_dict({"yielded": 3})


def _loader(world: int, rank: int, workers: int) -> StatefulDataLoader:
    sampler = ResizableSampler(range(64), num_replicas=world, rank=rank, seed=7, drop_last=True)
    return StatefulDataLoader(
        range(64), batch_size=2, sampler=sampler, drop_last=True, num_workers=workers, collate_fn=lambda rows: rows
    )


@pytest.mark.parametrize("workers", [0, 2])
def test_the_saved_position_is_what_training_consumed_not_what_loader_workers_prefetched(workers):
    """With loader workers the sampler runs ahead of the batches the loader has yielded; `DataPosition` saves the
    position of the last yielded batch. Restored beside the loader's own per-rank state (the same world size), the
    next batch is the uninterrupted run's next one (neither state skips it twice); restored alone on one rank (a
    resize), the run continues at the first sample not consumed."""
    uninterrupted = list(_loader(2, 0, 0))
    loader = _loader(2, 0, workers)
    it = iter(loader)
    taken = [next(it) for _ in range(3)]
    assert taken == uninterrupted[:3]
    position, local = DataPosition(loader).state_dict(), loader.state_dict()
    assert position[STATE_TAG]["consumed"] == 3 * 2 * 2  # 3 batches x 2 samples x 2 ranks
    if workers:
        assert loader.sampler.consumed > 12  # prefetched indices: the sampler alone would have skipped them
    del it

    same = _loader(2, 0, workers)
    DataPosition(same).load_state_dict(position)
    same.load_state_dict(local)
    assert list(same) == uninterrupted[3:]

    resized = _loader(1, 0, workers)
    DataPosition(resized).load_state_dict(position)
    rest = [i for batch in resized for i in batch]
    assert rest == resized.sampler.order()[12:64]
    assert DataPosition(resized).describe() == "epoch 0 at sample 12 of 64"
    with pytest.raises(TypeError, match="needs a loader whose sampler is a ResizableSampler"):
        DataPosition(StatefulDataLoader(range(4)))
