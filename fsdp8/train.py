"""The main job: train the built-in Llama on the built-in corpus on whatever hardware is here."""

from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import signal
import sys
import time
from dataclasses import asdict, dataclass, replace
from typing import List, Optional

import torch
import torch.distributed as dist

from .config import Precision
from .data import ByteCorpus
from .checkpoint import latest, load, save, wait_for_saves
from .checkpoint.store import METADATA
from .engine.grads import clip_grad_norm_
from .engine.model import fully_shard
from .fp8.recipes import recipe_from_name
from .launch import Stopped, stop_on_signals, stop_requested
from .models.llama import Llama, preset
from .parallel.mesh import init_distributed
from .plot import save_line_plot

PRECISIONS = ("auto", "fp32", "bf16", "fp8-delayed", "fp8-current", "fp8-block", "fp8-mxfp8")


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 200
    preset: str = "tiny"
    strategy: str = "optim_grads_params"
    precision: str = "auto"  # bf16 on GPUs, fp32 on CPUs
    batch_size: int = 8  # sequences per rank per optimizer step
    seq_len: int = 128
    micro_batches: int = 1
    lr: float = 3e-3
    warmup: int = 20
    weight_decay: float = 0.1
    clip: float = 1.0
    seed: int = 0
    log_every: int = 10
    eval_every: int = 50
    eval_batches: int = 4
    out: str = "runs/train"
    save_every: int = 0  # steps between checkpoints (0: none), under <out>/checkpoints
    keep_last: int = 2
    resume: str = ""  # a checkpoint, or a run or checkpoints directory to take the latest from ("": start afresh)
    overwrite: bool = False  # start afresh where an earlier run's outputs are (fsdp8 train deletes them first)
    stop_at: int = 0  # stop after this step (as if interrupted) with a checkpoint; 0: run to --steps
    async_save: bool = False
    lr_decay_steps: int = 0  # the cosine schedule's length (0: steps); a resumed run keeps its checkpoint's
    tensorboard: str = ""  # a directory for TensorBoard event files of the metrics ("": none)

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise ValueError(f"--precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        for name in ("steps", "batch_size", "seq_len", "micro_batches", "log_every", "eval_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.batch_size % self.micro_batches:
            raise ValueError(f"--batch-size {self.batch_size} is not divisible by --micro-batches {self.micro_batches}")
        if self.save_every < 0 or self.stop_at < 0 or self.keep_last < 1:
            raise ValueError("--save-every and --stop-at must be >= 0 and --keep-last >= 1")
        if not self.lr > 0 or not math.isfinite(self.lr):
            raise ValueError(f"--lr must be a positive number, got {self.lr}")
        max_seq_len = preset(self.preset).max_seq_len
        if self.seq_len > max_seq_len:
            raise ValueError(f"--seq-len {self.seq_len} exceeds the {self.preset!r} preset's {max_seq_len} positions; "
                             f"pass --seq-len {max_seq_len} or less, or a larger --preset")
        if self.resume and self.overwrite:
            raise ValueError("--resume continues a run and --overwrite deletes it: pass one of them")
        if self.tensorboard:
            try:
                import torch.utils.tensorboard  # noqa: F401  (checked here: before any worker starts)
            except ImportError as e:
                raise ValueError(f"--tensorboard needs the tensorboard package ({e}): "
                                 "pip install tensorboard") from None


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak over ``lr_decay_steps``."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, (cfg.lr_decay_steps or cfg.steps) - cfg.warmup)
    return cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


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


def _history(checkpoint: str, step: int) -> List[dict]:
    """The metrics records of the run ``checkpoint`` belongs to, up to its step: a resumed
    run's outputs cover the whole run (records after the checkpoint are redone)."""
    run_dir = run_dir_of(checkpoint)
    path = os.path.join(run_dir, "metrics.jsonl") if run_dir else ""
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [r for r in records if r["step"] <= step]


def _memory_mib(device: torch.device) -> float:
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


def _evaluate(model, corpus: ByteCorpus, cfg: TrainConfig, rank: int, world: int, device) -> float:
    total = torch.zeros((), device=device)
    with torch.no_grad():
        for i in range(cfg.eval_batches):
            x, y = corpus.batch(i, rank, world, cfg.batch_size, cfg.seq_len, seed=cfg.seed + 1)
            total += model(x.to(device), y.to(device)).float()
    dist.all_reduce(total)
    return float(total) / (cfg.eval_batches * world)


# metrics.jsonl key -> TensorBoard tag
_BOARD_TAGS = {"loss": "train/loss", "val_loss": "val/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
               "tokens_per_s": "perf/tokens_per_s", "max_mem_mib": "perf/max_mem_mib"}


def _nan_fault(step: int, rank: int) -> bool:
    """Test seam: FSDP8_FAULT=nan_loss:<step>:<rank> poisons that rank's loss at that step."""
    fault = os.environ.get("FSDP8_FAULT", "")
    return fault == f"nan_loss:{step}:{rank}"


class _RunLog:
    """Rank 0's record of a run: metrics.jsonl, TensorBoard events (with --tensorboard), the
    progress line, and the series that loss.png and summary.json are made of, starting from
    the records of a resumed run."""

    def __init__(self, cfg: TrainConfig, history: List[dict]):
        self.cfg = cfg
        os.makedirs(cfg.out, exist_ok=True)
        self.file = open(os.path.join(cfg.out, "metrics.jsonl"), "w")
        self.file.writelines(json.dumps(r) + "\n" for r in history)
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
                       title=f"fsdp8 {cfg.preset} {cfg.strategy}", xlabel="step", ylabel="loss")
        final_val = self.val[max(self.val)] if self.val else None
        stopped = signal.Signals(stopped_by).name if stopped_by else None
        summary = dict(summary, first_loss=self.losses[0], final_loss=self.losses[-1], final_val_loss=final_val,
                       skipped_steps=self.skipped, stopped_by=stopped)
        with open(os.path.join(cfg.out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        head = f"stopped by {stopped} after step {summary['steps_done']} of {cfg.steps}: " if stopped else ""
        val = f" (val {final_val:.3f})" if final_val is not None else ""
        print(f"{head}loss {self.losses[0]:.3f} -> {self.losses[-1]:.3f}{val} in {summary['elapsed_s']:.0f}s; "
              f"wrote {cfg.out}/metrics.jsonl, loss.png, summary.json"
              + (f" and TensorBoard events to {cfg.tensorboard}" if cfg.tensorboard else ""), file=sys.stderr)
        return summary


def train(cfg: TrainConfig) -> Optional[dict]:
    """Run on every rank (under torchrun or spawned by ``launch``); rank 0 writes the outputs
    and returns the summary.

    SIGINT or SIGTERM stops the run after the step all ranks agree on (one small all-reduce
    per step): a checkpoint when ``save_every`` is set, then the outputs for the steps done,
    then ``Stopped`` (see [Note: stopping on a signal] in launch.py)."""
    with stop_on_signals():
        return _train(cfg)


def _train(cfg: TrainConfig) -> Optional[dict]:
    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    if torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    fp8 = recipe_from_name(cfg.precision) if cfg.precision.startswith("fp8") else None
    bf16 = fp8 is not None or cfg.precision == "bf16" or (cfg.precision == "auto" and device.type == "cuda")
    precision = Precision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else Precision()

    torch.manual_seed(cfg.seed)
    with torch.device("meta"):
        model = Llama(preset(cfg.preset))  # never held in full: materialized shard by shard
    n_params = model.num_params()
    model = fully_shard(model, strategy=cfg.strategy, precision=precision, device=device, fp8=fp8)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay,
                            fused=device.type == "cuda")
    train_data, val_data = ByteCorpus(split="train"), ByteCorpus(split="val")
    tokens_per_step = cfg.batch_size * cfg.seq_len * world
    ckpt_dir = os.path.join(cfg.out, "checkpoints")
    # Saved with every checkpoint: a resumed run keeps the schedule it started with.
    saved_config = asdict(replace(cfg, lr_decay_steps=cfg.lr_decay_steps or cfg.steps))
    first_step, resumed_from = 0, None
    if cfg.resume:
        resumed_from = find_checkpoint(cfg.resume)
        extra = load(resumed_from, model, opt)
        first_step = int(extra["step"])  # the data position: batches are a function of the step
        torch.set_rng_state(extra["rng"])
        if device.type == "cuda" and "cuda_rng" in extra:
            torch.cuda.set_rng_state(extra["cuda_rng"], device)
    last_step = min(cfg.steps, cfg.stop_at) if cfg.stop_at else cfg.steps

    log = None
    if rank == 0:
        log = _RunLog(cfg, _history(resumed_from, first_step) if resumed_from else [])
        print(f"fsdp8 train: preset {cfg.preset} ({n_params / 1e6:.2f}M params), {world} x {device.type}, "
              f"strategy {cfg.strategy}, {cfg.precision if fp8 else ('bf16' if bf16 else 'fp32')} compute, "
              f"{tokens_per_step} tokens/step" + (f", resumed at step {first_step} from {resumed_from}"
                                                   if resumed_from else ""), file=sys.stderr)
        print(model.memory_report(), file=sys.stderr)
    running = torch.zeros((), device=device)  # sum of this log window's step losses (applied steps)
    stop = torch.zeros((), device=device)  # a pending stop request's signal number, agreed by max
    stopped_by, step_done = 0, first_step
    window_start, window_steps, window_applied = time.perf_counter(), 0, 0
    start = time.perf_counter() - (log.earlier_s if log else 0.0)
    for step in range(first_step, last_step):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        x, y = train_data.batch(step, rank, world, cfg.batch_size, cfg.seq_len, seed=cfg.seed)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        step_loss = torch.zeros((), device=device)
        for mb, (xs, ys) in enumerate(zip(x.chunk(cfg.micro_batches), y.chunk(cfg.micro_batches))):
            last = mb == cfg.micro_batches - 1
            with model.no_sync() if not last else contextlib.nullcontext():
                loss = model(xs, ys) / cfg.micro_batches
                if _nan_fault(step, rank):
                    loss = loss * float("nan")
                loss.backward()
            step_loss += loss.detach()
        norm = clip_grad_norm_(model, cfg.clip)
        stop.fill_(stop_requested() or 0)
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)  # every rank stops after the same step
        # One host sync per step: a bad step must not reach the weights.
        finite, stopped_by = torch.stack([torch.isfinite(norm).to(stop.dtype), stop]).tolist()
        stopped_by, step_done = int(stopped_by), step + 1
        if finite:
            opt.step()
            running += step_loss
            window_applied += 1
        elif log:
            log.write({"step": step + 1, "skipped": True, "grad_norm": str(float(norm))})
        opt.zero_grad(set_to_none=True)
        window_steps += 1
        if (step + 1) % cfg.log_every == 0 or step + 1 == last_step or stopped_by:
            dist.all_reduce(running)  # one small collective per log line, not per step
            mean_loss = float(running) / (world * window_applied) if window_applied else float("nan")
            running.zero_()
            now = time.perf_counter()
            tok_s = tokens_per_step * window_steps / (now - window_start)
            window_start, window_steps, window_applied = now, 0, 0
            if log:
                log.write({"step": step + 1, "loss": mean_loss, "lr": lr_at(step, cfg), "grad_norm": float(norm),
                           "tokens_per_s": tok_s, "max_mem_mib": _memory_mib(device), "elapsed_s": now - start})
        if (step + 1) % cfg.eval_every == 0 or step + 1 == last_step:  # not when stopping: stop promptly
            val = _evaluate(model, val_data, cfg, rank, world, device)
            if log:
                log.write({"step": step + 1, "val_loss": val})
        if ((cfg.save_every and ((step + 1) % cfg.save_every == 0 or stopped_by))
                or (cfg.stop_at and step + 1 == last_step)):
            extra = {"step": step + 1, "rng": torch.get_rng_state(), "config": saved_config}
            if device.type == "cuda":
                extra["cuda_rng"] = torch.cuda.get_rng_state(device)
            path = os.path.join(ckpt_dir, f"step-{step + 1:06d}")
            save(path, model, opt, extra, keep_last=cfg.keep_last, async_save=cfg.async_save)
            if log:
                log.note(f"saving checkpoint {path} in the background" if cfg.async_save
                         else f"saved checkpoint {path}")
        if stopped_by:
            break
    wait_for_saves()
    summary = None
    if log:
        summary = log.finish({"config": asdict(cfg), "world_size": world, "device": device.type, "params": n_params,
                              "steps_done": step_done, "resumed_from": resumed_from,
                              "elapsed_s": time.perf_counter() - start}, stopped_by)
    if stopped_by:
        raise Stopped(stopped_by)
    return summary
