"""cookbook.launch: the process counts and the --check before any worker (what each torchrun recipe's launch.sh runs)."""

import os
import signal
import time

import pytest

from cookbook.launch import main, plan


@pytest.mark.parametrize(
    "ngpu, nnodes, gpus, expected",
    [
        ("", "1", 0, (2, 1)),  # no GPU: 2 CPU processes
        ("", "2", 8, (8, 2)),  # every GPU of the node
        ("3", "1", 0, (3, 1)),  # CPU processes as asked
        ("4", "1", 8, (4, 1)),
    ],
)
def test_plan(ngpu, nnodes, gpus, expected):
    assert plan(ngpu, nnodes, gpus) == expected


@pytest.mark.parametrize(
    "ngpu, nnodes, gpus, message",
    [
        ("0", "1", 0, "error: NGPU=0 is not a positive integer"),
        ("two", "1", 0, "error: NGPU=two is not a positive integer"),
        ("", "-1", 0, "error: NNODES=-1 is not a positive integer"),
        ("9", "1", 8, r"error: NGPU=9 but this node has 8 GPU\(s\)"),
    ],
)
def test_plan_refuses(ngpu, nnodes, gpus, message):
    with pytest.raises(SystemExit, match=message):
        plan(ngpu, nnodes, gpus)


def test_a_failed_check_stops_before_any_worker(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text(
        "import os, sys\n"
        "open(os.path.join(os.path.dirname(__file__), 'calls'), 'a').write(' '.join(sys.argv[1:]) + '|' +"
        " os.environ['COOKBOOK_WORLD_SIZE'] + '|' + os.environ['COOKBOOK_LAUNCH_TIME'] + '\\n')\n"
        "sys.exit(2 if '--check' in sys.argv else 0)\n"
    )
    (tmp_path / "tiny.yaml").write_text("{}\n")
    t0 = time.time()
    status = main(["--ngpu", "3", "--nnodes", "2", str(script), "--config", "tiny.yaml", "optim.lr=1e-3"])
    t1 = time.time()
    assert status == 2
    calls = (tmp_path / "calls").read_text().splitlines()  # only the check ran; the config was found beside train.py
    assert [c.rsplit("|", 1)[0] for c in calls] == [f"--check --config {tmp_path / 'tiny.yaml'} optim.lr=1e-3|6"]
    assert t0 <= float(calls[0].rsplit("|", 1)[1]) <= t1  # the launch time the workers' startup_s counts from
    assert "COOKBOOK_LAUNCH_TIME" not in os.environ  # this process's environment is left as it was
    assert main(["--ngpu", "x", str(script), "--config", "tiny.yaml"]) == 2
    assert "error: NGPU=x is not a positive integer" in capsys.readouterr().err
    assert len((tmp_path / "calls").read_text().splitlines()) == 1  # nothing ran for the bad NGPU


CHECKED = """
import logging, os, signal, sys
import helper  # beside this file: the script's folder comes first on sys.path
from cookbook import run_main
from cookbook.config import ConfigError
print("module", helper.NAME, __name__, os.getpid(), sys.argv[1:], os.environ["COOKBOOK_WORLD_SIZE"], sys.path[0])
if "import-error" in sys.argv:
    raise RuntimeError("broken at import")
def main(argv):
    os.environ["FROM_CHECK"] = "1"
    os.environ.pop("KEPT", None)
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)  # ignored signals would outlive exec in the workers
    logging.basicConfig(level=logging.DEBUG)
    sys.path.append("/nowhere")
    if "bad" in argv:
        raise ConfigError("data.x=1: bad value")
    if "exit" in argv:
        sys.exit("the check's own message")
if __name__ == "__main__":
    run_main(main, user_errors=(ConfigError,))
"""


def test_a_sigterm_during_the_check_is_a_preemption_before_any_worker(tmp_path):
    """A scheduler's SIGTERM while launch.sh's in-process check runs (no GPU): one line and exit 75, no worker."""
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(
        "import pathlib, sys, time\n"
        "if '--check' not in sys.argv:\n"
        "    pathlib.Path(__file__).with_name('worker').write_text('ran')\n"
        "pathlib.Path(__file__).with_name('checking').write_text('')\n"
        "time.sleep(60)\n"
    )
    (tmp_path / "tiny.yaml").write_text("{}\n")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    launcher = subprocess.Popen(
        [sys.executable, "-m", "cookbook.launch", str(script), "--config", "tiny.yaml"],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not (tmp_path / "checking").exists() and time.monotonic() < deadline and launcher.poll() is None:
        time.sleep(0.05)
    launcher.send_signal(signal.SIGTERM)
    _, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 75, err
    assert err.strip().splitlines()[-1] == (
        "preempted (SIGTERM) during the check, before any worker started: nothing to save; run the same command "
        "again to start (exit status 75)"
    ), err
    assert not (tmp_path / "worker").exists()


def test_the_check_runs_in_the_launchers_process_and_leaves_it_as_it_was(tmp_path, capfd, monkeypatch):
    """``train.py --check`` runs in the launcher's own process (`cookbook.launch._run_script`), as ``python train.py
    --check`` would (``__main__``, its folder first on sys.path, its argv and COOKBOOK_WORLD_SIZE): its output, and
    its exit statuses (run_main's 2 with one line, a SystemExit's message, 1 and the traceback of an error at import);
    the workers then start with the launcher's environment, signal handlers, logging and sys.path as they were."""
    import logging
    import sys

    import cookbook.torchrun

    script = tmp_path / "train.py"
    script.write_text(CHECKED)
    (tmp_path / "helper.py").write_text("NAME = 'helper'\n")
    seen = []

    def torchrun(argv):
        seen.append(
            (
                dict(os.environ),
                signal.getsignal(signal.SIGUSR2),
                list(logging.getLogger().handlers),
                list(sys.path),
                "helper" in sys.modules,
            )
        )
        return 0

    monkeypatch.setattr(cookbook.torchrun, "main", torchrun)
    monkeypatch.setenv("KEPT", "yes")
    before = (signal.getsignal(signal.SIGUSR2), list(logging.getLogger().handlers), list(sys.path))
    capfd.readouterr()
    assert main(["--ngpu", "2", str(script), "a=1"]) == 0
    out, err = capfd.readouterr()
    assert out.splitlines() == [f"module helper __main__ {os.getpid()} ['--check', 'a=1'] 2 {tmp_path}"]
    env, *state = seen[0]
    assert "FROM_CHECK" not in env and env["KEPT"] == "yes" and "COOKBOOK_WORLD_SIZE" not in env
    assert state == [*before, False]
    for args, status, line in [(["bad"], 2, "error: data.x=1: bad value"), (["exit"], 1, "the check's own message")]:
        assert main(["--ngpu", "2", str(script), *args]) == status
        out, err = capfd.readouterr()
        assert err.splitlines()[-1] == line and "Traceback" not in err
    assert main(["--ngpu", "2", str(script), "import-error"]) == 1
    err = capfd.readouterr().err
    assert "Traceback" in err and err.splitlines()[-1] == "RuntimeError: broken at import"
    assert len(seen) == 1 and (signal.getsignal(signal.SIGUSR2), logging.getLogger().handlers, sys.path) == before
    assert main(["--ngpu", "2", str(tmp_path / "missing.py")]) == 2  # python's own line, from a process of its own
    assert "can't open file" in capfd.readouterr().err


def test_a_dry_run_prints_the_commands_and_runs_nothing(tmp_path, capsys, monkeypatch):
    """--dry-run (or DRY_RUN set, not 0): the process counts are checked, the check's and torchrun's commands printed
    (copy-pastable), and neither is run."""
    import sys

    import cookbook.torchrun

    script = tmp_path / "train.py"
    script.write_text("open(__file__ + '.ran', 'w')\n")
    (tmp_path / "tiny.yaml").write_text("{}\n")
    monkeypatch.setattr(cookbook.torchrun, "main", lambda argv: pytest.fail("torchrun ran in a dry run"))
    monkeypatch.delenv("DRY_RUN", raising=False)
    assert (
        main(
            [
                "--dry-run",
                "--ngpu",
                "3",
                "--nnodes",
                "2",
                "--node-rank",
                "1",
                "--master-addr",
                "10.0.0.1",
                str(script),
                "--config",
                "tiny.yaml",
                "optim.lr=1e-3",
                "data.name=a b",
            ]
        )
        == 0
    )
    config = tmp_path / "tiny.yaml"
    assert capsys.readouterr().out.splitlines() == [
        f"check: env COOKBOOK_WORLD_SIZE=6 {sys.executable} {script} --check --config {config} optim.lr=1e-3 "
        f"'data.name=a b'",
        f"run: {sys.executable} -m cookbook.torchrun --nnodes 2 --node-rank 1 --master-addr 10.0.0.1 --master-port "
        f"29500 --nproc-per-node 3 --max-restarts 3 {script} --config {config} optim.lr=1e-3 'data.name=a b'",
    ]
    monkeypatch.setenv("DRY_RUN", "1")
    here = tmp_path / "here"  # a config of the same name in the current folder wins, and says so
    here.mkdir()
    (here / "tiny.yaml").write_text("{}\n")
    monkeypatch.chdir(here)
    assert main(["--ngpu", "2", str(script), "--config", "tiny.yaml"]) == 0
    assert capsys.readouterr().err == (
        f"note: --config tiny.yaml is this folder's ({here / 'tiny.yaml'}), not the one beside train.py ({config}); "
        f"its relative paths are read from {here}\n"
    )
    assert main(["--ngpu", "2", "--max-restarts", "0", str(script)]) == 0
    assert (
        capsys.readouterr().out.splitlines()[1]
        == f"run: {sys.executable} -m cookbook.torchrun --standalone --nproc-per-node 2 --max-restarts 0 {script}"
    )
    assert main(["--ngpu", "0", str(script)]) == 2  # the process counts are still checked
    assert "error: NGPU=0 is not a positive integer" in capsys.readouterr().err
    assert not (tmp_path / "train.py.ran").exists()
    monkeypatch.setenv("DRY_RUN", "0")  # runs (the check fails here: its script is no recipe)
    script.write_text("import sys\nsys.exit(2)\n")
    assert main(["--ngpu", "2", str(script)]) == 2 and capsys.readouterr().out == ""


# ----------------------------------------------------------------------------- restarts (cookbook.torchrun)
@pytest.mark.parametrize(
    "exitcode, others, restart",
    [
        (-9, [], True),  # SIGKILL: the out-of-memory killer, a lost node's process
        (-11, [], True),  # SIGSEGV
        (-6, [3], True),  # SIGABRT (a collective's watchdog), a peer that lost it
        (1, [], True),  # a bug or library failure
        (3, [3], True),  # this node's ranks lost a peer on another node
        (2, [], False),  # bad input: it would fail again
        (4, [], False),  # diverged (train.on_nonfinite=stop): it would diverge again
        (75, [75], False),  # preempted: the scheduler takes over (Slurm's SIGUSR1 path ends with 75)
        (130, [], False),  # Ctrl-C
        (1, [75], False),  # a rank preempted beside the crash: no restart
        (-15, [], False),  # SIGTERM: asked to stop
        (-2, [], False),  # SIGINT
        (-10, [], False),  # SIGUSR1 before the training loop listens for it
        (5, [], False),  # a status that means nothing known
    ],
)
def test_which_failures_restart(exitcode, others, restart):
    from cookbook.torchrun import should_restart

    assert should_restart(exitcode, [exitcode, *others]) is restart


def _failure(rank: int, exitcode: int, tmp_path):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(tmp_path / "none.json"))


@pytest.mark.parametrize(
    "outcomes, status, restarts",
    [
        ([-9, 0], 0, ["restart 1 of 3: rank 1 was killed by SIGKILL; the workers resume from the newest checkpoint"]),
        (
            [1, 3, 0],
            0,
            [
                "restart 1 of 3: rank 1 failed (exit status 1: a failure, its traceback is above); the workers "
                "resume from the newest checkpoint",
                "restart 2 of 3: rank 1 failed (exit status 3: it lost contact with another rank); the workers "
                "resume from the newest checkpoint",
            ],
        ),
        (
            [-9, -9, -9, -9],
            137,
            [
                f"restart {k} of 3: rank 1 was killed by SIGKILL; the workers resume from the newest checkpoint"
                for k in (1, 2, 3)
            ],
        ),
        ([2], 2, []),
        ([-9, 2], 2, ["restart 1 of 3: rank 1 was killed by SIGKILL; the workers resume from the newest checkpoint"]),
        ([75], 75, []),
        ([130], 130, []),
    ],
)
def test_the_launcher_restarts_the_group_only_for_what_a_restart_can_cure(
    outcomes, status, restarts, tmp_path, monkeypatch, capsys
):
    """`cookbook.torchrun.main` around a stand-in for torchrun's agent whose worker group ends as `outcomes` says,
    one attempt after the other (0: success; else rank 1's status): the restarts, their lines, the exit status,
    the restart count the workers see and the rendezvous port of each attempt."""
    import torch.distributed.run as torchrun_module
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    import cookbook.torchrun as torchrun

    seen, launched = [], []

    def run(args):
        seen.append((os.environ[torchrun.RESTART_COUNT_ENV], args.max_restarts, args.master_port, args.standalone))
        launched.append(os.environ.get("COOKBOOK_LAUNCH_TIME"))
        code = outcomes[len(seen) - 1]
        if code:
            raise ChildFailedError("train.py", {1: _failure(1, code, tmp_path)})

    monkeypatch.setattr(torchrun_module, "run", run)
    monkeypatch.setattr(torchrun, "_stop_asked", False)
    monkeypatch.delenv(torchrun.RESTART_COUNT_ENV, raising=False)
    monkeypatch.setenv("COOKBOOK_LAUNCH_TIME", "100.0")  # as cookbook.launch sets it
    t0 = time.time()
    argv = [
        "--nnodes",
        "2",
        "--node-rank",
        "0",
        "--master-addr",
        "10.0.0.1",
        "--master-port",
        "29500",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "3",
        "train.py",
    ]
    assert torchrun.main(argv) == status
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if line.startswith("restart ")] == restarts
    attempts = len(restarts) + 1
    # Each attempt: the count in the workers' environment, torchrun's own restarts off, its own port.
    assert seen == [(str(k), 0, 29500 + k, False) for k in range(attempts)]
    assert torchrun.RESTART_COUNT_ENV not in os.environ  # this process's environment is left as it was
    # A restarted group's startup_s counts from its restart: each attempt after the first gets its own time.
    assert launched[0] == "100.0" and all(t0 <= float(t) for t in launched[1:])
    assert sorted(map(float, launched)) == list(map(float, launched)) and len(set(launched)) == attempts
    assert os.environ["COOKBOOK_LAUNCH_TIME"] == "100.0"
    if status == 137:
        assert "error: rank 1 was killed by SIGKILL; the other ranks were stopped (after 3 restarts)" in err


def test_no_restart_once_the_launcher_was_asked_to_stop(tmp_path, monkeypatch, capsys):
    """After SIGUSR1 to the launcher (Slurm's warning, passed on to the workers), a worker that then dies is not
    restarted: the job ends, for the scheduler to requeue."""
    import torch.distributed.run as torchrun_module
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    import cookbook.torchrun as torchrun

    calls = []

    def run(args):
        calls.append(args)
        assert signal.getsignal(signal.SIGUSR1) is torchrun._forward_to_workers
        torchrun._stop_asked = True  # what that handler sets, besides passing the signal on to the workers
        raise ChildFailedError("train.py", {1: _failure(1, -9, tmp_path)})

    monkeypatch.setattr(torchrun_module, "run", run)
    monkeypatch.setattr(torchrun, "_stop_asked", False)
    assert torchrun.main(["--standalone", "--nproc-per-node", "2", "--max-restarts", "3", "train.py"]) == 137
    assert len(calls) == 1 and "restart " not in capsys.readouterr().err


def test_each_restart_meets_at_a_rendezvous_of_its_own():
    from torch.distributed.run import parse_args

    from cookbook.torchrun import attempt_args

    one_node = parse_args(["--nnodes", "1", "--master-port", "29600", "--nproc-per-node", "2", "train.py"])
    assert (attempt_args(one_node, 0).standalone, attempt_args(one_node, 0).master_port) == (False, 29600)
    assert attempt_args(one_node, 1).standalone  # a free port: 29600 may still be held by the failed attempt
    nodes = parse_args(
        [
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--master-addr",
            "10.0.0.1",
            "--master-port",
            "29600",
            "--nproc-per-node",
            "8",
            "train.py",
        ]
    )
    assert [attempt_args(nodes, k).master_port for k in range(3)] == [29600, 29601, 29602]  # the same on every node
    assert nodes.master_port == 29600  # the parsed arguments are not changed
    c10d = parse_args(
        [
            "--nnodes",
            "2",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            "head:29400",
            "--rdzv-id",
            "job",
            "--nproc-per-node",
            "8",
            "train.py",
        ]
    )
    assert (attempt_args(c10d, 2).rdzv_endpoint, attempt_args(c10d, 2).rdzv_id) == ("head:29402", "job-restart2")


def test_max_restarts_is_checked_and_passed_to_torchrun(tmp_path, monkeypatch, capsys):
    import cookbook.torchrun

    script = tmp_path / "train.py"
    script.write_text("import sys\nsys.exit(0)\n")
    passed = []
    monkeypatch.setattr(cookbook.torchrun, "main", lambda argv: passed.append(argv) or 0)
    assert main(["--ngpu", "2", str(script)]) == 0
    assert passed[-1][passed[-1].index("--max-restarts") + 1] == "3"  # the default
    assert main(["--ngpu", "2", "--max-restarts", "0", str(script)]) == 0
    assert passed[-1][passed[-1].index("--max-restarts") + 1] == "0"
    assert main(["--ngpu", "2", "--max-restarts", "-1", str(script)]) == 2
    assert "error: MAX_RESTARTS=-1 is not a whole number (0 or more)" in capsys.readouterr().err
    assert len(passed) == 2


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"COOKBOOK_WORLD_SIZE": "3", "NGPU": "2"}, 3),  # set by launch.sh's launcher for its check
        ({"NGPU": "2", "NNODES": "2"}, 4),  # `python train.py --check` of its own, as launch.sh would run
        ({}, 2),  # no GPU here: launch.sh's 2 CPU processes
    ],
)
def test_check_world_size_is_the_world_launch_sh_starts(monkeypatch, env, expected):
    from cookbook.launch import check_world_size

    for var in ("COOKBOOK_WORLD_SIZE", "NGPU", "NNODES"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert check_world_size() == expected


def test_a_check_run_alone_plans_for_ngpu_processes(monkeypatch, capsys):
    """`NGPU=2 python train.py --check` with expert parallelism over 2 ranks: checked for 2 ranks, not 1."""
    from conftest import ROOT, load_recipe

    for var in ("COOKBOOK_WORLD_SIZE", "NNODES"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NGPU", "2")
    monkeypatch.setenv("COOKBOOK_DEVICE", "cpu")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    recipe = ROOT / "recipes" / "moe-lora-fsdp2-ep"
    load_recipe("moe-lora-fsdp2-ep").main(["--config", str(recipe / "tiny.yaml"), "--check", "parallel.ep=2"])
    monkeypatch.setenv("NGPU", "3")
    with pytest.raises(Exception, match="parallel.ep=2 does not divide the world size 3"):
        load_recipe("moe-lora-fsdp2-ep").main(["--config", str(recipe / "tiny.yaml"), "--check", "parallel.ep=2"])


def test_a_run_holds_its_output_dir_and_its_workers_end_with_a_killed_launcher(tmp_path):
    """A recipe's launch.sh as users run it: a second launch on the same output_dir is refused in one line naming the
    first launcher's pid and host, before any worker; ``kill -9`` of the first launcher ends its workers within
    seconds (no checkpoint after it), and frees the folder. The recipe is a stand-in with a real check (it reports
    its output_dir, as every recipe's check does) and workers under `run_main` that publish a checkpoint every 50 ms."""
    import shutil
    import socket

    import psutil
    from conftest import ROOT, start_launch

    from cookbook import run_lock

    recipe = tmp_path / "my-recipe"
    recipe.mkdir()
    shutil.copy(ROOT / "recipes" / "modernbert-ddp" / "launch.sh", recipe / "launch.sh")
    (recipe / "tiny.yaml").write_text("{}\n")
    (recipe / "train.py").write_text(
        "import os, sys, time\nfrom pathlib import Path\nfrom cookbook import run_lock\nfrom cookbook.entry import run_main\n"
        "def main(argv):\n"
        "    out = Path(next(a.split('=', 1)[1] for a in argv if a.startswith('output_dir=')))\n"
        "    if '--check' in argv:\n        return run_lock.report_output_dir(out)\n"
        "    for step in range(1, 6001):\n        time.sleep(0.05)\n"
        "        if os.environ['RANK'] == '0':\n"
        "            (out / 'checkpoints' / f'step_{step:08d}').mkdir(parents=True, exist_ok=True)\n"
        "if __name__ == '__main__':\n    run_main(main)\n"
    )
    out = tmp_path / "run"
    first = start_launch("my-recipe", f"output_dir={out}", cwd=recipe)
    try:
        deadline = time.time() + 300
        while time.time() < deadline and first.poll() is None and not list(out.glob("checkpoints/step_*")):
            time.sleep(0.2)
        assert first.poll() is None, first.communicate()[1][-3000:]
        second = start_launch("my-recipe", f"output_dir={out}", cwd=recipe)
        _, err = second.communicate(timeout=300)
        assert second.returncode == 2, err[-3000:]
        assert err.strip().splitlines()[-1] == (
            f"error: output_dir={out} is in use by the run of pid {first.pid} on host {socket.gethostname()} "
            f"(since {(out / '.run.lock.node0').read_text().split('(since ')[1]}; wait for it to end, stop it, or "
            f"choose another output_dir"
        ), err[-3000:]
        workers = [p for p in psutil.Process(first.pid).children() if p.environ().get("RANK") in ("0", "1")]
        assert len(workers) == 2
        first.kill()  # SIGKILL: the launcher cannot stop its workers itself
        first.wait()  # (not communicate(): live workers would hold its pipes open)
        gone, alive = psutil.wait_procs(workers, timeout=15)
        assert not alive, f"workers outlived their launcher: {alive}"
        saved = sorted(p.name for p in out.glob("checkpoints/step_*"))
        time.sleep(1)
        assert sorted(p.name for p in out.glob("checkpoints/step_*")) == saved  # nothing writes the folder any more
        os.close(run_lock.acquire(out))  # the kernel released the dead launcher's lock
    finally:
        if first.poll() is None:
            first.kill()


BESIDE = """
import os, sys, time
from pathlib import Path
import cookbook  # (its excepthook: an import that fails in a worker waits for the check's verdict)
from cookbook import run_main
from cookbook.config import ConfigError
here = Path(__file__).parent
if "--check" not in sys.argv:
    (here / f"imported-{os.environ['RANK']}").write_text(repr(time.time()))
    if "import-error" in sys.argv and os.environ["RANK"] == "1":
        raise RuntimeError("broken at import")
def main(argv):
    if "--check" in argv:  # it ends only once both workers have imported this module (or after 120 s)
        deadline = time.time() + 120
        while time.time() < deadline and not all((here / f"imported-{r}").is_file() for r in (0, 1)):
            time.sleep(0.05)
        (here / "checked").write_text(repr(time.time()))
        if "bad" in argv:
            raise ConfigError("data.x=1: bad value")
        return
    (here / f"ran-{os.environ['RANK']}").write_text(repr(time.time()))
if __name__ == "__main__":
    run_main(main, user_errors=(ConfigError,))
"""


def test_on_gpu_nodes_the_workers_import_while_the_check_runs_and_wait_for_its_verdict(tmp_path, capfd, monkeypatch):
    """With GPUs (`workers_during_check`, forced here) the check runs in a process of its own while torchrun starts
    the workers: they import the recipe meanwhile (the check below ends only after both did) and run main only after
    it passed. A failed check is its one line and status 2: no worker runs main, and one whose import failed
    meanwhile says nothing (the check's error is the one to read)."""
    import cookbook.launch

    monkeypatch.setattr(cookbook.launch, "workers_during_check", lambda gpus: True)
    script = tmp_path / "train.py"
    script.write_text(BESIDE)
    assert main(["--ngpu", "2", "--max-restarts", "0", str(script)]) == 0
    checked = float((tmp_path / "checked").read_text())
    for rank in (0, 1):
        assert (
            float((tmp_path / f"imported-{rank}").read_text())
            <= checked
            <= float((tmp_path / f"ran-{rank}").read_text())
        )
    for f in tmp_path.glob("[icr]*-*"):
        f.unlink()
    (tmp_path / "checked").unlink()
    capfd.readouterr()
    assert main(["--ngpu", "2", "--max-restarts", "0", str(script), "bad", "import-error"]) == 2
    err = capfd.readouterr().err
    assert [line for line in err.splitlines() if "error" in line.lower()] == ["error: data.x=1: bad value"], err
    assert "Traceback" not in err and not list(tmp_path.glob("ran-*"))
    assert (tmp_path / "imported-1").is_file() and "COOKBOOK_CHECK_VERDICT" not in os.environ


def test_the_ray_launcher_takes_a_relative_config_as_the_torchrun_one_does(tmp_path, monkeypatch, capfd):
    # The Ray recipes' launch.sh pass CONFIG_FILE as given: beside train.py when the current folder has none, this
    # folder's with a note when both have one (cookbook.config.config_beside, as cookbook.launch).
    from cookbook.ray_train.launch import main as ray_launch

    script = tmp_path / "train.py"
    script.write_text("import sys; print(' '.join(sys.argv[1:]))\n")
    (tmp_path / "tiny.yaml").write_text("{}\n")
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    monkeypatch.setenv("NNODES", "1")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert ray_launch([str(script), "--config", "tiny.yaml", "a=1"]) == 0
    assert capfd.readouterr() == (f"--config {tmp_path / 'tiny.yaml'} a=1\n", "")
    (here / "tiny.yaml").write_text("{}\n")
    assert ray_launch([str(script), "--config", "tiny.yaml"]) == 0
    out, err = capfd.readouterr()
    assert out == "--config tiny.yaml\n"
    assert err == (
        f"note: --config tiny.yaml is this folder's ({here / 'tiny.yaml'}), not the one beside train.py "
        f"({tmp_path / 'tiny.yaml'}); its relative paths are read from {here}\n"
    )
