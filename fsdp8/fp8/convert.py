"""Putting FP8 into a model: swap nn.Linear for Float8Linear."""

from __future__ import annotations

import warnings
from typing import Callable, List, Optional, Tuple

import torch.nn as nn

from .linear import Float8Linear
from .recipes import Recipe

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
