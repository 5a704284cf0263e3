"""The README's ``-n 2 --dist loadgroup`` keeps each module in one worker and every Ray test in one worker."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections import defaultdict
from pathlib import Path

from conftest import ROOT, order_groups

MODULE = """
import os, pathlib, time
import pytest

@pytest.mark.parametrize("i", range(6))
def test_{name}(i{fixture}):
    time.sleep(0.1)  # long enough that an idle worker would take a share of the module's tests
    pathlib.Path(os.environ["RECORD_DIR"], "{name}-" + str(i)).write_text(os.environ["PYTEST_XDIST_WORKER"])
"""


def test_modules_and_the_ray_tests_each_run_in_one_worker_and_one_head_starts(tmp_path):
    """Real conftest hooks over generated modules (the session's ``ray_env`` replaced by one that counts its
    starts): each module's tests ran in one worker, both Ray modules in the same one, and one head started."""
    suite, record = tmp_path / "suite", tmp_path / "record"
    suite.mkdir()
    record.mkdir()
    (suite / "conftest.py").write_text(
        textwrap.dedent(f"""
        import importlib.util, os, pathlib, pytest
        spec = importlib.util.spec_from_file_location("suite_conftest", {str(ROOT / "tests" / "conftest.py")!r})
        real = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(real)
        pytest_collection_modifyitems = real.pytest_collection_modifyitems

        @pytest.fixture(scope="session")
        def ray_env():
            pathlib.Path(os.environ["RECORD_DIR"], "head-" + os.environ["PYTEST_XDIST_WORKER"]).write_text("")
            yield {{}}
        """)
    )
    for name, fixture in (("a", ""), ("b", ""), ("c", ""), ("ray_one", ", ray_env"), ("ray_two", ", ray_env")):
        (suite / f"test_{name}.py").write_text(MODULE.format(name=name, fixture=fixture))
    env = {**os.environ, "RECORD_DIR": str(record)}
    env.pop("PYTEST_XDIST_WORKER", None)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-n",
            "2",
            "--dist",
            "loadgroup",
            "-p",
            "no:cacheprovider",
            "--no-loadscope-reorder",
            "-c",
            os.devnull,
            "--rootdir",
            str(suite),
            str(suite),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    workers = defaultdict(set)
    for f in record.glob("*-*"):
        if not f.name.startswith("head-"):
            workers[f.name.rsplit("-", 1)[0]].add(f.read_text())
    assert sorted(workers) == ["a", "b", "c", "ray_one", "ray_two"] and sum(1 for _ in record.glob("*-[0-9]")) == 30
    assert all(len(w) == 1 for w in workers.values()), dict(workers)
    assert workers["ray_one"] == workers["ray_two"]
    assert len(list(record.glob("head-*"))) == 1


def test_groups_are_handed_out_longest_first_and_unrecorded_ones_before_them():
    groups = {"tests/test_a.py": [], "tests/test_b.py": [], "ray": [], "tests/test_new.py": []}
    seconds = {"tests/test_a.py": 5.0, "tests/test_b.py": 120.0, "ray": 60.0}
    assert order_groups(groups, seconds) == ["tests/test_new.py", "tests/test_b.py", "ray", "tests/test_a.py"]


def test_the_readme_test_command_distributes_by_group():
    readme = (ROOT / "README.md").read_text()
    assert "-n 2 --dist loadgroup" in readme and "--no-loadscope-reorder" in Path(ROOT / "pytest.ini").read_text()


def test_each_test_process_uses_one_thread():
    import torch

    assert torch.get_num_threads() == 1 and os.environ["OMP_NUM_THREADS"] == os.environ["OPENBLAS_NUM_THREADS"] == "1"
