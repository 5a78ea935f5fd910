"""What the training loop reads and writes besides its metrics: the model's pretrained
weights, the token data, and checkpoints (saved telling the stop logic while they are being
written, loaded for a resume), with the failures a user can fix raised as ``RunError``s
that say how."""

from __future__ import annotations

import contextlib
import os
import time
from typing import Iterator, Tuple

import torch

from ...checkpoint import CheckpointError, load, load_pretrained, save
from ...checkpoint.safetensors import SafetensorsError
from ...data import check_token_count, encode_data, fingerprint, has_tokenizer, load_tokenizer, read_data
from ...engine.state_dict import StateDictError
from ..failures import RunError
from ..stop import checkpoint_finished, checkpoint_started
from .config import TrainConfig


def load_weights(model, cfg: TrainConfig) -> None:
    """Fill ``model`` from the weight files of ``--model hf:DIR``."""
    try:
        load_pretrained(model, cfg.hf_dir)  # each rank reads only its rows
    except (SafetensorsError, StateDictError) as e:
        raise RunError(f"--model {cfg.model}: {e}") from e


def load_data(cfg: TrainConfig) -> Tuple[torch.Tensor, dict, bool]:
    """The token ids to train on, what the checkpoints record of a --data file (its path and
    fingerprint; the launcher checked a short file's length, this checks any), and whether
    the model's tokenizer read it (else it was read as bytes)."""
    tokenizer = load_tokenizer(cfg.hf_dir) if cfg.model and has_tokenizer(cfg.hf_dir) else None
    raw = read_data(cfg.data or None)
    tokens = encode_data(raw, tokenizer)
    what = f"--data {cfg.data}" if cfg.data else "the packaged corpus"
    try:
        check_token_count(tokens.numel(), cfg.seq_len, what + (f" (read with the tokenizer of {cfg.hf_dir})"
                                                                if tokenizer is not None else " (read as bytes)"))
    except ValueError as e:
        raise RunError(str(e)) from None
    record = {"data": {"path": os.path.abspath(cfg.data), **fingerprint(raw)}} if cfg.data else {}
    return tokens, record, tokenizer is not None


def resume_from(checkpoint: str, model, opt, device: torch.device) -> int:
    """Load ``checkpoint`` (at any layout: checkpoints reshard) and its RNG states; its step."""
    try:
        extra = load(checkpoint, model, opt)
    except CheckpointError as e:
        raise RunError(f"--resume: cannot continue from {checkpoint}: {e}; pass --resume with an older checkpoint "
                       "of the run, or rerun with --overwrite instead of --resume to start afresh") from e
    except StateDictError as e:
        raise RunError(f"--resume: {checkpoint} does not fit the model: {e}; resume it with the model and "
                       "--precision it was saved with") from e
    torch.set_rng_state(extra["rng"])
    if device.type == "cuda" and "cuda_rng" in extra:
        torch.cuda.set_rng_state(extra["cuda_rng"], device)
    return int(extra["step"])  # the data position: batches are a function of the step


@contextlib.contextmanager
def saving(where: str) -> Iterator[None]:
    """Inside, an OSError of writing checkpoints (in ``where``) is the user's to fix."""
    try:
        yield
    except OSError as e:  # a full disk, a directory gone
        raise RunError(f"writing a checkpoint in {where} failed: {e}; free space or fix the directory, or give "
                       "another --out") from e


class _HeldWhileEncoded(dict):
    """Test seam, FSDP8_FAULT=hold_save:FILE: extra values whose encoding, which save does after
    it created the checkpoint's .partial directory, waits until FILE exists (at most a
    minute): a test signals the launcher mid-write, and lets the write go on when it likes."""

    def items(self):
        release = os.environ["FSDP8_FAULT"].split(":", 1)[1]
        deadline = time.monotonic() + 60
        while not os.path.exists(release) and time.monotonic() < deadline:
            time.sleep(0.05)
        return super().items()


def save_checkpoint(path: str, model, opt, extra: dict, cfg: TrainConfig) -> None:
    """Save a checkpoint, telling the stop logic while it is being written (app/stop.py's Note)."""
    if os.environ.get("FSDP8_FAULT", "").startswith("hold_save:"):
        extra = _HeldWhileEncoded(extra)
    checkpoint_started(path)
    try:
        with saving(path):
            future = save(path, model, opt, extra, keep_last=cfg.keep_last, async_save=cfg.async_save)
    except BaseException:
        checkpoint_finished(path, published=False)
        raise
    if future is None:
        checkpoint_finished(path, published=True)
    else:
        future.add_done_callback(lambda done: checkpoint_finished(path, published=done.exception() is None))
