"""`fsdp8 train` survives interruption and bad steps: resume exactness, what a resumed run
remembers, exporting a run's latest checkpoint, NaN steps skipped."""

import json
import os
import subprocess
import sys

import pytest
import torch

from fsdp8 import cli
from fsdp8.checkpoint.transfer import read_full_state

COMMON = ["--log-every", "5", "--eval-every", "5"]


def _train(tmp_path, out, *args, env_extra=None):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env.update(env_extra or {})
    where = ["--out", str(tmp_path / out)] if out else []
    proc = subprocess.run([sys.executable, "-m", "fsdp8.cli", "train", *where, *COMMON, *args],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """10 steps straight; and 5 steps, then a resume (new processes) given only the run
    directory and a longer --steps: --save-every and the LR schedule come from the checkpoint."""
    tmp = tmp_path_factory.mktemp("resume")
    straight = _train(tmp, "straight", "--steps", "10", "--save-every", "5")
    _train(tmp, "resumed", "--steps", "10", "--stop-at", "5", "--save-every", "5")
    resumed = _train(tmp, None, "--resume", str(tmp / "resumed"), "--steps", "12")
    return tmp, straight, resumed


def _tensors(state, prefix=""):
    if isinstance(state, torch.Tensor):
        yield prefix, state
    elif isinstance(state, dict):
        for k, v in state.items():
            yield from _tensors(v, f"{prefix}.{k}" if prefix else str(k))


def _metrics(run):
    return [json.loads(line) for line in open(run / "metrics.jsonl")]


def test_resume_is_bit_for_bit(runs):
    tmp, _, _ = runs
    a = dict(_tensors(read_full_state(str(tmp / "straight" / "checkpoints" / "step-000010"))))
    b = dict(_tensors(read_full_state(str(tmp / "resumed" / "checkpoints" / "step-000010"))))
    assert set(a) == set(b) and any(k.startswith("optim.state") for k in a)
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, different[:5]  # weights and optimizer state, bit for bit
    def losses(run):
        return [(r["step"], r["loss"], r["lr"]) for r in _metrics(run) if "loss" in r and r["step"] <= 10]

    assert losses(tmp / "straight") == losses(tmp / "resumed")  # the LR schedule kept its 10 steps


def test_a_resumed_run_covers_the_whole_run(runs):
    tmp, straight, resumed = runs
    assert sorted(os.listdir(tmp / "resumed" / "checkpoints")) == ["step-000005", "step-000010"]  # --save-every 5
    steps = [r["step"] for r in _metrics(tmp / "resumed") if "loss" in r]
    assert steps == [5, 10, 12]  # the first part's records kept, none twice
    first = json.loads((tmp / "straight" / "summary.json").read_text())
    summary = json.loads((tmp / "resumed" / "summary.json").read_text())
    assert summary["first_loss"] == first["first_loss"] and summary["steps_done"] == 12
    assert summary["resumed_from"].endswith("step-000005") and summary["config"]["save_every"] == 5
    # One line per checkpoint written.
    assert straight.stderr.count("saved checkpoint") == 2 and resumed.stderr.count("saved checkpoint") == 1


def test_resume_with_another_preset_names_the_checkpoints(runs, capsys):
    tmp, _, _ = runs
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", "--resume", str(tmp / "resumed"), "--preset", "small"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "step-000010 holds the 'tiny' preset, not 'small'" in err


@pytest.mark.parametrize("given", ["resumed", "resumed/checkpoints"])
def test_export_takes_the_latest_checkpoint_of_a_run(runs, capsys, given):
    tmp, _, _ = runs
    assert cli.main(["export", str(tmp / given), str(tmp / "export")]) == 0
    ckpt = tmp / "resumed" / "checkpoints" / "step-000010"
    assert capsys.readouterr().err.strip() == f"wrote {tmp / 'export' / 'model.safetensors'} from {ckpt}"


def test_nan_in_one_ranks_batch_is_reported_and_skipped(tmp_path):
    proc = _train(tmp_path, "nan", "--steps", "10", env_extra={"FSDP8_FAULT": "nan_loss:3:1"})  # step 4 on rank 1
    assert "step 4: gradient norm is nan" in proc.stderr and "step skipped" in proc.stderr
    summary = json.loads((tmp_path / "nan" / "summary.json").read_text())
    assert summary["skipped_steps"] == [4]
    assert summary["final_loss"] == summary["final_loss"] and summary["final_loss"] < summary["first_loss"]
