"""Running a benchmark script of benchmarks/ under torchrun on CPU ranks, as the tests of its harness do."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def torchrun_benchmark(script: str, args: list, cwd: Path, timeout: int = 300, nproc: int = 2) -> dict:
    """``benchmarks/<script>`` on ``nproc`` gloo ranks with ``args`` (which name ``--out``, read back):
    its results by stack. The caller's torchrun variables are dropped so the run makes its own group."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
                           str(REPO / "benchmarks" / script), *map(str, args)],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = Path(args[args.index("--out") + 1])
    return {r["stack"]: r for r in json.loads(out.read_text())["results"]}
