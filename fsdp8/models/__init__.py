"""Models fsdp8 ships or reads, and what it knows of each family: the built-in Llama, Hugging Face models
and their directories, and the ModelAdapter protocol (adapter.py) that parallel/ and fp8/ ask.

Importing this package registers the built-in families' adapters (Llama, Hugging Face), so
``adapter_for`` knows them whatever module of fsdp8 was imported first."""

from . import hf_adapter, llama_adapter  # noqa: F401  (they register their adapters)
from .adapter import ModelAdapter, adapter_for, register_adapter

__all__ = ["ModelAdapter", "adapter_for", "register_adapter"]
