"""How a failed run is reported: each failing rank's exception becomes one line for the user
(what went wrong and how to fix it) and its traceback goes to the run's error log; a rank
killed from outside is told apart from one that failed, with the likely cause."""

from __future__ import annotations

import signal
import socket
import sys
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

GENERIC_MEMORY_ADVICE = "use less memory per process"


class RunError(RuntimeError):
    """A failure of a run that its user can act on (a damaged file, data too short, out of
    memory): the message says what went wrong and how to fix it, and is all the launcher
    prints of it."""


@dataclass(frozen=True)
class Failure:
    """A rank's exception as its worker sends it to the launcher."""

    rank: int
    at: float  # time.time() when it was caught
    message: str  # one line for the user
    expected: bool  # a RunError (or out of memory): the message is the whole story; else a bug
    traceback: str


@dataclass(frozen=True)
class Reporting:
    """How a launcher reports failures: the command's name (``fsdp8 train``), where the
    tracebacks go (None: on the terminal) and what to say when memory ran out."""

    name: str = "fsdp8"
    error_log: Optional[str] = None
    memory_advice: str = GENERIC_MEMORY_ADVICE


def _one_line(text: str) -> str:
    return " ".join(text.split())


def failure_of(error: BaseException, rank: int, traceback: str, memory_advice: str = GENERIC_MEMORY_ADVICE) -> Failure:
    if isinstance(error, RunError):
        return Failure(rank, time.time(), _one_line(str(error)), True, traceback)
    if isinstance(error, torch.OutOfMemoryError):
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        return Failure(rank, time.time(), f"out of GPU memory ({_one_line(first)}); {memory_advice}", True, traceback)
    lines = str(error).strip().splitlines()
    what = f"{type(error).__name__}: {_one_line(lines[0])}" if lines else type(error).__name__
    return Failure(rank, time.time(), what, False, traceback)


def oom_kills() -> Optional[int]:
    """How many processes the kernel's out-of-memory killer has killed since boot (any cgroup's
    too), or None where /proc/vmstat does not say."""
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
    except (OSError, ValueError):
        pass
    return None


def describe_death(rank: int, exitcode: int, oom_before: Optional[int], oom_now: Optional[int],
                   memory_advice: str) -> str:
    """A rank that ended without reporting an error (``exitcode`` as multiprocessing gives it:
    minus the signal of one killed by a signal), and what probably ended it."""
    if exitcode >= 0:
        return f"rank {rank} exited with status {exitcode} without reporting an error"
    signum = -exitcode
    name = signal.Signals(signum).name
    if signum != signal.SIGKILL:
        return (f"rank {rank} was killed by {name} (a crash in native code, or a signal from outside fsdp8); "
                "rerun it to see whether it repeats, and report it if it does")
    if oom_before is not None and oom_now is not None and oom_now > oom_before:
        return (f"rank {rank} was killed by SIGKILL from outside fsdp8, most likely by the kernel's out-of-memory "
                f"killer (it killed {oom_now - oom_before} process(es) meanwhile, says /proc/vmstat): this machine "
                f"ran out of memory; {memory_advice}")
    if oom_before is not None and oom_now is not None:
        return (f"rank {rank} was killed by SIGKILL from outside fsdp8, not by the kernel's out-of-memory killer "
                "(/proc/vmstat counts no kill of it meanwhile): something sent it SIGKILL")
    return (f"rank {rank} was killed by SIGKILL from outside fsdp8, most likely by the kernel's out-of-memory killer "
            f"(dmesg says so if it was): the machine ran out of memory; {memory_advice}")


def _ranks(ranks: List[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def summary(failures: List[Failure], deaths: Dict[int, str]) -> List[str]:
    """The lines for the user, without prefix: every rank killed from outside (``deaths``: rank
    -> its description), every expected failure (ranks with the same message on one line),
    and only when there are neither, the first unexpected one (the others usually failed
    because of it: a peer gone mid-collective)."""
    lines = [deaths[rank] for rank in sorted(deaths)]
    by_message: Dict[str, List[int]] = {}
    for failure in sorted(failures, key=lambda f: f.rank):
        if failure.expected:
            by_message.setdefault(failure.message, []).append(failure.rank)
    lines += [f"{_ranks(ranks)}: {message}" for message, ranks in by_message.items()]
    if not lines and failures:
        first = min(failures, key=lambda f: f.at)
        lines.append(f"rank {first.rank}: {first.message} (an unexpected error: please report it with its traceback)")
    return lines


def write_error_log(path: str, failures: List[Failure]) -> bool:
    """Append the tracebacks of ``failures``, first failed first, to the log at ``path``; False
    when it cannot be written."""
    try:
        with open(path, "a") as f:
            for failure in sorted(failures, key=lambda f: f.at):
                when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(failure.at))
                f.write(f"=== rank {failure.rank} on {socket.gethostname()}, {when} ===\n"
                        f"{failure.traceback.rstrip()}\n\n")
    except OSError:
        return False
    return True


def report(reporting: Reporting, failures: List[Failure], deaths: Dict[int, str], out=None) -> None:
    """Print the summary lines, and the tracebacks: into the error log, or where it cannot be
    written, of the unexpected failures on the terminal."""
    out = out or sys.stderr
    logged = bool(failures) and reporting.error_log is not None and write_error_log(reporting.error_log, failures)
    if failures and not logged:
        for failure in sorted(failures, key=lambda f: f.at):
            if not failure.expected:
                out.write(failure.traceback)
    for line in summary(failures, deaths):
        print(f"{reporting.name}: error: {line}", file=out)
    if logged:
        print(f"{reporting.name}: the full traceback{'s are' if len(failures) > 1 else ' is'} in "
              f"{reporting.error_log}", file=out)
    out.flush()
