"""`fsdp8 bench` at a world of N on one device, with loopback collectives (fsdp8/app/bench/loopback.py).

    python benchmarks/bench_loopback.py --world 2 [fsdp8 bench flags]

One process plays rank 0 of N: shards, gathers, packs and the optimizer are those of N
ranks, and every collective is a local copy. So the step measured is the N-GPU step minus
communication, and the planner's prediction beside it is made with free communication
(fsdp8.app.bench.bench.without_network). Never a judge of numerics (see loopback.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fsdp8.app.bench.bench import bench  # noqa: E402
from fsdp8.app.bench.command import bench_config  # noqa: E402
from fsdp8.app.bench.loopback import init_loopback  # noqa: E402
from fsdp8.app.cli import build_parser  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2, help="the world this process plays rank 0 of (default: 2)")
    args, rest = p.parse_known_args(argv)
    cfg = bench_config(build_parser().parse_args(["bench", *rest]))
    cfg.check(args.world)  # bad flags: a clear error before any group exists
    init_loopback(args.world)
    bench(cfg, network=False)


if __name__ == "__main__":
    main()
