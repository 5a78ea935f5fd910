"""File names that a checkpoint or model directory gives for its own files: resolved inside it
or refused, before anything is opened.

A name comes from a file an attacker may have written (a DCP ``.metadata``, a safetensors
index), so it may be absolute, climb out with ``..``, or be a symlink to elsewhere; the
refusal names only what the directory said, never whether or how large anything outside is.
"""

from __future__ import annotations

import os

from .store import CheckpointError, shown


class OutsidePathError(CheckpointError):
    """A checkpoint or model directory names a file outside itself."""


def _roots(directory: str):
    """Where files of ``directory`` may resolve: inside it, and for a snapshot of the Hugging
    Face hub's cache (<repo>/snapshots/<revision>, whose files are symlinks to
    <repo>/blobs/<hash>), inside that repository's blobs."""
    root = os.path.realpath(directory)
    yield root
    parent = os.path.dirname(root)
    if os.path.basename(parent) == "snapshots":
        yield os.path.join(os.path.dirname(parent), "blobs")


def inside(directory: str, name, what: str) -> str:
    """The real path of ``name``, a file that ``what`` (e.g. "the checkpoint metadata") in
    ``directory`` names, symlinks resolved, if it lies inside ``directory``; else an
    OutsidePathError."""
    if type(name) is not str or not name or "\0" in name:
        raise OutsidePathError(f"{what} in {directory} names a file as {shown(name)}, which is not a file "
                               "name")
    real = os.path.realpath(os.path.join(directory, name))
    if not any(real != root and os.path.commonpath([root, real]) == root for root in _roots(directory)):
        raise OutsidePathError(f"{what} in {directory} names the file {shown(name)}, which is not inside that "
                               "directory (symlinks resolved); fsdp8 reads only files inside it: the directory is "
                               "damaged or was made to read other files")
    return real
