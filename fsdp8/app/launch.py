"""Starting worker processes (under torchrun as they are, otherwise spawned here), passing
stop requests on (see [Note: stopping on a signal] in stop.py) and reporting failures.

[Note: the launcher's stop]
The launcher passes the first SIGINT or SIGTERM to its workers as a stop request. A second
one kills them at once, unless a checkpoint is being written (rank 0 reports the start and
the publication of each write): then it says so, waits until the checkpoint is published
and kills them then; a third kills at once. Signals only queue a byte on a wake-up pipe;
the watch loop acts on them after reading what the workers sent, so a write reported just
before the signal is seen.

A worker that fails sends a ``Failure`` (one line for the user and its traceback) up the
same pipe. After the first failure the launcher gives the others a moment to report theirs
(ranks that check the same input fail together), kills the rest (they are usually blocked
in a collective with the failed rank), prints one line per failing rank, writes the
tracebacks to the run's error log and exits 1. A rank killed from outside (no report, a
signal the launcher did not send) is reported with its likely cause: the kernel's
out-of-memory killer. When the launcher itself dies, the pipe closes and every worker exits.
"""

from __future__ import annotations

import contextlib
import enum
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
import traceback
from multiprocessing.connection import wait
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from . import stop
from .failures import Failure, Reporting, describe_death, failure_of, oom_kills, report
from .stop import STOP_SIGNALS, CheckpointWrite, Stopped, Write

CPU_DEFAULT_WORKERS = 2
# After the first failure, how long the other workers may take to report theirs before they are killed.
REPORT_GRACE_S = 2.0


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def resolve_nproc(nproc: Optional[int]) -> int:
    """``nproc`` checked against this machine, or the default: all local GPUs, or two gloo
    workers on a CPU-only machine."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if nproc is None:
        return gpus or CPU_DEFAULT_WORKERS
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    if gpus and nproc > gpus:
        raise ValueError(f"--nproc {nproc} but only {gpus} GPUs are visible; start at most one worker per GPU")
    return nproc


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(local_rank: int, nproc: int, port: int, fn: Callable, args: tuple) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(local_rank),
        WORLD_SIZE=str(nproc), LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE=str(nproc),
    )
    _run_and_close(fn, args)


def _close_group() -> None:
    if dist.is_initialized():
        # Ranks finish at different times (rank 0 writes the run's files): meet once, so no
        # rank tears its connections down under a peer still in a last collective.
        dist.barrier()
        dist.destroy_process_group()


def _run_and_close(fn: Callable, args: tuple) -> None:
    try:
        fn(*args)
    except Stopped:  # a clean early stop: every rank gets here after the same step
        _close_group()
        raise
    _close_group()


def _listen(conn) -> None:
    """Worker thread: stop requests from the launcher; its end of the pipe closing means it died."""
    while True:
        try:
            stop.request_stop(conn.recv())
        except (EOFError, OSError):
            os._exit(1)


def _worker(rank: int, nproc: int, port: int, fn: Callable, args: tuple, conn, reporting: Reporting) -> None:
    stop.supervise(conn, rank)
    threading.Thread(target=_listen, args=(conn,), name="fsdp8-launcher", daemon=True).start()
    status = 0
    try:
        _child(rank, nproc, port, fn, args)
    except Stopped as stopped:
        status = stopped.code
    except BaseException as e:
        stop.uplink().send(failure_of(e, rank, traceback.format_exc(), reporting.memory_advice))
        status = 1  # and no normal exit: with a broken process group, gloo's threads would abort it
    # Skipping the interpreter's teardown saves seconds (torch's module graph) and loses
    # nothing: the run's files are closed, the process group too.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _failed(exitcode: int) -> bool:
    return exitcode not in (0, *(128 + s for s in STOP_SIGNALS))


class _Phase(enum.Enum):
    """Where a run stands with the signals the launcher got (see [Note: the launcher's stop])."""

    RUNNING = "running"  # no stop asked
    STOPPING = "stopping"  # the workers were asked to stop after the current step
    FINISHING_CHECKPOINT = "finishing checkpoint"  # insisted on mid-write: kill once it is published
    KILLED = "killed"  # the workers were killed on a signal


class _Supervisor:
    """The launcher's side: starts the workers, passes stop requests on, watches for failures."""

    def __init__(self, nproc: int, fn: Callable, args: tuple, reporting: Reporting):
        self.nproc, self.fn, self.args, self.reporting = nproc, fn, args, reporting
        self.phase = _Phase.RUNNING
        self.signum: Optional[int] = None  # the first signal
        self.last_signum: Optional[int] = None
        self.writing: List[str] = []  # checkpoints rank 0 is writing
        self.procs: List[multiprocessing.Process] = []
        self.conns: Dict[object, int] = {}
        self.killed_here = False
        self.failures: List[Failure] = []
        self.signals: List[int] = []  # received, not yet acted on
        self.wake_r, self.wake_w = os.pipe()
        self.oom_before = oom_kills()

    def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        port = _free_port()
        # Workers inherit ignored signals (see stop.py's Note); blocking them meanwhile keeps
        # a signal that arrives during the start pending for our handler instead of lost.
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            for s in STOP_SIGNALS:
                signal.signal(s, signal.SIG_IGN)
            for rank in range(self.nproc):
                ours, theirs = ctx.Pipe()
                proc = ctx.Process(target=_worker, name=f"fsdp8-rank{rank}",
                                   args=(rank, self.nproc, port, self.fn, self.args, theirs, self.reporting))
                proc.start()
                theirs.close()
                self.procs.append(proc)
                self.conns[ours] = rank
        finally:
            for s in STOP_SIGNALS:
                signal.signal(s, self._on_signal)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)

    def _on_signal(self, signum, frame) -> None:
        self.signals.append(signum)
        os.write(self.wake_w, b"!")

    def _say(self, text: str) -> None:
        print(f"{self.reporting.name}: {text}", file=sys.stderr, flush=True)

    def _act_on_signals(self) -> None:
        while self.signals:
            signum = self.signals.pop(0)
            self.last_signum = signum
            name = signal.Signals(signum).name
            if self.phase is _Phase.RUNNING:
                self.phase, self.signum = _Phase.STOPPING, signum
                for conn in self.conns:
                    with contextlib.suppress(OSError):
                        conn.send(signum)
            elif self.phase is _Phase.STOPPING and self.writing:
                self.phase = _Phase.FINISHING_CHECKPOINT
                self._say(f"second {name}: finishing checkpoint {self.writing[-1]}, then stopping; "
                          "a third kills at once")
            elif self.phase is not _Phase.KILLED:
                self._say(f"{'second' if self.phase is _Phase.STOPPING else 'third'} {name}: workers killed before "
                          "they wrote their outputs")
                self.phase = _Phase.KILLED
                self.kill()

    def _receive(self, message) -> None:
        if isinstance(message, Failure):
            self.failures.append(message)
        elif isinstance(message, CheckpointWrite) and message.event is Write.STARTED:
            self.writing.append(message.path)
        elif isinstance(message, CheckpointWrite):
            with contextlib.suppress(ValueError):
                self.writing.remove(message.path)
            if self.phase is _Phase.FINISHING_CHECKPOINT and not self.writing:
                self._say(f"checkpoint {message.path} is complete; workers stopped before they wrote their other "
                          "outputs" if message.event is Write.PUBLISHED else
                          f"writing checkpoint {message.path} failed; workers stopped")
                self.phase = _Phase.KILLED
                self.kill()

    def kill(self) -> None:
        for proc in self.procs:
            if proc.exitcode is None:
                self.killed_here = True
                with contextlib.suppress(OSError):
                    proc.kill()

    def run(self) -> int:
        previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}
        try:
            self._start()
            return self._watch()
        finally:
            self.kill()  # nothing outlives the launcher, whatever happened here
            for proc in self.procs:
                proc.join()
            for conn in self.conns:
                conn.close()
            for s, handler in previous.items():
                signal.signal(s, handler)
            os.close(self.wake_r)
            os.close(self.wake_w)

    def _drain(self, listening: Dict[object, int]) -> None:
        """Read every message the workers have sent so far."""
        for conn in list(listening):
            try:
                while conn.poll():
                    self._receive(conn.recv())
            except (EOFError, OSError):
                del listening[conn]

    def _watch(self) -> int:
        live = {proc.sentinel: rank for rank, proc in enumerate(self.procs)}
        listening = dict(self.conns)
        deaths: Dict[int, int] = {}  # rank -> exit code of a failed rank
        kill_at: Optional[float] = None
        while live:
            timeout = None if kill_at is None else max(0.0, kill_at - time.monotonic())
            ready = wait(list(live) + list(listening) + [self.wake_r], timeout)
            self._drain(listening)
            if self.wake_r in ready:
                os.read(self.wake_r, 1024)
                self._act_on_signals()
            for sentinel in ready:
                if sentinel in live:
                    rank = live.pop(sentinel)
                    self.procs[rank].join()
                    if self.phase is not _Phase.KILLED and not self.killed_here and _failed(self.procs[rank].exitcode):
                        deaths[rank] = self.procs[rank].exitcode
            if kill_at is None and (deaths or self.failures) and self.phase is not _Phase.KILLED:
                kill_at = time.monotonic() + REPORT_GRACE_S
            if kill_at is not None and time.monotonic() >= kill_at:
                self.kill()
        self._drain(listening)  # a report sent just before its sender exited
        if deaths or self.failures:
            reported = {f.rank for f in self.failures}
            oom_now = oom_kills()
            report(self.reporting, self.failures,
                   {rank: describe_death(rank, code, self.oom_before, oom_now, self.reporting.memory_advice)
                    for rank, code in deaths.items() if rank not in reported})
        if self.phase is _Phase.KILLED:
            return 128 + self.last_signum
        if deaths or self.failures:
            return 1
        if self.signum is not None:
            return 128 + self.signum
        return max(proc.exitcode for proc in self.procs)


def launch(fn: Callable, args: tuple = (), nproc: Optional[int] = None, reporting: Reporting = Reporting()) -> int:
    """Run ``fn(*args)`` on every rank: in this process under torchrun or for one rank,
    else in ``nproc`` spawned processes on this machine (default: ``resolve_nproc(None)``).

    Returns the exit status: 0; 1 when a rank failed (one line per failing rank printed, the
    tracebacks in ``reporting.error_log``, the other workers killed); 128 + the signal when
    SIGINT or SIGTERM stopped the run (``fn`` raises ``Stopped`` for that)."""
    rank = int(os.environ.get("RANK", "0"))
    try:
        if under_torchrun():
            _run_and_close(fn, args)
            return 0
        nproc = resolve_nproc(nproc)
        if nproc == 1:
            _child(0, 1, _free_port(), fn, args)
            return 0
    except Stopped as stopped:
        return stopped.code
    except Exception as e:
        report(reporting, [failure_of(e, rank, traceback.format_exc(), reporting.memory_advice)], {})
        return 1
    return _Supervisor(nproc, fn, args, reporting).run()
