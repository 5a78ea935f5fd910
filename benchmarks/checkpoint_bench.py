"""Checkpoint save/load cost for the ~1B preset on the GPUs here (torchrun, one process a GPU).

    torchrun --nproc_per_node 2 benchmarks/checkpoint_bench.py --dir /tmp/ckpt

Measures, after one training step (so AdamW state exists): a synchronous save (training is
blocked for all of it), an asynchronous save (blocked only while the state is copied to host
memory; written and published in the background), and a load; bytes on disk.
"""

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fsdp8  # noqa: E402
from fsdp8.models.llama import Llama, preset  # noqa: E402


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    dist.barrier()


def du(path):
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dir", default="/tmp/fsdp8-ckpt")
    p.add_argument("--preset", default="1b")
    args = p.parse_args()
    fsdp8.init_distributed()
    rank = dist.get_rank()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Llama(preset(args.preset))
    n = model.num_params()
    model = fsdp8.fully_shard(model, precision=fsdp8.Precision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=torch.cuda.is_available())
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = preset(args.preset)
    x = torch.randint(0, cfg.vocab_size, (1, min(512, cfg.max_seq_len)), device=device)
    model(x, x).backward()
    opt.step()
    opt.zero_grad()
    if rank == 0:
        shutil.rmtree(args.dir, ignore_errors=True)
    _sync()
    rows = []
    t0 = time.perf_counter()
    fsdp8.save(os.path.join(args.dir, "sync"), model, opt, extra={"step": 1})
    _sync()
    rows.append(("save (sync)", time.perf_counter() - t0, time.perf_counter() - t0))
    t0 = time.perf_counter()
    future = fsdp8.save(os.path.join(args.dir, "async"), model, opt, extra={"step": 1}, async_save=True)
    blocked = time.perf_counter() - t0
    model(x, x).backward()  # training goes on meanwhile
    opt.step()
    opt.zero_grad()
    future.result()
    _sync()
    rows.append(("save (async)", blocked, time.perf_counter() - t0))
    t0 = time.perf_counter()
    fsdp8.load(os.path.join(args.dir, "sync"), model, opt)
    _sync()
    rows.append(("load", time.perf_counter() - t0, time.perf_counter() - t0))
    if rank == 0:
        size = du(os.path.join(args.dir, "sync"))
        print(f"\n## checkpoint of preset {args.preset} ({n / 1e9:.2f} B params), {dist.get_world_size()} ranks, "
              f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}, torch {torch.__version__}")
        print(f"bytes on disk: {size / 2**30:.2f} GiB (fp32 main weights + AdamW moments + step)\n")
        print("| operation | training blocked s | total s | GiB/s (total) |")
        print("|---|---|---|---|")
        for name, blocked_s, total_s in rows:
            print(f"| {name} | {blocked_s:.2f} | {total_s:.2f} | {size / 2**30 / total_s:.2f} |")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
