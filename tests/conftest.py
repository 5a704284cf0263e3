"""Shared helpers: run a recipe's launch.sh as a user would, with this interpreter's tools on PATH."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(recipe: str, *overrides: str, config: str = "tiny.yaml", ngpu: int = 2, cwd: Path | None = None,
           env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run ``recipes/<recipe>/launch.sh`` on CPU with `ngpu` processes; returns the finished process."""
    full_env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
                "CONFIG_FILE": config, "NGPU": str(ngpu), "MASTER_PORT": str(free_port()),
                "COOKBOOK_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": "", **(env or {})}
    full_env.pop("MLFLOW_TRACKING_URI", None)
    full_env.pop("MLFLOW_RUN_ID", None)
    script = (cwd / "launch.sh") if cwd else ROOT / "recipes" / recipe / "launch.sh"
    return subprocess.run(["bash", str(script), *overrides], cwd=cwd or ROOT, env=full_env, capture_output=True,
                          text=True, timeout=timeout)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def train_losses(path: Path) -> dict[int, float]:
    """step -> loss from a metrics.jsonl (a resumed run's later records win)."""
    return {r["step"]: r["loss"] for r in read_jsonl(path) if r["event"] == "train"}


@pytest.fixture(autouse=True)
def _quiet_env(monkeypatch):
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
