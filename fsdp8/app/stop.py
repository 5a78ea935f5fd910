"""Stopping a run on a signal, in each worker: the stop request the training loop reads, and
the checkpoint writes a second signal waits for.

[Note: stopping on a signal]
SIGINT and SIGTERM ask for a stop, they do not interrupt: ``stop_on_signals()`` turns
them into a flag that the training loop reads once per step, and the ranks agree on it
in a collective, so every rank leaves after the same step and can still checkpoint and
write its outputs. The launcher does not re-send signals to its workers; it passes the
request down a pipe that each worker reads in a thread, which also works while a worker
is still importing (a signal would be lost or raise there). Workers start with SIGINT
and SIGTERM ignored, so a terminal's Ctrl-C, which reaches the whole process group,
cannot kill one mid-import with a traceback; ``stop_on_signals()`` takes them over once
training runs.

A second signal means "stop now", but never at the cost of the run's newest checkpoint:
killing a save leaves only ``step-N.partial``, and when that was the run's first
checkpoint nothing is left to resume from. So while a checkpoint is being written
(``checkpoint_started`` .. ``checkpoint_finished``) a second signal waits for it to be
published and then stops; otherwise, and at a third signal, the stop is immediate. The
launcher decides this for its workers (they report their checkpoint writes up the pipe,
and it got the terminal's signals too): a spawned worker only ever takes a signal as a
stop request. A process on its own (one rank, or each rank under torchrun) decides for
itself.
"""

from __future__ import annotations

import contextlib
import enum
import os
import signal
import sys
import threading
from dataclasses import dataclass
from typing import Iterator, List, Optional

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stopped(SystemExit):
    """Raised once a run stopped early on a signal and wrote its outputs: exit status 128 + signal."""

    def __init__(self, signum: int):
        super().__init__(128 + signum)
        self.signum = signum


class Write(enum.Enum):
    STARTED = "started"
    PUBLISHED = "published"
    FAILED = "failed"


@dataclass(frozen=True)
class CheckpointWrite:
    """What a spawned rank 0 tells its launcher when it starts writing a checkpoint, and when
    that write ends: published, or failed."""

    path: str
    event: Write


class _Uplink:
    """The pipe to the launcher of a spawned worker; the async-save thread sends on it too."""

    def __init__(self, conn, rank: int):
        self.conn, self.rank = conn, rank
        self.lock = threading.Lock()

    def send(self, message) -> None:
        with self.lock, contextlib.suppress(OSError):
            self.conn.send(message)


class _State:
    """This process's stop state: the first request's signal, the signals delivered to this
    process itself, the checkpoints being written, and the exit status owed once they are
    (a second signal came during a write)."""

    signum: Optional[int] = None
    signals = 0
    uplink: Optional[_Uplink] = None
    writing: List[str] = []
    exit_when_written: Optional[int] = None


def supervise(conn, rank: int) -> None:
    """Make this spawned worker report to its launcher through ``conn`` (see the Note)."""
    _State.uplink = _Uplink(conn, rank)


def uplink() -> Optional[_Uplink]:
    return _State.uplink


def request_stop(signum: int) -> None:
    if _State.signum is None:
        _State.signum = signum


def stop_requested() -> Optional[int]:
    """The signal number of a pending stop request, or None."""
    return _State.signum


def _say(text: str) -> None:
    if os.environ.get("RANK", "0") == "0":  # under torchrun every rank gets the terminal's signal
        sys.stderr.write(f"\n{text}\n")
        sys.stderr.flush()


def _exit(status: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _on_stop_signal(signum, frame) -> None:
    _State.signals += 1
    name = signal.Signals(signum).name
    if _State.uplink is not None or _State.signals == 1:
        request_stop(signum)
    elif _State.signals == 2 and _State.writing:
        _say(f"second {name}: finishing checkpoint {_State.writing[-1]}, then stopping; a third kills at once")
        _State.exit_when_written = 128 + signum
    else:
        _say(f"{'second' if _State.signals == 2 else 'third'} {name}: stopping at once")
        _exit(128 + signum)


def checkpoint_started(path: str) -> None:
    """Every rank, before it writes anything of the checkpoint at ``path``."""
    _State.writing.append(path)
    if _State.uplink is not None and _State.uplink.rank == 0:
        _State.uplink.send(CheckpointWrite(path, Write.STARTED))


def checkpoint_finished(path: str, published: bool) -> None:
    """Every rank, once the checkpoint at ``path`` is published or its save failed (from the
    async-save thread too); exits here if a second signal was waiting for it."""
    with contextlib.suppress(ValueError):
        _State.writing.remove(path)
    if _State.uplink is not None and _State.uplink.rank == 0:
        _State.uplink.send(CheckpointWrite(path, Write.PUBLISHED if published else Write.FAILED))
    if _State.exit_when_written is not None and not _State.writing:
        _exit(_State.exit_when_written)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """Inside, SIGINT and SIGTERM set ``stop_requested()`` instead of interrupting; a second
    one stops at once, or once the checkpoint being written is published (see the Note).
    Outside the main thread signals cannot be caught, and this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, _on_stop_signal) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        # Served: a later run in this process starts afresh.
        _State.signum, _State.signals, _State.writing, _State.exit_when_written = None, 0, [], None
