"""``cookbook.distributed`` on 2 CPU processes (gloo): results in rank order, a worker's error with its rank
and traceback and no process left behind, functions from a script's ``__main__`` with spawn, Ctrl-C,
DDP / FSDP2 / DeepSpeed training in the workers and the GPU-count check (the Ray Train backend:
test_launcher_ray.py, with the other tests on the session's Ray head)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import cookbook
import psutil
import pytest
import torch
from cookbook import WorkerError


def _children() -> set[int]:
    """Pids of this process's live descendants, less multiprocessing's resource tracker (one per process, by design)."""
    pids = set()
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(p.cmdline()):
                pids.add(p.pid)
        except psutil.NoSuchProcess:
            pass
    return pids


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture(autouse=True)
def _cpu(monkeypatch):
    monkeypatch.setenv("COOKBOOK_DEVICE", "cpu")


@cookbook.distributed(num_processes=2)
def _collectives(x: float):
    info = cookbook.get_dist_info()
    mean = cookbook.all_reduce_mean({"v": float(info.rank + x)}, info.device)
    total = cookbook.all_reduce_sum({"v": torch.tensor(float(info.rank + 1))}, info.device)
    env = {k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    return {
        "rank": info.rank,
        "world": info.world_size,
        "backend": info.backend,
        "mean": mean["v"],
        "total": total["v"],
        "ranks": cookbook.all_gather_object(info.rank),
        "env": env,
        "pid": os.getpid(),
    }


def test_results_come_back_in_rank_order_and_a_plain_call_runs_here(monkeypatch):
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)  # the plain call's group of one sets them here; undone after the test
    before = _children()  # e.g. a Ray head of the test session
    out = _collectives.distributed(10)
    assert [r["rank"] for r in out] == [0, 1]
    assert all(r["world"] == 2 and r["backend"] == "gloo" and r["ranks"] == [0, 1] for r in out)
    assert [r["mean"] for r in out] == [10.5, 10.5] and [r["total"] for r in out] == [3.0, 3.0]
    assert [r["env"]["RANK"] for r in out] == ["0", "1"] and [r["env"]["LOCAL_RANK"] for r in out] == ["0", "1"]
    assert {r["env"]["WORLD_SIZE"] for r in out} == {"2"} and len({r["env"]["MASTER_PORT"] for r in out}) == 1
    assert os.getpid() not in {r["pid"] for r in out}
    # The decorated object is still the function: a plain call runs in this process, as a world of one.
    assert _collectives.__name__ == "_collectives" and callable(_collectives.__wrapped__)
    with cookbook.distributed_context():
        here = _collectives(1)
    assert (here["rank"], here["world"], here["mean"], here["pid"]) == (0, 1, 1.0, os.getpid())
    assert _children() <= before


@cookbook.distributed(num_processes=2)
def _fails(pid_dir: str):
    info = cookbook.get_dist_info()
    Path(pid_dir, f"rank{info.rank}").write_text(str(os.getpid()))
    if info.rank == 1:
        raise ValueError("boom on rank 1")
    torch.distributed.barrier()  # rank 0 waits for a peer that is gone
    return 0


def test_a_worker_error_names_the_rank_and_traceback_and_leaves_no_process(tmp_path):
    before = _children()
    with pytest.raises(WorkerError) as caught:
        _fails.distributed(str(tmp_path))
    err = caught.value
    assert err.rank == 1 and err.exc_type == "ValueError"
    message = str(err)
    assert message.startswith("rank 1 of 2 failed: ValueError: boom on rank 1"), message
    # The worker's traceback, with the failing line of this file.
    assert "Traceback of rank 1" in message and __file__ in message and 'raise ValueError("boom on rank 1")' in message
    assert (
        isinstance(err.__cause__, ValueError)
        and err.exception is err.__cause__
        and str(err.exception) == "boom on rank 1"
    )
    pids = [int((tmp_path / f"rank{r}").read_text()) for r in (0, 1)]
    assert not any(_alive(p) for p in pids), pids
    assert _children() <= before


def test_more_processes_than_gpus_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("COOKBOOK_DEVICE")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match="num_processes=4 but only 2 GPU"):
        cookbook.distributed(num_processes=4)(_collectives.__wrapped__).distributed(1)
    assert cookbook.launcher.local_num_processes(None) == 2  # default: every GPU
    monkeypatch.setenv("COOKBOOK_DEVICE", "cpu")  # the escape hatch: CPU processes with gloo on a GPU machine
    assert cookbook.launcher.local_num_processes(4) == 4
    for bad in (0, -1, True, 2.0, "2"):
        with pytest.raises(ValueError, match="num_processes must be a positive integer"):
            cookbook.distributed(num_processes=bad)
    with pytest.raises(TypeError, match=r"@distributed\(num_processes=2\)"):
        cookbook.distributed(2)
    with pytest.raises(ValueError, match="start_method='threads'"):
        cookbook.distributed(start_method="threads")


def test_fork_from_a_process_that_has_a_process_group_is_refused():
    """A forked worker would inherit the group without its threads and hang in its first collective."""
    with cookbook.distributed_context():  # a process group of one here
        with pytest.raises(
            RuntimeError,
            match=r"^start_method='fork' from a process that has a process group .* "
            r"call cookbook.destroy_distributed\(\) first, or use start_method='spawn'$",
        ):
            cookbook.distributed(num_processes=2, start_method="fork")(_collectives.__wrapped__).distributed(1)


def test_a_script_read_from_stdin_is_refused_before_any_worker_with_spawn(tmp_path):
    """``python - < script.py``: spawned workers cannot import ``<stdin>``; one line says so, no worker starts."""
    script = "import cookbook\nprint(cookbook.distributed(num_processes=2)(sum).distributed([1]))\n"
    proc = subprocess.run(
        [sys.executable, "-"], input=script, capture_output=True, text=True, cwd=tmp_path, timeout=120
    )
    assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1] == (
        "RuntimeError: the caller's script <stdin> is not a file (read from standard input?), and spawned workers "
        "import it again: save it to a file and run that, or use start_method='fork'"
    ), proc.stderr[-3000:]


SCRIPT = textwrap.dedent("""
    import dataclasses, json, os, signal, sys, time
    import torch, cookbook

    @dataclasses.dataclass
    class Stats:                       # a type from __main__ travels both ways
        rank: int
        total: float

    @cookbook.distributed              # bare: one process per GPU, else 2
    def total(scale: float) -> Stats:
        info = cookbook.get_dist_info()
        t = torch.tensor([scale * (info.rank + 1)])
        torch.distributed.all_reduce(t)
        return Stats(info.rank, t.item())

    @cookbook.distributed(num_processes=2)  # spawn: a fork of this process, which has run workers, could deadlock
    def sleeper(pid_dir: str) -> None:
        open(os.path.join(pid_dir, f"rank{cookbook.get_dist_info().rank}"), "w").write(str(os.getpid()))
        time.sleep(600)

    if __name__ == "__main__":
        out = total.distributed(2.0)
        print(json.dumps({"results": [dataclasses.asdict(s) for s in out],
                          "types": all(isinstance(s, Stats) for s in out)}), flush=True)
        if sys.argv[2:] == ["run_main"]:  # as a recipe's train.py: one line and exit status 130, as cookbook.torchrun
            cookbook.run_main(lambda argv: sleeper.distributed(sys.argv[1]), argv=[])
        handler = signal.getsignal(signal.SIGINT)
        try:
            sleeper.distributed(sys.argv[1])
        except KeyboardInterrupt:
            print(json.dumps({"interrupted": True, "handler_kept": signal.getsignal(signal.SIGINT) is handler}), flush=True)
""")


def _interrupt_script(tmp_path, *args: str) -> tuple[subprocess.Popen, str, str, list[int]]:
    """Run `SCRIPT` (with `args`), SIGINT it once both sleepers run; returns it ended, its output and the workers' pids."""
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    proc = subprocess.Popen(
        [sys.executable, str(script), str(pid_dir), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        deadline = time.monotonic() + 120
        while len(list(pid_dir.iterdir())) < 2:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise AssertionError(f"the workers did not start: {proc.communicate()}")
            time.sleep(0.2)
        time.sleep(0.5)  # both files written: the workers are in their sleep
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc, stdout, stderr, [int(p.read_text()) for p in pid_dir.iterdir()]


def test_main_module_functions_work_with_spawn_and_ctrl_c_stops_every_worker(tmp_path):
    """A script's ``__main__`` functions (pickled by value, as a notebook's are) run on spawned workers; then
    SIGINT to the script while its workers sleep raises KeyboardInterrupt there and stops both workers."""
    _, stdout, stderr, pids = _interrupt_script(tmp_path)
    lines = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    assert lines[0] == {"results": [{"rank": 0, "total": 6.0}, {"rank": 1, "total": 6.0}], "types": True}, stderr[
        -3000:
    ]
    assert lines[1] == {"interrupted": True, "handler_kept": True}, stderr[-3000:]
    assert not any(_alive(p) for p in pids), pids


def test_ctrl_c_under_run_main_is_one_line_and_status_130_as_with_torchrun(tmp_path):
    proc, _, stderr, pids = _interrupt_script(tmp_path, "run_main")
    assert (proc.returncode, stderr) == (130, "interrupted (Ctrl-C): every worker was stopped\n"), stderr[-3000:]
    assert not any(_alive(p) for p in pids), pids


# Forked: DeepSpeed's import (~5 s) happens once, here, and the other tests cover spawn.
@cookbook.distributed(num_processes=2, start_method="fork")
def _train_three_ways(steps: int) -> dict:
    """A small MLP trained with DDP, FSDP2 (fully_shard) and DeepSpeed ZeRO-2 in the same workers; each
    rank its own data. Returns the losses and parameter fingerprints per technique."""
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel as DDP

    info = cookbook.get_dist_info()
    gen = torch.Generator().manual_seed(100 + info.rank)
    x = torch.randn(32, 16, generator=gen)
    y = x @ torch.linspace(-1, 1, 16).unsqueeze(1)

    def mlp() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))

    def fit(model: nn.Module) -> list[float]:
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        losses = []
        for _ in range(steps):
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    out = {}
    model = DDP(mlp())
    losses = fit(model)
    out["ddp"] = {"losses": losses, "fingerprint": cookbook.param_fingerprint(model.module)}

    model = mlp()
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    losses = fit(model)
    full = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    full.load_state_dict({k: v.full_tensor() for k, v in model.state_dict().items()})
    out["fsdp2"] = {
        "losses": losses,
        "fingerprint": cookbook.param_fingerprint(full),
        "sharded": all(isinstance(p, DTensor) for p in model.parameters()),
        "local_rows": model[0].weight.to_local().shape[0],
    }

    import importlib

    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # no C++ JIT build on CPU
    import deepspeed

    deepspeed.init_distributed(dist_backend=info.backend)
    model = mlp()
    config = {
        "train_micro_batch_size_per_gpu": 32,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 2},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "gradient_clipping": 0.0,
    }  # DeepSpeed clips at 1.0 by default; DDP and FSDP2 here do not clip
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05), config=config
    )
    losses = []
    for _ in range(steps):
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    out["deepspeed"] = {"losses": losses, "fingerprint": cookbook.param_fingerprint(engine.module)}
    return out


def test_ddp_fsdp2_and_deepspeed_train_in_the_workers_and_ranks_agree(tmp_path, monkeypatch):
    import deepspeed  # noqa: F401  imported once here, inherited by the forked workers

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "torch_extensions"))
    r0, r1 = _train_three_ways.distributed(steps=8)
    for kind in ("ddp", "fsdp2", "deepspeed"):
        assert r0[kind]["fingerprint"] == r1[kind]["fingerprint"], kind  # one model, bit for bit
        for r in (r0, r1):
            assert r[kind]["losses"][-1] < 0.8 * r[kind]["losses"][0], (kind, r[kind]["losses"])
        assert r0[kind]["losses"] != r1[kind]["losses"]  # each rank saw its own data
    # All three average the same gradients of the same model: the same weights after the same steps.
    for kind in ("fsdp2", "deepspeed"):
        assert r0[kind]["fingerprint"] == pytest.approx(r0["ddp"]["fingerprint"], rel=1e-5), kind
    assert r0["fsdp2"]["sharded"] and r0["fsdp2"]["local_rows"] == 16  # 32 rows of the first layer over 2 ranks
