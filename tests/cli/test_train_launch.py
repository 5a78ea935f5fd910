"""The launcher leaves no worker behind: a failing worker, the launcher killed; signals ask for a
stop, a second one waits for a checkpoint being written. Failures are one line per failing
rank, the tracebacks in the run's error log. The workers run small functions of this module
(no training), so these tests pay only for starting processes."""

import os
import signal
import subprocess
import sys
import time

import pytest

from fsdp8.app import launch as launch_module, stop
from fsdp8.checkpoint.store import write_json_atomic
from fsdp8.app.failures import Reporting, RunError, describe_death
from fsdp8.app.launch import launch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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
    from fsdp8.app.stop import Stopped, stop_requested

    _announce(pid_dir)
    while stop_requested() is None:
        time.sleep(0.05)
    raise Stopped(stop_requested())


def both_ranks_refuse_the_data(pid_dir) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    dist.barrier()  # as ranks that checked the same file fail together
    raise RunError("--data text.txt is too short: give more text")


def rank_1_killed_from_outside(pid_dir) -> None:
    _announce(pid_dir)
    if os.environ["RANK"] == "1":
        os.kill(os.getpid(), signal.SIGKILL)  # as the kernel's out-of-memory killer does
    time.sleep(300)  # as a rank blocked in a collective with the dead one would


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
    code = (f"import sys; from tests.cli.test_train_launch import {fn_name} as fn; from fsdp8.app.launch import launch; "
            f"sys.exit(launch(fn, ({str(tmp_path)!r},), nproc=2))")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    return subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)


def test_an_unexpected_error_is_reported_once_and_the_others_are_stopped(tmp_path, capfd):
    start = time.time()
    status = launch(fail_on_rank_1, (str(tmp_path),), nproc=2)
    err = capfd.readouterr().err
    assert status == 1 and time.time() - start < 120  # rank 0 would sleep 300 s
    # No error log to keep it in: the traceback of a bug is shown.
    assert err.count("Traceback") == 1 and "ValueError: rank 1 cannot go on" in err
    assert [line for line in err.splitlines() if line.startswith("fsdp8")] == [
        "fsdp8: error: rank 1: ValueError: rank 1 cannot go on (an unexpected error: please report it with its "
        "traceback)"]
    assert _all_gone(_pids(tmp_path, 2), timeout=0)


def test_each_failing_rank_is_one_line_with_the_tracebacks_in_the_log(tmp_path, capfd):
    """Errors raised in the workers were tracebacks of 17-34 lines on the terminal."""
    log = tmp_path / "error.log"
    status = launch(both_ranks_refuse_the_data, (str(tmp_path),), nproc=2,
                    reporting=Reporting("fsdp8 train", str(log)))
    err = capfd.readouterr().err
    assert status == 1 and "Traceback" not in err
    assert err.splitlines() == ["fsdp8 train: error: ranks 0, 1: --data text.txt is too short: give more text",
                                f"fsdp8 train: the full tracebacks are in {log}"]
    text = log.read_text()
    assert text.count("Traceback") == 2 and text.count("RunError: --data text.txt is too short") == 2
    assert "=== rank 0 on " in text and "=== rank 1 on " in text


def test_a_rank_killed_from_outside_is_blamed_on_memory(tmp_path, capfd, monkeypatch):
    """An OOM-killed worker read "rank 1 was killed by SIGKILL", with no word of memory."""
    counts = iter([7, 8])  # /proc/vmstat's oom_kill at the start and the end
    monkeypatch.setattr(launch_module, "oom_kills", lambda: next(counts))
    status = launch(rank_1_killed_from_outside, (str(tmp_path),), nproc=2,
                    reporting=Reporting("fsdp8 train", str(tmp_path / "error.log"), "a smaller --batch-size"))
    err = capfd.readouterr().err
    assert status == 1 and err.splitlines() == [
        "fsdp8 train: error: rank 1 was killed by SIGKILL from outside fsdp8, most likely by the kernel's "
        "out-of-memory killer (it killed 1 process(es) meanwhile, says /proc/vmstat): this machine ran out of memory; "
        "a smaller --batch-size"]
    assert _all_gone(_pids(tmp_path, 2), timeout=0)


@pytest.mark.parametrize("before,now,says", [
    (3, 4, "most likely by the kernel's out-of-memory killer (it killed 1 process(es) meanwhile"),
    (3, 3, "not by the kernel's out-of-memory killer (/proc/vmstat counts no kill of it meanwhile)"),
    (None, None, "most likely by the kernel's out-of-memory killer (dmesg says so if it was): the machine ran out "
                 "of memory; use less"),
])
def test_a_sigkill_is_explained_by_the_evidence_there_is(before, now, says):
    assert says in describe_death(1, -signal.SIGKILL, before, now, "use less")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_becomes_a_stop_request(signum):
    # What a worker does with a signal from anywhere; the launcher passes its own on (the
    # SIGINT test in test_train_signals.py runs that path end to end).
    before = signal.getsignal(signum)
    with stop.stop_on_signals():
        os.kill(os.getpid(), signum)
        assert stop.stop_requested() == signum
    assert signal.getsignal(signum) is before and stop.stop_requested() is None
    assert stop.Stopped(signum).code == 128 + signum


@pytest.fixture
def exits(monkeypatch):
    """The exit statuses a process on its own would have exited with."""
    statuses = []
    monkeypatch.setattr(stop, "_exit", statuses.append)
    return statuses


def test_a_second_signal_of_a_process_on_its_own_finishes_the_checkpoint_first(exits, capfd):
    with stop.stop_on_signals():
        os.kill(os.getpid(), signal.SIGINT)
        stop.checkpoint_started("ckpt/step-000005")
        os.kill(os.getpid(), signal.SIGINT)
        assert exits == [] and stop.stop_requested() == signal.SIGINT
        stop.checkpoint_finished("ckpt/step-000005", published=True)
        assert exits == [128 + signal.SIGINT]
    assert "second SIGINT: finishing checkpoint ckpt/step-000005, then stopping; a third kills at once" in \
        capfd.readouterr().err


@pytest.mark.parametrize("writing", [False, True])
def test_a_signal_beyond_that_stops_at_once(exits, writing):
    with stop.stop_on_signals():
        if writing:
            stop.checkpoint_started("ckpt/step-000005")
        for expected in ([], [] if writing else [130], [130] if writing else [130, 130]):
            os.kill(os.getpid(), signal.SIGINT)
            assert exits == expected


@pytest.fixture
def supervised(monkeypatch):
    """A launcher's supervisor without workers, fed signals and messages by hand, and the
    phases it was in when it killed the workers."""
    supervisor = launch_module._Supervisor(2, None, (), Reporting("fsdp8 train"))
    kills = []
    monkeypatch.setattr(supervisor, "kill", lambda: kills.append(supervisor.phase))
    yield supervisor, kills
    os.close(supervisor.wake_r)
    os.close(supervisor.wake_w)


def test_the_launchers_second_signal_waits_for_the_checkpoint_being_written(supervised, capfd):
    """A second SIGINT during the stop's save killed it, leaving only step-N.partial."""
    supervisor, kills = supervised
    supervisor.signals.append(signal.SIGINT)
    supervisor._act_on_signals()
    assert supervisor.phase is launch_module._Phase.STOPPING and kills == []
    supervisor._receive(stop.CheckpointWrite("ckpt/step-000005", stop.Write.STARTED))
    supervisor.signals.append(signal.SIGINT)
    supervisor._act_on_signals()
    assert supervisor.phase is launch_module._Phase.FINISHING_CHECKPOINT and kills == []
    supervisor._receive(stop.CheckpointWrite("ckpt/step-000005", stop.Write.PUBLISHED))
    assert kills == [launch_module._Phase.KILLED]
    assert capfd.readouterr().err.splitlines() == [
        "fsdp8 train: second SIGINT: finishing checkpoint ckpt/step-000005, then stopping; a third kills at once",
        "fsdp8 train: checkpoint ckpt/step-000005 is complete; workers stopped before they wrote their other outputs"]


@pytest.mark.parametrize("writing", [False, True])
def test_the_launchers_signal_beyond_that_kills_at_once(supervised, capfd, writing):
    supervisor, kills = supervised
    supervisor.signals += [signal.SIGINT] * (3 if writing else 2)
    if writing:
        supervisor._receive(stop.CheckpointWrite("ckpt/step-000005", stop.Write.STARTED))
    supervisor._act_on_signals()
    assert kills == [launch_module._Phase.KILLED]
    last = capfd.readouterr().err.splitlines()[-1]
    assert last == f"fsdp8 train: {'third' if writing else 'second'} SIGINT: workers killed before they wrote their " \
                   "outputs"


def test_workers_exit_when_the_launcher_is_killed(tmp_path):
    proc = _launcher(tmp_path, "run_until_stopped")
    pids = _pids(tmp_path, 2)
    proc.kill()  # no handler runs: the workers must notice on their own
    proc.communicate(timeout=60)
    assert _all_gone(pids)
