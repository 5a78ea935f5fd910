"""What `fsdp8 train` makes of its run directory before any worker starts (launch is
replaced): a damaged or interrupted newest checkpoint passed over, a crashed run's outputs,
the directory's lock, metrics.jsonl's torn and damaged lines and its replacement at a resume,
and the data file a resume trains on."""

import json
import os
import signal
import socket
import subprocess
import sys

import pytest
import torch.distributed.checkpoint as dcp

from fsdp8 import Float8CurrentScaling, ParallelConfig
from fsdp8.app import cli
from fsdp8.app.train import command as train_command
from fsdp8.checkpoint.store import FORMAT, MARKER
from fsdp8.config import BF16_MIXED
from fsdp8.data import file_fingerprint
from fsdp8.models.llama import Llama, preset
from fsdp8.app.train.config import TrainConfig
from fsdp8.app.train.run_lock import LOCK_FILE
from fsdp8.app.train.run_log import RunLog

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The checkpoints here are written by DCP in this one process, which it warns about.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture
def launched(monkeypatch):
    """The configs `fsdp8 train` would have started workers with."""
    calls = []
    monkeypatch.setattr(train_command, "launch", lambda fn, args, **kwargs: calls.append(args[0]) or 0)
    return calls


def _error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fsdp8 train: error: "), err
    return lines[0][len("fsdp8 train: error: "):]


def _records(*steps):
    return "".join(json.dumps({"step": s, "loss": 5.0 - s / 10}) + "\n" for s in steps)


def _checkpoint(out, step, data=None, weights="tiny"):
    """What `fsdp8 train --out OUT --save-every N` leaves as its step-N checkpoint, as far as
    the launcher looks: the tiny preset's weights (no optimizer), the marker, rank 0's extra."""
    path = out / "checkpoints" / f"step-{step:06d}"
    dcp.save({"model": Llama(preset(weights)).state_dict()}, checkpoint_id=str(path), no_dist=True)
    config = TrainConfig(steps=10, save_every=2, out=str(out), data=str(data) if data else "").settings()
    extra = {"step": step, "config": config}
    if data:
        extra["data"] = {"path": str(data), **file_fingerprint(str(data))}
    (path / "extra.rank0.json").write_text(json.dumps(extra))
    (path / MARKER).write_text(json.dumps({"format": FORMAT, "world_size": 1, "optimizer": False, "sequence": step}))
    return path


def _run(tmp_path, steps=(2, 4), data=None):
    """A run directory whose run was stopped after step 5 with checkpoints at ``steps``."""
    out = tmp_path / "run"
    for step in steps:
        _checkpoint(out, step, data)
    (out / "metrics.jsonl").write_text(_records(1, 2, 3, 4, 5))
    return out


def _truncate(checkpoint):
    data = checkpoint / "__0_0.distcp"
    os.truncate(data, data.stat().st_size // 2)


@pytest.mark.parametrize("damage,why", [
    (_truncate, "data file __0_0.distcp is truncated"),
    (lambda c: os.remove(c / "__0_0.distcp"), "data file __0_0.distcp is missing"),
    (lambda c: os.remove(c / MARKER), f"has no {MARKER}: the save that wrote it did not finish"),
])
def test_resume_passes_over_a_damaged_newest_checkpoint_saying_why(tmp_path, capsys, launched, damage, why):
    out = _run(tmp_path)
    damage(out / "checkpoints" / "step-000004")
    assert cli.main(["train", "--resume", str(out), "--steps", "10"]) == 0
    assert launched[0].resume == str(out / "checkpoints" / "step-000002")
    note = capsys.readouterr().err.strip()
    assert note.startswith("--resume: passed over step-000004 (") and why in note, note
    assert note.endswith(f") in {out / 'checkpoints'}; resuming from step-000002, the newest checkpoint that can be "
                         "loaded")


def test_resume_with_no_intact_checkpoint_names_them_all(tmp_path, capsys, launched):
    out = _run(tmp_path)
    _truncate(out / "checkpoints" / "step-000004")
    os.remove(out / "checkpoints" / "step-000002" / "__0_0.distcp")
    with pytest.raises(SystemExit):
        cli.main(["train", "--resume", str(out), "--steps", "10"])
    line = _error_line(capsys)
    assert line.startswith(f"--resume: no checkpoint in {out / 'checkpoints'} can be loaded: step-000004 (data file "
                           "__0_0.distcp is truncated")
    assert "; step-000002 (data file __0_0.distcp is missing); restore their files, or rerun with --overwrite " \
           "instead of --resume to start afresh" in line
    assert launched == []


def test_resume_of_a_named_damaged_checkpoint_names_the_intact_one(tmp_path, capsys, launched):
    out = _run(tmp_path)
    newest = out / "checkpoints" / "step-000004"
    _truncate(newest)
    with pytest.raises(SystemExit):
        cli.main(["train", "--resume", str(newest), "--steps", "10"])
    line = _error_line(capsys)
    older = out / "checkpoints" / "step-000002"
    assert line.startswith(f"--resume: cannot continue from {newest}: data file __0_0.distcp is truncated")
    assert line.endswith(f"the newest checkpoint beside it that can be loaded is {older}: pass --resume {older}")


def test_resume_of_a_checkpoint_of_another_shape_is_one_line(tmp_path, capsys, launched):
    """A checkpoint that does not fit the model failed on every rank with a traceback."""
    out = tmp_path / "run"
    checkpoint = _checkpoint(out, 2, weights="small")  # its settings say tiny
    with pytest.raises(SystemExit):
        cli.main(["train", "--resume", str(out), "--steps", "10"])
    line = _error_line(capsys)
    assert line.startswith(f"--resume: {checkpoint} does not fit preset tiny: mis-shaped keys (")
    assert "head.weight: checkpoint (256, 512) vs model (256, 128)" in line
    assert line.endswith("; resume it with the model it was saved with") and launched == []


def test_resume_where_only_an_interrupted_save_is_says_what_it_is(tmp_path, capsys, launched):
    """A second SIGINT used to kill the stop's save: step-N.partial was all that was left."""
    out = _run(tmp_path, steps=(4,))
    os.rename(out / "checkpoints" / "step-000004", out / "checkpoints" / "step-000004.partial")
    with pytest.raises(SystemExit):
        cli.main(["train", "--resume", str(out), "--steps", "10"])
    assert _error_line(capsys) == (
        f"--resume: {out / 'checkpoints'} holds no complete checkpoint, only step-000004.partial: a save that was "
        "interrupted (the run was killed while writing it), which cannot be loaded; rerun with --overwrite instead of "
        "--resume to start afresh (deleting it)")


def test_a_run_that_failed_at_its_start_does_not_block_the_next(tmp_path, capsys, launched):
    """An OOM kill before the first record left an empty metrics.jsonl: the next run refused."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text("")
    (out / "error.log").write_text("=== rank 1 ===\n")
    assert cli.main(["train", "--out", str(out)]) == 0 and len(launched) == 1
    assert capsys.readouterr().err.strip() == (f"--out {out} held only what a run that failed at its start left (empty "
                                               "metrics.jsonl, error.log); deleted it and starting afresh")
    assert sorted(os.listdir(out)) == [LOCK_FILE]


def test_a_crashed_run_without_a_checkpoint_says_which_flag_starts_afresh(tmp_path, capsys, launched):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text(_records(10, 20))
    with pytest.raises(SystemExit):
        cli.main(["train", "--out", str(out)])
    assert _error_line(capsys) == (
        f"--out {out} holds a run that ended at step 20 without a checkpoint (metrics.jsonl to step 20): there is "
        "nothing to resume; pass --overwrite to delete it and start afresh there, or another --out")
    with pytest.raises(SystemExit):
        cli.main(["train", "--resume", str(out)])
    assert _error_line(capsys) == (
        f"--resume: {out} holds no checkpoint to continue from (a run writes them with --save-every N or --stop-at N); "
        "rerun with --overwrite instead of --resume to start afresh")
    assert cli.main(["train", "--out", str(out), "--overwrite"]) == 0 and len(launched) == 1


_HOLDER = """
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("run_lock", sys.argv[1])
run_lock = importlib.util.module_from_spec(spec)
spec.loader.exec_module(run_lock)
lock = run_lock.RunLock(sys.argv[2])
print("locked", flush=True)
time.sleep(120)
"""


def test_a_second_run_on_the_same_out_refuses_naming_the_first(tmp_path, capsys, launched):
    """Two runs on one --out both exited 0 while one's checkpoints vanished: the second
    refuses at once. The first holds the lock in another process (run_lock.py alone)."""
    out = tmp_path / "run"
    out.mkdir()
    run_lock = os.path.join(REPO, "fsdp8", "app", "train", "run_lock.py")
    first = subprocess.Popen([sys.executable, "-c", _HOLDER, run_lock, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout.readline() == "locked\n"
        with pytest.raises(SystemExit):
            cli.main(["train", "--out", str(out)])
        line = _error_line(capsys)
        assert line.startswith(f"--out {out} is being written by another fsdp8 train (pid {first.pid} on "
                               f"{socket.gethostname()}, started ")
        assert line.endswith("); wait for it to finish or stop it, or give another --out") and launched == []
    finally:
        first.kill()
        first.wait()
    # Its lock died with it; the file left behind, naming it, does not block.
    assert str(first.pid) in (out / LOCK_FILE).read_text()
    assert cli.main(["train", "--out", str(out)]) == 0 and len(launched) == 1


def test_torn_last_metrics_line_is_dropped_with_a_note(tmp_path, capsys, launched):
    out = _run(tmp_path)
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "lo')  # killed mid-write
    assert cli.main(["train", "--resume", str(out), "--steps", "10"]) == 0 and len(launched) == 1
    assert capsys.readouterr().err.strip() == (f"{out / 'metrics.jsonl'}: dropped its last line, torn by an "
                                               "interrupted write (15 bytes)")


def test_a_damaged_metrics_line_is_one_line_naming_the_file(tmp_path, capsys, launched):
    out = _run(tmp_path)
    (out / "metrics.jsonl").write_text(_records(1, 2) + '{"step": 3, "loss"{"step": 3, "loss": 4.7}\n' + _records(4))
    with pytest.raises(SystemExit):
        cli.main(["train", "--resume", str(out), "--steps", "10"])
    line = _error_line(capsys)
    assert line.startswith(f"{out / 'metrics.jsonl'} line 3 is not a metrics record (")
    assert line.endswith("delete that line, or move the file aside to go on without the run's history")


def _history_after_kill(cfg, history, before: str, kill_at: int):
    """metrics.jsonl after a process that starts ``RunLog(cfg, history)`` over a file holding
    ``before`` is SIGKILLed at the ``kill_at``-th line run_log.py executes (None: not killed)."""
    path = os.path.join(cfg.out, "metrics.jsonl")
    with open(path, "w") as f:
        f.write(before)
    pid = os.fork()
    if pid == 0:
        signal.alarm(20)  # a forked child of a threaded process could deadlock: never hang the test
        from fsdp8.app.train import run_log

        count = [0]

        def tracer(frame, event, arg):
            if frame.f_code.co_filename == run_log.__file__ and event == "line":
                count[0] += 1
                if count[0] == kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)
            return tracer

        sys.settrace(tracer)
        RunLog(cfg, history).file.close()
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    assert code in (0, -signal.SIGKILL), code
    with open(path) as f:
        return f.read(), code == -signal.SIGKILL


def test_metrics_keep_the_whole_history_whenever_a_resumed_run_is_killed(tmp_path):
    """A SIGKILL within a second of a resumed run's start left metrics.jsonl at 0 bytes: it was
    reopened with "w" and the history kept in a buffer. Killed at every line of the start,
    the file holds the history before the resume or the history it continues from."""
    cfg = TrainConfig(steps=10, out=str(tmp_path))
    before = _records(1, 2, 3, 4, 5)  # interrupted after step 5; its checkpoint was at step 3
    kept = [json.loads(line) for line in _records(1, 2, 3).splitlines()]
    kill_at = 1
    while True:
        after, killed = _history_after_kill(cfg, kept, before, kill_at)
        assert after in (before, _records(1, 2, 3)), f"killed at line {kill_at}: {after!r}"
        if not killed:
            break
        kill_at += 1
    assert after == _records(1, 2, 3) and kill_at > 5


@pytest.fixture
def data_run(tmp_path):
    data = tmp_path / "text.txt"
    data.write_text("the data the run trained on. " * 200)
    return _run(tmp_path, data=data), data


def test_resume_trains_on_the_runs_data_while_it_is_unchanged(data_run, capsys, launched):
    out, data = data_run
    assert cli.main(["train", "--resume", str(out), "--steps", "10"]) == 0
    assert launched[0].data == str(data) and capsys.readouterr().err == ""


@pytest.mark.parametrize("change,what", [
    (lambda data: data.write_text("other text. " * 500), "which has changed since (5800 bytes then, 6000 now, "
                                                         "other content)"),
    (lambda data: data.rename(data.parent / "moved.txt"), "which is no longer there"),
])
def test_resume_refuses_a_data_file_that_changed_or_moved(data_run, capsys, launched, change, what):
    out, data = data_run
    change(data)
    with pytest.raises(SystemExit):
        cli.main(["train", "--resume", str(out), "--steps", "10"])
    assert _error_line(capsys) == (f"--resume: the run trained on --data {data}, {what}; pass --data FILE to say what "
                                   f"to train on (--data {data} if it is right)")
    assert launched == []


def test_a_checkpoints_config_cannot_redirect_the_data(data_run, capsys, launched):
    """extra.rank0.json's config named any file as --data, and the resume trained on it."""
    out, data = data_run
    elsewhere = data.parent / "secret.txt"
    elsewhere.write_text("not for training " * 100)
    extra_file = out / "checkpoints" / "step-000004" / "extra.rank0.json"
    extra = json.loads(extra_file.read_text())
    extra["config"]["data"] = str(elsewhere)
    extra_file.write_text(json.dumps(extra))
    with pytest.raises(SystemExit):
        cli.main(["train", "--resume", str(out), "--steps", "10"])
    assert f"--resume: the run trained on --data {elsewhere}, which has changed since" in _error_line(capsys)
    del extra["data"]  # no record to check it against: refused too
    extra_file.write_text(json.dumps(extra))
    with pytest.raises(SystemExit):
        cli.main(["train", "--resume", str(out), "--steps", "10"])
    assert _error_line(capsys).startswith(f"--resume: {out / 'checkpoints' / 'step-000004'} does not record what its "
                                          f"data file '{elsewhere}' held")
    assert launched == []


def test_resume_takes_data_given_again(data_run, tmp_path, capsys, launched):
    out, data = data_run
    other = tmp_path / "more.txt"
    other.write_text("more text to train on. " * 300)
    assert cli.main(["train", "--resume", str(out), "--steps", "10", "--data", str(other)]) == 0
    assert launched[0].data == str(other)
    assert capsys.readouterr().err.strip() == (f"--resume: training on --data {other} as asked; the run trained on "
                                               f"{data} until now, whose content differs")


# A checkpoint's saved settings as every fsdp8 train has written them: one flat dict by flag name
# (TrainConfig.settings(); until TrainConfig held a ParallelConfig, its own fields), written here
# as a run of `--strategy optim --precision fp8-current --dp-replicate 2 --outer-strategy optim
# --tp 2 --sequence-parallel --loss-parallel --ac full --compile --micro-batches 2` saved them.
FLAT_SAVED = {
    "steps": 10, "preset": "tiny", "model": "", "data": "", "strategy": "optim", "precision": "fp8-current", "tp": 2,
    "dp_replicate": 2, "outer_strategy": "optim", "cp": 1, "sequence_parallel": True, "loss_parallel": True,
    "ac": "full", "compile": True, "offload": "none", "batch_size": 8, "seq_len": 128, "micro_batches": 2,
    "lr": 0.003, "warmup": 20, "weight_decay": 0.1, "clip": 1.0, "seed": 0, "log_every": 10, "eval_every": 50,
    "eval_batches": 4, "out": "OUT", "save_every": 2, "keep_last": 2, "resume": "", "overwrite": False, "stop_at": 0,
    "async_save": False, "lr_decay_steps": 10, "tensorboard": ""}


def test_a_resume_takes_the_layout_from_the_flat_saved_settings(tmp_path, launched):
    out = tmp_path / "run"
    checkpoint = _checkpoint(out, 2)
    (checkpoint / "extra.rank0.json").write_text(json.dumps({"step": 2, "config": dict(FLAT_SAVED, out=str(out))}))
    assert cli.main(["train", "--resume", str(out), "--nproc", "4", "--steps", "12"]) == 0
    cfg = launched[0]
    assert cfg.parallel == ParallelConfig(dp_replicate=2, tp=2, sequence_parallel=True, loss_parallel=True,
                                          activation_checkpointing="full", compile=True, fp8=Float8CurrentScaling(),
                                          precision=BF16_MIXED, strategy="optim", outer_strategy="optim")
    assert (cfg.micro_batches, cfg.lr_decay_steps, cfg.steps, cfg.resume) == (2, 10, 12, str(checkpoint))
    # What it saves in turn is the same flat dict (plus the settings added since, at their
    # defaults, as the resume took them): a later resume reads it alike.
    assert cfg.settings() == dict(FLAT_SAVED, out=str(out), steps=12, resume=str(checkpoint), ep=1,
                                        load_balancing="local", fp8_dispatch=False)
    assert TrainConfig.from_settings(cfg.settings()) == cfg
