"""The main job end to end: `fsdp8 train` launches its own gloo workers, and runs under torchrun."""

import json
import os
import subprocess
import sys

import pytest


def _run(args, tmp_path, timeout=300):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)


def test_fsdp8_train_30_steps_loss_falls(tmp_path):
    out = tmp_path / "run"
    proc = _run([sys.executable, "-m", "fsdp8.cli", "train", "--steps", "30", "--out", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2
    # ln(256) = 5.5 at init; 30 steps of the tiny preset reach about 2.5.
    assert summary["final_loss"] < summary["first_loss"] - 1.0, summary
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [10, 20, 30]
    assert all(r["tokens_per_s"] > 0 and r["max_mem_mib"] > 0 for r in records if "loss" in r)
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "step 30/30" in proc.stderr and "memory per rank" in proc.stderr


def test_fsdp8_train_under_torchrun(tmp_path):
    out = tmp_path / "run"
    proc = _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "fsdp8.cli", "train",
                 "--steps", "4", "--log-every", "2", "--eval-every", "4", "--strategy", "optim", "--out", str(out)],
                tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((out / "summary.json").read_text())["world_size"] == 2


@pytest.mark.parametrize("args,message", [
    (["--steps", "0"], "--steps must be >= 1"),
    (["--strategy", "zero9"], "invalid choice: 'zero9'"),
    (["--batch-size", "8", "--micro-batches", "3"], "not divisible by --micro-batches 3"),
])
def test_fsdp8_train_bad_flags(tmp_path, args, message):
    proc = _run([sys.executable, "-m", "fsdp8.cli", "train", *args], tmp_path, timeout=60)
    assert proc.returncode != 0 and message in proc.stderr


def test_readme_quickstart_runs(tmp_path):
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "quickstart.py")
    proc = _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", script], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tensors, e.g. embed.weight" in proc.stdout and "memory per rank" in proc.stdout
