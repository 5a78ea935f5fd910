"""The launcher leaves no worker behind: a failing worker, the launcher killed; signals ask for a stop.
The workers run small functions of this module (no training), so these tests pay only
for starting processes."""

import os
import signal
import subprocess
import sys
import time

import pytest

from fsdp8.checkpoint.store import write_json_atomic
from fsdp8.launch import launch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _announce(pid_dir) -> None:
    # Atomically (the checkpoint store's write-then-rename): a reader polling for ``*.pid``
    # files must never see one that exists but is still empty (CI once read '' and failed).
    write_json_atomic(os.path.join(pid_dir, f"rank{os.environ['RANK']}.pid"), os.getpid())


def fail_on_rank_1(pid_dir) -> None:
    _announce(pid_dir)
    if os.environ["RANK"] == "1":
        _pids(pid_dir, 2)  # rank 0 is running: it must be stopped, not just never started
        raise ValueError("rank 1 cannot go on")
    time.sleep(300)  # as a rank blocked in a collective with the dead one would


def run_until_stopped(pid_dir) -> None:
    from fsdp8.launch import Stopped, stop_requested

    _announce(pid_dir)
    while stop_requested() is None:
        time.sleep(0.05)
    raise Stopped(stop_requested())


def _pids(pid_dir, n, timeout=120):
    deadline = time.time() + timeout
    while len([f for f in os.listdir(pid_dir) if f.endswith(".pid")]) < n:
        assert time.time() < deadline, "workers did not start"
        time.sleep(0.1)
    return [int(open(os.path.join(pid_dir, f"rank{r}.pid")).read()) for r in range(n)]


def _alive(pid) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _all_gone(pids, timeout=10) -> bool:
    deadline = time.time() + timeout
    while any(_alive(p) for p in pids) and time.time() < deadline:
        time.sleep(0.1)
    return not any(_alive(p) for p in pids)


def _launcher(tmp_path, fn_name):
    code = (f"import sys; from tests.test_train_launch import {fn_name} as fn; from fsdp8.launch import launch; "
            f"sys.exit(launch(fn, ({str(tmp_path)!r},), nproc=2))")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    return subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)


def test_a_failing_worker_is_reported_once_and_the_others_are_stopped(tmp_path, capfd):
    start = time.time()
    status = launch(fail_on_rank_1, (str(tmp_path),), nproc=2)
    err = capfd.readouterr().err
    assert status == 1 and time.time() - start < 120  # rank 0 would sleep 300 s
    assert err.count("Traceback") == 1 and "ValueError: rank 1 cannot go on" in err
    assert [line for line in err.splitlines() if line.startswith("fsdp8")] == [
        "fsdp8: rank 1 failed: ValueError: rank 1 cannot go on (its traceback is above); "
        "the other workers were stopped"]
    assert _all_gone(_pids(tmp_path, 2), timeout=0)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_becomes_a_stop_request(monkeypatch, signum):
    # What a worker does with a signal from anywhere; the launcher passes its own on (the
    # SIGINT test in test_train_signals.py runs that path end to end).
    from fsdp8 import launch as launch_module

    monkeypatch.setattr(launch_module._StopRequest, "signum", None)
    monkeypatch.setattr(launch_module._StopRequest, "direct", 0)
    before = signal.getsignal(signum)
    with launch_module.stop_on_signals():
        os.kill(os.getpid(), signum)
        assert launch_module.stop_requested() == signum
    assert signal.getsignal(signum) is before
    assert launch_module.Stopped(signum).code == 128 + signum


def test_workers_exit_when_the_launcher_is_killed(tmp_path):
    proc = _launcher(tmp_path, "run_until_stopped")
    pids = _pids(tmp_path, 2)
    proc.kill()  # no handler runs: the workers must notice on their own
    proc.communicate(timeout=60)
    assert _all_gone(pids)
