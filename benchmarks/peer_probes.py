"""Extra steps of a peers.py stack, outside its timings: where the host spends its time
(cProfile), one profiled step (compute, exposed communication, idle) and what is alive at
the step's memory peak. Each takes the stack's ``step`` and writes under ``out_dir``."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch


def host_profile(step: Callable[[], object], out_dir: str, stem: str, label: str, ctx, steps: int = 3) -> None:
    """``steps`` steps under cProfile: the Python functions that spend the host's time, by own
    time and by cumulative time, every rank's (text and pstats)."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    if ctx.device.type == "cuda":
        torch.cuda.synchronize()
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(45)
    stats.sort_stats("cumulative").print_stats(45)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # Every rank's: the slowest host sets a collective-bound step, and it need not be rank 0's.
    (out / f"{stem}-host-rank{ctx.rank}.txt").write_text(f"{label}, rank {ctx.rank}, {steps} steps\n"
                                                         + text.getvalue())
    profiler.dump_stats(str(out / f"{stem}-host-rank{ctx.rank}.pstats"))  # to compare two stacks offline


def host_syncs(step: Callable[[], object], out_dir: str, stem: str, label: str, ctx) -> None:
    """One step under ``torch.cuda.set_sync_debug_mode("warn")``: each call that made this rank's
    host wait for its GPU, with where it came from (every rank's file)."""
    import traceback
    import warnings

    seen = []

    def record(message, category, filename, lineno, file=None, line=None):
        if str(message).startswith("Synchronization debug mode is a prototype"):
            return  # what set_sync_debug_mode says of itself, not a synchronisation
        frames = [f for f in traceback.extract_stack()[:-1] if "site-packages/torch" not in f.filename]
        seen.append(f"{message}\n" + "".join(traceback.format_list(frames[-6:])))

    with warnings.catch_warnings():  # restores the filters and showwarning
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}-syncs-rank{ctx.rank}.txt").write_text(
        f"{label}, rank {ctx.rank}: {len(seen)} host synchronisations in one step\n\n" + "\n".join(seen))


def profile_one_step(step: Callable[[], object], out_dir: str, stem: str, label: str, ctx) -> None:
    """One profiled step: compute / exposed communication / idle (fsdp8/app/bench/step_profile.py)."""
    from fsdp8.app.bench.step_profile import format_summary, profile_step, summarize

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    base = out / f"{stem}-rank{ctx.rank}"
    kernels = profile_step(step, trace_path=str(base) + ".json.gz" if ctx.rank == 0 else None)
    text = format_summary(f"{label}, rank {ctx.rank} of {ctx.world}", summarize(kernels, top=ctx.args.profile_top))
    base.with_suffix(".md").write_text(text + "\n")
    if ctx.rank == 0:
        print(text, flush=True)


def memory_peak_of_step(step: Callable[[], object], out_dir: str, stem: str, label: str, ctx) -> None:
    """One step with the allocator's history recorded: what is alive at its peak (fsdp8/app/bench/memory_peak.py)."""
    from fsdp8.app.bench.memory_peak import format_peak, live_at_peak, record_step

    events, baseline = record_step(step)
    peak, live = live_at_peak(events, baseline)
    text = format_peak(f"{label}, rank {ctx.rank} of {ctx.world}", peak, live, baseline)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}-rank{ctx.rank}.md").write_text(text + "\n")
    if ctx.rank == 0:
        print(text, flush=True)
