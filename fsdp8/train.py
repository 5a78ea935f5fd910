"""The main job: train the built-in Llama on the built-in corpus on whatever hardware is here."""

from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import sys
import time
from dataclasses import asdict, dataclass
from typing import List, Optional

import torch
import torch.distributed as dist

from .config import Precision
from .data import ByteCorpus
from .checkpoint import latest, load, save, wait_for_saves
from .engine.grads import clip_grad_norm_
from .engine.model import fully_shard
from .fp8.recipes import recipe_from_name
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
    resume: bool = False  # continue from the latest checkpoint under <out>/checkpoints
    stop_at: int = 0  # stop after this step (as if interrupted) with a checkpoint; 0: run to --steps
    async_save: bool = False

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        for name in ("steps", "batch_size", "seq_len", "micro_batches", "log_every", "eval_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.batch_size % self.micro_batches:
            raise ValueError(f"--batch-size {self.batch_size} is not divisible by --micro-batches {self.micro_batches}")
        if self.save_every < 0 or self.stop_at < 0 or self.keep_last < 1:
            raise ValueError("--save-every and --stop-at must be >= 0 and --keep-last >= 1")


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


def _memory_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


class Progress:
    """One status line on rank 0: a bar on a terminal, plain lines otherwise."""

    def __init__(self, total: int, stream=sys.stderr):
        self.total, self.stream = total, stream
        self.tty = stream.isatty()

    def update(self, step: int, text: str) -> None:
        done = int(30 * step / self.total)
        line = f"step {step:>{len(str(self.total))}}/{self.total} [{'#' * done}{'.' * (30 - done)}] {text}"
        if self.tty:
            self.stream.write("\r" + line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")


def _evaluate(model, corpus: ByteCorpus, cfg: TrainConfig, rank: int, world: int, device) -> float:
    total = torch.zeros((), device=device)
    with torch.no_grad():
        for i in range(cfg.eval_batches):
            x, y = corpus.batch(i, rank, world, cfg.batch_size, cfg.seq_len, seed=cfg.seed + 1)
            total += model(x.to(device), y.to(device)).float()
    dist.all_reduce(total)
    return float(total) / (cfg.eval_batches * world)


def _nan_fault(step: int, rank: int) -> bool:
    """Test seam: FSDP8_FAULT=nan_loss:<step>:<rank> poisons that rank's loss at that step."""
    fault = os.environ.get("FSDP8_FAULT", "")
    return fault == f"nan_loss:{step}:{rank}"


def train(cfg: TrainConfig) -> Optional[dict]:
    """Run on every rank (under torchrun or spawned by ``launch``); rank 0 writes the outputs."""
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
    model_cfg = preset(cfg.preset)
    if cfg.seq_len > model_cfg.max_seq_len:
        raise ValueError(f"--seq-len {cfg.seq_len} exceeds preset {cfg.preset!r}'s max_seq_len {model_cfg.max_seq_len}")

    torch.manual_seed(cfg.seed)
    with torch.device("meta"):
        model = Llama(model_cfg)  # never held in full: materialized shard by shard
    n_params = model.num_params()
    model = fully_shard(model, strategy=cfg.strategy, precision=precision, device=device, fp8=fp8)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay,
                            fused=device.type == "cuda")
    train_data, val_data = ByteCorpus(split="train"), ByteCorpus(split="val")
    tokens_per_step = cfg.batch_size * cfg.seq_len * world
    ckpt_dir = os.path.join(cfg.out, "checkpoints")
    first_step, resumed_from = 0, None
    if cfg.resume:
        resumed_from = latest(ckpt_dir)
        if resumed_from is None:
            raise FileNotFoundError(f"--resume: no complete checkpoint under {ckpt_dir}")
        extra = load(resumed_from, model, opt)
        first_step = int(extra["step"])  # the data position: batches are a function of the step
        torch.set_rng_state(extra["rng"])
        if device.type == "cuda" and "cuda_rng" in extra:
            torch.cuda.set_rng_state(extra["cuda_rng"], device)
    last_step = min(cfg.steps, cfg.stop_at) if cfg.stop_at else cfg.steps

    out = None
    if rank == 0:
        os.makedirs(cfg.out, exist_ok=True)
        out = open(os.path.join(cfg.out, "metrics.jsonl"), "a" if cfg.resume else "w")
        print(f"fsdp8 train: preset {cfg.preset} ({n_params / 1e6:.2f}M params), {world} x {device.type}, "
              f"strategy {cfg.strategy}, {cfg.precision if fp8 else ('bf16' if bf16 else 'fp32')} compute, "
              f"{tokens_per_step} tokens/step" + (f", resumed at step {first_step}" if resumed_from else ""),
              file=sys.stderr)
        print(model.memory_report(), file=sys.stderr)
    progress = Progress(cfg.steps) if rank == 0 else None
    steps: List[int] = []
    losses: List[float] = []
    val_points: List[tuple] = []
    skipped: List[int] = []
    running = torch.zeros((), device=device)  # sum of this log window's step losses (applied steps)
    window_start, window_steps, window_applied = time.perf_counter(), 0, 0
    start = time.perf_counter()
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
        if bool(torch.isfinite(norm)):  # one host sync per step: a bad step must not reach the weights
            opt.step()
            running += step_loss
            window_applied += 1
        else:
            skipped.append(step + 1)
            if rank == 0:
                print(f"\nstep {step + 1}: gradient norm is {float(norm)} (NaN/Inf in a gradient); step skipped, "
                      "weights unchanged", file=sys.stderr)
                out.write(json.dumps({"step": step + 1, "skipped": True, "grad_norm": str(float(norm))}) + "\n")
        opt.zero_grad(set_to_none=True)
        window_steps += 1
        if (step + 1) % cfg.log_every == 0 or step + 1 == last_step:
            dist.all_reduce(running)  # one small collective per log line, not per step
            mean_loss = float(running) / (world * window_applied) if window_applied else float("nan")
            running.zero_()
            now = time.perf_counter()
            tok_s = tokens_per_step * window_steps / (now - window_start)
            window_start, window_steps, window_applied = now, 0, 0
            mem = _memory_mib(device)
            if rank == 0:
                steps.append(step + 1)
                losses.append(mean_loss)
                record = {"step": step + 1, "loss": mean_loss, "lr": lr_at(step, cfg), "tokens_per_s": tok_s,
                          "max_mem_mib": mem, "elapsed_s": now - start}
                out.write(json.dumps(record) + "\n")
                out.flush()
                progress.update(step + 1, f"loss {mean_loss:.3f} | {tok_s / 1e3:.1f}k tok/s | mem {mem:.0f} MiB")
        if (step + 1) % cfg.eval_every == 0 or step + 1 == last_step:
            val = _evaluate(model, val_data, cfg, rank, world, device)
            if rank == 0:
                val_points.append((step + 1, val))
                out.write(json.dumps({"step": step + 1, "val_loss": val}) + "\n")
        if (cfg.save_every and (step + 1) % cfg.save_every == 0) or (cfg.stop_at and step + 1 == last_step):
            extra = {"step": step + 1, "rng": torch.get_rng_state()}
            if device.type == "cuda":
                extra["cuda_rng"] = torch.cuda.get_rng_state(device)
            save(os.path.join(ckpt_dir, f"step-{step + 1:06d}"), model, opt, extra,
                 keep_last=cfg.keep_last, async_save=cfg.async_save)
    wait_for_saves()
    if rank != 0:
        return None
    progress.close()
    out.close()
    if not losses:
        return None
    val_series = [dict(val_points).get(s, float("nan")) for s in steps]
    save_line_plot(os.path.join(cfg.out, "loss.png"), steps, {"train": losses, "val": val_series},
                   title=f"fsdp8 {cfg.preset} {cfg.strategy}", xlabel="step", ylabel="loss")
    summary = {"config": asdict(cfg), "world_size": world, "device": device.type, "params": n_params,
               "first_loss": losses[0], "final_loss": losses[-1], "final_val_loss": val_points[-1][1],
               "skipped_steps": skipped, "resumed_from": resumed_from, "elapsed_s": time.perf_counter() - start}
    with open(os.path.join(cfg.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} (val {val_points[-1][1]:.3f}) in {summary['elapsed_s']:.0f}s; "
          f"wrote {cfg.out}/metrics.jsonl, loss.png, summary.json", file=sys.stderr)
    return summary
