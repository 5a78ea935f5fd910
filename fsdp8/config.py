"""User-facing policies: sharding strategy, mixed precision and the parallel layout, validated once at construction."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch


class Strategy(enum.IntEnum):
    """What is sharded over the data-parallel ranks (the ZeRO stage)."""

    NO_SHARD = 0  # DDP-like: everything replicated, gradients all-reduced
    OPTIM = 1  # ZeRO-1: main weights and optimizer state sharded
    OPTIM_GRADS = 2  # ZeRO-2: + gradients sharded
    OPTIM_GRADS_PARAMS = 3  # ZeRO-3: + compute parameters sharded between uses

    @classmethod
    def parse(cls, value: Union[str, int, "Strategy"], what: str = "strategy") -> "Strategy":
        if isinstance(value, Strategy):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            if 0 <= value <= 3:
                return cls(value)
        elif isinstance(value, str):
            key = value.strip().lower()
            if key in _STRATEGY_NAMES:
                return _STRATEGY_NAMES[key]
            if key.isdigit() and 0 <= int(key) <= 3:
                return cls(int(key))
        names = ", ".join(repr(n) for n in STRATEGY_NAMES)
        raise ValueError(f"unknown {what} {value!r}: use one of {names} (or the ints 0..3)")

    @property
    def label(self) -> str:
        return STRATEGY_NAMES[self.value]

    @property
    def shards_params(self) -> bool:
        return self is Strategy.OPTIM_GRADS_PARAMS

    @property
    def shards_main(self) -> bool:
        return self is not Strategy.NO_SHARD


STRATEGY_NAMES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
_STRATEGY_NAMES = {name: Strategy(i) for i, name in enumerate(STRATEGY_NAMES)}


class OuterStrategy(enum.IntEnum):
    """HSDP: what is sharded across the replicas (the outer mesh dimension)."""

    NO_SHARD = 0  # replicas hold identical main weights; gradients all-reduced across them
    OPTIM = 1  # main weights and optimizer state also sharded across replicas

    @classmethod
    def parse(cls, value: Union[str, int, "OuterStrategy"]) -> "OuterStrategy":
        if isinstance(value, OuterStrategy):
            return value
        if isinstance(value, str) and value.strip().lower() in ("no_shard", "optim"):
            return cls.OPTIM if value.strip().lower() == "optim" else cls.NO_SHARD
        if isinstance(value, int) and not isinstance(value, bool) and value in (0, 1):
            return cls(value)
        raise ValueError(f"unknown outer_strategy {value!r}: use 'no_shard' or 'optim'")

    @property
    def label(self) -> str:
        return "optim" if self is OuterStrategy.OPTIM else "no_shard"


_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclass(frozen=True)
class Precision:
    """Mixed precision: compute in ``param_dtype``, reduce gradients in ``reduce_dtype``,
    keep the optimizer's main weights in ``main_dtype``.

    ``param_dtype=None`` computes in ``main_dtype``; ``reduce_dtype=None`` reduces in the
    compute dtype (like FSDP2)."""

    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    main_dtype: torch.dtype = torch.float32

    def __post_init__(self):
        for field in ("param_dtype", "reduce_dtype", "main_dtype"):
            value = getattr(self, field)
            if value is None and field != "main_dtype":
                continue
            if value not in _FLOAT_DTYPES:
                raise ValueError(
                    f"Precision.{field}={value!r} is not a floating dtype; "
                    "use torch.float32, torch.bfloat16 or torch.float16"
                )

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.param_dtype or self.main_dtype

    @property
    def grad_reduce_dtype(self) -> torch.dtype:
        return self.reduce_dtype or self.compute_dtype

    @property
    def casts_inputs(self) -> bool:
        return self.param_dtype is not None and self.param_dtype != self.main_dtype

    @property
    def label(self) -> str:
        """The compute dtype's short name: ``"bf16"``, ``"fp32"``, ``"fp16"`` or ``"fp64"``."""
        return _DTYPE_LABELS[self.compute_dtype]


_DTYPE_LABELS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}
# bf16 compute with gradients reduced in fp32: what GPUs are fast at, and what fsdp8 picks there.
BF16_MIXED = Precision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def resolve_precision(precision: Optional[Precision], device_type: str) -> Precision:
    """``precision``, or where it is None (automatic) the one for ``device_type``: ``BF16_MIXED``
    on GPUs ("cuda"), fp32 elsewhere, since CPUs without bf16 units run bf16 GEMMs many times
    slower than fp32. The one place this choice is made: ``parallelize``, ``fsdp8 train
    --precision auto``, ``fsdp8 bench`` and the planner (which predicts GPUs) all ask here."""
    if precision is not None:
        return precision
    return BF16_MIXED if device_type == "cuda" else Precision()


class FP8Recipe:
    """What ``ParallelConfig.fp8`` holds: the base of fsdp8's FP8 recipes (``fsdp8.fp8.recipes``),
    declared here so that the configuration can check the field without depending on the FP8
    code, which builds on it."""

    name = "recipe"  # a recipe's short name: "current", "delayed", "block", "mxfp8"


class LayoutError(ValueError):
    """A layout ``ParallelConfig`` refuses. ``rule`` names the check, so that a command line can
    say the same in terms of its own flags (fsdp8/app/args.py)."""

    def __init__(self, rule: str, message: str):
        super().__init__(message)
        self.rule = rule


class LayoutNotSupported(LayoutError, NotImplementedError):
    """A layout fsdp8 cannot run yet: a NotImplementedError, and a ValueError for whoever checks
    configurations (as ``io.UnsupportedOperation`` is both an OSError and a ValueError)."""


AC_MODES = ("none", "full", "selective")


def check_checkpointing_with_cp(mode: str, cp: int) -> None:
    """Raise for the checkpointing modes context parallelism cannot run under yet."""
    if mode == "selective" and cp > 1:
        raise LayoutNotSupported(
            "selective_with_cp",
            f"activation_checkpointing='selective' with cp={cp}: the context-parallel attention builds its causal "
            "mask (torch's causal_lower_right, a tensor subclass) inside the checkpointed forward, which the "
            "selective policy's dispatch mode cannot create; use activation_checkpointing='full' with cp > 1",
        )


_MESH_SIZES = ("dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class ParallelConfig:
    """Everything ``fsdp8.parallelize`` does to a model, validated at construction.

    Mesh sizes, ordered ``(dp_replicate, dp_shard, cp, tp)`` as ``fsdp8.make_mesh`` lays
    them out; one of them may be ``-1`` (by default ``dp_shard``): it takes what the world
    leaves. The batch's rows are split over ``dp_replicate x dp_shard``; the ranks of one
    tensor-parallel group see the same rows, and the ``cp`` ranks of one context-parallel
    group the same rows cut along the sequence (``fsdp8.parallel.cp``: each holds two of
    ``2 x cp`` chunks of every sequence, and attention all-gathers keys and values).

    - ``tp``, ``sequence_parallel``, ``loss_parallel``, ``tp_plan``: tensor parallelism as
      ``fsdp8.parallel.tensor_parallel`` applies it; ``tp_plan`` (``{"module pattern":
      ParallelStyle or None}``) overrides and extends the automatic plan of the model's
      adapter (the built-in Llama's, Hugging Face models', a registered family's), or is the
      whole plan of other models. With ``loss_parallel`` compute the loss and call
      ``backward()`` inside ``torch.distributed.tensor.parallel.loss_parallel()``.
    - ``ep``: expert parallelism for a mixture-of-experts model (``fsdp8.parallel.ep``): each
      expert on one of ``ep`` ranks borrowed from ``dp_shard`` (which it must divide; they
      still see different rows), tokens sent to their experts' ranks and back with
      all-to-all, every routed token computed (no capacity limit, so results equal one
      process), the experts then sharded like other weights over the ``dp_shard / ep``
      ranks left (and ``dp_replicate``, ``cp``). The model's adapter says where its experts
      are (``fsdp8.models.adapter_for(model).experts(model)``). With ``tp`` > 1 attention and
      dense layers are tensor-parallel and the experts expert-parallel (a mixture-of-experts
      model then needs ep > 1), the router replicated over tp; each tp rank has its own ep
      group (the ranks of its tp coordinate). With ``sequence_parallel`` each tp rank routes
      its part of the sequences; without, every tp rank routes and computes the same tokens.
    - ``fp8_dispatch`` (with ep > 1): the dispatch all-to-all sends each token as e4m3 bytes
      with one fp32 scale per 128 of its values (``H + 4 ceil(H / 128)`` bytes a token against
      bf16's ``2 H``, as DeepSeek-V3 dispatches); the experts then compute on their input rounded
      to FP8 (on any ep degree the same, so a run equals one process whose experts take their
      input so rounded: ``fsdp8.parallel.ep.rows_through_fp8``). The rounding's gradient is the
      identity; the combine and every backward all-to-all stay in the compute dtype.
    - ``load_balancing`` (mixture-of-experts models whose adapter computes the router's
      load-balancing loss: the built-in Llama): ``"local"`` counts each rank's own tokens per
      expert (data-parallel semantics: each rank's rows one batch); ``"global"`` counts the
      whole global batch's (an all-reduce of the counts over the data-parallel and cp ranks
      in each MoE layer's forward), so the ranks' averaged loss is one process's on the
      global batch, as Qwen's global-batch balancing argues for.
    - ``activation_checkpointing``: ``"none"``; ``"full"`` (each unit's activations are
      recomputed in backward: least memory, one more forward); ``"selective"`` (an op-level
      policy: matmul outputs except every second one, attention outputs, reduce-scatter
      outputs and FP8 amaxes are kept, cheap elementwise ops recomputed).
    - ``compile``: ``True`` compiles each unit's forward with ``torch.compile``; a dict is
      passed to ``torch.compile`` as keyword arguments (e.g. ``{"mode": "max-autotune"}``).
      Under tp on torch before 2.13 the default is ``dynamic=False`` (that torch's DTensor
      cannot hash a symbolic shape): a new sequence length compiles again.
    - ``fp8``, ``precision``, ``strategy``, ``outer_strategy``, ``reshard_after_forward``,
      ``units``, ``offload``: as ``fsdp8.fully_shard`` takes them. ``precision=None`` picks
      ``BF16_MIXED`` (bf16 compute, fp32 gradient reduction) on GPUs and fp32 on CPUs
      (``resolve_precision``, as ``fsdp8 train --precision auto``). ``units=None`` takes the
      model adapter's units (a Hugging Face model's decoder layers, its ``_no_split_modules``
      classes), else every child of every ``nn.ModuleList``.
    - ``skip_packed_sequence_check`` (Hugging Face models): answer transformers' packed-
      sequence checks with "not packed" without reading the position ids. transformers'
      flash-attention path calls ``_is_packed_sequence`` in every attention layer at batch
      size 1, and its mask code calls ``find_packed_sequence_indices`` once per forward (any
      attention, any batch size) when no attention mask is given; both read position ids on
      the host, a device synchronisation per layer (and per recomputation) or per forward.
      Off by default because it is only right when no batch packs several sequences into one
      row: packed rows fed without an attention mask would then attend across sequence
      boundaries and train on wrong results. The replacement is process-wide (transformers
      keeps the functions in modules), as NeMo AutoModel's is for the first."""

    dp_replicate: int = 1
    dp_shard: int = -1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    fp8_dispatch: bool = False
    load_balancing: str = "local"
    sequence_parallel: bool = False
    loss_parallel: bool = False
    tp_plan: Optional[Mapping[str, Any]] = None
    activation_checkpointing: str = "none"
    compile: Union[bool, Mapping[str, Any]] = False
    fp8: Optional[Any] = None
    precision: Optional[Precision] = None
    strategy: Union[str, int, Strategy] = "optim_grads_params"
    outer_strategy: Union[str, int, OuterStrategy] = "no_shard"
    reshard_after_forward: bool = True
    units: Any = None
    offload: Optional[str] = None
    skip_packed_sequence_check: bool = False

    @property
    def compiled(self) -> bool:
        """Whether units are compiled: ``compile`` True, or a dict of torch.compile options (``{}`` too)."""
        return self.compile is not False

    def __post_init__(self):
        self._check_sizes()
        for name in ("sequence_parallel", "loss_parallel", "reshard_after_forward", "skip_packed_sequence_check",
                     "fp8_dispatch"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"ParallelConfig.{name} must be True or False, got {getattr(self, name)!r}")
        # Normalised once, so config.strategy is always a Strategy.
        object.__setattr__(self, "strategy", Strategy.parse(self.strategy))
        object.__setattr__(self, "outer_strategy", OuterStrategy.parse(self.outer_strategy))
        self._check_tensor_parallel()
        self._check_expert_parallel()
        if self.outer_strategy is not OuterStrategy.NO_SHARD and self.dp_replicate == 1:
            raise LayoutError(
                "outer_without_replicas",
                f"outer_strategy={self.outer_strategy.label!r} shards across HSDP replicas, but dp_replicate=1 makes "
                "none; set dp_replicate > 1 (e.g. the number of nodes) or keep outer_strategy='no_shard'",
            )
        if self.activation_checkpointing not in AC_MODES:
            raise LayoutError(
                "activation_checkpointing",
                f"ParallelConfig.activation_checkpointing={self.activation_checkpointing!r}: use one of "
                f"{', '.join(map(repr, AC_MODES))}",
            )
        check_checkpointing_with_cp(self.activation_checkpointing, self.cp)
        self._check_compile()
        self._check_types()
        if self.offload not in (None, "optim"):
            raise LayoutError("offload", f"ParallelConfig.offload={self.offload!r}: use None or 'optim' (main weights, "
                                         "gradients and optimizer state in host memory)")
        if self.offload is not None and self.strategy is Strategy.NO_SHARD:
            raise LayoutError(
                "offload_without_sharding",
                "offload='optim' moves the sharded main weights and optimizer state to the host, but "
                "strategy='no_shard' shards nothing; use strategy='optim' or higher with offload",
            )

    def _check_sizes(self) -> None:
        for name in _MESH_SIZES:
            size = getattr(self, name)
            if isinstance(size, bool) or not isinstance(size, int) or (size < 1 and size != -1):
                raise ValueError(f"ParallelConfig.{name} must be a positive int or -1 (inferred), got {size!r}")
        inferred = [name for name in _MESH_SIZES if getattr(self, name) == -1]
        if len(inferred) > 1:
            raise ValueError(
                f"only one mesh size may be -1 (inferred), got {' and '.join(inferred)}; dp_shard defaults to -1, "
                "so give it a size when another one is -1"
            )

    def _check_expert_parallel(self) -> None:
        if self.load_balancing not in ("local", "global"):
            raise ValueError(f"ParallelConfig.load_balancing must be 'local' or 'global', got {self.load_balancing!r}")
        if isinstance(self.ep, bool) or not isinstance(self.ep, int) or self.ep < 1:
            raise ValueError(f"ParallelConfig.ep must be a positive int (the expert-parallel ranks), got {self.ep!r}")
        if self.fp8_dispatch and self.ep == 1:
            raise LayoutError("fp8_dispatch_without_ep",
                              "fp8_dispatch sends tokens to their experts' ranks in FP8, but ep=1 sends none; set ep > 1 "
                              "(a divisor of dp_shard) or drop fp8_dispatch")

    def _check_tensor_parallel(self) -> None:
        if self.tp != 1:
            return
        wanting = [name for name in ("sequence_parallel", "loss_parallel") if getattr(self, name)]
        if self.tp_plan is not None:
            wanting.append("tp_plan")
        if wanting:
            raise LayoutError(
                "needs_tensor_parallel",
                f"{' and '.join(wanting)} need tensor parallelism, but tp=1; set tp=N (N > 1 dividing the world) "
                f"or drop {' and '.join(wanting)}",
            )

    def _check_compile(self) -> None:
        if isinstance(self.compile, bool):
            return
        if not isinstance(self.compile, Mapping) or not all(isinstance(k, str) for k in self.compile):
            raise TypeError(
                f"ParallelConfig.compile must be True, False or a dict of torch.compile keyword arguments, "
                f"got {self.compile!r}"
            )

    def _check_types(self) -> None:
        from torch.distributed.tensor.parallel import ParallelStyle

        if self.tp_plan is not None:
            if not isinstance(self.tp_plan, Mapping):
                raise TypeError(f"ParallelConfig.tp_plan must be a dict of module pattern -> ParallelStyle or None, "
                                f"got {type(self.tp_plan).__name__}")
            for key, style in self.tp_plan.items():
                if not isinstance(key, str) or not (style is None or isinstance(style, ParallelStyle)):
                    raise TypeError(
                        f"ParallelConfig.tp_plan[{key!r}] = {style!r}: keys are fnmatch patterns over module names, "
                        "values torch ParallelStyles (ColwiseParallel(), RowwiseParallel(), ...) or None"
                    )
        if self.fp8 is not None and not isinstance(self.fp8, FP8Recipe):
            raise TypeError(f"ParallelConfig.fp8 must be an fsdp8 FP8 recipe (e.g. fsdp8.Float8CurrentScaling()) "
                            f"or None, got {self.fp8!r}")
        if self.precision is not None and not isinstance(self.precision, Precision):
            raise TypeError(f"ParallelConfig.precision must be fsdp8.Precision or None (automatic), "
                            f"got {type(self.precision).__name__}")
        units = self.units
        classes = units if isinstance(units, (list, tuple)) else [units] if isinstance(units, type) else None
        if classes is not None:
            wrong = [c for c in classes if not (isinstance(c, type) and issubclass(c, torch.nn.Module))]
            if wrong or not classes:
                raise TypeError(f"ParallelConfig.units must be nn.Module classes or a callable(name, module) -> bool, "
                                f"got {units!r}")
        elif units is not None and not callable(units):
            raise TypeError(f"ParallelConfig.units must be nn.Module classes or a callable(name, module) -> bool, "
                            f"got {units!r}")
