"""The lock of a run directory: one ``fsdp8 train`` at a time writes an ``--out``.

An advisory ``fcntl.flock`` on ``OUT/.fsdp8-run.lock``, held by the launching process for the
whole run. The kernel drops it when that process dies however it dies, so the lock of a
dead run never blocks the next one; the file's content (pid, host, start time) only names
the holder for the refusal. The lock is not inherited by the workers (the launcher's
descriptors are not passed to spawned processes), which the launcher outlives anyway.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from typing import Optional

LOCK_FILE = ".fsdp8-run.lock"


class RunDirLocked(ValueError):
    """Another process holds the run directory's lock."""


def _holder(fd: int) -> str:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        info = json.loads(os.read(fd, 4096) or b"{}")
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["started"]))
        return f"pid {info['pid']} on {info['host']}, started {started}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not said who it is yet"


class RunLock:
    """Holds ``directory``'s lock from creation to ``release()`` (or the end of a ``with``);
    raises ``RunDirLocked``, naming the holder, when another process holds it."""

    def __init__(self, directory: str):
        self.path = os.path.join(directory, LOCK_FILE)
        self.unsupported: Optional[str] = None  # why this filesystem cannot lock it
        try:
            self.fd: Optional[int] = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise ValueError(f"--out {directory}: cannot create {self.path} ({e.strerror}); give a directory you can "
                             "write to") from None
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(self.fd)
            self.release()
            raise RunDirLocked(f"--out {directory} is being written by another fsdp8 train ({holder}); wait for it "
                               "to finish or stop it, or give another --out") from None
        except OSError as e:  # a filesystem without locks (some network ones): the run goes on unguarded
            self.unsupported = e.strerror
            self.release()
            return
        info = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}).encode()
        os.pwrite(self.fd, info, 0)
        os.ftruncate(self.fd, len(info))

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing drops the lock; the file stays, naming the last holder
            self.fd = None

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()
