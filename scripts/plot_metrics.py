"""Plot loss, learning rate, throughput per device, MFU and memory of one or several runs into one PNG.

    python scripts/plot_metrics.py outputs/run-a outputs/run-b -o compare.png
    python scripts/plot_metrics.py benchmarks/results/sft-h200x2-fsdp2-sdpa-seq2048.jsonl \\
        benchmarks/results/sft-h200x2-trl-zero3-seq2048.jsonl --labels fsdp2 zero3 -o sft.png

Each argument is a run's ``metrics.jsonl`` (`cookbook.metrics`) or its output folder. The runs are drawn side by
side, one line each, on five panels against the optimizer step: loss (evaluations as markers), learning rate,
tokens/s per device (samples/s per device for runs without tokens), MFU (GPU runs) and memory (peak allocated,
and reserved dashed, on GPUs; resident memory of the process on CPU). A step logged twice (a run resumed from a
checkpoint before it) counts once, its newest record. Needs matplotlib (``requirements/trackers.txt``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# The panels, left to right; the throughput keys: (key, its older name in committed results, unit), first found wins.
PANELS = ("loss", "learning rate", "throughput per device", "MFU (%)", "memory (GiB)")
THROUGHPUT = (
    ("tokens_per_s_per_device", "tokens_per_s_per_gpu", "tokens/s"),
    ("samples_per_s_per_device", "samples_per_s_per_gpu", "samples/s"),
)


def read_run(path: str | Path) -> tuple[dict[int, dict], dict[int, dict]]:
    """The train and eval records of a ``metrics.jsonl`` (or of the one in a run folder), by step; a step
    logged twice keeps its newest record.

    Raises:
        SystemExit: the file does not exist or a line before the last is not JSON (the message names file
            and line); a last line that is not JSON (a run killed mid-write) is left out with a warning.
    """
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"error: {path}: no such metrics file")
    train: dict[int, dict] = {}
    evals: dict[int, dict] = {}
    lines = path.read_text().splitlines()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            if n == len(lines):  # a run killed while it wrote its last record: the records before it stand
                print(
                    f"warning: {path} line {n}: not JSON ({exc.msg}), the last line, cut short: left out",
                    file=sys.stderr,
                )
                break
            raise SystemExit(f"error: {path} line {n}: not JSON ({exc.msg})") from None
        if rec.get("event") == "train" and "step" in rec:
            train[int(rec["step"])] = rec
        elif rec.get("event") == "eval" and "step" in rec:
            evals[int(rec["step"])] = rec
    return dict(sorted(train.items())), dict(sorted(evals.items()))


def _series(records: dict[int, dict], *keys: str, scale: float = 1.0) -> tuple[list[int], list[float]]:
    steps, values = [], []
    for step, rec in records.items():
        value = next((rec[k] for k in keys if isinstance(rec.get(k), (int, float))), None)
        if value is not None:
            steps.append(step)
            values.append(value * scale)
    return steps, values


def figure(paths: list[str | Path], labels: list[str] | None = None):
    """The figure of the runs of `paths`: one row of panels (`PANELS`, the throughput one named after its unit:
    tokens/s, or samples/s when no run counts tokens), one line per run in each.

    Args:
        paths: ``metrics.jsonl`` files or run folders.
        labels: one legend label per run (default: the run folder's name, or the file's stem).

    Returns:
        A ``matplotlib.figure.Figure``; its axes' titles name the panels.

    Raises:
        SystemExit: a missing or malformed file, or labels given but not one per run.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if labels is not None and len(labels) != len(paths):
        raise SystemExit(f"error: {len(labels)} labels for {len(paths)} runs")
    runs = [read_run(p) for p in paths]
    names = labels or [Path(p).name if Path(p).is_dir() else Path(p).stem for p in paths]
    fig, axes = plt.subplots(1, len(PANELS), figsize=(4.2 * len(PANELS), 3.6), constrained_layout=True)
    unit = next((u for key, old, u in THROUGHPUT for train, _ in runs if _series(train, key, old)[0]), "tokens/s")
    key, old, _ = next(t for t in THROUGHPUT if t[2] == unit)
    ax_loss, ax_lr, ax_tput, ax_mfu, ax_mem = axes
    for (train, evals), name, color in zip(runs, names, plt.rcParams["axes.prop_cycle"].by_key()["color"] * 10):
        ax_loss.plot(*_series(train, "loss"), color=color, label=name)
        eval_steps, eval_loss = _series(evals, "eval/loss")
        if eval_steps:
            ax_loss.plot(eval_steps, eval_loss, "o", color=color, label=f"{name} (eval)")
        ax_lr.plot(*_series(train, "lr"), color=color, label=name)
        ax_tput.plot(*_series(train, key, old), color=color, label=name)
        ax_mfu.plot(*_series(train, "mfu", scale=100.0), color=color, label=name)
        if _series(train, "mem_allocated_gib")[0]:
            ax_mem.plot(*_series(train, "mem_allocated_gib"), color=color, label=f"{name} allocated")
            ax_mem.plot(*_series(train, "mem_reserved_gib"), "--", color=color, label=f"{name} reserved")
        else:
            ax_mem.plot(*_series(train, "rss_gib"), color=color, label=f"{name} resident (CPU)")
    for ax, title in zip(axes, [PANELS[0], PANELS[1], f"{unit} per device", PANELS[3], PANELS[4]]):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if any(len(line.get_xdata()) for line in ax.lines):
            ax.legend(fontsize="small")
        else:
            ax.text(
                0.5,
                0.5,
                "not in these runs" + ("\n(MFU is measured on GPUs)" if title == PANELS[3] else ""),
                ha="center",
                va="center",
                transform=ax.transAxes,
            )
    return fig


def plot(paths: list[str | Path], out: str | Path, labels: list[str] | None = None) -> list[str]:
    """Draw the runs of `paths` (`figure`) into the PNG `out` (its folder is created).

    Returns:
        The panels' titles, in order.
    """
    import matplotlib.pyplot as plt

    fig = figure(paths, labels)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return [ax.get_title() for ax in fig.axes]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="metrics.jsonl files or run output folders")
    parser.add_argument("-o", "--output", default="metrics.png", help="the PNG to write (default metrics.png)")
    parser.add_argument("--labels", nargs="+", help="one legend label per run")
    args = parser.parse_args(argv)
    plot(args.runs, args.output, args.labels)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
