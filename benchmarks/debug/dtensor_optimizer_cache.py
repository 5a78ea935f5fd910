"""Experiment (issue 17): does torch's DTensor sharding-propagation cache hit for the
optimizer step of a fully_shard model, step after step? py-spy of model A on an H100 (torch
2.11) showed ``propagate_op_sharding_non_cached`` in every step's optimizer. Prints, per step,
the cache's hits and misses and the ops that missed; for an op that missed in two steps, which
part of its schema differed.

    PYTHONPATH=$PWD python benchmarks/debug/dtensor_optimizer_cache.py
"""

from __future__ import annotations

import os
import sys
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._sharding_prop import LocalLRUCache

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import fsdp8  # noqa: E402
from fsdp8.models.llama import Llama, LlamaConfig  # noqa: E402


def main():
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29571")
    dist.init_process_group("gloo" if not torch.cuda.is_available() else "nccl", rank=0, world_size=1)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = fsdp8.fully_shard(Llama(LlamaConfig(vocab_size=128, dim=64, n_layers=4, n_heads=4, n_kv_heads=2,
                                                ffn_dim=128, max_seq_len=16)).to(device))
    prop = DTensor._op_dispatcher.sharding_propagator
    missed = defaultdict(list)
    original = prop.propagate_op_sharding_non_cached

    def recording(schema):  # called by the cache on a miss only
        missed[str(schema.op)].append(schema)
        return original(schema)
    prop.propagate_op_sharding = LocalLRUCache(recording)  # a fresh cache in front of the recorder
    print(f"torch {torch.__version__}, {device}")
    for fused in ((False, True) if device == "cuda" else (False,)):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=not fused, fused=fused)
        x = torch.randint(0, 128, (1, 16), device=device)
        for step in range(4):
            model(x).float().mean().backward()
            missed.clear()
            before = prop.propagate_op_sharding.cache_info()
            opt.step()
            opt.zero_grad(set_to_none=True)
            after = prop.propagate_op_sharding.cache_info()
            ops = {op: len(s) for op, s in missed.items()}
            print(f"{'fused' if fused else 'foreach'} step {step}: hits {after.hits - before.hits}, "
                  f"misses {after.misses - before.misses} {ops}")
            if step == 2:
                kept = {op: s[0] for op, s in missed.items()}
            if step == 3:
                for op, schemas in missed.items():
                    if op in kept:
                        a, b = kept[op], schemas[0]
                        diffs = [i for i, (x1, x2) in enumerate(zip(a.args_schema, b.args_schema)) if x1 != x2]
                        print(f"  {op}: equal {a == b}, hash equal {hash(a) == hash(b)}, args differing {diffs[:5]}, "
                              f"kwargs equal {a.kwargs_schema == b.kwargs_schema}")
                        if diffs:
                            i = diffs[0]
                            print(f"    arg {i}: {str(a.args_schema[i])[:300]}\n    vs     {str(b.args_schema[i])[:300]}")
                        else:
                            ka, kb = a.kwargs_schema, b.kwargs_schema
                            print(f"    kwargs differing: {[k for k in ka if ka.get(k) != kb.get(k)][:5]}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
