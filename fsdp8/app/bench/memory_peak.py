"""What is alive at a step's memory peak, by where it was allocated.

`record_step(fn)` runs `fn` once with the CUDA caching allocator's history recorded and
returns the trace; `live_at_peak(events, baseline)` replays the trace's allocations and
frees and returns the peak (bytes over what was allocated before the step, plus that
baseline) and the blocks alive at that moment; `format_peak` groups them by their innermost
frames of fsdp8, torch or transformers. The replay is pure (tests/unit/test_memory_peak.py
checks it on hand-made events), so it runs anywhere; recording needs a CUDA device.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Dict, List, Tuple

GIB = 1024**3
_KEEP = ("fsdp8", "torch/", "transformers", "torchao", "benchmarks")


def record_step(fn: Callable[[], object]) -> Tuple[list, int]:
    """(the device trace of one call of ``fn``, bytes allocated before it)."""
    import torch

    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    try:
        fn()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    device = torch.cuda.current_device()
    return snapshot["device_traces"][device], baseline


def live_at_peak(events: List[dict], baseline: int) -> Tuple[int, List[dict]]:
    """(peak allocated bytes, the alloc events of the blocks alive then). A block allocated
    before recording and freed during it lowers the running total when freed."""
    live: Dict[int, dict] = {}
    total = best = baseline
    best_live: List[dict] = []
    for e in events:
        action = e.get("action")
        if action == "alloc":
            live[e["addr"]] = e
            total += e["size"]
            if total > best:
                best, best_live = total, list(live.values())
        elif action == "free_completed":
            live.pop(e["addr"], None)
            total -= e["size"]
    return best, best_live


def _where(frames: List[dict], depth: int) -> str:
    kept = [f for f in frames if any(k in f.get("filename", "") for k in _KEEP)]
    return " <- ".join(f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']} {f['name']}" for f in kept[:depth]) or "?"


def format_peak(title: str, peak: int, blocks: List[dict], baseline: int, top: int = 15, depth: int = 3) -> str:
    groups: Dict[str, List[int]] = defaultdict(lambda: [0, 0])
    for b in blocks:
        g = groups[_where(b.get("frames", []), depth)]
        g[0] += b["size"]
        g[1] += 1
    lines = [f"#### {title}: peak {peak / GIB:.2f} GiB = {baseline / GIB:.2f} before the step + "
             f"{(peak - baseline) / GIB:.2f} allocated in it and alive at the peak", "",
             "| GiB | blocks | allocated at |", "|---|---|---|"]
    for where, (size, count) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"| {size / GIB:.3f} | {count} | {where} |")
    return "\n".join(lines)
