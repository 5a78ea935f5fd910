"""`fsdp8 train` on the test pool's gloo ranks: what the command's spawned workers run
(fsdp8/app/train/command.py), without starting a launcher and workers (about 20 s of imports on a
2-core machine) for tests that train many times."""

from __future__ import annotations

import os
from typing import List, Optional


def train_on_pool(argv: List[str]) -> Optional[dict]:
    """``fsdp8 train ARGV`` (a fresh ``--out``) on this rank; rank 0 returns the run's summary."""
    import torch.distributed as dist

    from fsdp8.app.cli import build_parser
    from fsdp8.app.train.command import train_worker
    from fsdp8.app.train.config import TrainConfig

    args = build_parser().parse_args(["train", *argv])
    settings = {k: v for k, v in vars(args).items() if k not in ("command", "nproc")}
    cfg = TrainConfig.from_settings(settings)
    if dist.get_rank() == 0:
        os.makedirs(cfg.out, exist_ok=False)
    dist.barrier()
    return train_worker(cfg)
