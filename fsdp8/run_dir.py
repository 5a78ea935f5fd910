"""Which run ``fsdp8 train`` makes in its output directory, decided in the launching process
before any worker starts: the checkpoint a ``--resume`` continues and the settings it
remembers, a refusal where an earlier run's outputs would be overwritten unasked, and the
deletion ``--overwrite`` asks for."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import fields, replace
from typing import Collection, List, Optional

from .checkpoint.store import complete_checkpoints, extra_path, problems
from .run_log import find_checkpoint, run_dir_of
from .train_config import TrainConfig

# What a run writes into --out; an earlier run's are never overwritten unasked.
OUTPUTS = ("checkpoints", "metrics.jsonl", "summary.json", "loss.png")
# Settings a resumed run takes from its checkpoint unless they are given again.
PER_INVOCATION = {"out", "resume", "overwrite", "stop_at"}


def _saved_extra(checkpoint: str) -> dict:
    """Rank 0's extra values of an fsdp8 checkpoint: its step and the run's settings."""
    path = extra_path(checkpoint, 0)
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _earlier_run(out: str) -> List[str]:
    """The outputs of an earlier run in ``out``, described."""
    found = []
    for name in OUTPUTS:
        path = os.path.join(out, name)
        if name == "checkpoints" and os.path.isdir(path) and os.listdir(path):
            done = complete_checkpoints(path)
            found.append(f"checkpoints/ up to {os.path.basename(done[-1])}" if done else "checkpoints/")
        elif name != "checkpoints" and os.path.exists(path):
            found.append(name)
    return found


def _resume(cfg: TrainConfig, given: Collection[str]) -> TrainConfig:
    try:
        checkpoint = find_checkpoint(cfg.resume)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"--resume: {e}") from None
    wrong = problems(checkpoint, foreign_ok=True)
    if wrong:
        raise ValueError(f"--resume: cannot continue from {checkpoint}: {'; '.join(wrong)}")
    extra = _saved_extra(checkpoint)
    saved = extra.get("config", {})
    if "preset" in saved and {"model", "preset"} & set(given):
        was = saved.get("model", "")
        if was != cfg.model or (not was and saved["preset"] != cfg.preset):
            held = was or f"the {saved['preset']!r} preset"
            again = f"--model {was}" if was else f"--preset {saved['preset']}"
            raise ValueError(f"--resume: {checkpoint} holds {held}, not {cfg.model or repr(cfg.preset)}; drop "
                             f"--model and --preset or pass {again}")
    remembered = {k: v for k, v in saved.items()
                  if k in {f.name for f in fields(TrainConfig)} - PER_INVOCATION - set(given)}
    if "tp" in given and cfg.tp == 1:  # a layout without tensor parallelism: the switches of tp go with it
        for name in ("sequence_parallel", "loss_parallel"):
            remembered.pop(name, None)
    run_dir = run_dir_of(checkpoint)
    if "out" not in given and run_dir is not None:
        remembered["out"] = run_dir
    cfg = replace(cfg, resume=checkpoint, **remembered)
    step = extra.get("step", 0)
    if cfg.steps <= step:
        raise ValueError(f"--resume: {checkpoint} is at step {step} already; pass --steps above {step} to go on")
    return cfg


def plan_run(cfg: TrainConfig, given: Collection[str]) -> TrainConfig:
    """The run ``fsdp8 train`` will make: ``cfg`` with the checkpoint to resume resolved and
    the settings it remembers filled in (``given`` names the flags on the command line).
    Raises ValueError or FileNotFoundError, saying what to do, for what cannot work."""
    if cfg.resume:
        cfg = _resume(cfg, given)
    if os.path.exists(cfg.out) and not os.path.isdir(cfg.out):
        raise ValueError(f"--out {cfg.out} is a file; give a directory (it is created if missing)")
    try:
        os.makedirs(cfg.out, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--out {cfg.out}: cannot create it ({e.strerror}); give a directory you can write to")
    run_dir = run_dir_of(cfg.resume) if cfg.resume else None
    continuing = run_dir is not None and os.path.samefile(run_dir, cfg.out)
    earlier = _earlier_run(cfg.out)
    if earlier and not continuing and not cfg.overwrite:
        raise ValueError(f"--out {cfg.out} holds an earlier run ({', '.join(earlier)}); pass --resume to continue "
                         "it, --overwrite to delete it and start afresh, or another --out")
    return cfg


def clear_earlier_run(out: str) -> Optional[str]:
    """Delete an earlier run's outputs from ``out`` (for --overwrite); the line that says so."""
    earlier = _earlier_run(out)
    if not earlier:
        return None
    for name in OUTPUTS:
        path = os.path.join(out, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)
    return f"--overwrite: deleted the earlier run in {out} ({', '.join(earlier)})"
