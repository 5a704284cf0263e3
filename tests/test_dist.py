import pytest
import torch
import torch.distributed as dist

import cookbook
from cookbook.dist import get_dist_info


def test_context_destroys_the_group_on_exception():
    with pytest.raises(ValueError):
        with cookbook.distributed_context() as info:
            assert dist.is_initialized() and info.world_size == 1
            raise ValueError("inside the body")
    assert not dist.is_initialized()


def test_more_local_ranks_than_gpus_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("COOKBOOK_DEVICE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(RuntimeError, match="LOCAL_RANK=3 but this node has 2 GPU"):
        get_dist_info()


def test_param_fingerprint_sees_swapped_values():
    a = torch.nn.Linear(3, 2)
    b = torch.nn.Linear(3, 2)
    b.load_state_dict(a.state_dict())
    assert cookbook.param_fingerprint(a) == cookbook.param_fingerprint(b)
    with torch.no_grad():
        w = b.weight.view(-1)
        w[[0, 1]] = w[[1, 0]]
    fa, fb = cookbook.param_fingerprint(a), cookbook.param_fingerprint(b)
    assert fa[0] == pytest.approx(fb[0]) and fa[1] != fb[1]
