"""Where one training step's GPU time goes.

`profile_step(fn)` runs `fn` once under torch.profiler and returns the device kernels it
launched; `summarize(kernels)` splits the step's window (first kernel start to last kernel
end) into
  compute   time some non-communication kernel runs,
  exposed   time only communication kernels run (nothing hides them),
  idle      time no kernel runs at all (the GPU waits for the host),
and adds per-category kernel time and the costliest kernels. The interval arithmetic is pure
(tests/unit/test_step_profile.py checks it on hand-made kernels), so it runs anywhere;
profiling itself needs a CUDA device (on CPU there are no device kernels to find).
"""

from __future__ import annotations

import gzip
import json
import os
import tempfile
from collections import defaultdict
from dataclasses import dataclass

# Substrings of kernel names, first match wins (names lower-cased). NCCL first: its kernels
# are communication whatever else their names contain.
CATEGORIES = (
    ("comm", ("nccl",)),
    # Inductor's generated pointwise and reduction kernels: their names list the ops they
    # fused, so one that quantizes a GEMM's operand says "_scaled_mm" and must not count as
    # a GEMM (an earlier profile of block scaling did, and overstated its GEMM time).
    ("triton", ("triton_poi_", "triton_red_", "triton_per_")),
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "scaled_mm", "sm90_")),
    ("optimizer", ("multi_tensor", "adam")),
    ("triton", ("triton",)),
    ("copy", ("copy", "cat", "split", "memcpy", "memset", "fill")),
)


@dataclass(frozen=True)
class Kernel:
    name: str
    start_us: float
    end_us: float
    stream: int = 0

    @property
    def dur_us(self) -> float:
        return self.end_us - self.start_us


def category(name: str) -> str:
    lowered = name.lower()
    for label, needles in CATEGORIES:
        if any(n in lowered for n in needles):
            return label
    return "other"


def merge_intervals(intervals) -> list[tuple[float, float]]:
    """Sorted, disjoint union of (start, end) pairs."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def union_length(intervals) -> float:
    return sum(e - s for s, e in merge_intervals(intervals))


def summarize(kernels: list[Kernel], top: int = 20) -> dict:
    """Split the step window into compute / exposed communication / idle; totals per category."""
    if not kernels:
        raise ValueError("no device kernels were recorded: profile on a CUDA device, after warm-up")
    window = max(k.end_us for k in kernels) - min(k.start_us for k in kernels)
    busy = union_length((k.start_us, k.end_us) for k in kernels)
    compute = union_length((k.start_us, k.end_us) for k in kernels if category(k.name) != "comm")
    comm = union_length((k.start_us, k.end_us) for k in kernels if category(k.name) == "comm")
    per_category: dict[str, float] = defaultdict(float)
    per_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for k in kernels:
        per_category[category(k.name)] += k.dur_us
        per_kernel[k.name][0] += k.dur_us
        per_kernel[k.name][1] += 1
    costliest = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "window_ms": window / 1e3,
        "compute_ms": compute / 1e3,
        "exposed_comm_ms": (busy - compute) / 1e3,
        "idle_ms": (window - busy) / 1e3,
        "comm_ms": comm / 1e3,
        "kernels": len(kernels),
        "streams": len({k.stream for k in kernels}),
        "per_category_ms": {c: t / 1e3 for c, t in sorted(per_category.items(), key=lambda kv: -kv[1])},
        "costliest": [{"name": n, "ms": t / 1e3, "count": int(c)} for n, (t, c) in costliest],
    }


def format_summary(title: str, summary: dict) -> str:
    s = summary
    lines = [
        f"#### {title}",
        f"window {s['window_ms']:.1f} ms = compute {s['compute_ms']:.1f} + exposed comm {s['exposed_comm_ms']:.1f}"
        f" + idle {s['idle_ms']:.1f}; comm kernels {s['comm_ms']:.1f} ms in all;"
        f" {s['kernels']} kernels on {s['streams']} streams",
        "by category (kernel ms, overlapping streams counted separately): "
        + ", ".join(f"{c} {t:.1f}" for c, t in s["per_category_ms"].items()),
        "",
        "| kernel | ms | count |",
        "|---|---|---|",
    ]
    lines += [f"| {k['name'][:160]} | {k['ms']:.2f} | {k['count']} |" for k in s["costliest"]]
    return "\n".join(lines)


def kernels_from_chrome_trace(trace: dict) -> list[Kernel]:
    """Device kernels (and GPU memcpy/memset) of a torch.profiler chrome trace."""
    kernels = []
    for event in trace.get("traceEvents", []):
        if event.get("ph") != "X" or event.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        start = float(event["ts"])
        kernels.append(Kernel(event.get("name", "?"), start, start + float(event.get("dur", 0.0)),
                              int(event.get("args", {}).get("stream", 0))))
    return kernels


def profile_step(fn, trace_path: str | None = None) -> list[Kernel]:
    """Run `fn()` once under torch.profiler (CUDA activity); its kernels. `trace_path` (.json.gz)
    keeps the chrome trace for a viewer."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        raw = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(raw)
        with open(raw) as f:
            trace = json.load(f)
        if trace_path:
            with open(raw, "rb") as src, gzip.open(trace_path, "wb") as dst:
                dst.write(src.read())
    return kernels_from_chrome_trace(trace)
