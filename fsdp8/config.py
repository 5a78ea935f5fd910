"""User-facing policies: sharding strategy and mixed precision, validated once at construction."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional, Union

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
