"""The on-disk protocol of a checkpoint directory: written aside, published by rename.

[Note: atomic checkpoints]
A save writes everything into ``<path>.partial``; once every rank has finished, rank 0
writes the completion marker into it and renames it to ``<path>`` (an existing ``<path>``
is first renamed aside and deleted only after the new one is in place). A crash at any
moment therefore leaves either the old checkpoint or the new one complete at ``<path>``,
plus perhaps a ``.partial`` or ``.old-*`` directory that the next save removes. A
checkpoint counts only with its marker, so ``latest()`` never returns a half-written one.
"""

from __future__ import annotations

import json
import os
import re
import reprlib
import shutil
import time
from typing import Any, Dict, List, Optional, Tuple

MARKER = "COMPLETE.json"
METADATA = ".metadata"
FORMAT = "fsdp8-checkpoint-v1"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, damaged or does not fit the model."""


class DamagedCheckpointError(CheckpointError):
    """A checkpoint's data files do not hold what its metadata and checksums say: found while
    reading them (an older checkpoint may be intact)."""


_SHOWN = reprlib.Repr()
_SHOWN.maxstring = _SHOWN.maxother = 200


def shown(value) -> str:
    """A value read from a checkpoint, for a message: its repr, cut short (a crafted name or
    list may be megabytes long)."""
    return _SHOWN.repr(value)


def partial_path(path: str) -> str:
    return f"{path}.partial"


def extra_path(path: str, rank: int) -> str:
    return os.path.join(path, f"extra.rank{rank}.json")


def is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MARKER))


def read_marker(path: str) -> Dict[str, Any]:
    with open(os.path.join(path, MARKER)) as f:
        return json.load(f)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: str, obj: Any) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def prepare(path: str) -> None:
    """Rank 0, before a save: a fresh ``.partial`` directory (leftovers of a crash removed)."""
    parent = os.path.dirname(path) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = partial_path(path)
    shutil.rmtree(tmp, ignore_errors=True)
    for name in os.listdir(parent):
        if name.startswith(os.path.basename(path) + ".old-"):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
    os.makedirs(tmp)


def publish(path: str, info: Dict[str, Any]) -> None:
    """Rank 0, after every rank finished writing: marker, then the rename (see the Note)."""
    tmp = partial_path(path)
    parent = os.path.dirname(path) or "."
    published = max((key[2] for key, _ in _ordered(parent)), default=0)
    marker = dict(info, format=FORMAT, published=published + 1)
    write_json_atomic(os.path.join(tmp, MARKER), marker)
    _fsync_dir(tmp)
    old = None
    if os.path.exists(path):
        old = f"{path}.old-{time.time_ns()}"
        os.rename(path, old)
    os.rename(tmp, path)
    _fsync_dir(parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# [Note: the order of checkpoints]
# A checkpoint named <prefix><number> (step-000120, run-step3) is step <number> of the series
# <prefix>. Checkpoints are ordered by that step, never by a clock (a clock set back would put
# the newest first); ties, and names without a number, go by the order they were published
# in, a counter in the marker (so all names without a number come before the numbered ones).
_SERIES = re.compile(r"(.*?)(\d+)")
_DEBRIS = re.compile(r".*(\.partial|\.old-\d+)")  # what an interrupted save or publish leaves


def series_of(name: str) -> Optional[Tuple[str, int]]:
    """(prefix, step) of a checkpoint named <prefix><number>, or None."""
    match = _SERIES.fullmatch(name)
    return (match.group(1), int(match.group(2))) if match else None


def _ordered(directory: str) -> List[Tuple[tuple, str]]:
    """(order key, path) of the complete checkpoints in ``directory``, oldest first."""
    if not os.path.isdir(directory):
        return []
    found = []
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if _DEBRIS.fullmatch(name) or not (os.path.isdir(path) and is_complete(path)):
            continue
        try:
            published = read_marker(path).get("published", 0)
        except (OSError, ValueError, AttributeError):
            continue
        series = series_of(name)
        found.append(((series is not None, series[1] if series else 0, published if type(published) is int else 0,
                       name), path))
    return sorted(found)


def complete_checkpoints(directory: str) -> List[str]:
    """Complete checkpoints directly inside ``directory``, oldest first (see the Note)."""
    return [path for _, path in _ordered(directory)]


def latest(directory: str) -> Optional[str]:
    """The newest complete checkpoint in ``directory`` (the highest step), or None."""
    found = complete_checkpoints(directory)
    return found[-1] if found else None


def prune(directory: str, keep_last: int, protect: str) -> List[str]:
    """Delete all but the newest ``keep_last`` complete checkpoints of ``protect``'s series
    (same prefix, see the Note), never ``protect`` itself nor anything else."""
    series = series_of(os.path.basename(protect))
    if series is None:
        return []
    mine = [p for p in complete_checkpoints(directory) if (series_of(os.path.basename(p)) or ("",))[0] == series[0]]
    doomed = [p for p in mine[: max(0, len(mine) - keep_last)] if os.path.abspath(p) != os.path.abspath(protect)]
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return doomed


def problems(path: str, foreign_ok: bool = False) -> List[str]:
    """What makes the directory ``path`` not a checkpoint, as sentences (empty when fine).
    ``foreign_ok`` accepts a checkpoint without fsdp8's marker if fsdp8 did not write it (no
    extra files). verify.inspect checks the rest."""
    if not os.path.isdir(path):
        hint = " (a save was interrupted before it finished)" if os.path.isdir(partial_path(path)) else ""
        return [f"checkpoint {path} does not exist{hint}"]
    found = []
    written_by_fsdp8 = any(n.startswith("extra.rank") for n in os.listdir(path))
    if not is_complete(path) and (written_by_fsdp8 or not foreign_ok):
        found.append(f"{path} has no {MARKER}: the save that wrote it did not finish")
    if not os.path.isfile(os.path.join(path, METADATA)):
        found.append(f"{path} has no {METADATA} file")
    return found
