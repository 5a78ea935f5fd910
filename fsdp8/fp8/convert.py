"""Putting FP8 into a model: swap nn.Linear (and Hugging Face's Conv1D) for Float8Linear, give
mixture-of-experts experts a recipe for their grouped GEMMs (grouped.py), and say which layers stay
in high precision and why (tensor-parallel pieces that cannot run the recipe too)."""

from __future__ import annotations

import contextlib
import sys
import warnings
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .grouped import FP8_EXPERT_WEIGHTS, runs_fp8_experts
from .grouped_delayed import attach as attach_delayed_experts
from .kernels import quantize
from .linear import Float8Linear
from .recipes import Recipe
from .tensor import Float8Tensor
from .tp_forward import tp_fp8_ok

# filter(name, module) -> bool; the module is an nn.Linear or a transformers Conv1D.
LinearFilter = Callable[[str, nn.Module], bool]

# Why a layer stays in high precision, worded to follow "kept <count> ".
_DIMS = "linear layer(s) in high precision, dimensions not multiples of 16 (FP8 GEMMs need them)"
_NOT_LINEAR = ("layer(s) with a 2-D weight in high precision, neither nn.Linear nor transformers Conv1D (fsdp8 "
               "cannot tell how they use the weight; make them nn.Linear to run them in FP8)")
_GROUPED_FORWARD = ("mixture-of-experts layer(s) in high precision: their forward does not compute the experts with "
                    "fsdp8's FP8 grouped GEMMs (fsdp8.models.moe.experts_forward does; transformers' own experts "
                    "forward does not)")
_GROUPED_DIMS = ("mixture-of-experts layer(s) in high precision, expert dimensions not multiples of 16 (FP8 GEMMs "
                 "need them)")
_ROUTER = "router(s) in high precision (the experts they choose must not change with FP8 rounding)"
_OUTSIDE = ("projection layer(s) in high precision outside the units (fully_shard converts layers inside units "
            "only; select such a layer as a unit through units= to convert it)")


class HighPrecisionLayerWarning(UserWarning):
    """Projection-like layers left in high precision under an FP8 recipe, named with why.
    Filter this category to silence it where that is expected (fsdp8 train says it its own way)."""


class KeptLayer(NamedTuple):
    """A projection-like layer left in high precision, and why."""

    name: str
    detail: str  # "in x out", or the module's class
    reason: str


class Float8Conv1D(Float8Linear):
    """A transformers ``Conv1D`` (``x @ W + b`` with ``W`` stored (in, out)) turned into a
    Float8Linear. Its weight is stored transposed, (out, in): the layout the FP8 GEMMs and the
    engine's 8-bit all-gather take (row shards of (out, in), scales along ``in``). So its state
    dict and fsdp8 checkpoints hold (out, in) under HF's names; ``load_pretrained`` transposes
    the (in, out) weights of Hugging Face files into it."""


def _conv1d_class() -> Optional[type]:
    """transformers' Conv1D if transformers is loaded (a model cannot hold one otherwise)."""
    return getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)


def _features(module: nn.Module) -> Tuple[int, int]:
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    return module.nx, module.nf  # Conv1D


def _detail(module: nn.Module, kind: str) -> str:
    """How a kept layer is named beside its name: ``in x out``, the class fsdp8 does not know, or
    the shapes of its grouped weights."""
    if kind == "grouped":
        return ", ".join(f"{n} {'x'.join(map(str, p.shape))}" for n, p in _grouped_weights(module))
    return type(module).__name__ if kind == "other" else "x".join(map(str, _features(module)))


def _is_router(module: nn.Module) -> bool:
    """A mixture-of-experts router (transformers' ``*TopKRouter``, fsdp8's ``Router``, which says
    so with ``is_moe_router``): its 2-D weight scores experts, and it stays in high precision by
    design."""
    return getattr(module, "is_moe_router", False) is True or type(module).__name__.endswith("TopKRouter")


def _grouped_weights(module: nn.Module) -> List[Tuple[str, torch.Tensor]]:
    """The 3-D (or higher) floating-point weights ``module`` holds itself: a group of matrices,
    as the experts of a mixture-of-experts layer are stored."""
    return [(n, p) for n, p in module._parameters.items() if p is not None and p.dim() >= 3 and p.is_floating_point()]


def _kind(module: nn.Module, conv1d: Optional[type]) -> Optional[str]:
    """"linear" and "conv1d" can be converted; "other" is a projection-like layer fsdp8 does
    not know (a 2-D weight outside nn.Linear, Conv1D and embeddings); "grouped" holds groups of
    matrices (experts); None is anything else."""
    if isinstance(module, Float8Linear) or is_fp8_experts(module):
        return None
    if _grouped_weights(module):
        return "grouped"
    if isinstance(module, nn.Linear):
        return "linear"
    if conv1d is not None and type(module) is conv1d:
        return "conv1d"
    weight = module._parameters.get("weight")
    if (weight is not None and weight.dim() == 2 and weight.is_floating_point()
            and not isinstance(module, (nn.Embedding, nn.EmbeddingBag))):
        return "other"
    return None


def is_fp8_experts(module: nn.Module) -> bool:
    """Whether conversion gave ``module``, an experts module, an FP8 recipe for its grouped GEMMs."""
    return getattr(module, "fp8_recipe", None) is not None


def _grouped_reason(module: nn.Module, recipe: Recipe) -> Optional[str]:
    """Why an experts module stays in high precision under ``recipe``; None: it runs in FP8."""
    if not runs_fp8_experts(module):
        return _GROUPED_FORWARD
    if any(d % 16 for _, p in _grouped_weights(module) for d in p.shape[-2:]):
        return _GROUPED_DIMS
    return None


def fp8_friendly(name: str, linear: nn.Module) -> bool:
    """FP8 GEMMs need both dimensions to be multiples of 16."""
    in_features, out_features = _features(linear)
    return in_features % 16 == 0 and out_features % 16 == 0


def convert_to_fp8(model: nn.Module, recipe: Recipe, filter: Optional[LinearFilter] = None,
                   prefix: str = "") -> nn.Module:
    """Turn every ``nn.Linear`` and transformers ``Conv1D`` in ``model`` that
    ``filter(name, module)`` accepts into a Float8Linear (a Conv1D into a Float8Conv1D), in
    place, and return ``model`` (as torchao's ``convert_to_float8_training`` and
    ``fully_shard`` do; the converted layers are its Float8Linear modules). Mixture-of-experts
    experts whose forward runs fsdp8's grouped GEMMs (``fsdp8.fp8.grouped``) get the recipe as
    ``fp8_recipe`` (``filter`` is not asked: it takes linears). ``prefix`` is put
    before the names ``filter`` sees. One warning names the projection-like layers left in
    high precision (by the default filter, which skips dimensions that are not multiples of
    16, or because fsdp8 does not know the module), and another one says so when no layer of
    ``model`` runs in FP8 at all."""
    _, kept = convert_linears(model, recipe, filter, prefix)
    warn_skipped(kept, model)
    return model


def convert_units_to_fp8(root: nn.Module, units: Sequence[Tuple[str, nn.Module]], recipe: Recipe,
                         filter: Optional[LinearFilter] = None) -> List[str]:
    """fully_shard's conversion: the layers inside ``units`` (name, module), as convert_to_fp8
    does; the warning also names the projection-like layers outside all units."""
    converted, kept, inside = [], [], set()
    for name, unit in units:
        done, left = convert_linears(unit, recipe, filter, prefix=f"{name}.")
        converted += done
        kept += left
        inside.update(id(m) for m in unit.modules())
    conv1d = _conv1d_class()
    for name, module in root.named_modules():
        kind = _kind(module, conv1d)
        if id(module) not in inside and kind is not None:
            kept.append(KeptLayer(name, _detail(module, kind), _OUTSIDE))
    warn_skipped(list({layer.name: layer for layer in kept}.values()), root)  # nested units see layers twice
    return converted


def convert_linears(model: nn.Module, recipe: Recipe, filter: Optional[LinearFilter] = None,
                    prefix: str = "") -> Tuple[List[str], List[KeptLayer]]:
    """convert_to_fp8 without the warnings: (converted names, layers kept in high precision
    other than those ``filter`` rejected)."""
    if not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be an fsdp8 FP8 recipe (e.g. Float8CurrentScaling()), got {type(recipe).__name__}")
    accept = filter or fp8_friendly
    conv1d = _conv1d_class()
    converted, kept = [], []
    for name, module in model.named_modules():
        kind = _kind(module, conv1d)
        if kind is None:
            continue
        full = f"{prefix}{name}" if name else prefix.rstrip(".")
        if kind == "grouped":
            reason = _grouped_reason(module, recipe)
            if reason is None:
                module.fp8_recipe = recipe  # read by its forward (fsdp8.models.moe.experts_forward)
                if recipe.delayed:  # an amax history per expert (grouped_delayed.py)
                    attach_delayed_experts(module, recipe, FP8_EXPERT_WEIGHTS)  # the weights its forward reads
                converted.append(full)
            else:
                kept.append(KeptLayer(full, _detail(module, kind), reason))
        elif kind == "other":
            kept.append(KeptLayer(full, _detail(module, kind), _ROUTER if _is_router(module) else _NOT_LINEAR))
        elif accept(full, module):
            if kind == "conv1d":
                _convert_conv1d(module, recipe)
            else:
                Float8Linear.convert(module, recipe)
            converted.append(full)
        elif filter is None:
            kept.append(KeptLayer(full, _detail(module, kind), _DIMS))
    if converted:
        from .mlp import fuse_swiglu_mlps

        fuse_swiglu_mlps(model, recipe)
    return converted, kept


def _convert_conv1d(conv: nn.Module, recipe: Recipe) -> Float8Conv1D:
    """A Conv1D into a Float8Conv1D in place (same object and hooks; a new, transposed weight)."""
    w = conv.weight
    if w.is_meta:
        transposed = torch.empty((conv.nf, conv.nx), dtype=w.dtype, device="meta")
    else:
        transposed = w.detach().t().contiguous()
    conv.weight = nn.Parameter(transposed, requires_grad=w.requires_grad)
    conv.in_features, conv.out_features = conv.nx, conv.nf
    conv.__class__ = Float8Conv1D
    return Float8Linear.convert(conv, recipe)


def projection_layers(model: nn.Module) -> Tuple[List[str], List[str]]:
    """The names of ``model``'s projection-like layers (nn.Linear, transformers Conv1D, other
    2-D weights outside embeddings, experts) that run in FP8, and of those that do not, each as
    ``name (in x out)``, ``name (class)`` or ``name (its grouped weights)``."""
    conv1d = _conv1d_class()
    fp8, high = [], []
    for name, module in model.named_modules():
        if isinstance(module, Float8Linear) or is_fp8_experts(module):
            fp8.append(name)
            continue
        kind = _kind(module, conv1d)
        if kind is not None:
            high.append(f"{name} ({_detail(module, kind)})")
    return fp8, high


def warn_skipped(kept: List[KeptLayer], model: Optional[nn.Module] = None) -> None:
    """One warning for the layers kept in high precision (grouped by reason), and, given the
    model, one when none of its layers runs in FP8."""
    by_reason: Dict[str, List[str]] = {}
    for layer in kept:
        by_reason.setdefault(layer.reason, []).append(f"{layer.name} ({layer.detail})")
    if by_reason:
        parts = [f"kept {len(names)} {reason}: {', '.join(names)}"
                 for reason, names in by_reason.items()]
        warnings.warn("fsdp8: " + "; ".join(parts), HighPrecisionLayerWarning, stacklevel=3)
    if model is not None and not any(isinstance(m, Float8Linear) or is_fp8_experts(m) for m in model.modules()):
        warnings.warn(f"fsdp8: FP8 was requested but no layer of {type(model).__name__} runs in FP8, so every "
                      "GEMM stays in high precision: no nn.Linear or transformers Conv1D was converted (there is "
                      "none, the filter rejected them, or the warning above names them)", stacklevel=3)


def tp_aware_filter(user_filter, recipe: Recipe):
    """The conversion filter for a model with tensor-parallel layers: a layer whose pieces
    cannot run ``recipe`` as one process would (``tp_fp8_ok``) stays in high precision, and
    the returned list collects it with the reason (``warn_tp_kept``); other layers go to
    ``user_filter`` (default: dimensions that are multiples of 16)."""
    kept = []

    def accept(name: str, module: nn.Module) -> bool:
        if isinstance(getattr(module, "weight", None), DTensor):
            reason = tp_fp8_ok(module, recipe)
            if reason is not None:
                kept.append(f"{name}: {reason}")
                return False
        return (user_filter or fp8_friendly)(name, module)

    return accept, kept


def warn_tp_kept(kept) -> None:
    if kept:
        warnings.warn(f"fsdp8: kept {len(kept)} tensor-parallel layer(s) in high precision: {'; '.join(kept)}",
                      HighPrecisionLayerWarning, stacklevel=3)


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
    # Tensor-parallel styles re-make the weight as a DTensor of plain pieces: the module
    # remembers that its weight is meant to stay FP8.
    linear.fp8_primary = True
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
