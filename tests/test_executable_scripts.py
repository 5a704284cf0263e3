"""Scripts users run directly are executable in git (mode 100755), so that a fresh clone runs them as documented."""

import posixpath
import re
import sys
import subprocess

import pytest
from conftest import ROOT


def git_modes() -> dict[str, str]:
    """Path -> mode of every file git tracks (``git ls-files -s``)."""
    done = subprocess.run(["git", "ls-files", "-s"], cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"not a git checkout: {done.stderr.strip()}")
    return {line.split("\t", 1)[1]: line.split()[0] for line in done.stdout.splitlines()}


def documented_scripts(modes: dict[str, str]) -> set[str]:
    """Every ``recipes/*/launch.sh`` and every ``./x.sh`` a README names, resolved against the README's folder."""
    scripts = {p for p in modes if re.fullmatch(r"recipes/[^/]+/launch\.sh", p)}
    for readme in (p for p in modes if posixpath.basename(p) == "README.md"):
        for name in re.findall(r"(?<![\w./-])\./([\w./-]+\.sh)\b", (ROOT / readme).read_text()):
            scripts.add(posixpath.normpath(posixpath.join(posixpath.dirname(readme), name)))
    return scripts


def test_scripts_users_run_directly_are_executable_in_git():
    modes = git_modes()
    scripts = documented_scripts(modes)
    assert "recipes/qwen-zero3-receipts/launch.sh" in scripts
    assert sorted(s for s in scripts if s not in modes) == []  # a README names a script that is not there
    assert sorted(s for s in scripts if modes[s] != "100755") == []  # fix: git update-index --chmod=+x <path>


# axolotl-lora-ddp's launch.sh runs Axolotl's own launcher, in the recipe's own environment
LAUNCHERS = sorted(p for p in (ROOT / "recipes").glob("*/launch.sh") if "python3 -m cookbook." in p.read_text())


@pytest.mark.parametrize("launch", LAUNCHERS, ids=lambda p: p.parent.name)
def test_launch_sh_without_cookbook_says_what_to_activate(launch, tmp_path):
    """A launch.sh run by a python3 that cannot import cookbook (no environment activated): one line, exit 2."""
    assert len(LAUNCHERS) == 11
    (tmp_path / "python3").write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')  # -S: no site-packages
    (tmp_path / "python3").chmod(0o755)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "HOME": str(tmp_path)}
    done = subprocess.run(["bash", str(launch)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.startswith("error: python3 cannot import ") and "activate the environment" in done.stderr
    assert len(done.stderr.splitlines()) == 1
