"""`fsdp8 bench` on the CPU: two gloo workers train the tiny preset for 2 steps and print the
measurements beside the planner's prediction; bad flags are refused before a worker starts."""

import json
import os
import subprocess
import sys

import pytest


def test_bench_tiny_on_two_cpu_workers(tmp_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, "-m", "fsdp8.cli", "bench", "--model", "tiny", "--steps", "2", "--warmup", "1",
                           "--json"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert (result["world"], result["device"]) == (2, "cpu")
    measured, predicted, ratio = result["measured"], result["predicted"], result["ratio"]
    for key in ("tokens_per_s_per_gpu", "step_ms", "mfu", "exposed_comm_ms"):
        assert measured[key] > 0 and predicted[key] > 0, key
        assert ratio[key] == pytest.approx(measured[key] / predicted[key])
    assert measured["peak_allocated_gib"] is None and ratio["peak_allocated_gib"] is None  # not measured on a CPU
    assert result["plan"]["memory"]["report"]["strategy"] == "optim_grads_params"


@pytest.mark.parametrize("argv,message", [
    (["--steps", "0"], "--steps must be >= 1"),
    (["--tp", "3"], "tp 3 = 3 does not divide the 2 ranks (1 x 2 cpu)"),
    (["--micro-batch", "0"], "--micro-batch must be >= 1"),
    (["--fp8", "current", "--offload", "optim"], "offload"),
    (["--model", "tiny", "--dp-replicate", "3"], "does not divide the 2 ranks"),
])
def test_bench_bad_flags_fail_in_one_line(capsys, monkeypatch, argv, message):
    from fsdp8 import cli

    monkeypatch.setattr(cli, "launch", lambda *a, **k: pytest.fail("a worker was started"))
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit):
        cli.main(["bench", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fsdp8 bench: error: ") and message in err[0], err
