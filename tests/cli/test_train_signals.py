"""SIGINT to `fsdp8 train`'s launcher by PID, as schedulers, `timeout -s INT` and wrapper
scripts send it: the run stops after the current step, all ranks together, writes its
outputs and a checkpoint, prints one line and leaves no process behind; a second SIGINT
while that checkpoint is being written lets it finish."""

import json
import os
import signal
import subprocess
import sys
import time

from fsdp8.checkpoint import verify
from tests.cli.test_train_launch import _alive, _all_gone

ENV = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}


def _children(pid):
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().split(")")[-1].split()[1]) == pid:
                    found.append(int(entry))
        except FileNotFoundError:  # exited meanwhile
            continue
    return found


def test_sigint_to_the_launcher_stops_the_run_cleanly(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "fsdp8", "train", "--steps", "100000", "--batch-size", "2",
                             "--seq-len", "16", "--log-every", "1", "--save-every", "1000", "--out", str(out)],
                            env=ENV, stderr=subprocess.PIPE, text=True)
    workers = []
    try:
        before = []
        for line in proc.stderr:
            before.append(line)
            if line.startswith("step ") and "/100000" in line:
                break
        assert proc.poll() is None, "".join(before)
        workers += _children(proc.pid)
        assert len(workers) >= 2  # two ranks (and multiprocessing's resource tracker)
        sent = time.time()
        proc.send_signal(signal.SIGINT)
        after = proc.communicate(timeout=60)[1]
        assert proc.returncode == 128 + signal.SIGINT and time.time() - sent < 20, after
        assert "Traceback" not in after and "KeyboardInterrupt" not in after
        summary = json.loads((out / "summary.json").read_text())
        step = summary["steps_done"]
        assert summary["stopped_by"] == "SIGINT" and step < 100000
        lines = [line for line in after.splitlines() if not line.startswith("step ")]  # progress lines
        assert len(lines) == 2 and lines[0] == f"saved checkpoint {out / 'checkpoints' / f'step-{step:06d}'}", after
        assert lines[1].startswith(f"stopped by SIGINT after step {step} of 100000: loss "), after
        assert (out / "loss.png").read_bytes()[:4] == b"\x89PNG"
        assert os.listdir(out / "checkpoints") == [f"step-{step:06d}"]  # --save-every: one at the stop
        assert _all_gone(workers)
    finally:  # on a failure, leave nothing running
        for pid in [proc.pid, *workers]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_second_sigint_while_the_checkpoint_is_written_lets_it_finish(tmp_path):
    """It killed the workers mid-save: step-N.partial was left, and nothing to resume from."""
    out, release = tmp_path / "run", tmp_path / "release"
    # The test seam holds each save, once its .partial directory exists, until `release` does.
    proc = subprocess.Popen([sys.executable, "-m", "fsdp8", "train", "--steps", "100000", "--batch-size", "2",
                             "--seq-len", "16", "--log-every", "1", "--save-every", "1000", "--out", str(out)],
                            env=dict(ENV, FSDP8_FAULT=f"hold_save:{release}"), stderr=subprocess.PIPE, text=True)
    workers, said = [], []
    try:
        for line in proc.stderr:
            if line.startswith("step ") and "/100000" in line:
                break
        workers += _children(proc.pid)
        proc.send_signal(signal.SIGINT)
        deadline = time.time() + 60
        while not list((out / "checkpoints").glob("*.partial")):
            assert time.time() < deadline and proc.poll() is None, "the stop's checkpoint was not started"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        for line in proc.stderr:  # ends early when the launcher dies
            said.append(line)
            if "second SIGINT" in line:
                break
        release.touch()
        err = "".join(said) + proc.communicate(timeout=60)[1]
        assert proc.returncode == 128 + signal.SIGINT, err
        (checkpoint,) = os.listdir(out / "checkpoints")  # complete, and no .partial beside it
        path = out / "checkpoints" / checkpoint
        assert checkpoint.startswith("step-") and verify(str(path)) == [], err
        lines = [line for line in err.splitlines() if line.startswith("fsdp8 train: ")]
        assert lines == [f"fsdp8 train: second SIGINT: finishing checkpoint {path}, then stopping; a third kills at "
                         "once", f"fsdp8 train: checkpoint {path} is complete; workers stopped before they wrote their "
                         "other outputs"], err
        assert _all_gone(workers)
    finally:
        for pid in [proc.pid, *workers]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
