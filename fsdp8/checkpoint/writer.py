"""Writing a checkpoint's data files: DCP's FileSystemWriter, plus the checksums of what this
rank wrote (computed as it is written), and write errors that keep their cause.

torch.save reports a failed write of its zip archive as "[enforce fail at
inline_container.cc] unexpected pos", dropping the OSError (a full disk, a quota); the
streams here keep the first such error so the save can say what it was and where.
"""

from __future__ import annotations

import errno
import os
import zlib
from contextlib import contextmanager
from pathlib import Path

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from . import checksums
from .store import CheckpointError


class _RecordingStream:
    """A data file being written: what DCP and torch.save use of it, with its write errors kept
    and the crc32 of the bytes written between two ``tell()`` calls. DCP asks ``tell()`` just
    before and just after writing each item, so that is each item's checksum, computed as it
    is written instead of by reading the file again."""

    def __init__(self, file, path, fs: "_RecordingFileSystem"):
        self._file, self._path, self._fs = file, path, fs
        self._start, self._crc = file.tell(), 0

    def _recorded(self, operation, *args):
        try:
            return operation(*args)
        except OSError as e:
            self._fs.failed = self._fs.failed or (self._path, e)
            raise

    def write(self, data) -> int:
        written = self._recorded(self._file.write, data)
        self._crc = zlib.crc32(data, self._crc)
        return written

    def tell(self) -> int:
        position = self._file.tell()
        self._fs.spans[(os.path.basename(self._path), self._start)] = (position - self._start, self._crc)
        self._start, self._crc = position, 0
        return position

    def flush(self) -> None:
        self._recorded(self._file.flush)

    def close(self) -> None:
        self._recorded(self._file.close)

    def fileno(self) -> int:
        return self._file.fileno()


class _RecordingFileSystem(FileSystem):
    def __init__(self):
        self.failed = None  # (path, OSError) of the first failed write
        self.writing = None  # the file being written, for an OSError raised outside its stream (fsync)
        self.spans = {}  # (file name, offset) -> (length, crc32) of the bytes written between two tell()s

    @contextmanager
    def create_stream(self, path, mode: str):
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        self.writing = path
        file = self._open(path, mode)
        stream = _RecordingStream(file, path, self)
        try:
            yield stream
        finally:
            stream.close()

    def _open(self, path, mode: str):
        try:
            return Path(path).open(mode)
        except OSError as e:
            self.failed = self.failed or (path, e)
            raise

class SafeWriter(FileSystemWriter):
    """FileSystemWriter that records the checksum of every item this rank writes (in
    checksums.rank<r>.json beside them) and names the cause of a failed write."""

    def __init__(self, path: str):
        super().__init__(path)
        self.fs = _RecordingFileSystem()

    def write_data(self, plan, planner):
        try:
            future = super().write_data(plan, planner)
            items = [(r.storage_data.relative_path, r.storage_data.offset, r.storage_data.length)
                     for r in future.value()]
            checksums.write_rank_file(str(self.path), self.rank or 0, items, self.fs.spans)
        except Exception as e:
            self._raise_cause(e)
        return future

    def finish(self, metadata, results) -> None:
        try:
            super().finish(metadata, results)
        except Exception as e:
            self._raise_cause(e)

    def _raise_cause(self, error: Exception):
        """Raise ``error``, or a CheckpointError naming the file and the OSError behind it."""
        path, cause = self.fs.failed or (getattr(error, "filename", None) or self.fs.writing, error)
        if not isinstance(cause, OSError):
            raise error
        advice = ("free space there or save elsewhere" if cause.errno in (errno.ENOSPC, errno.EDQUOT)
                  else "fix that or save elsewhere")
        raise CheckpointError(f"cannot write checkpoint file {path or self.path}: {cause.strerror or cause}; "
                              f"{advice}") from error
