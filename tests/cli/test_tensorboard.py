"""`fsdp8 train --tensorboard DIR`: the metrics as TensorBoard events, read back with
TensorBoard's own reader; a missing package is one line before any worker starts."""

import json
import sys

import pytest
import torch
import torch.distributed as dist

from fsdp8.app import cli
from fsdp8.app.train import command as train_command
from fsdp8.app.train.config import TrainConfig
from fsdp8.app.train.loop import train
from fsdp8.app.train.run_log import RunLog

pytest.importorskip("tensorboard")

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402


def _scalars(folder) -> dict:
    """{tag: [(step, value)]} of every event file in ``folder``, as TensorBoard shows them."""
    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


@pytest.fixture
def one_rank(monkeypatch):
    """A group of one in this process, as `fsdp8 train` under no launcher would start; the
    environment, thread count and group are put back afterwards."""
    for key in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    started_here, threads = not dist.is_initialized(), torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
    if started_here and dist.is_initialized():
        dist.destroy_process_group()


def test_a_run_writes_its_metrics_as_events(tmp_path, one_rank, capsys):
    cfg = TrainConfig(steps=6, log_every=2, eval_every=3, eval_batches=1, batch_size=2, seq_len=32, warmup=2,
                      out=str(tmp_path / "run"), tensorboard=str(tmp_path / "tb"))
    train(cfg)
    assert capsys.readouterr().err.strip().endswith(f"summary.json and TensorBoard events to {tmp_path / 'tb'}")
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in records if "loss" in r]
    scalars = _scalars(tmp_path / "tb")
    assert [s for s, _ in scalars["train/loss"]] == [2, 4, 6]
    for tag, key in [("train/loss", "loss"), ("train/lr", "lr"), ("train/grad_norm", "grad_norm"),
                     ("perf/tokens_per_s", "tokens_per_s"), ("perf/max_mem_mib", "max_mem_mib")]:
        assert scalars[tag] == [(r["step"], pytest.approx(r[key], rel=1e-6)) for r in logged], tag
    assert scalars["val/loss"] == [(r["step"], pytest.approx(r["val_loss"], rel=1e-6)) for r in records
                                   if "val_loss" in r]
    assert [s for s, _ in scalars["val/loss"]] == [3, 6]
    assert all(v > 0 for _, v in scalars["train/grad_norm"])


def _record(step: int, loss: float) -> dict:
    return {"step": step, "loss": loss, "lr": 0.1, "grad_norm": 1.0, "tokens_per_s": 1e3, "max_mem_mib": 1.0}


def test_events_cover_the_whole_run_after_a_resume(tmp_path):
    """A resumed run redoes the steps after its checkpoint: TensorBoard shows the earlier
    records once and the redone steps with their new values, not both runs' points."""
    cfg = TrainConfig(steps=8, out=str(tmp_path / "run"), tensorboard=str(tmp_path / "tb"))
    first = RunLog(cfg, [])
    for step in (2, 4, 6):  # interrupted after step 6; its checkpoint was at step 4
        first.write(_record(step, 10.0 - step))
    first.finish({"elapsed_s": 1.0, "steps_done": 6}, 0)
    resumed = RunLog(cfg, [_record(2, 8.0), _record(4, 6.0)])
    for step in (6, 8):
        resumed.write(_record(step, 1.0 / step))
    resumed.finish({"elapsed_s": 2.0, "steps_done": 8}, 0)
    assert _scalars(tmp_path / "tb")["train/loss"] == [(2, 8.0), (4, 6.0), (6, pytest.approx(1 / 6)), (8, 0.125)]


def test_missing_tensorboard_is_one_line_before_any_worker(tmp_path, monkeypatch, capsys):
    launched = []
    monkeypatch.setattr(train_command, "launch", lambda fn, args, **kwargs: launched.append(args[0]) or 0)
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", "--out", str(tmp_path / "run"), "--tensorboard", str(tmp_path / "tb")])
    assert exit_info.value.code == 2 and launched == []
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fsdp8 train: error: --tensorboard needs the tensorboard package")
    assert lines[0].endswith("pip install tensorboard")


def test_the_flag_reaches_the_workers_config(tmp_path, monkeypatch):
    launched = []
    monkeypatch.setattr(train_command, "launch", lambda fn, args, **kwargs: launched.append(args[0]) or 0)
    assert cli.main(["train", "--out", str(tmp_path / "run"), "--tensorboard", str(tmp_path / "tb")]) == 0
    assert launched[0].tensorboard == str(tmp_path / "tb")
