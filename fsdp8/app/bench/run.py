"""One benchmarked configuration's model and its training step, as ``fsdp8 bench`` times it (and
its host probe, host.py, runs it small)."""

from __future__ import annotations

import contextlib
import time
from typing import Callable, List, Optional, Tuple

import torch

from ...engine.grads import clip_grad_norm_
from ...models.llama import Llama, LlamaConfig
from ...parallel.manager import parallelize
from ...planner.model import ModelSpec
from ..train.loop import micro_batches, model_loss
from .config import BenchConfig

# One step's host-side times: (seconds of every micro-batch's forward, seconds of the whole step).
StepTimes = Tuple[float, float]


def build(cfg: BenchConfig, spec: ModelSpec):
    """The model of ``spec``'s sizes on the meta device, and whether it is a Hugging Face model.
    For ``hf:DIR`` the directory's config is read and ``spec``'s sizes written over it, so a
    resized spec (the host probe's) builds the same architecture smaller."""
    if cfg.model is not None and cfg.model.startswith("hf:"):
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(cfg.model[3:])
        text = getattr(config, "text_config", None) or config
        sizes = {"num_hidden_layers": spec.layers, "hidden_size": spec.hidden, "intermediate_size": spec.ffn,
                 "vocab_size": spec.vocab, "head_dim": spec.hd}
        for name, value in sizes.items():
            if getattr(text, name, None) != value:
                setattr(text, name, value)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        return model, True
    config = LlamaConfig(vocab_size=spec.vocab, dim=spec.hidden, n_layers=spec.layers, n_heads=spec.heads,
                         n_kv_heads=spec.kv_heads, ffn_dim=spec.ffn, max_seq_len=cfg.seq_len, tie_embeddings=spec.tied)
    with torch.device("meta"):
        model = Llama(config)
    return model, False


def trainer(cfg: BenchConfig, spec: ModelSpec, device: torch.device) -> Callable[[int], StepTimes]:
    """``spec``'s model under ``cfg``'s parallel layout with AdamW, as one function: ``step(i)``
    trains on the i-th random batch (every rank draws the same, then takes its share), waits for
    the device, and returns the host's times."""
    from torch.distributed.tensor.parallel import loss_parallel

    cuda = device.type == "cuda"
    torch.manual_seed(cfg.seed)
    model, hf = build(cfg, spec)
    model = parallelize(model, cfg.parallel)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)

    def step(i: int) -> StepTimes:
        start = time.perf_counter()
        forward = 0.0
        g = torch.Generator().manual_seed(cfg.seed * 100003 + i)
        rows = cfg.micro_batch * cfg.accumulation * model.dp_size
        tokens = torch.randint(0, spec.vocab, (rows, cfg.seq_len + 1), generator=g).to(device)
        x, y = tokens[:, :-1], tokens[:, 1:]
        # As fsdp8 train feeds them: HF models shift their labels themselves.
        batch = model.shard_batch({"input_ids": x, "labels": x} if hf else {"tokens": x, "targets": y})
        for mb, part in enumerate(micro_batches(batch, cfg.accumulation)):
            with model.no_sync() if mb < cfg.accumulation - 1 else contextlib.nullcontext(), \
                    loss_parallel() if cfg.parallel.loss_parallel else contextlib.nullcontext():
                begin = time.perf_counter()
                loss = model_loss(model, part, hf)
                forward += time.perf_counter() - begin
                # With cp the loss is already a sum over the step's divisor (see fsdp8 train).
                (loss if "num_items_in_batch" in part else loss / cfg.accumulation).backward()
        clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        return forward, time.perf_counter() - start

    return step


def run_steps(step: Callable[[int], StepTimes], warmup: int, steps: int, first: int = 0,
              after_warmup: Optional[Callable[[], None]] = None) -> List[StepTimes]:
    """``warmup`` untimed steps, then ``steps`` whose times are returned."""
    for i in range(first, first + warmup):
        step(i)
    if after_warmup is not None:
        after_warmup()
    return [step(i) for i in range(first + warmup, first + warmup + steps)]
