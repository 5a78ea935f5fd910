"""Hang detection: a collective that waits too long names the ranks that never joined it.

[Note: finding the missing ranks]
A collective that some ranks never enter (a forward run on rank 0 only, under ZeRO-3) waits
until the group's timeout, ten minutes by default, and then says only that it timed out.
Instead, a gloo collective is waited for with a deadline, ``FSDP8_HANG_TIMEOUT_S`` (60 s by
default; 0 turns the check off), and a rank that reaches it asks which ranks are missing.

The ranks that could answer are the ones waiting too; a rank that is somewhere else (done,
running a forward of its own, idle) cannot answer anything. So the waiting ranks answer
for themselves: a collective still running after ``min(1 s, timeout / 10)`` writes
"rank r waits in <collective>" under the group's name into the default group's store,
and empties it when it completes or gives up. At the deadline a rank reads the entries of
its group: ranks without one are the missing ones, and it raises naming them and what the
others wait in. When every rank is waiting, the collective is only slow (or the ranks
disagree about the order of collectives, which their entries show nothing about: their
iteration counts may differ), and it goes on waiting up to the group's own timeout,
keeping its entry for the others' deadlines. Fast collectives never touch the store,
and a slow one costs two store writes, nothing next to a second of waiting. A rank that
entered the collective less than the announcement delay before the deadline is counted
as missing; it is late by nearly the whole timeout either way.

A rank that gives up (raises) keeps its entry: its collective stays posted in gloo and never
completes, so it still is in it. Emptying the entry would make a waiting rank whose deadline
comes a moment later (it entered later, or its clock of the deadline started later) blame
the rank that has just given up, a rank that did join. The group is unusable after a give-up
anyway (the stalled collective is still pending on some ranks), so the stale entry misleads
no later collective of it.

No monitored barrier on a side group: only its rank 0 learns who is missing (the others
time out waiting for rank 0 and would blame it), and a side gloo group costs every process
a full mesh of connections and threads for the whole run.

On CUDA (NCCL) collectives are enqueued on side streams and the host never waits for them,
so they are not watched here; NCCL's own watchdog ends them at the group's timeout.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Dict, List

import torch.distributed as dist

TIMEOUT_ENV = "FSDP8_HANG_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 60.0
_ANNOUNCE_AFTER_S = 1.0


class Stalled(RuntimeError):
    """A collective passed the hang deadline while some ranks of its group were not waiting."""

    def __init__(self, waited_s: float, missing: List[int], waiting: Dict[int, str]):
        self.waited_s, self.missing, self.waiting = waited_s, missing, waiting
        where = "; ".join(f"rank {r} waits in {what}" for r, what in sorted(waiting.items()))
        super().__init__(f"has waited {waited_s:g} s: rank(s) {', '.join(map(str, missing))} did not join it ({where})")


def timeout_s() -> float:
    """The hang deadline in seconds from ``FSDP8_HANG_TIMEOUT_S`` (0: no deadline)."""
    value = os.environ.get(TIMEOUT_ENV, "")
    try:
        seconds = float(value) if value.strip() else DEFAULT_TIMEOUT_S
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV}={value!r} is not a number of seconds (0 turns the hang check off)") from None
    if seconds < 0:
        raise ValueError(f"{TIMEOUT_ENV}={value!r} must be >= 0 (0 turns the hang check off)")
    return seconds


def _done_within(work, seconds: float) -> bool:
    """Wait up to ``seconds``; True once the work completed (its own failure is raised)."""
    try:
        work.wait(timeout=timedelta(seconds=seconds))
        return True
    except RuntimeError:
        if not work.is_completed():
            return False
        work.wait()  # completed with an error: raise that one, not the timeout
        return True


def _key(group, rank: int) -> str:
    return f"fsdp8/waiting/{group.group_name}/{rank}"


def wait(work, group, what: str) -> None:
    """Wait for the gloo ``work`` of ``group``; past the deadline raise ``Stalled``.

    ``what`` describes the collective to the other ranks (e.g. "all_gather for layers.1
    at iteration 3"). See [Note: finding the missing ranks]."""
    deadline = timeout_s()
    if deadline == 0:
        work.wait()
        return
    early = min(_ANNOUNCE_AFTER_S, deadline / 10)
    if _done_within(work, early):
        return
    me = dist.get_rank()
    store = dist.distributed_c10d._get_default_store()
    store.set(_key(group, me), what)
    stalled = False
    try:
        if _done_within(work, deadline - early):
            return
        ranks = dist.get_process_group_ranks(group)
        entries = {r: store.get(_key(group, r)).decode() for r in ranks if store.check([_key(group, r)])}
        waiting = {r: what for r, what in entries.items() if what}
        missing = [r for r in ranks if r not in waiting]
        if missing and not work.is_completed():
            stalled = True
            raise Stalled(deadline, missing, waiting)
        work.wait()  # everyone is here: slow, or disagreeing about the order; the group's timeout decides
    finally:
        # Emptied, not deleted: a reader that saw the key must not block in get(). A rank that
        # gives up keeps its entry (see [Note: finding the missing ranks]).
        if not stalled:
            store.set(_key(group, me), "")
