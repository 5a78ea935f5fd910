"""The main job: train the built-in Llama (or a Hugging Face model) on the built-in corpus (or a
text file) on whatever hardware is here, laid out by ``parallelize``."""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, replace
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from .config import AC_MODES, ParallelConfig, Precision
from .data import VAL_FRACTION, VOCAB_SIZE, TokenCorpus, has_tokenizer, load_tokenizer, load_tokens
from .checkpoint import load, load_pretrained, save, wait_for_saves
from .engine.grads import clip_grad_norm_
from .fp8.recipes import recipe_from_name
from .launch import Stopped, stop_on_signals, stop_requested
from .models.llama import Llama, preset
from .parallel.cp import local_multiple
from .parallel.manager import cut_sequences, parallelize
from .parallel.mesh import init_distributed
from .run_log import RunLog, find_checkpoint, history_of, memory_mib

PRECISIONS = ("auto", "fp32", "bf16", "fp8-delayed", "fp8-current", "fp8-block", "fp8-mxfp8")
OFFLOAD_MODES = ("none", "optim")
HF_PREFIX = "hf:"


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 200
    preset: str = "tiny"  # the built-in Llama's size
    model: str = ""  # "hf:DIR": a Hugging Face model directory instead of the built-in Llama ("": none)
    data: str = ""  # a text file to train on ("": the packaged corpus)
    strategy: str = "optim_grads_params"
    precision: str = "auto"  # bf16 on GPUs, fp32 on CPUs
    tp: int = 1
    dp_replicate: int = 1
    outer_strategy: str = "no_shard"  # HSDP: what is sharded across the replicas
    cp: int = 1
    sequence_parallel: bool = False
    loss_parallel: bool = False
    ac: str = "none"  # activation checkpointing
    compile: bool = False
    offload: str = "none"
    batch_size: int = 8  # sequences per data-parallel rank per optimizer step
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
        if self.model and (not self.model.startswith(HF_PREFIX) or self.model == HF_PREFIX):
            raise ValueError(f"--model takes hf:DIR (a Hugging Face model directory), got {self.model!r}")
        for name in ("steps", "batch_size", "seq_len", "micro_batches", "log_every", "eval_every", "tp",
                     "dp_replicate", "cp"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.batch_size % self.micro_batches:
            raise ValueError(f"--batch-size {self.batch_size} is not divisible by --micro-batches {self.micro_batches}")
        if self.save_every < 0 or self.stop_at < 0 or self.keep_last < 1:
            raise ValueError("--save-every and --stop-at must be >= 0 and --keep-last >= 1")
        if not self.lr > 0 or not math.isfinite(self.lr):
            raise ValueError(f"--lr must be a positive number, got {self.lr}")
        max_seq_len = preset(self.preset).max_seq_len
        if not self.model and self.seq_len > max_seq_len:
            raise ValueError(f"--seq-len {self.seq_len} exceeds the {self.preset!r} preset's {max_seq_len} positions; "
                             f"pass --seq-len {max_seq_len} or less, or a larger --preset")
        self._check_layout()
        if self.resume and self.overwrite:
            raise ValueError("--resume continues a run and --overwrite deletes it: pass one of them")
        if self.tensorboard:
            try:
                import torch.utils.tensorboard  # noqa: F401  (checked here: before any worker starts)
            except ImportError as e:
                raise ValueError(f"--tensorboard needs the tensorboard package ({e}): "
                                 "pip install tensorboard") from None

    def _check_layout(self) -> None:
        """The parallel flags among themselves (the world size is ``check_run``'s)."""
        if self.ac not in AC_MODES:
            raise ValueError(f"--ac must be one of {', '.join(AC_MODES)}, got {self.ac!r}")
        if self.offload not in OFFLOAD_MODES:
            raise ValueError(f"--offload must be one of {', '.join(OFFLOAD_MODES)}, got {self.offload!r}")
        wanting = [f"--{name.replace('_', '-')}" for name in ("sequence_parallel", "loss_parallel")
                   if getattr(self, name)]
        if wanting and self.tp == 1:
            flags = " and ".join(wanting)
            raise ValueError(f"{flags} need{'s' if len(wanting) == 1 else ''} tensor parallelism: pass --tp N "
                             f"(N > 1) too, or drop {flags}")
        if self.outer_strategy != "no_shard" and self.dp_replicate == 1:
            raise ValueError(f"--outer-strategy {self.outer_strategy} shards across HSDP replicas, but there are none; "
                             "pass --dp-replicate R (R > 1) too, or drop --outer-strategy")
        if self.ac == "selective" and self.cp > 1:
            raise ValueError(f"--ac selective does not work with --cp {self.cp} yet (the selective policy cannot "
                             "create the context-parallel attention's causal mask); use --ac full")
        if self.offload != "none" and self.strategy == "no_shard":
            raise ValueError("--offload optim moves the sharded main weights and optimizer state to the host, but "
                             "--strategy no_shard shards nothing; use --strategy optim or higher")
        if self.offload != "none" and self.precision.startswith("fp8"):
            raise ValueError(f"--offload optim does not work with --precision {self.precision} yet (FP8 weights "
                             "are quantized from the main weights on the device); use --precision bf16, or no "
                             "--offload")
        split_tp = self.tp if self.sequence_parallel else 1
        if self.cp > 1:
            multiple = self.cp * local_multiple(self.cp, split_tp)
            why = f"--cp {self.cp} cuts each sequence into 2 x {self.cp} equal chunks"
            if split_tp > 1:
                why += f" and --sequence-parallel splits each rank's part over --tp {self.tp}"
        else:
            multiple, why = split_tp, f"--sequence-parallel splits each sequence over --tp {self.tp}"
        if self.seq_len % multiple:
            raise ValueError(f"--seq-len {self.seq_len} is not a multiple of {multiple}: {why}; pass --seq-len "
                             f"{max(multiple, self.seq_len - self.seq_len % multiple)}")
        try:  # what parallelize itself refuses, should it refuse more than the checks above
            self.parallel_config(cuda=False)
        except (TypeError, ValueError, NotImplementedError) as e:
            raise ValueError(str(e)) from None

    @property
    def hf_dir(self) -> str:
        """The Hugging Face model directory of ``--model hf:DIR`` ("" for the built-in Llama)."""
        return self.model[len(HF_PREFIX):] if self.model else ""

    @property
    def model_name(self) -> str:
        return self.model or f"preset {self.preset}"

    def parallel_config(self, cuda: bool) -> ParallelConfig:
        """What ``parallelize`` is given: the layout, and the precision on GPUs (``cuda``) or CPUs."""
        fp8 = recipe_from_name(self.precision) if self.precision.startswith("fp8") else None
        bf16 = fp8 is not None or self.precision == "bf16" or (self.precision == "auto" and cuda)
        return ParallelConfig(
            dp_replicate=self.dp_replicate, cp=self.cp, tp=self.tp, sequence_parallel=self.sequence_parallel,
            loss_parallel=self.loss_parallel, activation_checkpointing=self.ac, compile=self.compile, fp8=fp8,
            precision=Precision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else Precision(),
            strategy=self.strategy, outer_strategy=self.outer_strategy,
            offload=None if self.offload == "none" else self.offload)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak over ``lr_decay_steps``."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, (cfg.lr_decay_steps or cfg.steps) - cfg.warmup)
    return cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


def _hf_config(directory: str):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(directory)


def build_model(cfg: TrainConfig) -> torch.nn.Module:
    """The run's model on the meta device: nothing is allocated until parallelize
    materializes each rank's shards (seed the RNG first: every rank draws the same values)."""
    if not cfg.model:
        with torch.device("meta"):
            return Llama(preset(cfg.preset))
    from transformers import AutoModelForCausalLM

    config = _hf_config(cfg.hf_dir)
    with torch.device("meta"):
        # fp32 whatever config.json's dtype: these are the main weights; --precision sets the compute dtype.
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _weight_files(directory: str) -> List[str]:
    return sorted(name for name in os.listdir(directory) if name.endswith(".safetensors"))


def check_run(cfg: TrainConfig, world: int) -> None:
    """What the launching process checks before any worker starts, beyond the flags
    themselves: the layout against the ``world`` size, the data file, the model directory, the
    tensor-parallel shapes, and the data's vocabulary against the model's. Raises ValueError
    saying what to change."""
    degree = cfg.dp_replicate * cfg.cp * cfg.tp
    if world % degree:
        raise ValueError(f"{world} worker processes do not divide into groups of --dp-replicate {cfg.dp_replicate} x "
                         f"--cp {cfg.cp} x --tp {cfg.tp} = {degree}; run a multiple of {degree} workers (--nproc), or "
                         "change those degrees")
    if cfg.data and not os.path.isfile(cfg.data):
        raise ValueError(f"--data {cfg.data}: no such file; give a text file to train on")
    vocab = preset(cfg.preset).vocab_size
    if cfg.model:
        vocab = _check_hf_dir(cfg).vocab_size
    if cfg.tp > 1:
        _check_tensor_parallel(cfg)
    if cfg.model and has_tokenizer(cfg.hf_dir):
        tokenizer = load_tokenizer(cfg.hf_dir)
        if len(tokenizer) > vocab:
            raise ValueError(f"the tokenizer in {cfg.hf_dir} has {len(tokenizer)} tokens, more than the model's "
                             f"vocabulary of {vocab} (config.json vocab_size); give the directory a config and "
                             "tokenizer that agree")
        return
    data = f"--data {cfg.data}" if cfg.data else "the packaged corpus"
    if vocab < VOCAB_SIZE:
        raise ValueError(f"{data} is read as bytes ({VOCAB_SIZE} token ids), but {cfg.model_name} has a vocabulary "
                         f"of {vocab}; use a model with vocab_size >= {VOCAB_SIZE}, or put a tokenizer in its "
                         "directory")
    if cfg.data:
        val = int(os.path.getsize(cfg.data) * VAL_FRACTION)
        if val < cfg.seq_len + 1:
            raise ValueError(f"{data} is too short: its validation part (the last {VAL_FRACTION:.0%}, {val} bytes) "
                             f"holds no sequence of --seq-len {cfg.seq_len} (+1 target); give more text or a "
                             "shorter --seq-len")


def _check_hf_dir(cfg: TrainConfig):
    """The text config of ``--model hf:DIR``, after checking the directory and the sequence length."""
    directory = cfg.hf_dir
    if not os.path.isfile(os.path.join(directory, "config.json")):
        what = "has no config.json" if os.path.isdir(directory) else "is not a directory"
        raise ValueError(f"--model {cfg.model}: {directory} {what}; give a Hugging Face model directory (config.json, "
                         "optionally *.safetensors weights and a tokenizer)")
    try:
        config = _hf_config(directory)
    except ImportError as e:
        raise ValueError(f"--model {cfg.model} needs transformers ({e}): pip install transformers") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"--model {cfg.model}: transformers cannot read {directory}/config.json: "
                         f"{' '.join(str(e).split())}") from None
    if not _weight_files(directory) and any(name.endswith((".bin", ".pt", ".pth")) for name in os.listdir(directory)):
        raise ValueError(f"--model {cfg.model}: the weights in {directory} are not safetensors files, which is what "
                         "fsdp8 reads; save them with save_pretrained(..., safe_serialization=True), or remove them "
                         "to start from a fresh init")
    text_config = config.get_text_config()
    positions = getattr(text_config, "max_position_embeddings", None)
    if positions and cfg.seq_len > positions:
        raise ValueError(f"--seq-len {cfg.seq_len} exceeds the {positions} positions of {cfg.model} "
                         f"(max_position_embeddings); pass --seq-len {positions} or less")
    return text_config


def _check_tensor_parallel(cfg: TrainConfig) -> None:
    """The model's tensor-parallel plan against --tp, on a meta-device copy (what parallelize checks
    in every worker, here in one line before they start)."""
    from .parallel.tp import check_shapes, family_plan, resolve_plan

    model = build_model(cfg)
    try:
        family = family_plan(model, cfg.sequence_parallel, cfg.loss_parallel)
        if family is None:
            raise ValueError(f"{type(model).__name__} has no automatic tensor-parallel plan (its config has no "
                             "base_model_tp_plan); use --tp 1")
        modules = dict(model.named_modules())
        check_shapes(modules, resolve_plan([name for name in modules if name], family.styles, None), cfg.tp, family)
    except ValueError as e:
        raise ValueError(f"--tp {cfg.tp}: {e}") from None


def _rank_batch(model, corpus: TokenCorpus, step: int, cfg: TrainConfig, seed: int, device) -> Dict[str, object]:
    """This rank's part of a step's global batch as the model's keyword arguments: the rows of
    its data-parallel rank (every rank of one tp/cp group gets the same rows), and with cp its
    chunks of each sequence and the loss divisor (``num_items_in_batch``) of the global batch."""
    x, y = corpus.batch(step, model.dp_rank, model.dp_size, cfg.batch_size, cfg.seq_len, seed=seed)
    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    # Hugging Face models shift their labels themselves; the built-in Llama takes next-token targets.
    batch = {"input_ids": x, "labels": x} if cfg.model else {"tokens": x, "targets": y}
    return cut_sequences(batch, model.device_mesh, cfg.sequence_parallel) if cfg.cp > 1 else batch


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
    return loss_parallel() if cfg.loss_parallel else contextlib.nullcontext()


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
    parallel = cfg.parallel_config(cuda=device.type == "cuda")
    hf = bool(cfg.model)

    torch.manual_seed(cfg.seed)
    model = build_model(cfg)  # never held in full: materialized shard by shard
    n_params = sum(p.numel() for p in model.parameters())
    model = parallelize(model, parallel)
    if hf and not cfg.resume and _weight_files(cfg.hf_dir):
        load_pretrained(model, cfg.hf_dir)  # each rank reads only its rows
    # Offloaded main weights live in host memory, where CUDA's fused AdamW cannot step them.
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay,
                            fused=device.type == "cuda" and cfg.offload == "none")
    tokenizer = load_tokenizer(cfg.hf_dir) if hf and has_tokenizer(cfg.hf_dir) else None
    tokens = load_tokens(cfg.data or None, tokenizer)
    train_data, val_data = TokenCorpus(tokens, split="train"), TokenCorpus(tokens, split="val")
    tokens_per_step = cfg.batch_size * cfg.seq_len * model.dp_size
    mesh = model.device_mesh
    layout = " x ".join(f"{name} {size}" for name, size in zip(mesh.mesh_dim_names, mesh.shape))
    ckpt_dir = os.path.join(cfg.out, "checkpoints")
    # Saved with every checkpoint: a resumed run keeps the schedule it started with.
    saved_config = asdict(replace(cfg, lr_decay_steps=cfg.lr_decay_steps or cfg.steps))
    first_step, resumed_from = 0, None
    if cfg.resume:
        resumed_from = find_checkpoint(cfg.resume)
        extra = load(resumed_from, model, opt)  # at any layout: checkpoints reshard
        first_step = int(extra["step"])  # the data position: batches are a function of the step
        torch.set_rng_state(extra["rng"])
        if device.type == "cuda" and "cuda_rng" in extra:
            torch.cuda.set_rng_state(extra["cuda_rng"], device)
    last_step = min(cfg.steps, cfg.stop_at) if cfg.stop_at else cfg.steps

    log = None
    if rank == 0:
        log = RunLog(cfg, history_of(resumed_from, first_step) if resumed_from else [])
        compute = cfg.precision if parallel.fp8 else ("bf16" if parallel.precision.param_dtype else "fp32")
        print(f"fsdp8 train: {cfg.model_name} ({n_params / 1e6:.2f}M params), {world} x {device.type} as {layout}, "
              f"strategy {cfg.strategy}, {compute} compute, "
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
        summary = log.finish({"config": asdict(cfg), "world_size": world, "layout": layout,
                              "tokens_per_step": tokens_per_step, "device": device.type, "params": n_params,
                              "steps_done": step_done, "resumed_from": resumed_from,
                              "elapsed_s": time.perf_counter() - start}, stopped_by)
    if stopped_by:
        raise Stopped(stopped_by)
    return summary
