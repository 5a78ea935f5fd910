"""Hugging Face causal LMs as a ModelAdapter: decoder layers (``_no_split_modules``) as units, the
plan from ``base_model_tp_plan`` (hf_tp.py), context parallelism through transformers' attention
registry (hf_cp.py), the KV cache kept out of checkpointed calls, sizes from the config, the
``LlamaMLP`` form as a SwiGLU MLP, the experts of mixture-of-experts layers, and the packed-sequence
checks removed on request.

Nothing here imports transformers unless the model is one of its models.
"""

from __future__ import annotations

import functools
import inspect
import sys
from typing import Callable, Dict, Optional, Tuple

import torch.nn as nn

from .adapter import CallFilter, CPAttention, ModelAdapter, Units, register_adapter
from .hf_cp import context_parallel_hf
from .hf_tp import hf_plan
from .spec import ModelSpec, hf_spec_of
from .tp_plan import FamilyPlan

# Names of a decoder layer's argument that carries the KV cache: "cache" in recent 5.x (which
# deprecates "past_key_values"), "past_key_values" in earlier 5.x, "past_key_value" in 4.5x,
# "layer_past" in a few older architectures (transformers' own checkpointing drops the same).
_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")


class HFAdapter(ModelAdapter):
    """A transformers ``PreTrainedModel`` (the module doc says where each answer comes from)."""

    no_tp_plan_hint = "its config has no base_model_tp_plan naming its modules"

    def claims(self, model: nn.Module) -> bool:
        return is_hf_model(model)

    def units(self, model: nn.Module) -> Optional[Units]:
        return decoder_layers(model)

    def tp_plan(self, model: nn.Module, sequence_parallel: bool, loss_parallel: bool) -> Optional[FamilyPlan]:
        return hf_plan(model, sequence_parallel, loss_parallel, self.experts(model))

    def supports_context_parallel(self, model: nn.Module) -> bool:
        return True  # whether its attention goes through the registry is checked on the model itself

    def context_parallel(self, model: nn.Module, attention: CPAttention) -> nn.Module:
        return context_parallel_hf(model, attention)

    def checkpoint_filter(self, model: nn.Module) -> Optional[CallFilter]:
        return without_cache

    def planner_spec(self, model: nn.Module) -> ModelSpec:
        return hf_spec_of(model.config.to_dict(), type(model).__name__, f"{type(model).__name__}'s config")

    def swiglu_names(self, module: nn.Module) -> Optional[Tuple[str, str, str]]:
        return swiglu_form(module)

    def experts(self, model: nn.Module) -> Dict[str, nn.Module]:
        return {name: m for name, m in model.named_modules() if is_experts(m)}

    def skip_packed_sequence_check(self, model: nn.Module) -> Callable[[], None]:
        return skip_packed_sequence_check


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


_EXPERTS_ARGS = ["hidden_states", "top_k_index", "top_k_weights"]
# The layout flags of transformers' experts classes (integrations/moe.py use_experts_implementation)
# and the values of the layout fsdp8.models.moe computes: [gate; up] concatenated, [E, out, in]
# (not transposed), no biases.
_EXPERTS_LAYOUT = {"is_concatenated": True, "is_transposed": False, "has_bias": False, "has_gate": True}


def is_experts(module: nn.Module) -> bool:
    """Whether ``module`` holds mixture-of-experts experts as transformers' ``Qwen3MoeExperts`` and
    ``MixtralExperts`` do (fsdp8.models.moe.experts_forward computes its forward): 3-D
    ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I] parameters, a forward taking
    (hidden_states, top_k_index, top_k_weights), and no layout flag saying otherwise."""
    gate_up, down = module._parameters.get("gate_up_proj"), module._parameters.get("down_proj")
    if gate_up is None or down is None or gate_up.dim() != 3 or down.dim() != 3:
        return False
    experts, two_hidden, dim = gate_up.shape
    if tuple(down.shape) != (experts, dim, two_hidden // 2) or two_hidden % 2:
        return False
    if any(getattr(module, flag, value) != value for flag, value in _EXPERTS_LAYOUT.items()):
        return False
    try:  # inspect follows functools.wraps to the forward that transformers' dispatch wraps
        params = list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return False
    return params[:3] == _EXPERTS_ARGS


def _swiglu_forward(self, x):  # Hugging Face's LlamaMLP.forward, token for token
    down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
    return down_proj


def _swiglu_forward_returned(self, x):  # the same, returned directly
    return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


_SWIGLU_FORWARDS = {(f.__code__.co_code, f.__code__.co_names) for f in (_swiglu_forward, _swiglu_forward_returned)}


def swiglu_form(module: nn.Module) -> Optional[Tuple[str, str, str]]:
    """``("gate_proj", "up_proj", "down_proj")`` for an MLP of Hugging Face's ``LlamaMLP`` form,
    ``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` with SiLU (Llama, Mistral, Qwen2/3 and the other
    models whose MLP is a copy of it), recognised by its forward's code; else None."""
    code = getattr(type(module).forward, "__code__", None)
    act = getattr(module, "act_fn", None)
    if (code is not None and (code.co_code, code.co_names) in _SWIGLU_FORWARDS
            and type(act).__name__ in ("SiLU", "SiLUActivation")
            and not (act._forward_hooks or act._forward_pre_hooks)):
        return ("gate_proj", "up_proj", "down_proj")
    return None


register_adapter(HFAdapter())
