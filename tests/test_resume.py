"""`fsdp8 train` survives interruption and bad steps: resume exactness, NaN steps skipped."""

import json
import os
import subprocess
import sys

import torch

from fsdp8.checkpoint.transfer import read_full_state

COMMON = ["--steps", "10", "--log-every", "5", "--eval-every", "5"]


def _train(tmp_path, out, *args, env_extra=None):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env.update(env_extra or {})
    proc = subprocess.run([sys.executable, "-m", "fsdp8.cli", "train", "--out", str(tmp_path / out), *COMMON, *args],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _tensors(state, prefix=""):
    if isinstance(state, torch.Tensor):
        yield prefix, state
    elif isinstance(state, dict):
        for k, v in state.items():
            yield from _tensors(v, f"{prefix}.{k}" if prefix else str(k))


def test_resume_is_bit_for_bit(tmp_path):
    _train(tmp_path, "straight", "--save-every", "5")
    _train(tmp_path, "resumed", "--stop-at", "5")  # new processes from here on
    _train(tmp_path, "resumed", "--resume", "--save-every", "5")
    a = dict(_tensors(read_full_state(str(tmp_path / "straight" / "checkpoints" / "step-000010"))))
    b = dict(_tensors(read_full_state(str(tmp_path / "resumed" / "checkpoints" / "step-000010"))))
    assert set(a) == set(b) and any(k.startswith("optim.state") for k in a)
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, different[:5]  # weights and optimizer state, bit for bit
    straight = [json.loads(l) for l in open(tmp_path / "straight" / "metrics.jsonl")]
    resumed = [json.loads(l) for l in open(tmp_path / "resumed" / "metrics.jsonl")]
    loss = lambda recs: [(r["step"], r["loss"]) for r in recs if "loss" in r]  # noqa: E731
    assert loss(straight) == loss(resumed)


def test_nan_in_one_ranks_batch_is_reported_and_skipped(tmp_path):
    proc = _train(tmp_path, "nan", env_extra={"FSDP8_FAULT": "nan_loss:3:1"})  # step 4 on rank 1
    assert "step 4: gradient norm is nan" in proc.stderr and "step skipped" in proc.stderr
    summary = json.loads((tmp_path / "nan" / "summary.json").read_text())
    assert summary["skipped_steps"] == [4]
    assert summary["final_loss"] == summary["final_loss"] and summary["final_loss"] < summary["first_loss"]
