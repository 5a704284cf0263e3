"""The notebooks in recipes/notebooks, executed top to bottom with nbclient on CPU (each starts 2 gloo workers
through ``@cookbook.distributed``), as a user runs them in Jupyter. Each notebook checks itself in its last cell
and writes ``results.json``; the tests assert on those numbers."""

from __future__ import annotations

import json
from pathlib import Path

import nbformat
from nbclient import NotebookClient

from conftest import ROOT

NOTEBOOKS = ROOT / "recipes" / "notebooks"


def execute(name: str, out: Path, monkeypatch) -> dict:
    """Run the notebook in a fresh kernel (working directory: the notebook's folder); returns its results.json."""
    monkeypatch.setenv("NOTEBOOK_OUTPUT_DIR", str(out))
    monkeypatch.setenv("COOKBOOK_DEVICE", "cpu")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    return json.loads((out / "results.json").read_text())


def test_notebooks_are_stored_clean():
    names = sorted(p.name for p in NOTEBOOKS.glob("*.ipynb"))
    assert names == ["fsdp2_transformer_dcp.ipynb", "mlp_ddp.ipynb", "modernbert_recipe.ipynb"]
    for name in names:
        nb = nbformat.read(NOTEBOOKS / name, as_version=4)
        nbformat.validate(nb)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert code and all(not c.outputs and c.execution_count is None for c in code), f"{name} has stored outputs"
        assert sum(c.cell_type == "markdown" for c in nb.cells) >= len(code), f"{name}: explain each step"


def test_mlp_ddp_notebook(tmp_path, monkeypatch):
    r = execute("mlp_ddp.ipynb", tmp_path, monkeypatch)
    assert r["world_size"] == 2 and r["device"] == "cpu" and r["steps"] == 40
    assert r["ranks_agree"] and r["fingerprints"][0] == r["fingerprints"][1]
    assert r["last_loss"] < 0.5 * r["first_loss"], r


def test_fsdp2_transformer_notebook_saves_and_reloads_with_dcp(tmp_path, monkeypatch):
    r = execute("fsdp2_transformer_dcp.ipynb", tmp_path, monkeypatch)
    assert r["world_size"] == 2 and r["sharded"]
    assert 9.5e6 < r["params"] < 11.5e6, r["params"]
    assert sum(r["local_params"]) == r["params"] and abs(r["local_params"][0] / r["params"] - 0.5) < 0.01
    assert r["first_loss"] > 8.5 and r["last_loss"] < r["first_loss"] - 1.0, r  # from ~ln(8192) = 9.0
    assert r["fresh_differed"] and r["reload_equal"] and r["next_step_equal"]
    assert (tmp_path / "checkpoints" / "step_00000006" / ".metadata").is_file()


def test_modernbert_recipe_notebook(tmp_path, monkeypatch):
    r = execute("modernbert_recipe.ipynb", tmp_path, monkeypatch)
    assert r["steps"] == list(range(1, 9)) and r["world_size"] == 2 and r["ranks_agree"]
    losses = r["losses"]
    assert sum(losses[-2:]) < sum(losses[:2]), losses
    assert set(r["eval"]) >= {"eval/loss", "eval/accuracy", "eval/macro_f1"} and r["eval"]["eval/loss"] > 0
    assert (tmp_path / "run" / "metrics.jsonl").is_file()
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step_00000004", "step_00000008"]
