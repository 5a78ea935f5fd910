"""Float8Linear: an ``nn.Linear`` whose GEMMs run in FP8 under a recipe (see fsdp8.fp8.recipes),
eager, traced into compiled blocks, or on tensor-parallel pieces."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .formats import Granularity
from .gemm import input_in_graph
from .kernels import amax, quantize
from .linear_fn import Float8LinearFn
from .recipes import X, DelayedState, Recipe, record_amax, update_delayed_states
from .tp_forward import tensor_parallel_forward

_FLOAT8_CLASSES: dict = {}


class Float8Linear(nn.Linear):
    """``nn.Linear`` whose GEMMs run in FP8 under ``recipe`` (see fsdp8.fp8.recipes)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, recipe: Optional[Recipe] = None,
                 device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        if recipe is None:
            raise ValueError("Float8Linear needs a recipe, e.g. fsdp8.Float8CurrentScaling()")
        self.recipe = recipe
        self._delayed: Optional[DelayedState] = None
        # Under fully_shard, the engine batches delayed-scaling updates across all linears.
        self.external_delayed_update = False
        # Under torch FSDP1 (prepare_fp8_modules_for_fsdp): where delayed amaxes are reduced.
        self.amax_reduction_group = None

    @classmethod
    def convert(cls, linear: nn.Linear, recipe: Recipe) -> "Float8Linear":
        """Turn ``linear`` into a Float8Linear in place (same object, parameters, hooks and
        custom ``reset_parameters``); a subclass of nn.Linear becomes ``Float8<Subclass>``."""
        base = type(linear)
        if not isinstance(linear, Float8Linear):
            if base is not nn.Linear and base not in _FLOAT8_CLASSES:
                _FLOAT8_CLASSES[base] = type(f"Float8{base.__name__}", (cls, base), {})
            linear.__class__ = cls if base is nn.Linear else _FLOAT8_CLASSES[base]
        linear.recipe = recipe
        linear._delayed = None
        linear.external_delayed_update = False
        linear.amax_reduction_group = None
        if recipe.delayed and not linear.weight.is_meta:
            linear.delayed_state(linear.weight.device)
        return linear

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)  # copies into the delayed buffers in place
        if self._delayed is not None:
            self._delayed.refresh_inverses()

    def delayed_state(self, device: torch.device) -> Optional[DelayedState]:
        """The delayed-scaling state (created on first use, on ``device``); its amax history,
        scales and not yet folded-in amaxes are registered as buffers, so checkpoints save and
        restore them and a resumed run scales exactly as an uninterrupted one."""
        if not self.recipe.delayed:
            return None
        if self._delayed is None or self._delayed.history.is_meta:
            self._delayed = DelayedState(self.recipe, device)
            self.register_buffer("fp8_amax_history", self._delayed.history)
            self.register_buffer("fp8_scale", self._delayed.scale)
            self.register_buffer("fp8_amax_pending", self._delayed.pending)
        state = self._delayed
        if state.history is not self.fp8_amax_history:  # the module was moved (.to / .cuda)
            state.use(self.fp8_amax_history, self.fp8_scale, self.fp8_amax_pending)
        return state

    def traced(self) -> bool:
        """Whether compiled blocks trace this linear: a traceable recipe, and under delayed
        scaling a state updated outside the block (``external_delayed_update``, as under the
        engine), since a standalone linear decides at each forward, on the host, whether to
        update its state first."""
        return self.recipe.traceable and (not self.recipe.delayed or self.external_delayed_update)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, DTensor):
            if torch.compiler.is_compiling() and self.recipe.traced_under_tp:
                return tensor_parallel_forward(self, x, traced=True)  # tp_forward.py: FP8 under TP, compiled
            return self._tensor_parallel_forward(x)
        if not self.traced():
            return self._forward_opaque(x)
        state = self.delayed_state(x.device)
        if not torch.compiler.is_compiling():
            return Float8LinearFn.apply(x, self.weight, self.bias, self.recipe, state)
        # In a compiled block the quantization becomes part of the compiled graph. The input
        # is quantized out here, not inside the autograd function: linears fed the same
        # input (q/k/v, gate/up) then share one quantization once the compiler merges the
        # identical subgraphs (inside separate functions it does not). The function keeps
        # the input itself for backward, not an FP8 copy: the block keeps it (or what it is
        # recomputed from) anyway (a norm's input, the attention output, the MLP's gate and
        # up outputs), so the compiler saves no copy at all, where an FP8 copy per distinct
        # input cost 104 MiB per layer on model B. Backward quantizes it again (same bytes),
        # with a per-tensor scale saved from here: finding it again from the input cost a
        # reduction over every distinct input a layer (docs/PERFORMANCE.md, 2026-11-26 fifth
        # session); block scales of the transpose are other blocks, found in backward.
        if state is None:
            qx, x_scale = input_in_graph(x, self.recipe)
            return Float8LinearFn.apply(x, self.weight, self.bias, self.recipe, None, qx.data, qx.scale_inv, None,
                                         None, None, x_scale)
        x2d = x.detach().reshape(-1, x.shape[-1])
        # [Note: delayed scaling in a compiled block]
        # The scales come from the state's scale buffer and every amax (x here; w in forward
        # and dy in backward inside the function) is folded into its pending buffer with
        # in-place tensor ops. The compiler functionalizes them and writes the buffer back at
        # the end of the forward graph and of the backward graph (AOTAutograd keeps input
        # mutations made in backward, as float8 training needs), so no graph breaks and no
        # host synchronizes; the step's all-reduce and history roll stay outside, in eager.
        # The backward folds dy's amax into the pending value its forward left, so the state
        # must not change in between (the engine's forward-then-backward steps keep to it);
        # autograd checks the buffers' versions and raises if it did (a second forward of the
        # same linear, or a state update, before this one's backward).
        qx = quantize(x2d, self.recipe.fwd_dtype, Granularity.TENSOR, state.scale[X])
        record_amax(state.pending, X, amax(x2d))
        return Float8LinearFn.apply(x, self.weight, self.bias, self.recipe, None, qx.data, state.scale_inv[X], None,
                                     state.scale, state.pending, None, state.scale_inv)

    # Delayed scaling under TP in a compiled block: an opaque call (its state update and FP8
    # sequence gather are host-side work). Opaque, not split: a graph split inside it handed the
    # engine's FP8 weight (a Float8Tensor piece) across the split as an output that requires
    # grad, whose plain-tensor gradient AOTAutograd then refused ("Expected a Float8Tensor tangent").
    @torch.compiler.disable
    def _tensor_parallel_forward(self, x):
        return tensor_parallel_forward(self, x)

    @torch.compiler.disable  # an opaque call in compiled blocks (see Float8Linear.traced)
    def _forward_opaque(self, x: torch.Tensor) -> torch.Tensor:
        state = self.delayed_state(x.device)
        if state is not None and not self.external_delayed_update and state.dirty:
            # Standalone use: fold last step's amaxes in (over the FSDP1 group, if given).
            update_delayed_states([state], self.amax_reduction_group)
        return Float8LinearFn.apply(x, self.weight, self.bias, self.recipe, state)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe}"
