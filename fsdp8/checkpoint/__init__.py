"""Checkpoints: atomic, reshardable save/load, safetensors export and import."""

from .core import load, save, wait_for_saves
from .exporter import export
from .store import CheckpointError, DamagedCheckpointError, latest
from .transfer import load_pretrained
from .verify import verify

__all__ = ["CheckpointError", "DamagedCheckpointError", "export", "latest", "load", "load_pretrained", "save", "verify",
           "wait_for_saves"]
