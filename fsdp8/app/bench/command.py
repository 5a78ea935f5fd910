"""``fsdp8 bench``, the command: its flags, the BenchConfig they make (checked before a worker
starts), and the launch."""

from __future__ import annotations

import argparse
import os

from ...planner.hardware import GPUS
from ..args import PRECISIONS, fail, given, layout_flags, model_flags, parallel_from_flags, sizes
from ..failures import Reporting
from ..launch import launch, resolve_nproc, under_torchrun
from .bench import bench
from .config import BenchConfig


def add_parser(sub) -> None:
    d = BenchConfig()
    p = sub.add_parser("bench", help="measure a configuration here, beside the planner's prediction",
                       description="Train a configuration for a few steps on this machine (all GPUs, or 2 gloo workers "
                                   "on a CPU) and print tokens/s/GPU, MFU, peak memory and exposed communication beside "
                                   "the planner's prediction and their ratio.")
    model_flags(p, d.model, ": needs transformers")
    p.add_argument("--steps", type=int, default=d.steps, help="timed steps (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=d.warmup, help="steps before timing (default: %(default)s)")
    p.add_argument("--accumulation", type=int, default=d.accumulation,
                   help="micro-batches per optimizer step (default: %(default)s)")
    p.add_argument("--precision", default="auto", choices=PRECISIONS,
                   help="compute dtype; auto = bf16 on GPUs, fp32 on CPUs (default: %(default)s)")
    p.add_argument("--gpu", choices=sorted(GPUS), help="the planner's GPU (default: the one found here)")
    p.add_argument("--nproc", type=int, help="worker processes (default: all GPUs, or 2 on CPU; under torchrun, "
                                             "torchrun's)")
    p.add_argument("--no-host-probe", dest="host_probe", action="store_false",
                   help="predict the host's cost of issuing kernels from fixed per-op costs instead of measuring this "
                        "machine's on a tiny copy of the configuration first (a few seconds)")
    layout_flags(p)


def bench_config(args: argparse.Namespace) -> BenchConfig:
    """The BenchConfig of parsed ``fsdp8 bench`` flags."""
    return BenchConfig(model=args.model, sizes={k: v for k, v in sizes(args).items() if v is not None},
                       seq_len=given(args.seq_len, BenchConfig.seq_len),
                       micro_batch=given(args.micro_batch, BenchConfig.micro_batch),
                       accumulation=args.accumulation, steps=args.steps, warmup=args.warmup,
                       parallel=parallel_from_flags(vars(args)), gpu=args.gpu, json=args.json,
                       host_probe=args.host_probe)


def run(args: argparse.Namespace) -> int:
    try:
        cfg = bench_config(args)
        nproc = None if under_torchrun() else resolve_nproc(args.nproc)
        cfg.check(int(os.environ["WORLD_SIZE"]) if under_torchrun() else nproc)
    except (ValueError, FileNotFoundError, NotImplementedError) as e:
        fail("bench", str(e))
    return launch(bench, (cfg,), nproc=nproc, reporting=Reporting("fsdp8 bench"))
