"""Training metrics: throughput, MFU, memory; `MetricsLogger.log_step` reduces a window over ranks and writes one
record (rank 0) to the console, ``<out_dir>/metrics.jsonl``, the progress bar and the ``trackers`` (docs/outputs.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import psutil
import torch
import torch.distributed as dist

from cookbook import push
from cookbook.config import save_config, to_dict
from cookbook.dist import DistInfo, all_reduce_sum, get_logger
from cookbook.errors import EXIT_USER_ERROR, LAUNCH_TIME_ENV, OneLineError
from cookbook.progress import ProgressBar
from cookbook.requirements import check_trackers
from cookbook.trackers import SINKS, MLflowSink, Sink, redact_uri


def shown(values: Mapping[str, Any], sep: str = " ") -> str:
    """``name value`` pairs for a log line: a whole number of 2 or more as an integer, another number to 4 decimals."""
    return sep.join(
        f"{k} {v:.0f}"
        if float(v).is_integer() and abs(v) >= 2
        else f"{k} {v:.4f}"
        if isinstance(v, float)
        else f"{k} {v}"
        for k, v in values.items()
    )


def launch_time() -> float:
    """The Unix time (s) this run was launched: ``COOKBOOK_LAUNCH_TIME`` if a number, else this process's start."""
    try:
        return float(os.environ.get(LAUNCH_TIME_ENV, ""))
    except ValueError:
        return psutil.Process().create_time()


# Dense bf16 tensor-core peak, FLOP/s: NVIDIA's A10, A100, H100 and H200 data sheets (half their sparse figures); the
# first entry whose words are all in the GPU's name counts (an H100/H200 without NVL/PCIe is SXM).
_PEAK_BF16_FLOPS = (
    ("H200 NVL", 835e12),
    ("H200", 989e12),
    ("H100 NVL", 835e12),
    ("H100 PCIE", 756e12),
    ("H100", 989e12),
    ("A100", 312e12),
    ("A10", 125e12),
)


def peak_bf16_flops(device_name: str) -> float | None:
    """Peak dense bf16 FLOP/s of the GPU `device_name`, None if not in the table; ``COOKBOOK_PEAK_TFLOPS`` (TFLOP/s)
    overrides it."""
    override = os.environ.get("COOKBOOK_PEAK_TFLOPS")
    if override:
        return float(override) * 1e12
    name = device_name.upper()
    return next((peak for chip, peak in _PEAK_BF16_FLOPS if all(w in name for w in chip.split())), None)


def count_parameters(model: torch.nn.Module, exclude_embeddings: bool = True) -> int:
    """Number of parameters, by default without ``nn.Embedding``'s (no matrix FLOPs: Kaplan et al. 2020, section
    2.1). Tied parameters count once (`model.parameters()` yields each once); shards, ZeRO-3 partitions at full size."""
    skip = {
        id(p)
        for m in model.modules()
        if exclude_embeddings and isinstance(m, torch.nn.Embedding)
        for p in m.parameters(recurse=False)
    }
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if id(p) not in skip)  # ZeRO-3: numel 0


@dataclass(frozen=True)
class ModelFlops:
    """FLOPs per token of a training step: ``6 * N + 12 * L * d * T`` (PaLM, Chowdhery et al. 2022, appendix B), N
    `num_params` (non-embedding), L `num_layers`, d `attn_width` (heads x head dim), T the sequence length."""

    num_params: int
    num_layers: int
    attn_width: int

    def per_token(self, seq_len: float) -> float:
        """FLOPs per token at sequence length `seq_len` (tokens)."""
        return 6.0 * self.num_params + 12.0 * self.num_layers * self.attn_width * seq_len


def mfu(tokens_per_s_per_device: float, flops_per_token: float, peak_flops: float) -> float:
    """Model FLOPs utilisation (0-1): model FLOP/s over the peak (PaLM, Chowdhery et al. 2022, section 4.1)."""
    return tokens_per_s_per_device * flops_per_token / peak_flops


class MetricsWriteError(OneLineError, OSError):
    """``metrics.jsonl`` could not be written (disk full, I/O error): exit status 2; ``errno`` is the OS error's."""

    exit_status = EXIT_USER_ERROR


def _append_line(path: Path, line: str) -> None:
    """Append `line` to `path` whole or not at all (else MetricsWriteError, `path` cut back to its old size)."""
    data = line.encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)
            err = MetricsWriteError(
                f"cannot write {path}: {exc.strerror or exc} (the disk is full or a file-size "
                f"limit is reached); free space, then run the same command again to resume"
            )
            err.errno = exc.errno
            raise err from exc
    finally:
        os.close(fd)


def _cut_torn_line(path: Path) -> int:
    """Cut a torn last line (no final newline, or not JSON) from the JSONL file `path`, warning; returns bytes cut."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 65536))
            tail = f.read()
    except FileNotFoundError:
        return 0
    if not tail:
        return 0
    whole = tail.endswith(b"\n")
    start = (tail[:-1] if whole else tail).rfind(b"\n") + 1
    if whole:
        try:
            json.loads(tail[start:])
            return 0
        except ValueError:
            pass
    cut = len(tail) - start
    os.truncate(path, size - cut)
    get_logger().warning(f"{path}: cut its torn last line ({cut} bytes, a crash mid-write)")
    return cut


class MetricsLogger:
    """Per-step metrics for a distributed run (keys and sinks: docs/outputs.md); `log_step` is collective. `flops`:
    for MFU; `params`: the config (its ``trackers`` and ``checkpoint.push_to_hub`` are read); `mlflow` False turns
    MLflow off; `count_tokens` False leaves out ``tokens_per_s*``. Raises ConfigError: an unknown or missing tracker;
    MetricsWriteError (rank 0): ``metrics.jsonl`` could not be written."""

    def __init__(
        self,
        out_dir: str | Path,
        info: DistInfo,
        flops: ModelFlops | None = None,
        run_name: str = "run",
        experiment: str = "cookbook",
        params: Mapping[str, Any] | None = None,
        mlflow: bool = True,
        max_steps: int | None = None,
        count_tokens: bool = True,
        trackers: Sequence[str] | None = None,
        progress: bool = True,
    ):
        self.params = dict(params or {})
        names = self.params.get("trackers", ["mlflow"]) if trackers is None else trackers
        self.trackers = [t for t in dict.fromkeys(names) if mlflow or t != "mlflow"]
        check_trackers(self.trackers)
        self.out_dir, self.info, self.flops, self.max_steps = Path(out_dir), info, flops, max_steps
        self.count_tokens = count_tokens
        self.jsonl_path = self.out_dir / "metrics.jsonl"
        self._peak = peak_bf16_flops(torch.cuda.get_device_name(info.device)) if info.device.type == "cuda" else None
        self._sinks: list[Sink] = []
        if info.is_main:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            _cut_torn_line(self.jsonl_path)
            self._sinks = [SINKS[name](self.out_dir, run_name, experiment, self.params) for name in self.trackers]
        self._mlflow = next((k for k in self._sinks if isinstance(k, MLflowSink)), None)
        self._progress = progress
        self._bar: ProgressBar | None = None
        self.last_train: dict[str, float] = {}  # the newest train record (`log_step`)
        self.timings: dict[str, float] = {}  # startup_s, first_step_s (`first_step_done`): this rank's
        self._unit = "gpu" if info.device.type == "cuda" else "rank"  # what one device is, for the console
        self._reset_window(step=None)
        self._t_loop = time.perf_counter()  # the loop's start (`start`)

    @classmethod
    def for_run(cls, cfg: Any, info: DistInfo, *, experiment: str, **kwargs) -> MetricsLogger:
        """The run's logger in ``cfg.output_dir`` (run name, config as params, MLflow switch from `cfg`), after rank 0
        writes the resolved ``config.yaml`` there; `kwargs` as for the constructor."""
        out = Path(cfg.output_dir)
        if info.is_main:
            out.mkdir(parents=True, exist_ok=True)
            save_config(cfg, out / "config.yaml")
        return cls(
            out, info, run_name=cfg.run_name, experiment=experiment, params=to_dict(cfg), mlflow=cfg.mlflow, **kwargs
        )

    @property
    def mlflow_uri(self) -> str | None:
        """Where the MLflow run lives, secrets masked (`redact_uri`); None off rank 0 or when tracking is off."""
        return redact_uri(self._mlflow.tracking_uri) if self._mlflow and self._mlflow.enabled else None

    @property
    def mlflow_run_id(self) -> str | None:
        return self._mlflow.run_id if self._mlflow and self._mlflow.enabled else None

    def tracker_lines(self) -> list[tuple[str, str]]:
        """``(tracker name, where its run is and the command that shows it)`` for each tracker still on (rank 0)."""
        return [(sink.name, sink.where()) for sink in self._sinks if sink.enabled]

    def _reset_window(self, step: int | None) -> None:
        self._last_step = step
        self._last_time = time.perf_counter()
        self._samples = 0
        self._tokens: torch.Tensor | int = 0
        self._data_wait = 0.0
        self._pass_wait = -1.0  # the wait for the first batch of a pass that began in this window; -1: none

    def start(self, step: int) -> None:
        """Mark the start of timing at `step` (call just before the loop, also after a resume)."""
        if self.info.device.type == "cuda":
            torch.cuda.synchronize(self.info.device)
            torch.cuda.reset_peak_memory_stats(self.info.device)
        if self.info.is_main and self._progress:
            if self._bar is not None:
                self._bar.close()
            self._bar = ProgressBar(self.max_steps, step, unit=self._unit)
        self._reset_window(step)
        self._t_loop = time.perf_counter()

    def first_step_done(self) -> dict[str, float]:
        """Note the end of the first optimizer step (no collective): sets and returns `timings` ``startup_s`` (from
        `launch_time`) and ``first_step_s`` (from `start`); rank 0 logs them."""
        if self.info.device.type == "cuda":
            torch.cuda.synchronize(self.info.device)  # the step's kernels, not just their launch
        first = time.perf_counter() - self._t_loop
        self.timings.update(startup_s=max(0.0, time.time() - launch_time()), first_step_s=first)
        if self.info.is_main:
            get_logger().info(
                f"first step done {self.timings['startup_s']:.1f} s after the launch (set-up "
                f"{self.timings['startup_s'] - first:.1f} s, the step itself {first:.1f} s)"
            )
        return self.timings

    def note_pass_start(self, wait_s: float) -> None:
        """A pass over the data began, its first batch after `wait_s` s: the record's ``epoch_start_wait_s`` (max)."""
        self._pass_wait = max(self._pass_wait, float(wait_s))

    def advance(self, step: int) -> None:
        """Move rank 0's progress bar to `step` (optimizer steps done; call after every step). No collective."""
        if self._bar is not None:
            self._bar.advance(step)

    @contextlib.contextmanager
    def paused(self):
        """Leave the time spent inside out of the window's step time, throughput and ETA."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._last_time += time.perf_counter() - t0

    def add(self, samples: int, tokens: int | torch.Tensor, data_wait_s: float) -> None:
        """Count one micro-batch on this rank: `samples`, `tokens` (a device tensor: no sync), `data_wait_s` (s)."""
        self._samples += samples
        self._tokens = self._tokens + (tokens.detach() if isinstance(tokens, torch.Tensor) else tokens)
        self._data_wait += data_wait_s

    def log_step(
        self,
        step: int,
        loss: float | torch.Tensor,
        lr: float,
        grad_norm: float | torch.Tensor | None,
        extra: Mapping[str, float | torch.Tensor] | None = None,
    ) -> dict[str, float]:
        """Reduce this window over ranks and write one train record (returned on every rank). `loss`: this rank's
        window mean; `grad_norm`: before clipping; `extra`: more numbers averaged over ranks."""
        dev, cuda = self.info.device, self.info.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(dev)
        steps = max(1, step - (self._last_step if self._last_step is not None else step - 1))
        elapsed = time.perf_counter() - self._last_time
        peaks = [
            torch.cuda.max_memory_allocated(dev) / 2**30 if cuda else 0.0,
            torch.cuda.max_memory_reserved(dev) / 2**30 if cuda else 0.0,
            psutil.Process().memory_info().rss / 2**30,
            elapsed,
            self._pass_wait,
        ]
        mem = torch.tensor(peaks, dtype=torch.float64, device=dev)
        sums = [loss, self._tokens, float(self._samples), self._data_wait, *(extra or {}).values()]
        loss_sum, tok, samples, wait, *extra_sums = all_reduce_sum(dict(enumerate(sums)), dev).values()
        if dist.is_initialized():
            dist.all_reduce(mem, op=dist.ReduceOp.MAX)
        alloc, reserved, rss, elapsed, pass_wait = mem.tolist()
        world = self.info.world_size
        rec: dict[str, float] = {"step": step, "loss": loss_sum / world, "lr": float(lr)}
        if grad_norm is not None:
            rec["grad_norm"] = float(grad_norm)
        rec.update({k: v / world for k, v in zip(extra or {}, extra_sums)})
        rec.update(step_time_s=elapsed / steps, samples_per_s=samples / elapsed)
        if self.count_tokens:
            rec["tokens_per_s"] = tok / elapsed
        rec["samples_per_s_per_device"] = samples / elapsed / world
        if self.count_tokens:
            rec["tokens_per_s_per_device"] = tok / elapsed / world
        if self.flops is not None and self._peak is not None and samples > 0 and self.count_tokens:
            rec["mfu"] = mfu(tok / elapsed / world, self.flops.per_token(tok / samples), self._peak)
        if cuda:
            rec.update(mem_allocated_gib=alloc, mem_reserved_gib=reserved)
        rec["rss_gib"] = rss
        rec["data_wait_s"] = wait / world / steps
        rec["data_wait_frac"] = min(1.0, wait / world / elapsed) if elapsed > 0 else 0.0
        if pass_wait >= 0:
            rec["epoch_start_wait_s"] = pass_wait
        self._emit("train", rec)
        self._console(rec)
        self._reset_window(step)
        self.last_train = rec
        return rec

    def log_eval(self, step: int, metrics: Mapping[str, float]) -> None:
        """Write evaluation metrics (already reduced across ranks) as ``eval/<name>``."""
        rec = {"step": step, **{f"eval/{k}": float(v) for k, v in metrics.items()}}
        self._emit("eval", rec)
        get_logger().info("eval  step %d | %s", step, shown(metrics, " | "))

    def log_summary(self, summary: Mapping[str, Any]) -> None:
        """Write the final ``summary`` record; then on rank 0, with ``checkpoint.push_to_hub`` set, upload the export
        it names (the first of `cookbook.push.PUSHED`) with a model card. Raises HubPushError: the upload failed."""
        self._emit("summary", dict(summary), mlflow=False)
        repo_id = (self.params.get("checkpoint") or {}).get("push_to_hub") if self.info.is_main else None
        folder = next((summary[k] for k in push.PUSHED if summary.get(k)), None)
        if repo_id and folder:
            numbers = {
                "steps": float(summary.get("step", self.last_train.get("step", 0))),
                **({"train/loss": self.last_train["loss"]} if "loss" in self.last_train else {}),
                **{k: float(v) for k, v in summary.items() if k.startswith("eval/") and isinstance(v, (int, float))},
            }
            url = push.push_to_hub(repo_id, folder, self.params, numbers)
            get_logger().info(f"{'hub:':<12} {url} ({folder} with its model card)")

    def _emit(self, event: str, rec: Mapping[str, Any], mlflow: bool = True) -> None:
        if not self.info.is_main:
            return
        _append_line(self.jsonl_path, json.dumps({"event": event, "time": time.time(), **rec}) + "\n")
        if mlflow:
            numbers = {k: v for k, v in rec.items() if k != "step" and isinstance(v, (int, float))}
            for sink in self._sinks:
                sink.log(numbers, int(rec["step"]))

    def _console(self, rec: Mapping[str, float]) -> None:
        if not self.info.is_main:
            return
        step = int(rec["step"])
        head = f"step {step}" + (f"/{self.max_steps}" if self.max_steps else "")
        parts = [head, f"loss {rec['loss']:.4f}", f"lr {rec['lr']:.2e}"]
        if "grad_norm" in rec:
            parts.append(f"gnorm {rec['grad_norm']:.2f}")
        parts += [
            f"{rec['step_time_s'] * 1000:.0f} ms/step",
            f"{rec['samples_per_s_per_device']:.1f} samples/s/{self._unit}",
        ]
        if self.count_tokens:
            parts.append(f"{rec['tokens_per_s_per_device']:,.0f} tok/s/{self._unit}")
        if "mfu" in rec:
            parts.append(f"mfu {rec['mfu'] * 100:.1f}%")
        if "mem_allocated_gib" in rec:
            parts.append(f"mem {rec['mem_allocated_gib']:.1f}/{rec['mem_reserved_gib']:.1f} GiB")
        else:
            parts.append(f"rss {rec['rss_gib']:.2f} GiB")
        parts.append(f"data {rec['data_wait_frac'] * 100:.0f}%")
        if self.max_steps and step < self.max_steps:
            eta = rec["step_time_s"] * (self.max_steps - step)
            parts.append(f"eta {eta / 60:.1f} min" if eta >= 60 else f"eta {eta:.0f} s")
        get_logger().info(" | ".join(parts))
        if self._bar is not None:
            self._bar.show(rec)

    def close(self, failed: bool = False, stopped: bool = False) -> None:
        """Close the progress bar and end the trackers' runs: FAILED (`failed`), KILLED (`stopped`), else FINISHED."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        for sink in self._sinks:
            sink.close("FAILED" if failed else "KILLED" if stopped else "FINISHED")


class StepProfiler:
    """Profile the 1-based `step` (0 or less: off) with ``torch.profiler``; rank r writes ``<out_dir>/profile/``
    ``trace_rank<r>.json`` (Perfetto) and ``ops_rank<r>.txt`` (the 40 operators with the most device time)."""

    def __init__(self, step: int, out_dir: str | Path, info: DistInfo):
        self.step, self.dir, self.info = step, Path(out_dir) / "profile", info
        self._prof: torch.profiler.profile | None = None

    def start(self, step: int) -> None:
        """Start profiling if `step` (the step about to run) is the one asked for."""
        if self.step > 0 and step == self.step:
            activities = [torch.profiler.ProfilerActivity.CPU] + (
                [torch.profiler.ProfilerActivity.CUDA] if self.info.device.type == "cuda" else []
            )
            self._prof = torch.profiler.profile(activities=activities, record_shapes=True)
            self._prof.start()

    def stop(self) -> None:
        """Stop a running profile and write its files."""
        if self._prof is None:
            return
        if self.info.device.type == "cuda":
            torch.cuda.synchronize()
        self._prof.stop()
        self.dir.mkdir(parents=True, exist_ok=True)
        self._prof.export_chrome_trace(str(self.dir / f"trace_rank{self.info.rank}.json"))
        sort = "self_device_time_total" if self.info.device.type == "cuda" else "self_cpu_time_total"
        table = self._prof.key_averages().table(sort_by=sort, row_limit=40, max_name_column_width=90)
        (self.dir / f"ops_rank{self.info.rank}.txt").write_text(table)
        get_logger().info(f"profile of step {self.step}: {self.dir}")
        self._prof = None
