"""GPU-only checks run on every rank (NCCL)."""

from __future__ import annotations

import torch

import fsdp8
from fsdp8.models.llama import Llama, LlamaConfig


def sync_free_step(strategy: str) -> bool:
    """A whole training step under torch.cuda.set_sync_debug_mode('error')."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, dim=256, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=768, max_seq_len=128)
    model = fsdp8.fully_shard(Llama(cfg), strategy=strategy,
                              precision=fsdp8.Precision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    x = torch.randint(0, 512, (4, 128), device="cuda")
    y = torch.randint(0, 512, (4, 128), device="cuda")

    def step():
        model(x, y).backward()
        fsdp8.clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):  # first iteration records the order; second warms caches
        step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    return True


def fsdp1_delayed_histories():
    from tests.dist import fp8_fsdp_interop_workers as workers

    count, history = workers.fsdp1_delayed(True)
    return count, history
