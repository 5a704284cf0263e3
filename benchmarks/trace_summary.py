"""Where one profiled step's GPU time goes: a torch.profiler Chrome trace (``train.profile_step``'s
``profile/trace_rank0.json``) summed by kind of kernel, with the GPU's busy and idle time over the step.

    python benchmarks/trace_summary.py outputs/run/profile/trace_rank0.json [--json out.json]

Kinds are matched on kernel names (first match wins; ``other`` for the rest; attention first, since
FlashAttention's kernel names hold ``cutlass`` too). Also the 15 kernels with the most time, and the idle
gaps of 1 ms or more (the host not keeping up, or a synchronisation). ``--host``: where the host's time goes,
per thread (forward on the main thread, backward on autograd's), as exclusive time per operator or annotation
(an event's length less its children's; FSDP2's hooks are annotated ``FSDP::...``). Times in ms.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict

KINDS = [  # (kind, pattern on the kernel name)
    ("attention", r"flash|fmha|attention"),
    ("matmul", r"gemm|cutlass|nvjet|xmma|sm90_|cublas|wgmma"),
    ("optimizer", r"adam|multi_tensor|foreach"),
    ("communication", r"nccl"),
    ("compiled (triton)", r"^triton_|triton"),
    ("cross entropy / softmax", r"softmax|cross_entropy|nll|log_softmax"),
    ("copy / cast", r"copy|cast|cat|convert|memcpy|memset|fill"),
    ("reduction", r"reduce|norm|sum"),
    ("elementwise (eager)", r"elementwise|vectorized|unrolled"),
]


def summarize(path: str) -> dict:
    """{"kinds": {kind: [ms, kernels]}, "busy_ms", "span_ms", "idle_ms", "top": [[name, ms, kernels]],
    "gaps_over_1ms": [count, ms]} of the device events in `path`."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    kinds: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    names: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in kernels:
        name = e["name"] if e["cat"] == "kernel" else e["cat"]
        kind = next((k for k, pat in KINDS if re.search(pat, name, re.I)), "other")
        for acc in (kinds[kind], names[name[:160]]):
            acc[0] += e["dur"] / 1e3
            acc[1] += 1
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in kernels)
    busy, end = 0.0, float("-inf")
    gaps = [0, 0.0]
    for s, t in spans:  # union of the intervals (kernels on several streams overlap)
        if end > float("-inf") and s - end >= 1e3:
            gaps[0] += 1
            gaps[1] += (s - end) / 1e3
        if t > end:
            busy += t - max(s, end)
            end = t
    span = (spans[-1][1] - spans[0][0]) if spans else 0.0
    return {
        "kinds": dict(sorted(kinds.items(), key=lambda kv: -kv[1][0])),
        "busy_ms": busy / 1e3,
        "span_ms": span / 1e3,
        "idle_ms": (span - busy) / 1e3,
        "gaps_over_1ms": gaps,
        "top": [[n, ms, k] for n, (ms, k) in sorted(names.items(), key=lambda kv: -kv[1][0])[:15]],
    }


def host_summary(path: str, top: int = 25) -> dict:
    """{tid: {"busy_ms", "events", "top": [[name, exclusive ms, calls]]}} of the CPU-side events in `path`."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    cpu = sorted(
        (
            e
            for e in events
            if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver")
        ),
        key=lambda e: (e["tid"], e["ts"], -e["dur"]),
    )
    out: dict = {}
    for tid in {e["tid"] for e in cpu}:
        names: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
        stack: list[list] = []  # [end, name, children's time]
        busy = 0.0

        def close(item):
            names[item[1][:120]][0] += (item[3] - item[2]) / 1e3
            if stack:
                stack[-1][2] += item[3]

        for e in (e for e in cpu if e["tid"] == tid):
            while stack and e["ts"] >= stack[-1][0]:
                close(stack.pop())
            if not stack:
                busy += e["dur"]
            names[e["name"][:120]][1] += 1
            stack.append([e["ts"] + e["dur"], e["name"], 0.0, e["dur"]])
        while stack:
            close(stack.pop())
        out[str(tid)] = {
            "busy_ms": busy / 1e3,
            "events": sum(n for _, n in names.values()),
            "top": [[n, ms, k] for n, (ms, k) in sorted(names.items(), key=lambda kv: -kv[1][0])[:top]],
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace")
    p.add_argument("--json", help="also write the summary here")
    p.add_argument("--host", action="store_true", help="also the host's time per thread and operator")
    a = p.parse_args()
    s = summarize(a.trace)
    if a.host:
        s["host"] = host_summary(a.trace)
    print(
        f"{a.trace}: span {s['span_ms']:.1f} ms, GPU busy {s['busy_ms']:.1f} ms, idle {s['idle_ms']:.1f} ms "
        f"({s['gaps_over_1ms'][0]} gaps of 1 ms or more: {s['gaps_over_1ms'][1]:.1f} ms)"
    )
    for kind, (ms, n) in s["kinds"].items():
        print(f"  {kind:26s} {ms:9.1f} ms  {n:6d} kernels")
    for tid, h in s.get("host", {}).items():
        print(f"host thread {tid}: busy {h['busy_ms']:.1f} ms, {h['events']} events; exclusive time:")
        for name, ms, n in h["top"]:
            print(f"  {ms:8.1f} ms {n:7d}  {name}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(s, f, indent=1)


if __name__ == "__main__":
    main()
