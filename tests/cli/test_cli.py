"""The main job end to end: `fsdp8 train` launches its own gloo workers, and runs under torchrun.
(Its outputs - summary, metrics, plot, progress lines - are checked on the bf16 run of
tests/cli/test_convergence.py, which CI makes anyway.)"""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(args, tmp_path, timeout=300):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)


def test_fsdp8_train_under_torchrun(tmp_path):
    out = tmp_path / "run"
    proc = _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "fsdp8", "train",
                 "--steps", "4", "--log-every", "2", "--eval-every", "4", "--strategy", "optim", "--out", str(out)],
                tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((out / "summary.json").read_text())["world_size"] == 2


@pytest.mark.parametrize("args,message", [
    (["--steps", "0"], "--steps must be >= 1"),
    (["--strategy", "zero9"], "invalid choice: 'zero9'"),
    (["--batch-size", "8", "--micro-batches", "3"], "not divisible by --micro-batches 3"),
])
def test_fsdp8_train_bad_flags(capsys, args, message):
    # Rejected while parsing, before any worker starts, so in this process.
    from fsdp8.app import cli

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", *args])
    assert exit_info.value.code != 0 and message in capsys.readouterr().err


def test_readme_quickstart_runs(tmp_path):
    script = os.path.join(REPO, "examples", "quickstart.py")
    proc = _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", script], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tensors, e.g. embed.weight" in proc.stdout and "memory per rank" in proc.stdout


def test_python_m_fsdp8_is_the_command(monkeypatch, capsys):
    import runpy

    monkeypatch.setattr(sys, "argv", ["fsdp8", "--version"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module("fsdp8", run_name="__main__")
    assert exit_info.value.code == 0 and capsys.readouterr().out.startswith("fsdp8 ")


def test_parallelize_example_without_transformers_says_what_to_install(monkeypatch):
    import runpy

    script = os.path.join(REPO, "examples", "parallelize.py")
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(script, run_name="__main__")
    assert exit_info.value.code == ("examples/parallelize.py needs transformers (import of transformers halted; None in "
                                    "sys.modules): pip install -e \".[hf]\"")


def test_readme_parallelize_example_runs(tmp_path):
    script = os.path.join(REPO, "examples", "parallelize.py")
    proc = _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", script], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [float(line.split()[-1]) for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert len(losses) == 4 and losses[-1] < losses[0] - 1.0, proc.stdout  # it learns
    assert "tp=2" in proc.stdout and "memory per rank" in proc.stdout
