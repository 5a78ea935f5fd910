"""`fsdp8 bench` on the CPU: two gloo workers train the tiny preset for 2 steps and print the
measurements beside the planner's prediction; bad flags are refused before a worker starts."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("layout,mesh", [([], "dp_shard 2 x cp 1"), (["--cp", "2"], "dp_shard 1 x cp 2")])
def test_bench_tiny_on_two_cpu_workers(tmp_path, layout, mesh):
    # As `python -m fsdp8` (fsdp8/__main__.py): spawned workers must not run the command again.
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, "-m", "fsdp8", "bench", "--model", "tiny", "--steps", "2", "--warmup", "1",
                           "--json", *layout], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "USDT" not in proc.stderr, proc.stderr  # kineto's profiler markers
    result = json.loads(proc.stdout)
    assert (result["world"], result["device"]) == (2, "cpu")
    assert mesh in result["setup"], result["setup"]
    measured, predicted, ratio = result["measured"], result["predicted"], result["ratio"]
    for key in ("tokens_per_s_per_gpu", "step_ms", "mfu", "exposed_comm_ms"):
        assert measured[key] > 0 and predicted[key] > 0, key
        assert ratio[key] == pytest.approx(measured[key] / predicted[key])
    assert measured["peak_allocated_gib"] is None and ratio["peak_allocated_gib"] is None  # not measured on a CPU
    assert result["plan"]["memory"]["report"]["strategy"] == "optim_grads_params"
    # The host probe measured this machine; the prediction's host is its figures' sum, and the
    # per-op model's step is there to compare.
    host, time = result["host"], result["plan"]["time"]
    assert time["host_measured"] and host["probe_ms"]["layer_bwd"] > 0
    probe = host["probe_ms"]
    layers = result["plan"]["model"]["layers"]
    assert time["host"] * 1e3 == pytest.approx(layers * (probe["layer_fwd"] + probe["layer_bwd"]) + probe["root_fwd"]
                                               + probe["root_bwd"])
    assert host["per_op_model_step_ms"] > 0 and host["per_op_model_step_ms"] != pytest.approx(predicted["step_ms"])


@pytest.mark.parametrize("argv,message", [
    (["--steps", "0"], "--steps must be >= 1"),
    (["--tp", "3"], "tp 3 = 3 does not divide the 2 ranks (1 x 2 cpu)"),
    (["--micro-batch", "0"], "--micro-batch must be >= 1"),
    (["--fp8", "current", "--offload", "optim"], "offload"),
    (["--model", "tiny", "--dp-replicate", "3"], "does not divide the 2 ranks"),
    (["--cp", "2", "--seq-len", "130"], "seq_len 130 is not a multiple of 2 x cp = 4"),
    (["--cp", "2", "--ac", "selective"], "selective"),
])
def test_bench_bad_flags_fail_in_one_line(capsys, monkeypatch, argv, message):
    from fsdp8.app import cli
    from fsdp8.app.bench import command as bench_command

    monkeypatch.setattr(bench_command, "launch", lambda *a, **k: pytest.fail("a worker was started"))
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit):
        cli.main(["bench", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fsdp8 bench: error: ") and message in err[0], err


def test_bench_of_an_hf_model_without_transformers_names_the_extra(capsys, monkeypatch):
    from fsdp8.app import cli
    from fsdp8.app.bench import command as bench_command

    monkeypatch.setattr(bench_command, "launch", lambda *a, **k: pytest.fail("a worker was started"))
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    with pytest.raises(SystemExit):
        cli.main(["bench", "--model", "hf:somewhere"])
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["fsdp8 bench: error: --model hf:somewhere needs transformers (import of transformers halted; None "
                   "in sys.modules); install fsdp8's Hugging Face extra: pip install -e \".[hf]\" (fsdp8 plan reads "
                   "hf:DIR without it)"], err


def test_bench_at_a_loopback_world_of_two(tmp_path):
    """benchmarks/bench_loopback.py: one process plays rank 0 of 2 (gloo-free, loopback
    collectives); the prediction beside it has no communication."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    script = os.path.join(REPO, "benchmarks", "bench_loopback.py")
    proc = subprocess.run([sys.executable, script, "--world", "2", "--model", "tiny", "--steps", "2", "--warmup", "1",
                           "--json"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert result["world"] == 2 and "dp_shard 2" in result["setup"]
    assert result["measured"]["step_ms"] > 0
    assert result["predicted"]["exposed_comm_ms"] < 1e-3 and result["ratio"]["exposed_comm_ms"] is None
    comm = result["plan"]["communication"]
    assert comm and all(c["seconds"] < 1e-9 for c in comm), comm
