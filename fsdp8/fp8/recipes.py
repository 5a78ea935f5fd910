"""FP8 recipes (frozen dataclasses) and the state delayed scaling keeps per linear."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ..config import FP8Recipe
from ..distributed import comm
from .formats import E4M3, E5M2, SCALE_ALIGN, Granularity, amax_to_scale, scale_to_inv

_FORMATS = ("hybrid", "e4m3")


@functools.lru_cache(maxsize=None)
def _capability(device_index: int) -> int:
    major, minor = torch.cuda.get_device_capability(device_index)
    return 10 * major + minor


# A compiled graph asks once, while it is traced. An int, not torch's (major, minor) tuple:
# Dynamo (torch 2.11) cannot compare a tuple that came out of an assumed-constant call.
@torch.compiler.assume_constant_result
def capability(device: torch.device) -> int:
    """The CUDA compute capability as an integer (89 for 8.9), asked once per device (it is
    checked on every FP8 GEMM)."""
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


class Recipe(FP8Recipe):
    """What every recipe answers: dtypes and scaling granularity of x, w and dy."""

    fp8_format: str = "hybrid"
    x_granularity = Granularity.TENSOR
    w_granularity = Granularity.TENSOR
    g_granularity = Granularity.TENSOR
    delayed = False
    # Whether a Float8Linear of this recipe is traced into a compiled block (else it is an
    # opaque call there, running its eager kernels). Checked on H200 (torch 2.11): the
    # compiled quantization equals the eager kernels byte for byte once scales are divided
    # exactly (formats.amax_to_scale). MX is traced too: where its GEMM is emulated (Hopper)
    # the compiler fuses quantization and exact dequantization into the neighbouring ops,
    # and only bf16 operands reach the GEMM.
    # Delayed scaling is traced where its states are updated outside the block (see
    # Float8Linear.traced); checked bit for bit against eager on CPU (torch 2.13) only.
    traceable = True

    @property
    def traced_under_tp(self) -> bool:
        """Whether a tensor-parallel Float8Linear of this recipe is traced into a compiled block:
        delayed scaling is not (its state update runs on the host there; fp8/linear.py)."""
        return self.traceable and not self.delayed

    def _check_format(self, allowed=_FORMATS) -> None:
        if self.fp8_format not in allowed:
            raise ValueError(f"{type(self).__name__}.fp8_format={self.fp8_format!r}: use one of {', '.join(map(repr, allowed))}")

    @property
    def fwd_dtype(self) -> torch.dtype:
        return E4M3

    @property
    def bwd_dtype(self) -> torch.dtype:
        """'hybrid' keeps gradients in e5m2 (more range), 'e4m3' everywhere else."""
        return E5M2 if self.fp8_format == "hybrid" else E4M3

    def native_gemm(self, device: torch.device) -> bool:
        """Whether this device multiplies this recipe's FP8 operands natively (else emulated)."""
        if device.type != "cuda":
            return False
        return capability(device) >= 89


@dataclass(frozen=True)
class DelayedScaling(Recipe):
    """Per-tensor scales from a history of amaxes (one batched all-reduce per step)."""

    amax_history_len: int = 1024
    amax_compute: str = "max"  # or "most_recent"
    margin: int = 0
    fp8_format: str = "hybrid"

    delayed = True
    # Traced under the engine (or any caller that updates the states between steps): the
    # compiled block reads the scale buffer and folds amaxes into the pending buffer on the
    # device; a standalone linear updates its state at each forward, host work that stays
    # an opaque call.
    traceable = True
    name = "delayed"

    def __post_init__(self):
        self._check_format()
        if self.amax_history_len < 1:
            raise ValueError(f"amax_history_len must be >= 1, got {self.amax_history_len}")
        if self.amax_compute not in ("max", "most_recent"):
            raise ValueError(f"amax_compute={self.amax_compute!r}: use 'max' or 'most_recent'")
        if self.margin < 0:
            raise ValueError(f"margin must be >= 0, got {self.margin}")


@dataclass(frozen=True)
class Float8CurrentScaling(Recipe):
    """Per-tensor scales from the tensor's own amax, computed when it is quantized."""

    fp8_format: str = "hybrid"
    name = "current"

    def __post_init__(self):
        self._check_format()


@dataclass(frozen=True)
class Float8BlockScaling(Recipe):
    """1x128 blocks for activations and gradients, 128x128 for weights (DeepSeek-V3 style);
    native through cuBLAS on Hopper (sm90)."""

    fp8_format: str = "e4m3"
    x_granularity = Granularity.ROW_1x128
    w_granularity = Granularity.BLOCK_128x128
    g_granularity = Granularity.ROW_1x128
    name = "block"

    def __post_init__(self):
        self._check_format(("e4m3",))

    def native_gemm(self, device: torch.device) -> bool:
        return device.type == "cuda" and capability(device) == 90


@dataclass(frozen=True)
class MXFP8BlockScaling(Recipe):
    """OCP MXFP8: 1x32 blocks with power-of-two (e8m0) scales. Native GEMMs need sm100;
    elsewhere the GEMM is emulated (exact dequantize, bf16 matmul)."""

    fp8_format: str = "e4m3"
    x_granularity = Granularity.MX_1x32
    w_granularity = Granularity.MX_1x32
    g_granularity = Granularity.MX_1x32
    name = "mxfp8"

    def __post_init__(self):
        self._check_format()

    def native_gemm(self, device: torch.device) -> bool:
        return device.type == "cuda" and capability(device) >= 100


RECIPES = {
    "fp8-delayed": DelayedScaling,
    "fp8-current": Float8CurrentScaling,
    "fp8-block": Float8BlockScaling,
    "fp8-mxfp8": MXFP8BlockScaling,
}


def recipe_from_name(name: str) -> Recipe:
    if name not in RECIPES:
        raise ValueError(f"unknown FP8 recipe {name!r}: use one of {', '.join(RECIPES)}")
    return RECIPES[name]()


X, W, G = 0, 1, 2  # rows of a DelayedState: input, weight, output gradient


def record_amax(pending: torch.Tensor, row: int, amax: torch.Tensor) -> None:
    """Fold ``amax`` into ``pending[row]`` (a running max), on the device."""
    pending[row] = torch.maximum(pending[row], amax.to(pending.device))


@dataclass(frozen=True)
class DelayedBuffers:
    """What a compiled graph touches of a DelayedState: the scales (and their inverses) it
    reads and the pending amaxes it writes, in place, with no host-side flag (its updates
    happen outside, and compute the inverses with the scales)."""

    scale: torch.Tensor
    pending: torch.Tensor
    scale_inv: tuple  # DelayedState.scale_inv

    def record(self, row: int, amax: torch.Tensor) -> None:
        record_amax(self.pending, row, amax)


class DelayedState:
    """Amax history and scales of one linear under delayed scaling.

    Amaxes seen in a step collect in ``pending`` (a running max, no host sync); ``update``
    folds them into the history and derives the scales used by the next step. Under the
    sharding engine ``update_delayed_states`` does this for every linear at once, with one
    all-reduce (max) over the data-parallel group."""

    def __init__(self, recipe: DelayedScaling, device: torch.device):
        self._bind(recipe, torch.zeros(3, recipe.amax_history_len, device=device), torch.ones(3, device=device),
                   torch.zeros(3, device=device))

    @classmethod
    def over(cls, recipe: DelayedScaling, history: torch.Tensor, scale: torch.Tensor,
             pending: torch.Tensor) -> "DelayedState":
        """A state whose history [3, L], scales [3] and pending amaxes [3] are the given tensors
        (views into tensors a group of states shares: FP8 experts, one state per expert)."""
        state = cls.__new__(cls)
        state._bind(recipe, history, scale, pending)
        return state

    def _bind(self, recipe: DelayedScaling, history: torch.Tensor, scale: torch.Tensor, pending: torch.Tensor) -> None:
        self.recipe = recipe
        self.dtypes = (recipe.fwd_dtype, recipe.fwd_dtype, recipe.bwd_dtype)
        self.use(history, scale, pending)
        self.dirty = False  # host-side: amaxes recorded since the last update
        self.steps = 0

    def use(self, history: torch.Tensor, scale: torch.Tensor, pending: torch.Tensor) -> None:
        """Read and write these tensors from now on (its module's buffers were replaced: moved,
        materialized), keeping this object, which others may hold (the engine's scale agreement)."""
        self.history, self.scale, self.pending = history, scale, pending
        self.keep_inverses()

    def keep_inverses(self) -> None:
        """``1 / scale`` beside the scales (``scale_inv_column``, each update writes it): a
        compiled graph reads ``scale_inv``, its three elements as 0-d tensors, instead of
        computing one inverse per quantization (a one-element kernel each: 14 a layer of model
        A). They reach cuBLAS as _scaled_mm scales, so they sit SCALE_ALIGN elements apart, as
        the engine lays out its weights' scales (Float8Unit._allocate_scales). Not module
        buffers: derived from the scales, rebuilt when the module moves (Float8Linear.delayed_state)."""
        self.scale_inv_column = torch.empty(3, SCALE_ALIGN, device=self.scale.device)[:, 0]
        self.scale_inv = tuple(self.scale_inv_column.unbind(0))
        self.refresh_inverses()

    def refresh_inverses(self) -> None:
        """Write ``1 / scale`` into the kept inverses, in place (compiled graphs hold views of
        them): after every update, and after anything that writes the scales in place (a
        state dict or checkpoint load), or a compiled step would dequantize with the old ones."""
        self.scale_inv_column.copy_(scale_to_inv(self.scale))

    def record(self, row: int, amax: torch.Tensor) -> None:
        record_amax(self.pending, row, amax)
        self.dirty = True

    def update(self, amaxes: Optional[torch.Tensor] = None) -> None:
        """Roll ``amaxes`` (default: this state's pending) into the history; recompute scales."""
        amaxes = self.pending if amaxes is None else amaxes
        # In place: the history and scales are also the module's checkpointed buffers.
        self.history.copy_(torch.roll(self.history, 1, dims=1))
        self.history[:, 0] = amaxes
        if self.recipe.amax_compute == "max":
            current = self.history.amax(dim=1)
        else:
            current = self.history[:, 0]
        self.scale.copy_(torch.stack([amax_to_scale(current[i], self.dtypes[i], self.recipe.margin) for i in range(3)]))
        self.refresh_inverses()
        self.pending.zero_()
        self.dirty = False
        self.steps += 1


def update_delayed_states(states: Sequence[DelayedState], group=None) -> None:
    """One batched max all-reduce of every state's pending amaxes, then ``update_states``."""
    if not states:
        return
    stacked = torch.stack([s.pending for s in states])
    comm.all_reduce(stacked, group, dist.ReduceOp.MAX, "fp8 delayed amaxes")
    update_states(states, stacked)


def update_states(states: Sequence[DelayedState], amaxes: torch.Tensor) -> torch.Tensor:
    """``states[i].update(amaxes[i])`` for every state, in a few launches for all of them;
    returns the new scales, one row of three per state.

    Why batched: one state's update is ~25 small kernels, so a model of 56 delayed linears
    (model B) spent ~1,400 launches a step on its histories, and the host, not the GPU, set
    the step's pace. Stacked, rolled, reduced and scaled together the values are the same,
    bit for bit: every operation is elementwise or along a history."""
    groups = {}
    for i, state in enumerate(states):
        groups.setdefault((state.recipe, state.history.shape), []).append(i)
    scales = None if len(groups) == 1 else torch.empty(len(states), 3, dtype=torch.float32, device=amaxes.device)
    for (recipe, _), members in groups.items():
        picked = [states[i] for i in members]
        rows = amaxes if scales is None else amaxes[members]
        history = torch.roll(torch.stack([s.history for s in picked]), 1, dims=2)
        history[:, :, 0] = rows
        torch._foreach_copy_([s.history for s in picked], list(history.unbind(0)))
        current = history.amax(dim=2) if recipe.amax_compute == "max" else history[:, :, 0]
        dtypes = picked[0].dtypes
        new = torch.stack([amax_to_scale(current[:, r], dtypes[r], recipe.margin) for r in range(3)], dim=1)
        torch._foreach_copy_([s.scale for s in picked], list(new.unbind(0)))
        torch._foreach_copy_([s.scale_inv_column for s in picked], list(scale_to_inv(new).unbind(0)))
        torch._foreach_zero_([s.pending for s in picked])
        for state in picked:
            state.dirty = False
            state.steps += 1
        if scales is None:
            return new
        scales[members] = new
    return scales
