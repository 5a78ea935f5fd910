"""Checkpoints: atomic, reshardable save/load, safetensors export and import."""

from .core import load, save, wait_for_saves
from .store import CheckpointError, latest

__all__ = ["CheckpointError", "latest", "load", "save", "wait_for_saves"]
