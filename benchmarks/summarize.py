"""Summarise recipe runs from their metrics.jsonl files as a Markdown table.

    python benchmarks/summarize.py --skip-steps 20 outputs/run-a outputs/run-b
    python benchmarks/summarize.py --skip-steps 4 --json results.jsonl outputs/run-a outputs/run-b

Throughput columns are medians over the logged windows after `--skip-steps` (warm-up and
first-step compilation excluded); memory is the peak over the run; accuracy is the final eval.
``--json PATH`` also appends one JSON object per run to PATH: the table's row, the loss of every logged
step (``losses``, step -> loss) and the software (``date``, ``device``, ``torch``, ``transformers``, ``cuda``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
from pathlib import Path


def summarise(run: Path, skip_steps: int) -> dict:
    train, final = [], {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["event"] == "train" and rec["step"] > skip_steps:
            train.append(rec)
        elif rec["event"] == "summary":
            final = rec
    if not train:
        raise SystemExit(f"{run}: no train records after step {skip_steps}")
    # Older runs wrote *_per_gpu (GPU) or *_per_rank (CPU) where newer ones write *_per_device.
    for rec in train:
        for old in ("per_gpu", "per_rank"):
            for what in ("samples", "tokens"):
                if f"{what}_per_s_{old}" in rec:
                    rec.setdefault(f"{what}_per_s_per_device", rec[f"{what}_per_s_{old}"])

    def med(key: str) -> float | None:
        vals = [r[key] for r in train if key in r]
        return statistics.median(vals) if vals else None

    return {
        "run": run.name,
        "steps": f"{train[0]['step']}-{train[-1]['step']}",
        "step_ms": med("step_time_s") * 1000,
        "samples/s/device": med("samples_per_s_per_device"),
        "tokens/s/device": med("tokens_per_s_per_device"),
        "mfu_%": (med("mfu") or 0) * 100 if "mfu" in train[0] else None,
        "peak_alloc_gib": max((r["mem_allocated_gib"] for r in train if "mem_allocated_gib" in r), default=None),
        "peak_reserved_gib": max((r["mem_reserved_gib"] for r in train if "mem_reserved_gib" in r), default=None),
        "data_wait_%": med("data_wait_frac") * 100,
        "eval_acc_%": final["eval/accuracy"] * 100 if "eval/accuracy" in final else None,
        "startup_s": final.get("startup_s"),  # launch to the end of step 1 (the recipes' summary)
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="run output folders (holding metrics.jsonl)")
    parser.add_argument("--skip-steps", type=int, default=20)
    parser.add_argument("--json", type=Path, default=None, help="JSONL file to append one object per run to")
    args = parser.parse_args()
    import torch
    import transformers

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or "cpu"
    print(
        f"date {datetime.date.today()} | {gpu} | torch {torch.__version__} | transformers {transformers.__version__} "
        f"| CUDA {torch.version.cuda}"
    )
    rows = [summarise(r, args.skip_steps) for r in args.runs]
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for row in rows:
        cells = [
            f"{v:,.1f}" if isinstance(v, float) else ("" if v is None else str(v)) for v in (row.get(c) for c in cols)
        ]
        print("| " + " | ".join(cells) + " |")
    if args.json:
        software = {
            "date": datetime.date.today().isoformat(),
            "device": gpu,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "cuda": torch.version.cuda,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        with args.json.open("a") as f:
            for run, row in zip(args.runs, rows):
                f.write(json.dumps({**row, "losses": losses(run), **software}) + "\n")


def losses(run: Path) -> dict[int, float]:
    """Step -> training loss of every logged step of `run`."""
    recs = (json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["loss"] for r in recs if r["event"] == "train"}


if __name__ == "__main__":
    main()
