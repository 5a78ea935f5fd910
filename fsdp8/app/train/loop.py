"""The main job: train the built-in Llama (or a Hugging Face model) on the built-in corpus (or a
text file) on whatever hardware is here, laid out by ``parallelize``."""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from dataclasses import replace
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from ...checkpoint import wait_for_saves
from ...config import resolve_precision
from ...data import TokenCorpus
from ...distributed.process_group import current_device, init_distributed
from ...engine.grads import clip_grad_norm_
from ...parallel.manager import cut_sequences, parallelize
from ..stop import Stopped, stop_on_signals, stop_requested
from .config import TrainConfig, build_model, weight_files
from .io import load_data, load_weights, resume_from, save_checkpoint, saving
from .run_log import RunLog, find_checkpoint, history_of, memory_mib
from .startup import startup_lines

# What the launcher says when a worker ran out of memory.
TRAIN_MEMORY_ADVICE = ("use less memory per process: a smaller --batch-size (or more --micro-batches), --ac full, or "
                       "more ranks to shard over")


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak over ``lr_decay_steps``."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, (cfg.lr_decay_steps or cfg.steps) - cfg.warmup)
    return cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


def _rank_batch(model, corpus: TokenCorpus, step: int, cfg: TrainConfig, seed: int, device) -> Dict[str, object]:
    """This rank's part of a step's global batch as the model's keyword arguments: the rows of
    its data-parallel rank (every rank of one tp/cp group gets the same rows), and with cp its
    chunks of each sequence and the loss divisor (``num_items_in_batch``) of the global batch."""
    x, y = corpus.batch(step, model.dp_rank, model.dp_size, cfg.batch_size, cfg.seq_len, seed=seed)
    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    # Hugging Face models shift their labels themselves; the built-in Llama takes next-token targets.
    batch = {"input_ids": x, "labels": x} if cfg.model else {"tokens": x, "targets": y}
    return cut_sequences(batch, model.device_mesh, cfg.parallel.sequence_parallel) if cfg.parallel.cp > 1 else batch


def micro_batches(batch: Dict[str, object], n: int) -> List[Dict[str, object]]:
    """``n`` micro-batches of ``batch``'s rows; a number (the loss divisor) goes to each whole."""
    parts: List[Dict[str, object]] = [{} for _ in range(n)]
    for key, value in batch.items():
        chunks = value.chunk(n) if isinstance(value, torch.Tensor) and value.dim() > 0 else [value] * n
        for part, chunk in zip(parts, chunks):
            part[key] = chunk
    return parts


def model_loss(model, batch: Dict[str, object], hf: bool) -> torch.Tensor:
    if hf:
        return model(**batch, use_cache=False).loss
    return model(batch["tokens"], batch["targets"], num_items_in_batch=batch.get("num_items_in_batch"))


def _value(loss: torch.Tensor) -> torch.Tensor:
    # Under loss parallel the loss is a DTensor replicated over tp: each rank holds the value.
    return loss.to_local() if isinstance(loss, DTensor) else loss


def _loss_context(cfg: TrainConfig):
    # Vocabulary-sharded logits: the loss and its backward go through torch's parallel cross-entropy.
    return loss_parallel() if cfg.parallel.loss_parallel else contextlib.nullcontext()


def _evaluate(model, corpus: TokenCorpus, cfg: TrainConfig, device) -> float:
    total = torch.zeros((), device=device)
    model.eval()
    with torch.no_grad(), _loss_context(cfg):
        for i in range(cfg.eval_batches):
            batch = _rank_batch(model, corpus, i, cfg, cfg.seed + 1, device)
            total += _value(model_loss(model, batch, bool(cfg.model))).float()
    model.train()
    dist.all_reduce(total)  # averaged over the world as the training loss is (see _train)
    return float(total) / (cfg.eval_batches * dist.get_world_size())


def _nan_fault(step: int, rank: int) -> bool:
    """Test seam: FSDP8_FAULT=nan_loss:<step>:<rank> poisons that rank's loss at that step."""
    fault = os.environ.get("FSDP8_FAULT", "")
    return fault == f"nan_loss:{step}:{rank}"


def train(cfg: TrainConfig) -> Optional[dict]:
    """Run on every rank (under torchrun or spawned by ``launch``); rank 0 writes the outputs
    and returns the summary.

    SIGINT or SIGTERM stops the run after the step all ranks agree on (one small all-reduce
    per step): a checkpoint when ``save_every`` is set, then the outputs for the steps done,
    then ``Stopped`` (see [Note: stopping on a signal] in app/stop.py)."""
    with stop_on_signals():
        return _train(cfg)


def _train(cfg: TrainConfig) -> Optional[dict]:
    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    device = current_device()
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    hf = bool(cfg.model)

    torch.manual_seed(cfg.seed)
    model = build_model(cfg)  # never held in full: materialized shard by shard
    n_params = sum(p.numel() for p in model.parameters())
    model = parallelize(model, cfg.parallel)
    if hf and not cfg.resume and weight_files(cfg.hf_dir):
        load_weights(model, cfg)
    # Offloaded main weights live in host memory, where CUDA's fused AdamW cannot step them. Elsewhere
    # one foreach call per update op steps every parameter (torch's CPU default is a loop over them,
    # each op a DTensor dispatch: a quarter of a tiny model's step on a CPU).
    fused = device.type == "cuda" and cfg.parallel.offload is None
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay,
                            fused=fused, foreach=not fused)
    tokens, data_id, tokenized = load_data(cfg)
    train_data, val_data = TokenCorpus(tokens, split="train"), TokenCorpus(tokens, split="val")
    tokens_per_step = cfg.batch_size * cfg.seq_len * model.dp_size
    mesh = model.device_mesh
    layout = " x ".join(f"{name} {size}" for name, size in zip(mesh.mesh_dim_names, mesh.shape))
    if cfg.parallel.ep > 1:
        layout += f" (experts over ep {cfg.parallel.ep} of dp_shard)"
    if cfg.parallel.load_balancing == "global":
        layout += ", router loss balanced over the global batch"
    ckpt_dir = os.path.join(cfg.out, "checkpoints")
    # Saved with every checkpoint: a resumed run keeps the schedule it started with, and finds
    # its data file from any directory (and checks it is the one it trained on: data_id).
    saved_config = replace(cfg, lr_decay_steps=cfg.lr_decay_steps or cfg.steps,
                           data=os.path.abspath(cfg.data) if cfg.data else "").settings()
    first_step, resumed_from = 0, None
    if cfg.resume:
        resumed_from = find_checkpoint(cfg.resume)
        first_step = resume_from(resumed_from, model, opt, device)
    last_step = min(cfg.steps, cfg.stop_at) if cfg.stop_at else cfg.steps

    log = None
    if rank == 0:
        log = RunLog(cfg, history_of(resumed_from, first_step) if resumed_from else [])
        fp8 = cfg.parallel.fp8
        compute = f"fp8-{fp8.name}" if fp8 else resolve_precision(cfg.parallel.precision, device.type).label
        print(startup_lines(cfg, model, params=n_params, world=world, device=device.type, layout=layout,
                            compute=compute, tokens_per_step=tokens_per_step, tokenized=tokenized,
                            train_tokens=len(train_data), val_tokens=len(val_data), resumed_from=resumed_from,
                            first_step=first_step), file=sys.stderr)
        print(model.memory_report(), file=sys.stderr)
    running = torch.zeros((), device=device)  # sum of this log window's step losses (applied steps)
    stop = torch.zeros((), device=device)  # a pending stop request's signal number, agreed by max
    stopped_by, step_done = 0, first_step
    window_start, window_steps, window_applied = time.perf_counter(), 0, 0
    start = time.perf_counter() - (log.earlier_s if log else 0.0)
    for step in range(first_step, last_step):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        batch = _rank_batch(model, train_data, step, cfg, cfg.seed, device)
        step_loss = torch.zeros((), device=device)
        for mb, part in enumerate(micro_batches(batch, cfg.micro_batches)):
            last = mb == cfg.micro_batches - 1
            with model.no_sync() if not last else contextlib.nullcontext(), _loss_context(cfg):
                loss = model_loss(model, part, hf)
                # A mean over the micro-batch's tokens, except with cp: there it is their sum over
                # the divisor of the whole step (cp.loss_divisor), so the micro-batches already add
                # up to the step's loss.
                if "num_items_in_batch" not in part:
                    loss = loss / cfg.micro_batches
                if _nan_fault(step, rank):
                    loss = loss * float("nan")
                loss.backward()
            step_loss += _value(loss.detach())
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
            # One small collective per log line, not per step. Each data-parallel x cp rank's loss is
            # its share of the global batch's token mean (a mean over as many tokens as every other
            # rank's, or with cp its tokens' sum over N / W), so their average is that mean; the tp
            # ranks of a group hold the same loss, so averaging over the whole world gives it too.
            dist.all_reduce(running)
            mean_loss = float(running) / (world * window_applied) if window_applied else float("nan")
            running.zero_()
            now = time.perf_counter()
            tok_s = tokens_per_step * window_steps / (now - window_start)
            window_start, window_steps, window_applied = now, 0, 0
            if log:
                log.write({"step": step + 1, "loss": mean_loss, "lr": lr_at(step, cfg), "grad_norm": float(norm),
                           "tokens_per_s": tok_s, "max_mem_mib": memory_mib(device), "elapsed_s": now - start})
        if (step + 1) % cfg.eval_every == 0 or step + 1 == last_step:  # not when stopping: stop promptly
            val = _evaluate(model, val_data, cfg, device)
            if log:
                log.write({"step": step + 1, "val_loss": val})
        if ((cfg.save_every and ((step + 1) % cfg.save_every == 0 or stopped_by))
                or (cfg.stop_at and step + 1 == last_step)):
            extra = {"step": step + 1, "rng": torch.get_rng_state(), "config": saved_config, **data_id}
            if device.type == "cuda":
                extra["cuda_rng"] = torch.cuda.get_rng_state(device)
            path = os.path.join(ckpt_dir, f"step-{step + 1:06d}")
            save_checkpoint(path, model, opt, extra, cfg)
            if log:
                log.note(f"saving checkpoint {path} in the background" if cfg.async_save
                         else f"saved checkpoint {path}")
        if stopped_by:
            break
    with saving(ckpt_dir):
        wait_for_saves()
    summary = None
    if log:
        summary = log.finish({"config": cfg.settings(), "world_size": world, "layout": layout,
                              "tokens_per_step": tokens_per_step, "device": device.type, "params": n_params,
                              "steps_done": step_done, "resumed_from": resumed_from,
                              "elapsed_s": time.perf_counter() - start}, stopped_by)
    if stopped_by:
        raise Stopped(stopped_by)
    return summary
