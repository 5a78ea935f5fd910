"""Starting worker processes (under torchrun as they are, otherwise spawned here) and stopping them.

[Note: stopping on a signal]
SIGINT and SIGTERM ask for a stop, they do not interrupt: ``stop_on_signals()`` turns
them into a flag that the training loop reads once per step, and the ranks agree on it
in a collective, so every rank leaves after the same step and can still checkpoint and
write its outputs. The launcher does not re-send signals to its workers; it passes the
request down a pipe that each worker reads in a thread, which also works while a worker
is still importing (a signal would be lost or raise there). Workers start with SIGINT
and SIGTERM ignored, so a terminal's Ctrl-C, which reaches the whole process group,
cannot kill one mid-import with a traceback; ``stop_on_signals()`` takes them over once
training runs. A second signal to the launcher kills the workers at once. A worker that
fails sends its traceback up the same pipe; the launcher prints the first one, kills
the others (they are usually blocked in a collective with the dead rank) and exits 1.
When the launcher itself dies, the pipe closes and every worker exits.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
import traceback
from multiprocessing.connection import wait
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

CPU_DEFAULT_WORKERS = 2
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stopped(SystemExit):
    """Raised once a run stopped early on a signal and wrote its outputs: exit status 128 + signal."""

    def __init__(self, signum: int):
        super().__init__(128 + signum)
        self.signum = signum


class _StopRequest:
    """The signal that asked this process to stop (None: none did); ``direct`` counts those
    delivered to this process itself, as opposed to passed on by the launcher, which speaks
    for its workers (``supervised``)."""

    signum: Optional[int] = None
    direct = 0
    supervised = False


def request_stop(signum: int) -> None:
    if _StopRequest.signum is None:
        _StopRequest.signum = signum


def stop_requested() -> Optional[int]:
    """The signal number of a pending stop request, or None."""
    return _StopRequest.signum


def _on_stop_signal(signum, frame) -> None:
    _StopRequest.direct += 1
    if _StopRequest.direct > 1:  # the user insists: no clean stop
        if not _StopRequest.supervised:
            sys.stderr.write(f"\nsecond {signal.Signals(signum).name}: stopping at once\n")
            sys.stderr.flush()
        os._exit(128 + signum)
    request_stop(signum)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """Inside, SIGINT and SIGTERM set ``stop_requested()`` instead of interrupting (see the
    Note); a second one exits at once. Outside the main thread signals cannot be caught,
    and this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, _on_stop_signal) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        _StopRequest.signum, _StopRequest.direct = None, 0  # served: a later run in this process starts afresh


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
            request_stop(conn.recv())
        except (EOFError, OSError):
            os._exit(1)


def _worker(rank: int, nproc: int, port: int, fn: Callable, args: tuple, conn) -> None:
    _StopRequest.supervised = True
    threading.Thread(target=_listen, args=(conn,), name="fsdp8-launcher", daemon=True).start()
    status = 0
    try:
        _child(rank, nproc, port, fn, args)
    except Stopped as stop:
        status = stop.code
    except BaseException:
        conn.send((time.time(), traceback.format_exc()))
        status = 1  # and no normal exit: with a broken process group, gloo's threads would abort it
    # Skipping the interpreter's teardown saves seconds (torch's module graph) and loses
    # nothing: the run's files are closed, the process group too.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _failed(exitcode: int) -> bool:
    return exitcode not in (0, *(128 + s for s in STOP_SIGNALS))


def _describe(exitcode: int) -> str:
    if exitcode < 0:
        return f"was killed by {signal.Signals(-exitcode).name}"
    return f"exited with status {exitcode}"


class _Supervisor:
    """The launcher's side: starts the workers, passes stop requests on, watches for failures."""

    def __init__(self, nproc: int, fn: Callable, args: tuple):
        self.nproc, self.fn, self.args = nproc, fn, args
        self.signum: Optional[int] = None
        self.killed_by: Optional[int] = None
        self.procs: List[multiprocessing.Process] = []
        self.conns: Dict[object, int] = {}

    def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        port = _free_port()
        # Workers inherit ignored signals (see the Note); blocking them meanwhile keeps a
        # signal that arrives during the start pending for our handler instead of lost.
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            for s in STOP_SIGNALS:
                signal.signal(s, signal.SIG_IGN)
            for rank in range(self.nproc):
                ours, theirs = ctx.Pipe()
                proc = ctx.Process(target=_worker, args=(rank, self.nproc, port, self.fn, self.args, theirs),
                                   name=f"fsdp8-rank{rank}")
                proc.start()
                theirs.close()
                self.procs.append(proc)
                self.conns[ours] = rank
        finally:
            for s in STOP_SIGNALS:
                signal.signal(s, self._on_signal)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)

    def _on_signal(self, signum, frame) -> None:
        if self.signum is None:
            self.signum = signum
            for conn in self.conns:
                with contextlib.suppress(OSError):
                    conn.send(signum)
        else:
            self.killed_by = signum
            self.kill()

    def kill(self) -> None:
        for proc in self.procs:
            if proc.exitcode is None:
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

    def _watch(self) -> int:
        reports: List[Tuple[float, int, str]] = []
        live = {proc.sentinel: rank for rank, proc in enumerate(self.procs)}
        listening = dict(self.conns)
        failure: Optional[int] = None
        while live:
            for ready in wait(list(live) + list(listening)):
                if ready in listening:
                    try:
                        sent_at, text = ready.recv()
                        reports.append((sent_at, listening[ready], text))
                    except (EOFError, OSError):
                        del listening[ready]
                elif ready in live:
                    rank = live.pop(ready)
                    self.procs[rank].join()
                    if failure is None and self.killed_by is None and _failed(self.procs[rank].exitcode):
                        failure = rank
                        self.kill()
        for conn, rank in listening.items():  # a report sent just before its sender exited
            while conn.poll():
                try:
                    reports.append((*conn.recv(), rank))
                except (EOFError, OSError):
                    break
        if self.killed_by is not None:
            name = signal.Signals(self.killed_by).name
            print(f"fsdp8: second {name}: workers killed before they wrote their outputs", file=sys.stderr)
            return 128 + self.killed_by
        if failure is not None:
            if reports:
                _, rank, text = min(reports)  # the first to fail; the others failed because it did
                sys.stderr.write(text)
                last = text.strip().splitlines()[-1]
                print(f"fsdp8: rank {rank} failed: {last} (its traceback is above); the other workers were stopped",
                      file=sys.stderr)
            else:
                print(f"fsdp8: rank {failure} {_describe(self.procs[failure].exitcode)}; "
                      "the other workers were stopped", file=sys.stderr)
            return 1
        if self.signum is not None:
            return 128 + self.signum
        return max(proc.exitcode for proc in self.procs)


def launch(fn: Callable, args: tuple = (), nproc: Optional[int] = None) -> int:
    """Run ``fn(*args)`` on every rank: in this process under torchrun or for one rank,
    else in ``nproc`` spawned processes on this machine (default: ``resolve_nproc(None)``).

    Returns the exit status: 0; 1 when a worker failed (its traceback and one line were
    printed, the other workers killed); 128 + the signal when SIGINT or SIGTERM stopped the
    run (``fn`` raises ``Stopped`` for that)."""
    try:
        if under_torchrun():
            _run_and_close(fn, args)
            return 0
        nproc = resolve_nproc(nproc)
        if nproc == 1:
            _child(0, 1, _free_port(), fn, args)
            return 0
    except Stopped as stop:
        return stop.code
    return _Supervisor(nproc, fn, args).run()
