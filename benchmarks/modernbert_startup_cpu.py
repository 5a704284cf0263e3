"""modernbert-ddp's launch to the end of step 1 on CPU (issue 37 item 1; not the H200 target): this tree against
``--before`` (a commit, checked out with ``git archive``) in one command, ``--runs`` runs of each, alternating, and
their medians. tiny.yaml with a 2-layer ModernBERT of the real vocabulary (random init), the real tokenizer and the
real AG News rows (``hf_subset_train_5000.csv`` to train, ``train.csv`` to evaluate), 1 CPU process, 1 step, a new
output_dir per run (the check tokenizes; the workers read its cache when the version has one).

    python benchmarks/modernbert_startup_cpu.py --data ../shared/data/datasets/ag_news \\
        --tokenizer ../shared/data/models/modernbert --before 4446eb5 --runs 3 > results.jsonl

One JSON line per run (version, startup_s and its phases from the run's summary, launch_to_exit_s, job_cpu_s: user +
system seconds of every process of the job, which other load on the machine changes less), then one per version with
the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _tree(commit: str, work: Path) -> Path:
    """`commit`'s ``shared`` and ``recipes/modernbert-ddp`` under `work`/before."""
    out = work / "before"
    out.mkdir()
    archive = subprocess.run(
        ["git", "archive", commit, "shared", "recipes/modernbert-ddp"], cwd=ROOT, check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    return out


def _run(tree: Path, name: str, k: int, args, work: Path) -> dict:
    out = work / f"{name}-{k}"
    env = {
        **os.environ,
        "PYTHONPATH": str(tree / "shared"),
        "CONFIG_FILE": "tiny.yaml",
        "NGPU": "1",
        "MAX_RESTARTS": "0",
        "COOKBOOK_DEVICE": "cpu",
        "CUDA_VISIBLE_DEVICES": "",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    t0, used = time.time(), resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(
        [
            "bash",
            str(tree / "recipes/modernbert-ddp/launch.sh"),
            f"output_dir={out}",
            "mlflow=false",
            f"model.name_or_path={work / 'model'}",
            "model.pretrained=false",
            f"data.train_files=[{args.data / 'hf_subset_train_5000.csv'}]",
            f"data.eval_files=[{args.data / 'train.csv'}]",
            "train.max_steps=1",
            "train.eval_every=0",
            "checkpoint.every_steps=-1",
            "checkpoint.export_hf=false",
        ],
        env=env,
        capture_output=True,
        text=True,
    )
    wall, now = time.time() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = now.ru_utime + now.ru_stime - used.ru_utime - used.ru_stime  # every process of the job, waited for
    if proc.returncode:
        raise SystemExit(f"{name} run {k}: exit status {proc.returncode}\n{proc.stderr[-3000:]}")
    summary = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["event"] == "summary"][
        -1
    ]
    return {
        "version": name,
        "run": k,
        "startup_s": round(summary["startup_s"], 3),
        "first_step_s": round(summary["first_step_s"], 3),
        "startup_phases": summary["startup_phases"],
        "tokenized_cache": summary.get("tokenized_cache"),
        "launch_to_exit_s": round(wall, 3),
        "job_cpu_s": round(cpu, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True, help="the ag_news folder")
    parser.add_argument("--tokenizer", required=True, help="the ModernBERT tokenizer folder")
    parser.add_argument("--before", required=True, help="the commit to compare with")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    args.data = args.data.resolve()
    from transformers import AutoTokenizer, ModernBertConfig

    with tempfile.TemporaryDirectory(prefix="mb-startup-") as tmp:
        work = Path(tmp)
        ModernBertConfig(
            num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4
        ).save_pretrained(work / "model")
        AutoTokenizer.from_pretrained(args.tokenizer).save_pretrained(work / "model")
        trees = {"before": _tree(args.before, work), "after": ROOT}
        subprocess.run(
            [sys.executable, "-c", "import torch, transformers, datasets, torchdata"], check=True
        )  # page cache
        runs = [_run(trees[name], name, k, args, work) for k in range(args.runs) for name in trees]
    for r in runs:
        print(json.dumps(r))
    for name in trees:
        mine = [r for r in runs if r["version"] == name]
        print(
            json.dumps(
                {
                    "version": name,
                    "commit": args.before if name == "before" else _head(),
                    "runs": len(mine),
                    **{
                        f"median_{k}": statistics.median(r[k] if k in r else r["startup_phases"][k] for r in mine)
                        for k in ("startup_s", "worker_start", "imports", "data", "launch_to_exit_s", "job_cpu_s")
                    },
                }
            )
        )


def _head() -> str:
    return subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()


if __name__ == "__main__":
    main()
