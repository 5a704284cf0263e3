import os

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


def _timeout_in_a_collective():
    """A gloo timeout as a rank sees it, raised from a call site with a source line."""
    try:
        raise RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 10000ms for recv operation")
    except RuntimeError as exc:
        return exc


@pytest.mark.parametrize(
    "others, expected",
    [
        # rank 1 never finished step 5: it is behind, whatever it says about timeouts
        (
            {"progress": "4 4242 node7"},
            "rank 1 (pid 4242 on node7) last finished step 4, this rank step 5 - it is stalled (stopped, hung, or much "
            "slower); `py-spy dump --pid 4242` on node7 shows where it is",
        ),
        # every rank finished step 5, rank 1 did not time out with this one: it never reached the collective
        (
            {"progress": "5 4242 node7"},
            "rank 1 (pid 4242 on node7) did not reach it (every rank last finished step 5, but it did not time out with "
            "this rank within 0.3 s) - it is stalled (stopped, hung, or much slower); `py-spy dump --pid 4242` on node7",
        ),
        # both timed out at the same step: not one stalled rank
        (
            {"progress": "5 4242 node7", "timed_out": "5"},
            "every rank timed out waiting, none is behind: the ranks are in different collectives",
        ),
    ],
)
def test_describe_stall_names_the_rank_that_is_behind(tmp_path, monkeypatch, others, expected):
    from cookbook.dist import describe_stall, record_progress

    with cookbook.distributed_context():
        cookbook.init_distributed(10, debug_dir=tmp_path / "debug")
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)  # this process is rank 0 of 2
        store = dist.distributed_c10d._get_default_store()
        record_progress(5)
        assert store.get("cookbook/progress/0").decode().split(" ")[0] == "5"
        for key, value in others.items():
            store.set(f"cookbook/{key}/1", value)
        line = describe_stall(_timeout_in_a_collective(), grace_s=0.3)
        monkeypatch.undo()
    assert line.startswith(
        'a collective did not finish within 10 s (`raise RuntimeError("[gloo/transport/tcp/'
        'unbound_buffer.cc:78] Timed out waiting 10000ms for recv operation")`, test_dist.py:'
    )
    assert f") at step 6: {expected}" in line, line
    assert line.endswith(f"; this rank's stacks: {tmp_path / 'debug' / 'stacks_rank0.txt'}")
    stacks = (tmp_path / "debug" / "stacks_rank0.txt").read_text()
    assert "Timed out waiting 10000ms" in stacks and "in _timeout_in_a_collective" in stacks


def test_collective_timeouts_are_told_from_other_failures():
    from cookbook.dist import collective_timed_out

    assert collective_timed_out(_timeout_in_a_collective())
    assert collective_timed_out(RuntimeError("Application timeout caused pair closure"))
    assert collective_timed_out(RuntimeError("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(...)"))
    assert not collective_timed_out(RuntimeError("Connection closed by peer [127.0.0.1]:41234"))


def test_the_flight_recorder_is_turned_on_unless_the_user_set_it(tmp_path, monkeypatch):
    from cookbook.dist import _enable_flight_recorder

    for k in (
        "TORCH_FR_BUFFER_SIZE",
        "TORCH_NCCL_TRACE_BUFFER_SIZE",
        "TORCH_FR_DUMP_TEMP_FILE",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
        "TORCH_NCCL_DUMP_ON_TIMEOUT",
    ):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "0")  # the user turned it off
    _enable_flight_recorder(tmp_path / "debug")
    assert "TORCH_FR_BUFFER_SIZE" not in os.environ
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "debug" / "rank_") and (tmp_path / "debug").is_dir()
    monkeypatch.delenv("TORCH_NCCL_TRACE_BUFFER_SIZE")
    _enable_flight_recorder(tmp_path / "debug")
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000"
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"


def test_a_timeout_must_be_positive():
    with pytest.raises(ValueError, match=r"the collective timeout must be > 0 seconds, got 0"):
        cookbook.init_distributed(0)
