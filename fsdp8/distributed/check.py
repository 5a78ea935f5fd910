"""Cross-rank agreement checks that run before any collective could hang on a mismatch."""

from __future__ import annotations

import hashlib
import json
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from . import comm


class DesyncError(RuntimeError):
    """Ranks disagree about something that must be identical everywhere."""


def _digest(lines: List[str]) -> int:
    h = hashlib.sha256("\n".join(lines).encode()).digest()
    return int.from_bytes(h[:8], "little", signed=True)


def first_difference(a: List[str], b: List[str]) -> Tuple[int, str]:
    """Index of the first differing entry and a sentence describing it."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i, f"entry {i}: {x!r} vs {y!r}"
    i = min(len(a), len(b))
    longer, which = (a, "first") if len(a) > len(b) else (b, "second")
    return i, f"the {which} has {abs(len(a) - len(b))} more entries, starting with {longer[i]!r}"


def _all_gather_lines(lines: List[str], group, device: torch.device) -> List[List[str]]:
    """Every rank's lines, sent as UTF-8 bytes in tensors (object collectives need numpy)."""
    world = dist.get_world_size(group)
    payload = torch.tensor(list(json.dumps(lines).encode()), dtype=torch.uint8, device=device)
    sizes = torch.empty(world, dtype=torch.int64, device=device)
    comm.all_gather(sizes, torch.tensor([payload.numel()], dtype=torch.int64, device=device), group, "structure sizes")
    longest = int(sizes.max())
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: payload.numel()] = payload
    gathered = torch.empty(world * longest, dtype=torch.uint8, device=device)
    comm.all_gather(gathered, padded, group, "structure lines")
    chunks = gathered.view(world, longest).cpu()
    return [json.loads(bytes(chunks[r, : int(sizes[r])].tolist()).decode()) for r in range(world)]


def check_same_everywhere(
    lines: List[str],
    what: str,
    group: Optional[dist.ProcessGroup],
    device: torch.device,
    hints: Optional[dict] = None,
) -> None:
    """Raise ``DesyncError`` on every rank unless all ranks of ``group`` hold equal ``lines``.

    The common case costs one all-gather of an 8-byte digest; only on a mismatch are the
    descriptions exchanged to name the first difference. ``hints`` maps a line prefix to
    advice added when the first difference is on such a line."""
    world = dist.get_world_size(group)
    if world == 1:
        return
    mine = torch.tensor([_digest(lines)], dtype=torch.int64, device=device)
    digests = torch.empty(world, dtype=torch.int64, device=device)
    comm.all_gather(digests, mine, group, "structure check")
    if bool((digests == digests[0]).all()):
        return
    everyone = _all_gather_lines(lines, group, device)
    ranks = dist.get_process_group_ranks(group)
    for i in range(1, world):
        if everyone[i] != everyone[0]:
            index, difference = first_difference(everyone[0], everyone[i])
            line = everyone[0][index] if index < len(everyone[0]) else ""
            advice = "Every rank must build the same model and call fully_shard with the same arguments."
            for prefix, hint in (hints or {}).items():
                if line.startswith(prefix):
                    advice = hint
            raise DesyncError(f"ranks disagree about {what}: rank {ranks[0]} and rank {ranks[i]} differ at {difference}. {advice}")
