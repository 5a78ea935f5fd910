"""Checksums of a checkpoint's stored items (crc32 of each item's bytes): computed by the rank
that wrote the items right after writing them, gathered by rank 0 into checksums.json when
the checkpoint is published (the marker names the algorithm, so a lost file is noticed),
and checked by whoever reads an item, before it is used.

An item (one rank's piece of one tensor, or one pickled value) is the unit DCP reads: a rank
loading a resharded checkpoint reads only the items that overlap its shards, so it checks
only what it reads. crc32 finds flipped bits and torn or mixed-up writes; it authenticates
nothing (whoever can edit the data files can edit the marker). A checkpoint without them
(written by torch or an older fsdp8) loads unchecked.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from collections import defaultdict
from typing import Dict, Iterable, Optional, Tuple

from .store import CheckpointError, DamagedCheckpointError, shown, write_json_atomic

ALGORITHM = "crc32"
FILE = "checksums.json"  # beside the data files; the marker names the algorithm
_BLOCK = 4 << 20
_RANK_FILE = re.compile(r"checksums\.rank\d+\.json")

# (data file, offset) -> (length, crc32) of every stored item
Table = Dict[Tuple[str, int], Tuple[int, int]]


def crc32_of(stream, offset: int, length: int) -> int:
    """crc32 of ``length`` bytes of ``stream`` from ``offset`` (leaves the position after them)."""
    stream.seek(offset)
    buffer = memoryview(bytearray(min(_BLOCK, length)))
    crc, left = 0, length
    while left:
        n = stream.readinto(buffer[:min(left, len(buffer))])
        if not n:
            raise DamagedCheckpointError(f"{getattr(stream, 'name', 'a data file')} ends {left} bytes before the "
                                         f"item at offset {offset} does")
        crc = zlib.crc32(buffer[:n], crc)
        left -= n
    return crc


def write_rank_file(directory: str, rank: int, items: Iterable[Tuple[str, int, int]], known: Table) -> None:
    """Rank ``rank``'s items (data file name, offset, length), with their crc32s, into
    ``directory``/checksums.rank<rank>.json for ``gather`` to collect. ``known``: the crc32s
    computed while writing, by (file, offset); an item not among them is read back."""
    table = defaultdict(list)
    opened = {}
    try:
        for name, offset, length in sorted(items):
            length_and_crc = known.get((name, offset))
            if length_and_crc is None or length_and_crc[0] != length:
                if name not in opened:
                    opened[name] = open(os.path.join(directory, name), "rb")
                length_and_crc = (length, crc32_of(opened[name], offset, length))
            table[name].append([offset, *length_and_crc])
    finally:
        for f in opened.values():
            f.close()
    write_json_atomic(os.path.join(directory, f"checksums.rank{rank}.json"), table)


def gather(directory: str) -> str:
    """Rank 0, publishing: every rank's checksums into ``directory``/checksums.json (the rank
    files go); returns what the marker records of them (the algorithm)."""
    files: Dict[str, list] = {}
    for name in sorted(os.listdir(directory)):
        if _RANK_FILE.fullmatch(name):
            with open(os.path.join(directory, name)) as f:
                for data_file, items in json.load(f).items():
                    files.setdefault(data_file, []).extend(items)
            os.remove(os.path.join(directory, name))
    write_json_atomic(os.path.join(directory, FILE), files)
    return ALGORITHM


def read_table(checkpoint: str, marker: dict) -> Optional[Table]:
    """The checksums of ``checkpoint`` (whose completion marker is ``marker``), or None when it
    was saved without them."""
    algorithm = marker.get("checksums")
    if algorithm is None:
        return None
    path = os.path.join(checkpoint, FILE)
    if algorithm != ALGORITHM:
        raise CheckpointError(f"{checkpoint}'s marker lists checksums of a kind fsdp8 does not know "
                              f"({shown(algorithm)})")
    try:
        with open(path) as f:
            files = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} cannot be read ({e}): the checkpoint's checksums are gone") from None
    table: Table = {}
    for name, items in (files.items() if type(files) is dict else [(None, None)]):
        for item in items if type(items) is list else [None]:
            if type(item) is not list or len(item) != 3 or not all(type(v) is int for v in item):
                raise CheckpointError(f"{path} lists a checksum that is not [offset, length, crc32] of a data file; "
                                      "it is damaged")
            table[(name, item[0])] = (item[1], item[2])
    return table


def check_item(checkpoint: str, name: str, stream, offset: int, length: int, table: Table) -> None:
    """Raise DamagedCheckpointError unless the item at ``offset`` of data file ``name`` (open as
    ``stream``) has the checksum its checkpoint recorded."""
    saved = table.get((name, offset))
    if saved is None or saved[0] != length:
        raise DamagedCheckpointError(f"checkpoint {checkpoint}: data file {name} holds an item (bytes {offset} to "
                                     f"{offset + length}) that its {ALGORITHM} list does not: the checkpoint was "
                                     "altered after it was saved; load an older one")
    crc = crc32_of(stream, offset, length)
    if crc != saved[1]:
        raise DamagedCheckpointError(f"checkpoint {checkpoint}: data file {name} is damaged: bytes {offset} to "
                                     f"{offset + length} have {ALGORITHM} {crc:08x}, but {saved[1]:08x} was written "
                                     "(the disk or a copy changed them); load an older checkpoint")
