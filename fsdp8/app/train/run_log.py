"""The record of a ``fsdp8 train`` run on rank 0: where its checkpoints are, its metrics
(metrics.jsonl, TensorBoard events), the progress line, and at the end summary.json and
loss.png, covering the whole run across resumes."""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
from typing import List, Optional, Tuple

import torch

from ...checkpoint import latest
from ...checkpoint.store import METADATA
from .config import TrainConfig
from .plot import save_line_plot

METRICS = "metrics.jsonl"


def find_checkpoint(path: str) -> str:
    """The checkpoint ``path`` names: itself, or the newest complete one in its checkpoints/
    folder (a run directory) or in it (a checkpoints folder)."""
    if os.path.isfile(os.path.join(path, METADATA)):
        return path
    for folder in (os.path.join(path, "checkpoints"), path):
        found = latest(folder)
        if found is not None:
            return found
    what = "no such directory" if not os.path.isdir(path) else "no complete checkpoint in it"
    raise FileNotFoundError(f"{path}: {what}; give a run directory (with checkpoints/), its checkpoints/ "
                            "folder or one checkpoint")


def run_dir_of(checkpoint: str) -> Optional[str]:
    """The run directory a checkpoint of ``fsdp8 train`` lives in (``<run>/checkpoints/step-N``)."""
    folder = os.path.dirname(os.path.normpath(checkpoint))
    return (os.path.dirname(folder) or ".") if os.path.basename(folder) == "checkpoints" else None


def read_metrics(path: str) -> Tuple[List[dict], Optional[str]]:
    """The records of a metrics.jsonl (none where it does not exist), and a note when its last
    line was torn (a write cut short by a kill: dropped). Raises ValueError naming the file and
    line for any other line that is not a record (e.g. two runs wrote it at once)."""
    if not os.path.isfile(path):
        return [], None
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    records, torn = [], None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise ValueError("not a record with a step")
        except ValueError as e:
            if number == len(lines):  # no newline after it: the last write was cut short
                torn = f"{path}: dropped its last line, torn by an interrupted write ({len(line)} bytes)"
                break
            raise ValueError(f"{path} line {number} is not a metrics record ({e}): the file is damaged (two runs "
                             "writing it at once leave such lines); delete that line, or move the file aside to "
                             "go on without the run's history") from None
        records.append(record)
    return records, torn


def history_of(checkpoint: str, step: int) -> List[dict]:
    """The metrics records of the run ``checkpoint`` belongs to, up to its step: a resumed
    run's outputs cover the whole run (records after the checkpoint are redone)."""
    run_dir = run_dir_of(checkpoint)
    records, _ = read_metrics(os.path.join(run_dir, METRICS)) if run_dir else ([], None)
    return [r for r in records if r["step"] <= step]


def write_atomic(path: str, text: str) -> None:
    """Replace ``path`` by a file holding ``text``: written aside, synced, renamed over it, so
    that at every instant ``path`` holds either its old or its new content in full."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def memory_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


class Progress:
    """One status line on rank 0: a bar on a terminal, plain lines otherwise."""

    def __init__(self, total: int, stream=sys.stderr):
        self.total, self.stream = total, stream
        self.tty = stream.isatty()
        self.shown = 0  # characters of the bar now on the terminal line

    def _clear(self) -> str:
        # "\r" only moves the cursor: a shorter line would leave the longer one's tail behind.
        return "\r" + " " * self.shown + "\r" if self.shown else ""

    def update(self, step: int, text: str) -> None:
        done = int(30 * step / self.total)
        line = f"step {step:>{len(str(self.total))}}/{self.total} [{'#' * done}{'.' * (30 - done)}] {text}"
        if self.tty:
            self.stream.write(self._clear() + line)
            self.shown = len(line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def note(self, text: str) -> None:
        """A line of its own; on a terminal it replaces the bar, which the next update redraws."""
        self.stream.write(self._clear() + text + "\n")
        self.shown = 0
        self.stream.flush()

    def close(self) -> None:
        if self.shown:
            self.stream.write("\n")
            self.shown = 0


# metrics.jsonl key -> TensorBoard tag
_BOARD_TAGS = {"loss": "train/loss", "val_loss": "val/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
               "tokens_per_s": "perf/tokens_per_s", "max_mem_mib": "perf/max_mem_mib"}


class RunLog:
    """Rank 0's record of a run: metrics.jsonl, TensorBoard events (with --tensorboard), the
    progress line, and the series that loss.png and summary.json are made of, starting from
    the records of a resumed run.

    metrics.jsonl is only ever appended to, a line per record, except at the start, where it
    is replaced at once (``write_atomic``) by ``history``: no kill loses the records it held."""

    def __init__(self, cfg: TrainConfig, history: List[dict]):
        self.cfg = cfg
        os.makedirs(cfg.out, exist_ok=True)
        path = os.path.join(cfg.out, METRICS)
        write_atomic(path, "".join(json.dumps(r) + "\n" for r in history))
        self.file = open(path, "a")
        self.progress = Progress(cfg.steps)
        self.steps = [r["step"] for r in history if "loss" in r]
        self.losses = [r["loss"] for r in history if "loss" in r]
        self.val = {r["step"]: r["val_loss"] for r in history if "val_loss" in r}
        self.skipped = [r["step"] for r in history if r.get("skipped")]
        self.earlier_s = max((r["elapsed_s"] for r in history if "elapsed_s" in r), default=0.0)
        self.board = None
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # Like metrics.jsonl, the events cover the whole run: purge_step=0 hides what an
            # earlier process wrote into this folder (the interrupted part of a resumed run, or
            # a run that --overwrite replaced), and a resumed run's records are written again.
            self.board = SummaryWriter(cfg.tensorboard, purge_step=0)
            for record in history:
                self._to_board(record)

    def _to_board(self, record: dict) -> None:
        for key, tag in _BOARD_TAGS.items():
            if isinstance(record.get(key), (int, float)):  # a skipped step's grad_norm is a string
                self.board.add_scalar(tag, record[key], record["step"])

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.board:
            self._to_board(record)
            self.board.flush()
        if "loss" in record:
            self.steps.append(record["step"])
            self.losses.append(record["loss"])
            self.progress.update(record["step"], f"loss {record['loss']:.3f} | {record['tokens_per_s'] / 1e3:.1f}k "
                                                 f"tok/s | mem {record['max_mem_mib']:.0f} MiB")
        if "val_loss" in record:
            self.val[record["step"]] = record["val_loss"]
        if record.get("skipped"):
            self.skipped.append(record["step"])
            self.note(f"step {record['step']}: gradient norm is {record['grad_norm']} (NaN/Inf in a "
                               "gradient); step skipped, weights unchanged")

    def note(self, text: str) -> None:
        self.progress.note(text)

    def finish(self, summary: dict, stopped_by: int) -> Optional[dict]:
        """summary.json (``summary`` plus the losses), loss.png and one line."""
        cfg = self.cfg
        self.progress.close()
        self.file.close()
        if self.board:
            self.board.close()
        if not self.losses:
            return None
        val_series = [self.val.get(s, float("nan")) for s in self.steps]
        save_line_plot(os.path.join(cfg.out, "loss.png"), self.steps, {"train": self.losses, "val": val_series},
                       title=f"fsdp8 {cfg.model_name} {cfg.parallel.strategy.label}", xlabel="step", ylabel="loss")
        final_val = self.val[max(self.val)] if self.val else None
        stopped = signal.Signals(stopped_by).name if stopped_by else None
        summary = dict(summary, first_loss=self.losses[0], final_loss=self.losses[-1], final_val_loss=final_val,
                       skipped_steps=self.skipped, stopped_by=stopped)
        write_atomic(os.path.join(cfg.out, "summary.json"), json.dumps(summary, indent=2))
        head = f"stopped by {stopped} after step {summary['steps_done']} of {cfg.steps}: " if stopped else ""
        val = f" (val {final_val:.3f})" if final_val is not None else ""
        print(f"{head}loss {self.losses[0]:.3f} -> {self.losses[-1]:.3f}{val} in {summary['elapsed_s']:.0f}s; "
              f"wrote {cfg.out}/metrics.jsonl, loss.png, summary.json"
              + (f" and TensorBoard events to {cfg.tensorboard}" if cfg.tensorboard else ""), file=sys.stderr)
        return summary
