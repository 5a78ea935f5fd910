"""Hugging Face specifics of parallelize: decoder-layer units, KV caches, packed sequences.

Nothing here imports transformers unless the model is one of its models.
"""

from __future__ import annotations

import functools
import inspect
import sys
from typing import Callable, Optional, Tuple

import torch.nn as nn

# Names of a decoder layer's argument that carries the KV cache: "cache" in recent 5.x (which
# deprecates "past_key_values"), "past_key_values" in earlier 5.x, "past_key_value" in 4.5x,
# "layer_past" in a few older architectures (transformers' own checkpointing drops the same).
_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")


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


def without_cache(forward: Callable) -> Callable[[tuple, dict], Tuple[tuple, dict]]:
    """For a decoder layer's ``forward``, the function that takes the KV cache out of a
    checkpointed call's arguments, as transformers' own gradient checkpointing does:
    recomputation would append the keys and values again and attend to twice as many. The
    cache may come by keyword or by position (GPT-2's blocks take it second), so the
    forward's signature, read once here, says where to look."""
    try:
        params = list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):  # a builtin or C forward: keywords only
        params = []
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    at = set()
    for i, p in enumerate(params):
        if p.kind not in positional:
            break
        if p.name in _CACHE_KWARGS:
            at.add(i)

    def adapt(args: tuple, kwargs: dict) -> Tuple[tuple, dict]:
        if any(i < len(args) and args[i] is not None for i in at):
            args = tuple(None if i in at else a for i, a in enumerate(args))
        if any(kwargs.get(k) is not None for k in _CACHE_KWARGS) or kwargs.get("use_cache"):
            kwargs = {k: (None if k in _CACHE_KWARGS else v) for k, v in kwargs.items()}
            if "use_cache" in kwargs:
                kwargs["use_cache"] = False
        return args, kwargs

    return adapt


def skip_packed_sequence_check() -> None:
    """Replace transformers' two packed-sequence checks by their answer for unpacked rows
    (process-wide, once):

    - ``modeling_flash_attention_utils._is_packed_sequence`` (-> ``False``): compares the
      position ids with a range and turns the result into a Python bool, a device-to-host
      synchronisation in every flash-attention layer at batch size 1;
    - ``masking_utils.find_packed_sequence_indices`` (-> ``None``, where this transformers has
      it): the same kind of test once per forward, for every attention implementation and
      batch size, whenever position ids are given or made from the cache positions without an
      attention mask (what a training step does).

    Those are the answers for any batch without packed rows; see
    ``ParallelConfig.skip_packed_sequence_check`` for why that must hold."""
    try:
        import transformers
        import transformers.modeling_flash_attention_utils as flash_utils
    except ImportError as e:
        raise RuntimeError(f"skip_packed_sequence_check needs transformers: {e}") from None
    if getattr(flash_utils, "_is_packed_sequence", None) is None:
        raise RuntimeError(
            f"transformers {transformers.__version__} has no modeling_flash_attention_utils._is_packed_sequence to "
            "replace (it appeared in 4.5x); upgrade transformers or drop skip_packed_sequence_check"
        )
    _replace(flash_utils, "_is_packed_sequence", lambda position_ids, batch_size: False)
    try:
        import transformers.masking_utils as masking_utils
    except ImportError:  # older than masking_utils: only the flash check exists
        return
    if getattr(masking_utils, "find_packed_sequence_indices", None) is not None:
        _replace(masking_utils, "find_packed_sequence_indices", lambda position_ids: None)


def _replace(module, name: str, answer: Callable) -> None:
    """``module.name`` becomes ``answer`` (wrapping the original, marked, so a second call
    leaves it)."""
    original = getattr(module, name)
    if getattr(original, "fsdp8_never_packed", False):
        return
    replacement = functools.wraps(original)(answer)
    replacement.fsdp8_never_packed = True
    setattr(module, name, replacement)
