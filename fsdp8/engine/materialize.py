"""Filling the main chunks: meta-device models module by module, real models by slicing."""

from __future__ import annotations

import functools
import hashlib
import sys
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..fp8.convert import high_precision_value
from .unit import ParamSlot, ShardedUnit


def rng_fingerprint(device: torch.device) -> str:
    """A digest of the RNG state that ``reset_parameters`` will draw from on ``device``."""
    state = torch.random.get_rng_state()
    if device.type == "cuda":
        state = torch.cat([state, torch.cuda.get_rng_state(device)])
    return hashlib.sha256(bytes(state.tolist())).hexdigest()[:16]  # uint8 state; no numpy needed


def meta_leftovers(root: nn.Module) -> List[str]:
    """FQNs of parameters and buffers still on the meta device."""
    names = [n for n, p in root.named_parameters() if p.is_meta]
    return names + [n for n, b in root.named_buffers() if b.is_meta]


def materialize_and_load(
    root: nn.Module,
    units: Dict[str, ShardedUnit],
    originals: Dict[int, nn.Parameter],
    slot_unit: Dict[int, ShardedUnit],
    device: torch.device,
) -> None:
    """Copy this rank's rows of every parameter into its unit's main chunk.

    [Note: meta-device init]
    A module that directly owns meta parameters or buffers is given empty real tensors
    for them and its ``reset_parameters()`` is called, in ``root.modules()`` order; its
    rows are copied into the main chunks and the full tensors dropped before the next
    module, so no rank ever holds more than one module's parameters in full. Every rank
    draws the same values because fully_shard checked that all RNG states agree. Tied
    parameters are materialized once, through the first module that owns them. Modules
    inside a Hugging Face model are initialized by its own scheme (``module_initializer``)."""
    slot_of: Dict[int, ParamSlot] = {}
    for unit in units.values():
        for slot in unit.slots:
            slot_of[id(originals[id(slot)])] = slot
    loaded = set()
    initializer = module_initializer(root)
    for module in root.modules():
        meta_params = [(a, p) for a, p in module._parameters.items() if p is not None and p.is_meta and id(p) not in loaded]
        meta_buffers = [(n, b) for n, b in module._buffers.items() if b is not None and b.is_meta]
        if not meta_params and not meta_buffers:
            continue
        reset = initializer(module)
        if reset is None:
            if meta_params:
                raise ValueError(
                    f"{type(module).__name__} has parameters on the meta device but no reset_parameters(); "
                    "define reset_parameters() to initialize them, or build the model on a real device"
                )
            continue  # meta buffers without a reset: reported at the first forward
        fresh = []
        for _, p in meta_params:
            slot = slot_of[id(p)]
            # Under TP the initializer fills the global tensor, so the values are the unsharded
            # model's; load_full keeps this rank's tensor-parallel piece of it.
            value = torch.empty(tuple(p.shape), dtype=p.dtype, device=device) if isinstance(p, DTensor) \
                else torch.empty_like(p, device=device)
            real = nn.Parameter(value, requires_grad=p.requires_grad)
            for m, attr in slot.aliases:
                m._parameters[attr] = real
            fresh.append((p, slot, real))
        for name, b in meta_buffers:
            module._buffers[name] = torch.empty_like(b, device=device)
        with torch.no_grad():
            reset([a for a, _ in meta_params] + [n for n, _ in meta_buffers])
        for p, slot, real in fresh:
            slot_unit[id(slot)].load_full(slot, real.detach())
            loaded.add(id(p))
            for m, attr in slot.aliases:
                m._parameters[attr] = p  # drop the full tensor now; main DTensors replace it later
    for pid, slot in slot_of.items():
        p = originals[id(slot)]
        if isinstance(p, DTensor) and not p.is_meta:
            slot_unit[id(slot)].load_local(slot, p._local_tensor)
        elif not p.is_meta:
            slot_unit[id(slot)].load_full(slot, high_precision_value(p))
    for module in root.modules():
        for name, b in module._buffers.items():
            if b is not None and not b.is_meta and b.device != device:
                module._buffers[name] = b.to(device)


# -- how a module initializes ---------------------------------------------------------------------
Initializer = Callable[[List[str]], None]  # called with the names of the module's fresh tensors


def module_initializer(root: nn.Module) -> Callable[[nn.Module], Optional[Initializer]]:
    """For each module of ``root``: how it fills its freshly materialized tensors, or None.

    [Note: initializing Hugging Face models]
    A module inside a transformers ``PreTrainedModel`` gets what that model gives it when built
    on a real device: its ``reset_parameters()`` if it has one (its constructor's init), then
    ``_init_weights`` (of the nearest enclosing PreTrainedModel, as HF's ``smart_apply`` picks it)
    for the module itself and for each of its ancestors, child before parent as HF applies them,
    since a parent's rule may set a child's weight (GPT-2 scales ``c_proj`` from its attention
    module). Ancestors' rules touch only this module's tensors: the others are on meta then.
    This covers modules with no ``reset_parameters`` (Conv1D, RMSNorm) and recomputes
    non-persistent buffers (rotary ``inv_freq``) on the real device. The values follow the
    model's own scheme and are the same on every rank and at every world size, but they are not
    those of a model built on CPU with the same seed: HF draws the constructors' inits and then
    ``_init_weights`` over the whole model, another order of random draws. A tensor nothing
    filled (NaN left in a floating-point one, no write to an integer one) is an error naming
    it, not garbage."""
    pretrained = getattr(sys.modules.get("transformers.modeling_utils"), "PreTrainedModel", None)
    names = {id(m): n for n, m in root.named_modules()}
    parent: Dict[int, nn.Module] = {}
    for m in root.modules():
        for child in m.children():
            parent.setdefault(id(child), m)

    def hf_chain(module: nn.Module) -> List[Tuple[nn.Module, nn.Module]]:
        lineage = [module]
        while id(lineage[-1]) in parent:
            lineage.append(parent[id(lineage[-1])])
        chain, owner = [], None
        for m in reversed(lineage):  # root first: the nearest PreTrainedModel at or above m
            owner = m if isinstance(m, pretrained) else owner
            if owner is not None:
                chain.append((m, owner))
        return chain[::-1]

    def initializer(module: nn.Module) -> Optional[Initializer]:
        reset = getattr(module, "reset_parameters", None)
        reset = reset if callable(reset) else None
        chain = hf_chain(module) if pretrained is not None else []
        if chain:
            return functools.partial(_init_hf_module, module, names[id(module)], reset, chain)
        return None if reset is None else lambda fresh: reset()

    return initializer


def _init_hf_module(module: nn.Module, name: str, reset, chain, fresh: List[str]) -> None:
    """See [Note: initializing Hugging Face models]."""
    allocated = {a: module._parameters[a] if a in module._parameters else module._buffers[a] for a in fresh}
    for t in allocated.values():
        if t.is_floating_point():
            t.fill_(float("nan"))  # marks what no initializer fills
    versions = {a: t._version for a, t in allocated.items()}  # integer buffers: written in place or not
    if reset is not None:
        reset()
    for m, owner in chain:
        owner._init_weights(m)
    _rope_fallback(module)
    unfilled = []
    for a, t in allocated.items():
        now = module._buffers.get(a, t)  # a buffer may have been replaced; the engine loads the allocated params
        unset = bool(torch.isnan(now).any()) if t.is_floating_point() else now is t and t._version == versions[a]
        if unset:
            unfilled.append(a)
    if unfilled:
        cls = type(module).__name__
        what = f"{cls}.reset_parameters()" if reset is not None else f"{cls} (which has no reset_parameters())"
        fix = f"give {cls} a reset_parameters() that fills them, or build the model on a real device"
        if all(a in module._buffers for a in unfilled):  # e.g. masks and constants made in __init__
            fix = ("build the model with its buffers on a real device (accelerate.init_empty_weights() puts only "
                   "parameters on meta)")
        raise ValueError(
            f"{', '.join(f'{name}.{a}' if name else a for a in unfilled)}: left unset by meta-device init: neither "
            f"{what} nor {type(chain[0][1]).__name__}._init_weights() fills them; {fix}"
        )


def _rope_fallback(module: nn.Module) -> None:
    """transformers 4.4x-4.5x rotary modules keep ``rope_init_fn(config, device)``, and their
    models' ``_init_weights`` does not recompute ``inv_freq`` (5.x's does)."""
    inv_freq = module._buffers.get("inv_freq")
    rope_init_fn = getattr(module, "rope_init_fn", None)
    if inv_freq is None or not callable(rope_init_fn) or not bool(torch.isnan(inv_freq).any()):
        return
    value, _ = rope_init_fn(module.config, inv_freq.device)
    inv_freq.copy_(value)
    if "original_inv_freq" not in module._buffers and hasattr(module, "original_inv_freq"):
        module.original_inv_freq = inv_freq  # 4.x keeps it as an attribute aliasing inv_freq
