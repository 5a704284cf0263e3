"""Checkpoints under real faults: a damaged newest checkpoint (truncated shard, DCP index or meta.json missing or
broken), a job killed with SIGKILL while it writes a checkpoint, a save that fails on one rank with a real OS error
(a file size limit: EFBIG), and an output folder that cannot be written. Single processes forked from this one,
and 2 gloo ranks forked once, so that no test pays an interpreter start-up."""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import re
import resource
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

import cookbook
from cookbook.checkpoint import (
    Checkpointer,
    CheckpointError,
    CheckpointSaveError,
    ModelOptimizerState,
    RankLocalState,
    ResumeGuard,
)
from cookbook.config import ConfigError, RunConfig, check_run


class Blob:
    """A `Stateful` holding one tensor filled with a number (the step that wrote it)."""

    def __init__(self, value: float = 0.0, numel: int = 1024):
        self.t = torch.full((numel,), float(value))

    def state_dict(self):
        return {"t": self.t}

    def load_state_dict(self, state):
        self.t = state["t"]


def _train_state(value: float):
    """A tiny model and AdamW (moments included) whose weights hold `value`."""
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return model, {"app": ModelOptimizerState(model, opt), "blob": Blob(value)}


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    """A checkpoints folder holding step_00000002 and step_00000004 (weights 2.0 and 4.0), to copy."""
    root = tmp_path_factory.mktemp("two") / "checkpoints"
    ck = Checkpointer(root)
    for step in (2, 4):
        ck.save(step, _train_state(float(step))[1], {"epoch": 0})
    return root


def _shard(folder: Path) -> Path:
    return next(folder.glob("*.distcp"))


def _truncate(folder: Path) -> None:
    shard = _shard(folder)
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)


def _overwrite_4k(folder: Path) -> None:
    """4 KiB of the shard overwritten with 0xFF bytes (NaN as float32), its size unchanged: a disk fault in place."""
    shard = _shard(folder)
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.seek(size // 4)
        f.write(b"\xff" * 4096)
    assert shard.stat().st_size == size


DAMAGES = {
    "4 KiB overwritten in a shard": (
        _overwrite_4k,
        r"__0_0\.distcp does not match its checksum \(xxh3_64:[0-9a-f]{16} in "
        r"meta\.json, xxh3_64:[0-9a-f]{16} now\)",
    ),
    "truncated shard": (_truncate, r"__0_0\.distcp is \d+ bytes, its index says \d+ are needed"),
    "missing shard": (lambda d: _shard(d).unlink(), r"__0_0\.distcp is missing \(its index names it\)"),
    "no .metadata": (lambda d: (d / ".metadata").unlink(), r"no \.metadata inside"),
    "garbage .metadata": (lambda d: (d / ".metadata").write_bytes(b"\x80\x04garbage"), r"\.metadata is unreadable \("),
    "no meta.json": (lambda d: (d / "meta.json").unlink(), r"no meta\.json inside"),
    "empty meta.json": (lambda d: (d / "meta.json").write_text(""), r"meta\.json is empty"),
    "meta.json not JSON": (lambda d: (d / "meta.json").write_text('{"step": 4,'), r"meta\.json is not JSON \("),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_newest_checkpoint_is_skipped_with_one_warning(two_checkpoints, tmp_path, damage, capsys, caplog):
    root = tmp_path / "checkpoints"
    shutil.copytree(two_checkpoints, root)
    newest, previous = root / "step_00000004", root / "step_00000002"
    ck = Checkpointer(root)
    assert ck.latest() == newest and ck.problem(newest) is None
    apply, problem = DAMAGES[damage]
    apply(newest)

    assert re.fullmatch(problem + ".*", Checkpointer(root).verify(newest))
    capsys.readouterr()
    caplog.clear()
    assert ck.check_resume("auto", world_size=1) == previous
    assert ck.latest() == previous and ck.complete_checkpoints() == [previous]
    # The cookbook logger writes to stderr once a process group set it up, else it reaches pytest's log capture.
    lines = capsys.readouterr().err.splitlines() + [r.getMessage() for r in caplog.records]
    warnings = [line for line in lines if "damaged" in line]
    assert len(warnings) == 1, warnings
    assert re.search(
        rf"warning: checkpoint {re.escape(str(newest))} is damaged \({problem}.*\); resuming from "
        rf"{re.escape(str(previous))} instead$",
        warnings[0],
    ), warnings[0]

    model, state = _train_state(0.0)
    assert ck.load(previous, state)["step"] == 2
    assert all(torch.equal(p, torch.full_like(p, 2.0)) for p in model.parameters())
    with pytest.raises(
        CheckpointError,
        match=rf"checkpoint.resume='{re.escape(str(newest))}' is (not a complete|a "
        rf"damaged) checkpoint.*\({problem}",
    ):
        ck.check_resume(str(newest), world_size=1)  # an explicit path is refused, never replaced
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(newest))} is not a complete checkpoint \({problem}"):
        ck.load(newest, state)


def test_no_complete_checkpoint_left_is_said_and_a_save_replaces_the_damaged_ones(two_checkpoints, tmp_path):
    root = tmp_path / "checkpoints"
    shutil.copytree(two_checkpoints, root)
    _truncate(root / "step_00000004")
    (root / "step_00000002" / ".metadata").write_bytes(b"")
    ck = Checkpointer(root, run_dir=tmp_path)
    assert ck.latest() is None and ck.complete_checkpoints() == []
    with pytest.raises(
        CheckpointError,
        match=rf"checkpoint.resume=auto: no complete checkpoint remains under "
        rf"{re.escape(str(root))}, every one is damaged: \S+step_00000002 \("
        rf"\.metadata is unreadable .*\S+step_00000004 \(__0_0.distcp is .* "
        rf"start afresh with a new output_dir \(or delete {re.escape(str(tmp_path))}\)",
    ):
        ck.check_resume("auto", world_size=1)
    with pytest.raises(CheckpointError, match="holds checkpoints of an earlier run"):
        ck.check_resume("none", world_size=1)  # damaged ones still belong to an earlier run
    # A run that saves step 3 drops the damaged step 2 below it; step 4 is replaced once step 4 is saved again.
    ck.save(3, _train_state(3.0)[1])
    assert sorted(p.name for p in root.iterdir()) == ["step_00000003", "step_00000004"]
    ck.save(4, _train_state(4.0)[1])
    assert ck.complete_checkpoints() == [root / "step_00000003", root / "step_00000004"]
    assert sorted(p.name for p in root.iterdir()) == ["step_00000003", "step_00000004"]


def test_other_layouts_check_meta_json_and_their_files_but_no_dcp_index(tmp_path):
    """Ray Train's folders (meta.json and state.pt, written in place) and the Hugging Face Trainer's (meta.json):
    a broken meta.json is damage; a missing file is an unfinished save, left out without a warning."""

    def folder(name: str, meta: str | None, state: bool = True) -> None:
        (tmp_path / name).mkdir()
        if meta is not None:
            (tmp_path / name / "meta.json").write_text(meta)
        if state:
            (tmp_path / name / "state.pt").write_bytes(b"x")

    folder("checkpoint_step_00000008", json.dumps({"step": 8}))
    folder("checkpoint_step_00000016", "not json")
    folder("checkpoint_step_00000024", None)  # Ray was stopped while writing it
    guard = ResumeGuard(tmp_path, folder="checkpoint_step_<n>", files=("state.pt",))
    assert guard.latest().name == "checkpoint_step_00000008"
    assert [p.name for p, _ in guard.damaged()] == ["checkpoint_step_00000016"]
    assert guard.resolve("auto").name == "checkpoint_step_00000008"


class _Saver:
    """Saves 32 MiB checkpoints (the step number in every element), step after step: the process that
    `test_a_job_killed_while_it_saves_leaves_the_previous_checkpoint_and_the_next_save_cleans_up` kills."""

    def __init__(self, root: Path):
        self.root = root

    def __call__(self) -> None:
        torch.set_num_threads(1)
        ck = Checkpointer(self.root, keep_last=2)
        for step in range(1, 100):
            ck.save(step, {"blob": Blob(step, numel=8 * 2**20)})
        os._exit(0)


def test_a_job_killed_while_it_saves_leaves_the_previous_checkpoint_and_the_next_save_cleans_up(tmp_path):
    """SIGKILL to a process while it writes a checkpoint: it is stopped (SIGSTOP) once its temporary folder holds
    shard bytes and no step_* of that number exists, then killed. The previous checkpoint is what resume=auto
    takes and it loads; the next save removes every .tmp-* and .old-* folder."""
    root = tmp_path / "checkpoints"
    child = multiprocessing.get_context("fork").Process(target=_Saver(root), daemon=True)
    child.start()
    caught, deadline = None, time.time() + 300
    try:
        while caught is None and time.time() < deadline and child.is_alive():
            for tmp in root.glob(".tmp-step_*") if root.is_dir() else []:
                step = int(tmp.name.rsplit("_", 1)[1])
                try:
                    written = sum(shard.stat().st_size for shard in tmp.glob("*.distcp"))
                except FileNotFoundError:  # published meanwhile
                    continue
                if step < 2 or written == 0:
                    continue
                os.kill(child.pid, signal.SIGSTOP)  # frozen: what is on disk now is what a kill leaves
                if tmp.is_dir() and not (root / f"step_{step:08d}").exists():
                    caught = step
                    break
                os.kill(child.pid, signal.SIGCONT)  # it published meanwhile: catch a later save
            time.sleep(0.001)
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.join(60)
    assert caught is not None, "never caught the process while it wrote a checkpoint"
    assert child.exitcode == -signal.SIGKILL
    assert (root / f".tmp-step_{caught:08d}").is_dir() and not (root / f"step_{caught:08d}").exists()

    ck = Checkpointer(root, keep_last=2)
    previous = root / f"step_{caught - 1:08d}"
    assert ck.latest() == previous and ck.check_resume("auto", world_size=1) == previous
    blob = Blob(numel=8 * 2**20)
    assert ck.load(previous, {"blob": blob})["step"] == caught - 1
    assert torch.equal(blob.t, torch.full((8 * 2**20,), float(caught - 1)))

    (root / f".old-step_{caught - 1:08d}").mkdir()  # what a crash between the two renames of a publish leaves
    (root / f".old-step_{caught - 1:08d}" / "meta.json").write_text("{}")
    (root / ".tmp-step_00000099").mkdir()
    ck.save(caught, {"blob": Blob(caught)})
    assert not [p.name for p in root.iterdir() if p.name.startswith((".tmp-", ".old-"))]
    assert ck.latest() == root / f"step_{caught:08d}"


def _efbig_limit(limit_bytes: int | None) -> None:
    """Cap the size of files this process writes (``RLIMIT_FSIZE``), ``None``: back to unlimited. With SIGXFSZ
    ignored, a write past the cap fails with EFBIG ("File too large") instead of killing the process."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard if limit_bytes is None else limit_bytes, hard))


def _saves_that_fail(root: str) -> dict:
    """On 2 gloo ranks: a save whose shard on rank 1 exceeds its file size limit; a save whose meta.json on rank 0
    does; then a save with no limit. Returns what each rank saw."""
    import torch.distributed as dist

    rank = dist.get_rank()
    ck = Checkpointer(root)
    state = {"local": RankLocalState(blob=Blob(rank, numel=64 * 1024))}  # 256 KiB per rank, in each rank's file
    ck.save(2, state)
    seen = {}
    for name, limited_rank, limit, extra in (
        ("shard", 1, 64 * 1024, None),
        ("meta", 0, 512 * 1024, {"note": "x" * 2**20}),
    ):
        if rank == limited_rank:
            _efbig_limit(limit)
        try:
            ck.save(4, state, extra)
            seen[name] = None
        except CheckpointSaveError as exc:
            seen[name] = (str(exc), exc.errno)
        finally:
            _efbig_limit(None)
        seen[name + "_listing"] = sorted(os.listdir(root))
        dist.barrier()  # before rank 0 starts the next save
    seen["after"] = str(ck.save(4, state))
    return seen


def test_a_save_that_fails_on_one_rank_fails_on_every_rank_and_keeps_the_previous_checkpoint(tmp_path):
    root = tmp_path / "checkpoints"
    seen = cookbook.distributed(num_processes=2, start_method="fork")(_saves_that_fail).distributed(str(root))
    previous, final = root / "step_00000002", root / "step_00000004"
    for name, rank in (("shard", 1), ("meta", 0)):
        for r in (0, 1):
            message, code = seen[r][name]
            assert code == errno.EFBIG
            assert re.fullmatch(
                re.escape(
                    f"could not save the checkpoint of step 4 to {final} (rank {rank}: EFBIG, File too large); the "
                    f"previous checkpoint {previous} is intact. Raise the file size limit (ulimit -f) or the "
                    f"largest file size of "
                )
                + r"/\S*"
                + re.escape(f" and run the same command again: it resumes from {previous}"),
                message,
            ), (name, r, message)
            assert seen[r][name + "_listing"] == ["step_00000002"]  # no temporary folder left, step 2 intact
    assert seen[0]["after"] == seen[1]["after"] == str(final)  # no rank hung; the next save works
    assert Checkpointer(root).complete_checkpoints() == [previous, final]


def _save_past_a_file_size_limit(root: Path, err: Path) -> None:
    """A recipe's ``main`` under `cookbook.run_main`: a save, then one past a file size limit (forked child)."""
    import atexit

    atexit._clear()  # the handlers this test process registered are not the child's to run
    fd = os.open(err, os.O_WRONLY | os.O_CREAT)
    os.dup2(fd, 2)
    sys.stderr = open(2, "w", closefd=False)
    torch.set_num_threads(1)

    def main(argv):
        ck = Checkpointer(root)
        ck.save(2, {"blob": Blob(2, numel=64 * 1024)})
        _efbig_limit(64 * 1024)
        ck.save(4, {"blob": Blob(4, numel=64 * 1024)})

    cookbook.run_main(main, user_errors=(CheckpointError,), argv=[])


def test_a_failed_save_ends_the_run_with_one_line_and_status_2(tmp_path):
    """What every recipe does with it: its ``run_main`` lists CheckpointError among the user errors."""
    recipes = Path(__file__).resolve().parents[1] / "recipes"
    for train in sorted(recipes.glob("*/train.py")):
        text = train.read_text()
        assert re.search(r"run_main\(main, user_errors=\([^)]*CheckpointError", text), train
    root, err = tmp_path / "checkpoints", tmp_path / "stderr.txt"
    child = multiprocessing.get_context("fork").Process(target=_save_past_a_file_size_limit, args=(root, err))
    child.start()
    child.join(300)
    assert child.exitcode == 2, err.read_text()
    errors = [line for line in err.read_text().splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err.read_text(), err.read_text()
    assert errors[0].startswith(
        f"error: could not save the checkpoint of step 4 to {root / 'step_00000004'} (EFBIG, "
        f"File too large); the previous checkpoint {root / 'step_00000002'} is intact."
    )
    assert sorted(p.name for p in root.iterdir()) == ["step_00000002"]


def test_a_save_where_the_checkpoints_folder_cannot_be_made_says_so(tmp_path):
    (tmp_path / "file").write_text("")
    ck = Checkpointer(tmp_path / "file" / "checkpoints")
    with pytest.raises(
        CheckpointSaveError,
        match=r"could not save the checkpoint of step 1 to \S+/file/checkpoints/"
        r"step_00000001 \(ENOTDIR, Not a directory: .*\); there is no earlier "
        r"checkpoint\. .* it starts from step 0$",
    ) as info:
        ck.save(1, {"blob": Blob(1)})
    assert info.value.errno == errno.ENOTDIR


def test_an_output_dir_that_cannot_be_written_is_refused_before_any_worker(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(
        ConfigError,
        match=rf"^output_dir='{re.escape(str(tmp_path))}/file/run': {re.escape(str(tmp_path))}"
        rf"/file is not a folder \(Not a directory, ENOTDIR\); set output_dir to a "
        rf"folder this user can write to$",
    ):
        check_run(RunConfig(output_dir=str(tmp_path / "file" / "run")))
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoints").write_text("")  # a file where the checkpoints go
    with pytest.raises(ConfigError, match=r"/run/checkpoints is not a folder \(Not a directory, ENOTDIR\)"):
        check_run(RunConfig(output_dir=str(tmp_path / "run")))
    (tmp_path / "run" / "checkpoints").unlink()
    check_run(RunConfig(output_dir=str(tmp_path / "run")))
    check_run(RunConfig(output_dir=str(tmp_path / "new" / "run")))  # created by the run, below a writable folder
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["file", "run"]  # the probes left nothing
    # The check launch.sh runs before torchrun (`train.py --check`) refuses it the same way.
    from conftest import check

    with pytest.raises(ConfigError, match=r"/file is not a folder \(Not a directory, ENOTDIR\)"):
        check("modernbert-ddp", f"output_dir={tmp_path / 'file' / 'run'}")
