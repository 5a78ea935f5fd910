"""ModelAdapter: what fsdp8 needs to know about a family of models, behind one small protocol, and
``adapter_for(model)``, which finds the adapter of a model.

[Note: model adapters]
``parallelize``, ``tensor_parallel``, ``context_parallel`` and ``parallelize(model, "auto")`` lay out
any model the same way; what differs between families is a handful of facts: which modules are
the units, the tensor-parallel plan, how to route attention through context parallelism, what a
checkpointed unit must not see again, the sizes the planner predicts from, which MLPs run as one
FP8 function, and where the experts of mixture-of-experts layers are. A family answers those here,
as torchtitan gives each model its own parallelize and transformers puts the plan in the model's
config (``base_model_tp_plan``); parallel/ and fp8/ ask, and never import a model class or branch
on one.

A family's adapter subclasses ModelAdapter, overrides ``claims`` and what it knows, and is
registered once with ``register_adapter``; the methods it leaves are the generic answers, those
of a model fsdp8 knows nothing about (fully_shard's default units, no automatic plan, no context
parallelism). The built-in Llama (llama_adapter.py) and Hugging Face causal LMs (hf_adapter.py)
are registered when fsdp8.models is imported, which every fsdp8 import does.

Adapters live below parallel/ and the planner: what they return is written in types of this
layer (``FamilyPlan``, ``ModelSpec``), and what parallel/ builds for them (the context-parallel
attention) is handed in.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Protocol, Sequence, Tuple, Union

import torch
import torch.nn as nn

from ..fp8.swiglu_forms import register_swiglu_form
from .spec import ModelSpec
from .tp_plan import FamilyPlan

# What fully_shard's ``units`` takes: module classes, or a predicate over (name, module).
Units = Union[Sequence[type], Callable[[str, nn.Module], bool]]
# Given a unit's forward, the function that adapts each training call's (args, kwargs) (checkpointed or compiled).
CallFilter = Callable[[Callable], Callable[[tuple, dict], Tuple[tuple, dict]]]


class CPAttention(Protocol):
    """What ``context_parallel`` hands an adapter (parallel/cp.py's ContextAttention): causal
    attention over the cp group on this rank's two chunks of each sequence."""

    cp: int

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float] = None,
                 dropout_p: float = 0.0) -> torch.Tensor:
        """``q`` [b, heads, 2L, d], ``k``, ``v`` [b, kv_heads, 2L, d], rotated at their global positions."""

    def check_local_length(self, local_len: int) -> None:
        """Raise unless ``local_len`` tokens per sequence are a valid part for this rank."""

    def positions(self, local_len: int, device=None) -> torch.Tensor:
        """The global positions of this rank's ``local_len`` tokens of each sequence."""


class ModelAdapter:
    """One family of models as fsdp8 sees it (see [Note: model adapters]). Each method's body here
    is the generic answer, for a model no registered adapter claims."""

    # The error's reason when ``tp_plan`` gives nothing and the caller gave no plan either.
    no_tp_plan_hint = "fsdp8 knows the plans of its own Llama and of Hugging Face models"

    def claims(self, model: nn.Module) -> bool:
        """Whether ``model`` is of this family (the generic adapter is never asked)."""
        return False

    def units(self, model: nn.Module) -> Optional[Units]:
        """fully_shard's units for ``model`` (what ``ParallelConfig.units`` replaces); None:
        fully_shard's default, every child of every nn.ModuleList."""
        return None

    def tp_plan(self, model: nn.Module, sequence_parallel: bool, loss_parallel: bool) -> Optional[FamilyPlan]:
        """The automatic tensor-parallel plan of ``model`` (a caller's ``tp_plan`` extends or
        overrides it); None: there is none, the caller's plan is the whole plan."""
        return None

    def supports_context_parallel(self, model: nn.Module) -> bool:
        """Whether ``context_parallel`` can reach ``model``'s attention: asked before any mesh
        exists, so that every rank raises before anything is communicated."""
        return False

    def context_parallel(self, model: nn.Module, attention: CPAttention) -> nn.Module:
        """Route ``model``'s attention through ``attention`` and make the model take this rank's
        part of each sequence (positions, checks); returns ``model``."""
        raise ValueError(
            f"context_parallel knows fsdp8's Llama and Hugging Face models, not {type(model).__name__}; in your own "
            "model's attention call attend = fsdp8.parallel.cp.ContextAttention(mesh) as attend(q, k, v) on this "
            "rank's tokens (cut with shard_sequence), rotated at their global positions (attend.positions)"
        )

    def checkpoint_filter(self, model: nn.Module) -> Optional[CallFilter]:
        """What a unit's training call must not carry, taken out before activation checkpointing
        (a KV cache would be appended to twice when recomputed) and before a compiled unit's code
        (a cache in another state at every layer would compile the layer again); None: nothing."""
        return None

    def planner_spec(self, model: nn.Module) -> ModelSpec:
        """``model``'s sizes as the planner reads them (``parallelize(model, "auto")``)."""
        raise ValueError(f"parallelize(model, 'auto') plans fsdp8's Llama and Hugging Face Llama-family models, not "
                         f"{type(model).__name__}; pass a fsdp8.ParallelConfig")

    def swiglu_names(self, module: nn.Module) -> Optional[Tuple[str, str, str]]:
        """The gate, up and down children of ``module`` when it is this family's SwiGLU MLP,
        ``down(silu(gate(x)) * up(x))``, which FP8 conversion may run as one function
        (fp8/mlp.py); None otherwise. Asked of every module of every converted model."""
        return None

    def experts(self, model: nn.Module) -> Dict[str, nn.Module]:
        """The modules holding ``model``'s mixture-of-experts experts, by name: what expert
        parallelism will split. Each has transformers' experts form, which
        fsdp8.models.moe.experts_forward computes: 3-D ``gate_up_proj`` [E, 2I, H] and ``down_proj``
        [E, H, I] parameters, ``act_fn``, and ``forward(hidden_states, top_k_index, top_k_weights)``.
        Empty: a dense model."""
        return {}

    def load_balancing_modules(self, model: nn.Module) -> List[nn.Module]:
        """The modules whose forward computes ``model``'s router load-balancing loss through
        fsdp8.models.moe.load_balancing_loss, reading their ``load_balancing_groups``: where
        ``ParallelConfig(load_balancing="global")`` sets the token groups. Raises for a family
        that computes that loss elsewhere (transformers' models, in their own forward)."""
        raise ValueError(
            f"load_balancing='global' counts the experts' tokens in fsdp8's load-balancing loss, which "
            f"{type(model).__name__} does not compute (transformers' MoE models compute theirs in their own "
            "forward); use load_balancing='local'"
        )

    def skip_packed_sequence_check(self, model: nn.Module) -> Callable[[], None]:
        """The function that removes the family's host-synchronising checks for packed sequences
        (``ParallelConfig.skip_packed_sequence_check``); raises for a family without them."""
        raise ValueError(
            f"skip_packed_sequence_check replaces a check of Hugging Face attention, but {type(model).__name__} is "
            "not a transformers model; drop the option"
        )


_GENERIC = ModelAdapter()
_REGISTERED: List[ModelAdapter] = []


def register_adapter(adapter: ModelAdapter) -> None:
    """Make ``adapter`` the first one ``adapter_for`` asks: the latest registration wins, so a
    user's adapter can take over models a built-in one claims. Its SwiGLU MLPs become known to
    FP8 conversion."""
    if not isinstance(adapter, ModelAdapter):
        raise TypeError(f"register_adapter takes a fsdp8.models.ModelAdapter instance, got {type(adapter).__name__}")
    _REGISTERED.insert(0, adapter)
    register_swiglu_form(adapter.swiglu_names)


def adapter_for(model: nn.Module) -> ModelAdapter:
    """The adapter of ``model``: the latest registered one that claims it, else the generic one."""
    return next((adapter for adapter in _REGISTERED if adapter.claims(model)), _GENERIC)
