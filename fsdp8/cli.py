"""The ``fsdp8`` command line: ``fsdp8 train`` (the main job) and ``fsdp8 export``."""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields
from typing import List, Optional

from .config import STRATEGY_NAMES
from .launch import launch
from .models.llama import PRESETS
from .train import PRECISIONS, TrainConfig, train


def _train_parser(sub) -> None:
    p = sub.add_parser("train", help="train the built-in Llama on the built-in corpus",
                       description="Train the built-in Llama on the built-in corpus: all local GPUs, or "
                                   "2 gloo worker processes on a CPU-only machine. Works under torchrun too.")
    defaults = TrainConfig()
    p.add_argument("--steps", type=int, default=defaults.steps)
    p.add_argument("--preset", choices=sorted(PRESETS), default=defaults.preset)
    p.add_argument("--strategy", choices=STRATEGY_NAMES, default=defaults.strategy)
    p.add_argument("--precision", choices=PRECISIONS, default=defaults.precision,
                   help="compute dtype; auto = bf16 on GPUs, fp32 on CPUs; fp8-* = bf16 with FP8 GEMMs and "
                        "8-bit weight all-gathers in the blocks (main weights stay fp32)")
    p.add_argument("--nproc", type=int, default=None, help="worker processes (default: all GPUs, or 2 on CPU)")
    p.add_argument("--out", default=defaults.out, help="directory for metrics.jsonl, loss.png, summary.json")
    p.add_argument("--batch-size", type=int, default=defaults.batch_size, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, default=defaults.seq_len)
    p.add_argument("--micro-batches", type=int, default=defaults.micro_batches)
    p.add_argument("--lr", type=float, default=defaults.lr)
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--log-every", type=int, default=defaults.log_every)
    p.add_argument("--eval-every", type=int, default=defaults.eval_every)
    p.add_argument("--save-every", type=int, default=defaults.save_every,
                   help="checkpoint every N steps under OUT/checkpoints (0: never)")
    p.add_argument("--keep-last", type=int, default=defaults.keep_last, help="checkpoints to keep")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint under OUT/checkpoints")
    p.add_argument("--stop-at", type=int, default=defaults.stop_at,
                   help="stop after this step with a checkpoint, as if interrupted (0: run to --steps)")
    p.add_argument("--async-save", action="store_true", help="write checkpoints in the background")


def _export_parser(sub) -> None:
    p = sub.add_parser("export", help="write a checkpoint's model weights as safetensors",
                       description="Read an fsdp8 (or any DCP) checkpoint in this one process and write its "
                                   "model weights, in full, to OUT/model.safetensors.")
    p.add_argument("checkpoint")
    p.add_argument("out")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="cast floating weights (default: as saved, fp32 main weights)")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="fsdp8", description="Sharded data-parallel training with FP8.")
    sub = parser.add_subparsers(dest="command", required=True)
    _train_parser(sub)
    _export_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "export":
        import torch

        from .checkpoint import export

        target = export(args.checkpoint, args.out, getattr(torch, args.dtype) if args.dtype else None)
        print(f"wrote {target}", file=sys.stderr)
        return 0
    if args.command == "train":
        names = {f.name for f in fields(TrainConfig)}
        try:
            cfg = TrainConfig(**{k: v for k, v in vars(args).items() if k in names})
        except ValueError as e:
            parser.error(str(e))
        launch(train, (cfg,), nproc=args.nproc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
