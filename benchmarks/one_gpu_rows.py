"""The numbers that benchmarks/one_gpu_rows.sh keeps from each part's run, as one JSON object on stdout.

    python3 benchmarks/one_gpu_rows.py modernbert RUN/metrics.jsonl   # startup_s, final_eval_s, epoch_start_wait_s, ...
    python3 benchmarks/one_gpu_rows.py ray RUN/metrics.jsonl          # samples/s per GPU, recall@k against popularity
    python3 benchmarks/one_gpu_rows.py zero SUMMARY.json              # benchmarks/summarize.py --json's row, no losses
    python3 benchmarks/one_gpu_rows.py record PART EXIT_STATUS LOG [NUMBERS_JSON]   # one results.jsonl line
    python3 benchmarks/one_gpu_rows.py tag PART RUN/metrics.jsonl     # the run's records, each with "part"

A missing metrics file gives ``{}`` (the part failed before its first record; ``record`` then says why from its log).
Medians leave out the warm-up windows: the ModernBERT windows up to step min(20, last step / 2) (the compiled first
step), the first fifth of the two-tower windows.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path


def read_records(path: str) -> list[dict]:
    """The records of a metrics.jsonl file; [] when it does not exist."""
    p = Path(path)
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()] if p.is_file() else []


def median(records: list[dict], key: str) -> float | None:
    """Median of ``key`` over the records that have it; None when none has."""
    values = [r[key] for r in records if key in r]
    return statistics.median(values) if values else None


def modernbert(path: str) -> dict:
    """Start-up and final-evaluation seconds of the summary, the train records' ``epoch_start_wait_s`` (a window that
    began a pass over the data) beside the median data wait and step time (seconds), and the final evaluation."""
    recs = read_records(path)
    if not recs:
        return {}
    train = [r for r in recs if r["event"] == "train"]
    summary = next((r for r in recs if r["event"] == "summary"), {})
    evals = [r for r in recs if r["event"] == "eval"]
    last = train[-1]["step"] if train else 0
    later = [r for r in train if r["step"] > min(20, last // 2)]
    return {
        **{k: summary.get(k) for k in ("startup_s", "first_step_s", "final_eval_s")},
        "epoch_starts": [
            {k: r.get(k) for k in ("step", "epoch_start_wait_s", "step_time_s", "data_wait_s")}
            for r in train
            if "epoch_start_wait_s" in r
        ],
        "median_step_time_s": median(later, "step_time_s"),
        "median_data_wait_s": median(later, "data_wait_s"),
        "median_data_wait_frac": median(later, "data_wait_frac"),
        "samples_per_s_per_device": median(later, "samples_per_s_per_device"),
        "steps": last,
        "final_eval": {k: v for k, v in evals[-1].items() if k.startswith("eval/")} if evals else None,
    }


def ray(path: str) -> dict:
    """Median samples/s per device and step time of the two-tower run, and its last evaluation (recall@k of the
    towers and of the popularity baseline, held-out users)."""
    recs = read_records(path)
    if not recs:
        return {}
    train = [r for r in recs if r["event"] == "train"]
    evals = [r for r in recs if r["event"] == "eval"]
    later = train[len(train) // 5 :] or train
    return {
        "samples_per_s_per_device": median(later, "samples_per_s_per_device"),
        "median_step_time_s": median(later, "step_time_s"),
        "steps": train[-1]["step"] if train else 0,
        "eval": {k: v for k, v in evals[-1].items() if "recall" in k or k.endswith(("users", "step", "epoch"))}
        if evals
        else None,
    }


def zero(path: str) -> dict:
    """The first row of a ``summarize.py --json`` file without its per-step losses; {} when there is none."""
    p = Path(path)
    if not p.is_file() or not p.read_text().strip():
        return {}
    row = json.loads(p.read_text().splitlines()[0])
    row.pop("losses", None)
    return row


def record(part: str, exit_status: int, log: str, numbers: str = "") -> dict:
    """One results.jsonl record: the part, its exit status, its numbers and, when it failed, the last error lines
    of its log (124 / 137: it ran out of its time)."""
    rec = {"part": part, "exit_status": exit_status, **(json.loads(numbers) if numbers.strip() else {})}
    if exit_status != 0:
        try:
            lines = Path(log).read_text(errors="replace").splitlines()
        except OSError:
            lines = []
        errors = [line for line in lines if re.search(r"Error|error:|Traceback|Killed", line)]
        rec["error"] = " | ".join(errors[-3:])[-600:] or (lines[-1][-300:] if lines else "no log")
        if exit_status in (124, 137):
            rec["error"] = f"over its time limit; {rec['error']}"
    return rec


def main(argv: list[str]) -> None:
    what, args = argv[0], argv[1:]
    if what == "tag":
        for rec in read_records(args[1]):
            print(json.dumps({"part": args[0], **rec}))
        return
    if what == "record":
        out = record(args[0], int(args[1]), args[2], args[3] if len(args) > 3 else "")
    else:
        out = {"modernbert": modernbert, "ray": ray, "zero": zero}[what](args[0])
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
