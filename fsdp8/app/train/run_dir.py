"""Which run ``fsdp8 train`` makes in its output directory, decided in the launching process
before any worker starts: the directory's lock, the checkpoint a ``--resume`` continues
(run_resume.py), and what becomes of an earlier run's outputs there: kept and continued,
refused with the flag that would go on, or deleted (``--overwrite``, or nothing worth
keeping: a run that failed before its first record)."""

from __future__ import annotations

import enum
import os
import shutil
from dataclasses import dataclass, field, replace
from typing import Collection, List, Optional

from ...checkpoint.store import complete_checkpoints
from .config import TrainConfig
from .run_lock import RunLock
from .run_log import METRICS, read_metrics, run_dir_of
from .run_resume import choose_checkpoint, resumed_config, run_dir_named

ERROR_LOG = "error.log"
# What a run writes into --out; an earlier run's are never overwritten unasked.
OUTPUTS = ("checkpoints", METRICS, "summary.json", "loss.png", ERROR_LOG)


class Earlier(enum.Enum):
    """What an --out holds of an earlier run."""

    NONE = "none"  # nothing
    FAILED_AT_START = "failed at its start"  # outputs, but no metrics record, checkpoint or summary
    NO_CHECKPOINT = "ended without a checkpoint"  # records or a summary, but nothing to resume from
    RESUMABLE = "resumable"  # a complete checkpoint (finished or not)


@dataclass(frozen=True)
class RunDirState:
    earlier: Earlier
    found: List[str]  # its outputs, described
    last_step: int = 0  # of its metrics records


def inspect_run_dir(out: str) -> RunDirState:
    found = []
    checkpoints = os.path.join(out, "checkpoints")
    done = complete_checkpoints(checkpoints)
    if os.path.isdir(checkpoints) and os.listdir(checkpoints):
        found.append(f"checkpoints/ up to {os.path.basename(done[-1])}" if done else "checkpoints/ with no complete "
                     "checkpoint")
    records: list = []
    for name in OUTPUTS[1:]:
        path = os.path.join(out, name)
        if not os.path.exists(path):
            continue
        if name == METRICS:
            try:
                records = read_metrics(path)[0]
            except ValueError:
                records = [{"step": 0}]  # damaged, but not empty: not for deleting unasked
            found.append(f"{METRICS} to step {max(r['step'] for r in records)}" if records else f"empty {METRICS}")
        else:
            found.append(name)
    if not found:
        return RunDirState(Earlier.NONE, [])
    last_step = max((r["step"] for r in records), default=0)
    if done:
        return RunDirState(Earlier.RESUMABLE, found, last_step)
    if records or os.path.exists(os.path.join(out, "summary.json")):
        return RunDirState(Earlier.NO_CHECKPOINT, found, last_step)
    return RunDirState(Earlier.FAILED_AT_START, found)


def clear_run_dir(out: str) -> None:
    """Delete an earlier run's outputs from ``out``."""
    for name in OUTPUTS:
        path = os.path.join(out, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)


@dataclass
class RunPlan:
    """The run to start: its settings, the lines to print, whether an earlier run's outputs are
    deleted first, and the directory's lock (held until ``release``; None off rank 0)."""

    cfg: TrainConfig
    notes: List[str] = field(default_factory=list)
    clear: bool = False
    lock: Optional[RunLock] = None

    def start(self) -> List[str]:
        """Rank 0, just before the workers start: delete what is to go; the lines to print."""
        if self.clear:
            clear_run_dir(self.cfg.out)
        return self.notes

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()

    def __enter__(self) -> "RunPlan":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _make_out(out: str) -> None:
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--out {out} is a file; give a directory (it is created if missing)")
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--out {out}: cannot create it ({e.strerror}); give a directory you can write to")


def _refusal(out: str, state: RunDirState) -> str:
    held = ", ".join(state.found)
    if state.earlier is Earlier.NO_CHECKPOINT:
        return (f"--out {out} holds a run that ended at step {state.last_step} without a checkpoint ({held}): there is "
                "nothing to resume; pass --overwrite to delete it and start afresh there, or another --out")
    return (f"--out {out} holds an earlier run ({held}); pass --resume to continue it, --overwrite to delete it and "
            "start afresh, or another --out")


def plan_run(cfg: TrainConfig, given: Collection[str], lock: bool = True) -> RunPlan:
    """The run ``fsdp8 train`` will make (``given`` names the flags on the command line): the
    checkpoint to resume resolved and the settings it remembers filled in, --out locked (with
    ``lock``: rank 0). Raises ValueError or FileNotFoundError, saying what to do, for what
    cannot work."""
    out = cfg.out
    if cfg.resume and "out" not in given:
        out = run_dir_named(cfg.resume) or out
    cfg = replace(cfg, out=out)
    _make_out(out)
    plan = RunPlan(cfg, lock=RunLock(out) if lock else None)
    if plan.lock is not None and plan.lock.unsupported:
        plan.notes.append(f"--out {out}: cannot lock it ({plan.lock.unsupported}): nothing stops another fsdp8 train "
                          "from writing it meanwhile")
    try:
        _decide(plan, given)
    except BaseException:
        plan.release()
        raise
    return plan


def _decide(plan: RunPlan, given: Collection[str]) -> None:
    cfg = plan.cfg
    state = inspect_run_dir(cfg.out)
    if cfg.resume:
        named = run_dir_named(cfg.resume) or cfg.resume
        in_the_way = inspect_run_dir(named).earlier in (Earlier.NO_CHECKPOINT, Earlier.RESUMABLE)
        resume = choose_checkpoint(cfg.resume, "rerun with --overwrite instead of --resume to start afresh"
                                   if in_the_way else "rerun without --resume to start afresh")
        plan.cfg, notes = resumed_config(cfg, given, resume)
        plan.notes += notes
        run_dir = run_dir_of(resume.checkpoint)
        if run_dir is not None:  # the records it goes on from: a damaged file stops it here, not in rank 0
            torn = read_metrics(os.path.join(run_dir, METRICS))[1]
            plan.notes += [torn] if torn else []
            if os.path.samefile(run_dir, cfg.out):
                return
    if cfg.overwrite:
        plan.clear = state.earlier is not Earlier.NONE
        if plan.clear:
            plan.notes.append(f"--overwrite: deleted the earlier run in {cfg.out} ({', '.join(state.found)})")
    elif state.earlier is Earlier.FAILED_AT_START:
        plan.clear = True
        plan.notes.append(f"--out {cfg.out} held only what a run that failed at its start left "
                          f"({', '.join(state.found)}); deleted it and starting afresh")
    elif state.earlier is not Earlier.NONE:
        raise ValueError(_refusal(cfg.out, state))
