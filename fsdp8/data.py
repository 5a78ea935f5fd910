"""Token data: the packaged byte corpus or a text file, tokenized as bytes or with a tokenizer,
and world-size-independent batches of it."""

from __future__ import annotations

import codecs
import hashlib
import os
import sys
from importlib import resources
from typing import Optional

import torch

from .models.hf_dir import import_transformers

VOCAB_SIZE = 256  # of byte data
VAL_FRACTION = 0.05
_SNIFF_BYTES = 64 * 1024  # what check_text_file reads of a --data file


def read_data(path: Optional[str]) -> bytes:
    """The bytes of a text file to train on (``None``: the packaged corpus)."""
    if path is None:
        return (resources.files("fsdp8") / "assets" / "corpus.txt").read_bytes()
    with open(path, "rb") as f:
        raw = f.read()
    if not raw:
        raise ValueError(f"--data {path} is empty; give a text file to train on")
    return raw


def check_text_file(path: str) -> None:
    """Raise ValueError, in one line, unless ``path`` is a file that starts as UTF-8 text. A
    directory, or a weights file or archive given by mistake, would otherwise fail later or
    train silently on its bytes. Only the first 64 KiB are read: a cheap look, not a proof."""
    if os.path.isdir(path):
        raise ValueError(f"--data {path} is a directory; give one text file to train on (concatenate the "
                         "directory's files into one)")
    if not os.path.isfile(path):
        raise ValueError(f"--data {path}: no such file; give a text file to train on")
    with open(path, "rb") as f:
        head = f.read(_SNIFF_BYTES)
    nul = head.find(b"\0")
    if nul >= 0:
        raise ValueError(f"--data {path} is not text: it has a NUL byte at offset {nul}, as weights, archives and "
                         "other binary files do; give a UTF-8 text file")
    try:
        # A file cut at 64 KiB may end inside a character: that part is left to the next read.
        codecs.getincrementaldecoder("utf-8")().decode(head, final=len(head) < _SNIFF_BYTES)
    except UnicodeDecodeError as e:
        raise ValueError(f"--data {path} is not UTF-8 text (byte 0x{head[e.start]:02x} at offset {e.start} is "
                         "invalid); give a UTF-8 text file (iconv -t utf-8 converts one)") from None


def load_corpus() -> torch.Tensor:
    """The packaged corpus (fsdp8/assets/corpus.txt) as a 1-D uint8 tensor of bytes."""
    return torch.frombuffer(bytearray(read_data(None)), dtype=torch.uint8)


def encode(text: str) -> torch.Tensor:
    """UTF-8 bytes of `text` as int64 token ids, ready for the model."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.int64)


def decode(tokens: torch.Tensor) -> str:
    """Text of a 1-D tensor of byte ids; bytes that are not valid UTF-8 become U+FFFD."""
    if tokens.dim() != 1:
        raise ValueError(f"decode expects a 1-D tensor of byte ids, got shape {tuple(tokens.shape)}")
    return bytes(tokens.to(torch.uint8).tolist()).decode("utf-8", errors="replace")


def has_tokenizer(model_dir: str) -> bool:
    """Whether a Hugging Face model directory holds a tokenizer (what AutoTokenizer loads)."""
    return any(os.path.isfile(os.path.join(model_dir, name))
               for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json"))


def load_tokenizer(model_dir: str):
    """The tokenizer of a local Hugging Face model directory, read from it alone (no network)."""
    auto_tokenizer = import_transformers("a Hugging Face tokenizer").AutoTokenizer
    tokenizer = auto_tokenizer.from_pretrained(model_dir, local_files_only=True)
    # The whole file is encoded at once and cut into windows afterwards: the model never sees
    # a sequence longer than --seq-len, so the "longer than the model's maximum" warning the
    # tokenizer would print for the whole file is wrong here.
    tokenizer.model_max_length = sys.maxsize
    return tokenizer


def load_tokens(path: Optional[str] = None, tokenizer=None) -> torch.Tensor:
    """A text file (``None``: the packaged corpus) as a 1-D tensor of token ids: its bytes
    (uint8), or int32 ids from ``tokenizer`` (a transformers tokenizer; no special tokens added)."""
    return encode_data(read_data(path), tokenizer)


def encode_data(raw: bytes, tokenizer=None) -> torch.Tensor:
    """The bytes of a text as a 1-D tensor of token ids (see ``load_tokens``)."""
    if tokenizer is None:
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    ids = tokenizer.encode(raw.decode("utf-8", errors="replace"), add_special_tokens=False)
    return torch.tensor(ids, dtype=torch.int32)


def fingerprint(raw: bytes) -> dict:
    """What identifies a data file's content: its size and SHA-256 (a resumed run checks that
    the file it would train on is the one it trained on)."""
    return {"bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}


def file_fingerprint(path: str) -> dict:
    """``fingerprint`` of the file at ``path``, read in pieces."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        for piece in iter(lambda: f.read(1 << 20), b""):
            digest.update(piece)
            size += len(piece)
    return {"bytes": size, "sha256": digest.hexdigest()}


def check_token_count(n_tokens: int, seq_len: int, what: str) -> None:
    """Raise ValueError when ``n_tokens`` of data (described by ``what``) hold no sequence of
    ``seq_len`` (+1 target) in their validation part, the smaller of the two."""
    val = int(n_tokens * VAL_FRACTION)
    if val < seq_len + 1:
        raise ValueError(f"{what} is too short: its validation part (the last {VAL_FRACTION:.0%}, {val} of "
                         f"{n_tokens} tokens) holds no sequence of --seq-len {seq_len} (+1 target); give more text or "
                         "a shorter --seq-len")


def _step_seed(seed: int, step: int) -> int:
    # A hash rather than seed * K + step, so distinct (seed, step) pairs never collide.
    digest = hashlib.sha256(f"fsdp8-data:{seed}:{step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # torch takes seeds below 2**63 everywhere


_INTEGER_DTYPES = (torch.uint8, torch.int16, torch.int32, torch.int64)


class TokenCorpus:
    """Random windows of a 1-D tensor of token ids, split into train (first 95%) and val (last 5%).

    The global batch of a step depends only on (seed, step, global batch size), never on
    how it is split across ranks, so runs at different world sizes see the same data.
    """

    def __init__(self, data: torch.Tensor, split: str = "train"):
        if data.dim() != 1 or data.dtype not in _INTEGER_DTYPES:
            raise ValueError(f"data must be a 1-D tensor of integer token ids, got {data.dtype} of shape "
                             f"{tuple(data.shape)}")
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

        targets[i, t] is the token after inputs[i, t]. ``rank`` and ``world_size`` are the
        data-parallel rank and size: ranks that must see the same rows (one tensor- or
        context-parallel group) pass the same rank.
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
                f"seq_len={seq_len} needs {seq_len + 1} tokens per window but the {self.split} split "
                f"has only {len(self)}; use a shorter seq_len or more data"
            )
        generator = torch.Generator().manual_seed(_step_seed(seed, step))
        n_rows = world_size * batch_per_rank
        starts = torch.randint(0, len(self) - seq_len, (n_rows,), generator=generator)
        mine = starts[rank * batch_per_rank : (rank + 1) * batch_per_rank]
        windows = self.data[mine[:, None] + torch.arange(seq_len + 1)].long()
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


class ByteCorpus(TokenCorpus):
    """A TokenCorpus of bytes (token ids 0..255): by default the packaged corpus."""

    def __init__(self, data: torch.Tensor | None = None, split: str = "train"):
        data = load_corpus() if data is None else data
        if data.dim() != 1 or data.dtype != torch.uint8:
            raise ValueError(
                f"data must be a 1-D uint8 tensor, got {data.dtype} of shape {tuple(data.shape)}"
            )
        super().__init__(data, split)
