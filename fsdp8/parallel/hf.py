"""Hugging Face specifics of parallelize: decoder-layer units, per-head norms under TP, KV caches, packed sequences.

Nothing here imports transformers unless the model is one of its models.
"""

from __future__ import annotations

import functools
import sys
from fnmatch import fnmatchcase
from typing import Callable, Dict, Optional

import torch.nn as nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, SequenceParallel

# Keyword arguments of a decoder layer that carry the KV cache (5.x name, 4.5x name).
_CACHE_KWARGS = ("past_key_values", "past_key_value")


def is_hf_model(model: nn.Module) -> bool:
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


def decoder_layers(model: nn.Module) -> Optional[Callable[[str, nn.Module], bool]]:
    """The units of a Hugging Face model: modules of its ``_no_split_modules`` classes (the
    decoder layers: what transformers itself never splits across devices), or None when
    that names no module with parameters (then fully_shard's default rule applies)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    if not any(type(m).__name__ in names and any(True for _ in m.parameters()) for m in model.modules()):
        return None

    def is_layer(name: str, module: nn.Module) -> bool:
        return type(module).__name__ in names and any(True for _ in module.parameters())

    return is_layer


def without_cache(kwargs: dict) -> dict:
    """A checkpointed layer's keyword arguments without its KV cache, as transformers' own
    gradient checkpointing does: recomputation would append the keys and values again."""
    if not any(kwargs.get(k) is not None for k in _CACHE_KWARGS) and not kwargs.get("use_cache"):
        return kwargs
    kwargs = {k: (None if k in _CACHE_KWARGS else v) for k, v in kwargs.items()}
    if "use_cache" in kwargs:
        kwargs["use_cache"] = False
    return kwargs


def per_head_norm_plan(model: nn.Module, plan: Dict[str, ParallelStyle]) -> Dict[str, ParallelStyle]:
    """Styles for norms that see attention heads (Qwen3's and Gemma 3's ``q_norm``/``k_norm``)
    inside a module whose projections ``plan`` column-shards.

    Such a norm gets this rank's heads only, so its replicated weight's gradient is a
    partial sum over tp (transformers calls the style ``replicated_with_grad_allreduce``).
    ``SequenceParallel(sequence_dim=0)`` says just that to DTensor: the weight becomes a
    ``Replicate`` DTensor and the input a piece of a tensor whose rows (here: heads) differ
    between ranks, so the norm over the last dim stays local, the output is handed back as
    the local tensor, and the weight's gradient comes out ``Partial``, which the engine sums
    over tp. Left plain, each tp rank would update it from its own heads and the ranks'
    copies would drift apart."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    modules = dict(model.named_modules())
    owners = {name.rsplit(".", 1)[0] for name in modules
              if "." in name and any(fnmatchcase(name, p) and isinstance(s, ColwiseParallel) for p, s in plan.items())}
    styles: Dict[str, ParallelStyle] = {}
    for name, module in modules.items():
        params = list(module.parameters())
        # A head's width, not the hidden size: a norm on the residual stream is not one of these.
        per_head = params and all(p.shape[-1] == head_dim != config.hidden_size for p in params)
        if per_head and "norm" in type(module).__name__.lower() and any(name.startswith(o + ".") for o in owners):
            styles[name] = SequenceParallel(sequence_dim=0, use_local_output=True)
    return styles


def skip_packed_sequence_check() -> None:
    """Replace transformers' ``_is_packed_sequence`` by ``False`` (process-wide, once).

    The original compares the position ids with a range and turns the result into a Python
    bool: a device-to-host synchronisation in every flash-attention layer at batch size 1.
    ``False`` is its answer for any batch without packed rows; see
    ``ParallelConfig.skip_packed_sequence_check`` for why that must hold."""
    try:
        import transformers
        import transformers.modeling_flash_attention_utils as flash_utils
    except ImportError as e:
        raise RuntimeError(f"skip_packed_sequence_check needs transformers: {e}") from None
    original = getattr(flash_utils, "_is_packed_sequence", None)
    if original is None:
        raise RuntimeError(
            f"transformers {transformers.__version__} has no modeling_flash_attention_utils._is_packed_sequence to "
            "replace (it appeared in 4.5x); upgrade transformers or drop skip_packed_sequence_check"
        )
    if getattr(original, "fsdp8_never_packed", False):
        return

    @functools.wraps(original)
    def never_packed(position_ids, batch_size):
        return False

    never_packed.fsdp8_never_packed = True
    flash_utils._is_packed_sequence = never_packed
