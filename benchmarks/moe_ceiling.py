"""Throughput ceiling of a mixture-of-experts decoder on one GPU, per transformers experts implementation.

What it measures: forward + backward of a causal LM built from a config (by default the Qwen3-30B-A3B
architecture of ``recipes/moe-lora-fsdp2-ep/models/qwen3-30b-a3b/config.json``: 48 layers, 128 experts,
top-8), random init made directly on the device in bf16 (no hub, no checkpoint). Every base weight is
frozen and only the input embeddings' output requires grad (``enable_input_require_grads``), so backward
computes the activation gradients through every layer, as LoRA training does, and no weight gradient.
No activation checkpointing, no optimizer, no communication: this is what one GPU can do with
transformers' own expert kernels, the ceiling against which ``recipes/moe-lora-fsdp2-ep`` is compared.

For each ``--experts`` setting (transformers' ``experts_implementation``: ``grouped_mm`` runs each
layer's experts as grouped GEMMs, ``eager`` loops over the experts that received tokens), the same
model (switched with ``set_experts_implementation``) runs ``--warmup`` untimed steps and then
``--steps`` steps, each timed between ``torch.cuda.synchronize()`` calls, on the same random token ids
(``--tokens`` tokens per step, as rows of ``--seq-len``).

    python benchmarks/moe_ceiling.py --experts grouped_mm eager --out moe-ceiling.jsonl \\
        --profile moe-ceiling-profile.txt

Output: one line per setting on stdout and one JSON object per setting appended to ``--out``, with
``tokens_per_s`` (tokens per second, from the mean step time), ``step_ms_mean`` / ``step_ms_min``
(milliseconds), ``peak_alloc_gib`` / ``peak_reserved_gib`` (GiB = 2**30 bytes, CUDA peak over the
setting's steps; ``null`` on CPU), ``loss_first`` (cross-entropy of the first step, nats; equal across
settings up to bf16 rounding, which checks that the settings compute the same model), ``active_params``,
``flops_per_token`` and ``mfu_pct`` (``null`` on a device without a known peak).

MFU counts FLOPs over the *active* parameters: all non-embedding parameters except that each routed
expert layer contributes top-k / E of its expert weights (the recipe's ``moe_model.active_flops``, as the MoE
recipe counts them). FLOPs per token are ``6 N + 12 L d T`` (PaLM, Chowdhery et al. 2022, appendix B;
``cookbook.metrics.ModelFlops``) and MFU is achieved over peak FLOP/s (PaLM section 4.1;
``cookbook.metrics.mfu``), the peak being NVIDIA's dense bf16 datasheet figure
(``cookbook.metrics.peak_bf16_flops``: 989 TFLOP/s for an H200 SXM). With a frozen base the backward
skips the weight gradients (about 2 N of the 6 N), so the work done is nearer 4 N: this MFU is the
figure comparable with the recipe's logs, not the utilisation of the arithmetic units.

``--profile PATH`` runs one more step per setting under ``torch.profiler`` and writes a table of the
15 CUDA kernels with the largest total time in that step (on CPU: the 15 operators with the largest
self time).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

from cookbook.metrics import count_parameters, mfu, peak_bf16_flops

RECIPE = Path(__file__).resolve().parents[1] / "recipes/moe-lora-fsdp2-ep"
sys.path.insert(0, str(RECIPE))  # the recipe's modules
from moe_model import active_flops  # noqa: E402

DEFAULT_CONFIG = RECIPE / "models/qwen3-30b-a3b/config.json"
GIB = 2**30


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="a transformers config.json of a MoE causal LM")
    p.add_argument("--tokens", type=int, default=2 * 2048, help="tokens per step (a multiple of --seq-len)")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per row")
    p.add_argument("--experts", nargs="+", default=["grouped_mm", "eager"], help="experts_implementation settings")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per setting")
    p.add_argument("--steps", type=int, default=5, help="timed steps per setting")
    p.add_argument("--device", default="cuda", help="cuda or cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--attn", default=None, help="attn_implementation (default: transformers' choice for the model)")
    p.add_argument("--out", type=Path, default=None, help="JSONL file to append one line per setting to")
    p.add_argument("--profile", type=Path, default=None, help="text file for the top-15 kernel table of each setting")
    args = p.parse_args(argv)
    if args.seq_len <= 0 or args.tokens <= 0 or args.tokens % args.seq_len:
        p.error(f"--tokens ({args.tokens}) must be a positive multiple of --seq-len ({args.seq_len})")
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    return args


def load_config(path: Path, dtype: torch.dtype):
    """The transformers config of `path` (a config.json), with `dtype` and the KV cache off.

    Raises:
        FileNotFoundError: no file at `path`.
        ValueError: the file has no ``model_type``, or it names a model without routed experts.
    """
    raw = json.loads(Path(path).read_text())
    if "model_type" not in raw:
        raise ValueError(f"{path}: no 'model_type' key; expected a transformers config.json")
    config = AutoConfig.for_model(raw.pop("model_type"), **raw)
    if not getattr(config, "num_experts_per_tok", None):
        raise ValueError(f"{path}: 'num_experts_per_tok' missing; expected a mixture-of-experts config")
    config.use_cache = False
    config.dtype = dtype
    return config


def kernel_table(prof: torch.profiler.profile, cuda: bool, rows: int = 15) -> str:
    """Markdown table of the `rows` CUDA kernels with the largest total time in `prof` (name, calls, total
    ms, share of all kernel time); on CPU the operators with the largest self CPU time."""
    total: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    for e in prof.events():
        if cuda and e.device_type == torch.autograd.DeviceType.CUDA:
            us = e.time_range.elapsed_us()
        elif not cuda and e.device_type == torch.autograd.DeviceType.CPU:
            us = e.self_cpu_time_total
        else:
            continue
        total[e.name] += us
        calls[e.name] += 1
    whole = sum(total.values()) or 1.0
    what = "CUDA kernel" if cuda else "CPU operator (self time)"
    lines = [f"| {what} | calls | total ms | % of all |", "|---|---|---|---|"]
    for name, us in sorted(total.items(), key=lambda kv: -kv[1])[:rows]:
        short = name if len(name) <= 110 else name[:107] + "..."
        lines.append(f"| `{short}` | {calls[name]} | {us / 1000:.2f} | {100 * us / whole:.1f} |")
    lines.append(f"| all ({len(total)} distinct) | {sum(calls.values())} | {whole / 1000:.2f} | 100.0 |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    """Run every ``--experts`` setting; returns the records (also printed and appended to ``--out``)."""
    args = parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = getattr(torch, args.dtype)
    config = load_config(args.config, dtype)
    torch.manual_seed(args.seed)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=args.attn)
    model.requires_grad_(False)
    model.enable_input_require_grads()  # the embeddings' output requires grad: backward runs through all layers
    model.train()
    flops = active_flops(model, config)
    per_token = flops.per_token(args.seq_len)
    peak = peak_bf16_flops(torch.cuda.get_device_name(device)) if cuda and dtype == torch.bfloat16 else None
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    ids = torch.randint(0, config.vocab_size, (args.tokens // args.seq_len, args.seq_len), generator=gen).to(device)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    print(
        f"{torch.cuda.get_device_name(device) if cuda else 'cpu'} | torch {torch.__version__} | "
        f"transformers {transformers.__version__} | {count_parameters(model, exclude_embeddings=False) / 1e9:.2f} B "
        f"params, {flops.num_params / 1e9:.3f} B active non-embedding | {args.tokens} tokens/step",
        flush=True,
    )

    def step() -> float:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.item()

    records = []
    for impl in args.experts:
        model.set_experts_implementation(impl)
        if model.config._experts_implementation != impl:
            raise RuntimeError(
                f"experts_implementation {impl!r} was not applied "
                f"(model reports {model.config._experts_implementation!r})"
            )
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        loss_first = step()
        for _ in range(args.warmup - 1):
            step()
        times = []
        for _ in range(args.steps):
            sync()
            t0 = time.perf_counter()
            step()
            sync()
            times.append(time.perf_counter() - t0)
        mean_s = statistics.fmean(times)
        tps = args.tokens / mean_s
        rec = {
            "experts_implementation": impl,
            "attn_implementation": model.config._attn_implementation,
            "model_type": config.model_type,
            "layers": config.num_hidden_layers,
            "experts": config.num_experts,
            "top_k": config.num_experts_per_tok,
            "tokens_per_step": args.tokens,
            "seq_len": args.seq_len,
            "warmup": args.warmup,
            "steps": args.steps,
            "step_ms_mean": round(mean_s * 1000, 2),
            "step_ms_min": round(min(times) * 1000, 2),
            "tokens_per_s": round(tps, 1),
            "loss_first": round(loss_first, 5),
            "peak_alloc_gib": round(torch.cuda.max_memory_allocated(device) / GIB, 2) if cuda else None,
            "peak_reserved_gib": round(torch.cuda.max_memory_reserved(device) / GIB, 2) if cuda else None,
            "active_params": flops.num_params,
            "flops_per_token": per_token,
            "mfu_pct": round(100 * mfu(tps, per_token, peak), 2) if peak else None,
            "device": torch.cuda.get_device_name(device) if cuda else "cpu",
            "dtype": args.dtype,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "date": datetime.date.today().isoformat(),
        }
        records.append(rec)
        mem = f"{rec['peak_alloc_gib']} GiB peak" if cuda else "no CUDA memory"
        print(
            f"{impl:10s} {rec['step_ms_mean']:9.1f} ms/step | {tps:10,.1f} tokens/s | {mem} | "
            f"MFU {rec['mfu_pct']}% | first loss {rec['loss_first']}",
            flush=True,
        )
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            with args.out.open("a") as f:
                f.write(json.dumps(rec) + "\n")
        if args.profile:
            activities = [torch.profiler.ProfilerActivity.CPU] + (
                [torch.profiler.ProfilerActivity.CUDA] if cuda else []
            )
            with torch.profiler.profile(activities=activities) as prof:
                step()
                sync()
            args.profile.parent.mkdir(parents=True, exist_ok=True)
            with args.profile.open("a") as f:
                f.write(
                    f"## experts_implementation={impl}, {args.tokens} tokens, one step (forward + backward)\n\n"
                    f"{kernel_table(prof, cuda)}\n\n"
                )
    return records


if __name__ == "__main__":
    main(sys.argv[1:])
