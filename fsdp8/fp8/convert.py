"""Putting FP8 into a model: swap nn.Linear for Float8Linear."""

from __future__ import annotations

import contextlib
import warnings
from typing import Callable, List, Optional, Tuple

import torch
import torch.nn as nn

from .kernels import quantize
from .linear import Float8Linear
from .recipes import Recipe
from .tensor import Float8Tensor

LinearFilter = Callable[[str, nn.Linear], bool]


def fp8_friendly(name: str, linear: nn.Linear) -> bool:
    """FP8 GEMMs need both dimensions to be multiples of 16."""
    return linear.in_features % 16 == 0 and linear.out_features % 16 == 0


def convert_to_fp8(model: nn.Module, recipe: Recipe, filter: Optional[LinearFilter] = None,
                   prefix: str = "") -> List[str]:
    """Turn every ``nn.Linear`` in ``model`` that ``filter(name, linear)`` accepts into a
    Float8Linear, in place; returns the converted names. The default filter skips layers
    whose dimensions are not multiples of 16 and says so once."""
    converted, skipped = convert_linears(model, recipe, filter, prefix)
    warn_skipped(skipped)
    return converted


def convert_linears(model: nn.Module, recipe: Recipe, filter: Optional[LinearFilter] = None,
                    prefix: str = "") -> Tuple[List[str], List[str]]:
    """convert_to_fp8 without the warning: (converted names, skipped by the default filter)."""
    if not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be an fsdp8 FP8 recipe (e.g. Float8CurrentScaling()), got {type(recipe).__name__}")
    accept = filter or fp8_friendly
    converted, skipped = [], []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or isinstance(module, Float8Linear):
            continue
        full = f"{prefix}{name}" if name else prefix.rstrip(".")
        if accept(full, module):
            Float8Linear.convert(module, recipe)
            converted.append(full)
        elif filter is None:
            skipped.append(f"{full} ({module.in_features}x{module.out_features})")
    return converted, skipped


def warn_skipped(skipped: List[str]) -> None:
    if skipped:
        warnings.warn(f"fsdp8: kept {len(skipped)} linear layer(s) in high precision, dimensions not multiples "
                      f"of 16: {', '.join(skipped)}", stacklevel=3)


_INIT_RECIPE: List[Recipe] = []


@contextlib.contextmanager
def fp8_init(recipe: Recipe):
    """FP8 primary weights: every ``nn.Linear`` (and subclass) built inside this context is a
    Float8Linear whose weight is an FP8 tensor from the start.

    Under ``torch.device("meta")`` nothing is allocated; ``fully_shard`` then initializes
    module by module, seeds the fp32 main shards (the only high-precision copies) and keeps
    this rank's FP8 shard, re-quantized once after each optimizer step. On a real device the
    high-precision init value is held (as ``weight._hp_init``) until ``fully_shard`` has
    seeded the main shards from it, and is dropped there."""
    if not isinstance(recipe, Recipe):
        raise TypeError(f"fp8_init needs an fsdp8 FP8 recipe, got {type(recipe).__name__}")
    original_init = nn.Linear.__init__

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        if _INIT_RECIPE:
            make_fp8_primary(self, _INIT_RECIPE[-1])

    _INIT_RECIPE.append(recipe)
    nn.Linear.__init__ = init
    try:
        yield
    finally:
        _INIT_RECIPE.pop()
        nn.Linear.__init__ = original_init


def make_fp8_primary(linear: nn.Linear, recipe: Recipe) -> Float8Linear:
    """Turn ``linear`` into a Float8Linear whose weight parameter holds FP8 bytes."""
    Float8Linear.convert(linear, recipe)
    w = linear.weight
    if w.is_meta:
        data = torch.empty(w.shape, dtype=recipe.fwd_dtype, device="meta")
        q_scale_inv = torch.ones((), device="meta")
        hp = None
    else:
        q = quantize(w.detach(), recipe.fwd_dtype, recipe.w_granularity)
        data, q_scale_inv, hp = q.data, q.scale_inv, w.detach()
    weight = nn.Parameter(Float8Tensor(data, q_scale_inv, recipe.w_granularity, w.dtype), requires_grad=w.requires_grad)
    weight._hp_init = hp  # set on the Parameter itself: Parameter() detaches its input
    linear.weight = weight
    return linear


def is_fp8_primary(param: torch.Tensor) -> bool:
    return isinstance(param, Float8Tensor)


def high_precision_value(param: torch.Tensor) -> torch.Tensor:
    """The value to seed main weights from: the kept init value of an FP8 primary weight."""
    hp = getattr(param, "_hp_init", None)
    if hp is not None:
        return hp
    if isinstance(param, Float8Tensor):
        return param.dequantize(torch.float32)
    return param.detach()
