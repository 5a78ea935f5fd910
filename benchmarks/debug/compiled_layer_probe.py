"""What one decoder layer keeps for backward and how long its forward and backward take, eager
against compiled, on one GPU: the per-layer figures the planner's compiled mode is fitted to.

Each configuration is built twice, with 1 and with 2 layers, under ``fsdp8.parallelize`` at world 1;
the difference of the two is one layer: the bytes allocated between the start of forward and the
loss (what autograd keeps), and the time of a forward and backward (no optimizer), the median of
``--steps`` after ``--warmup``.

    python3 benchmarks/debug/compiled_layer_probe.py --families hf,fsdp8 --fp8 none,current
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import fsdp8  # noqa: E402
from fsdp8.app.train.loop import model_loss  # noqa: E402
from fsdp8.config import BF16_MIXED  # noqa: E402


def build(family: str, layers: int, a: argparse.Namespace, compile_: bool, fp8: str):
    torch.manual_seed(0)
    with torch.device("meta"):
        if family == "hf":
            from transformers import LlamaConfig, LlamaForCausalLM

            cfg = LlamaConfig(hidden_size=a.hidden, intermediate_size=a.ffn, num_hidden_layers=layers,
                              num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, vocab_size=a.vocab,
                              max_position_embeddings=a.seq)
            cfg._attn_implementation = "sdpa"
            model = LlamaForCausalLM(cfg)
        else:
            from fsdp8.models.llama import Llama, LlamaConfig

            model = Llama(LlamaConfig(vocab_size=a.vocab, dim=a.hidden, n_layers=layers, n_heads=a.heads,
                                      n_kv_heads=a.kv_heads, ffn_dim=a.ffn, max_seq_len=a.seq))
    config = fsdp8.ParallelConfig(compile=compile_, precision=BF16_MIXED,
                                  fp8=None if fp8 == "none" else fsdp8.Float8CurrentScaling())
    return fsdp8.parallelize(model, config)


def _sync(a: argparse.Namespace) -> None:
    if a.device == "cuda":
        torch.cuda.synchronize()


def _allocated(a: argparse.Namespace) -> int:
    return torch.cuda.memory_allocated() if a.device == "cuda" else 0


def measure(family: str, layers: int, a: argparse.Namespace, compile_: bool, fp8: str) -> dict:
    model = build(family, layers, a, compile_, fp8)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=g).to(a.device)
    batch = ({"input_ids": x[:, :-1], "labels": x[:, :-1]} if family == "hf"
             else {"tokens": x[:, :-1], "targets": x[:, 1:]})
    kept, times = [], []
    for i in range(a.warmup + a.steps):
        _sync(a)
        before = _allocated(a)
        start = time.perf_counter()
        loss = model_loss(model, batch, family == "hf")
        _sync(a)
        kept.append(_allocated(a) - before)
        loss.backward()
        _sync(a)
        times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    del model, loss
    if a.device == "cuda":
        torch.cuda.empty_cache()
    return {"kept": statistics.median(kept[a.warmup:]), "ms": 1e3 * statistics.median(times[a.warmup:])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", default="hf,fsdp8")
    p.add_argument("--fp8", default="none,current")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=14336)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a smoke test (no memory figures)")
    p.add_argument("--out", default=None, help="write the rows as JSON here too")
    a = p.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    if a.device == "cuda":
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    else:
        dist.init_process_group("gloo", rank=0, world_size=1)
    tokens = a.batch * a.seq
    rows = []
    print(f"{'family':6} {'fp8':8} {'mode':8} {'kept B/token/layer':>19} {'fwd+bwd ms/layer':>17}", flush=True)
    for family in a.families.split(","):
        for fp8 in a.fp8.split(","):
            for compile_ in (False, True):
                one, two = (measure(family, n, a, compile_, fp8) for n in (1, 2))
                row = {"family": family, "fp8": fp8, "compile": compile_, "tokens": tokens,
                       "kept_per_token": (two["kept"] - one["kept"]) / tokens, "layer_ms": two["ms"] - one["ms"],
                       "one_layer": one, "two_layers": two}
                rows.append(row)
                print(f"{family:6} {fp8:8} {'compiled' if compile_ else 'eager':8} {row['kept_per_token']:19.0f} "
                      f"{row['layer_ms']:17.2f}", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"args": vars(a), "torch": torch.__version__,
                                           "gpu": torch.cuda.get_device_name() if a.device == "cuda" else "cpu", "rows": rows}, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
