"""Byte-level data: the packaged corpus and world-size-independent, per-rank batches."""

from __future__ import annotations

import hashlib
from importlib import resources

import torch

VOCAB_SIZE = 256
VAL_FRACTION = 0.05


def load_corpus() -> torch.Tensor:
    """The packaged corpus (fsdp8/assets/corpus.txt) as a 1-D uint8 tensor of bytes."""
    raw = (resources.files("fsdp8") / "assets" / "corpus.txt").read_bytes()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def encode(text: str) -> torch.Tensor:
    """UTF-8 bytes of `text` as int64 token ids, ready for the model."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.int64)


def decode(tokens: torch.Tensor) -> str:
    """Text of a 1-D tensor of byte ids; bytes that are not valid UTF-8 become U+FFFD."""
    if tokens.dim() != 1:
        raise ValueError(f"decode expects a 1-D tensor of byte ids, got shape {tuple(tokens.shape)}")
    return bytes(tokens.to(torch.uint8).tolist()).decode("utf-8", errors="replace")


def _step_seed(seed: int, step: int) -> int:
    # A hash rather than seed * K + step, so distinct (seed, step) pairs never collide.
    digest = hashlib.sha256(f"fsdp8-data:{seed}:{step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # torch takes seeds below 2**63 everywhere


class ByteCorpus:
    """Random windows of a byte corpus, split into train (first 95%) and val (last 5%).

    The global batch of a step depends only on (seed, step, global batch size), never on
    how it is split across ranks, so runs at different world sizes see the same data.
    """

    def __init__(self, data: torch.Tensor | None = None, split: str = "train"):
        data = load_corpus() if data is None else data
        if data.dim() != 1 or data.dtype != torch.uint8:
            raise ValueError(
                f"data must be a 1-D uint8 tensor, got {data.dtype} of shape {tuple(data.shape)}"
            )
        n_val = int(data.numel() * VAL_FRACTION)
        if split == "train":
            self.data = data[: data.numel() - n_val]
        elif split == "val":
            self.data = data[data.numel() - n_val :]
        else:
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        self.split = split

    def __len__(self) -> int:
        return self.data.numel()

    def batch(
        self, step: int, rank: int, world_size: int, batch_per_rank: int, seq_len: int, seed: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), int64 [batch_per_rank, seq_len]: rank's rows of the step's global batch.

        targets[i, t] is the byte after inputs[i, t].
        """
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        if batch_per_rank < 1 or seq_len < 1:
            raise ValueError(
                f"batch_per_rank and seq_len must be >= 1, got {batch_per_rank} and {seq_len}"
            )
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if seq_len + 1 > len(self):
            raise ValueError(
                f"seq_len={seq_len} needs {seq_len + 1} bytes per window but the {self.split} split "
                f"has only {len(self)}; use a shorter seq_len"
            )
        generator = torch.Generator().manual_seed(_step_seed(seed, step))
        n_rows = world_size * batch_per_rank
        starts = torch.randint(0, len(self) - seq_len, (n_rows,), generator=generator)
        mine = starts[rank * batch_per_rank : (rank + 1) * batch_per_rank]
        windows = self.data[mine[:, None] + torch.arange(seq_len + 1)].long()
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
