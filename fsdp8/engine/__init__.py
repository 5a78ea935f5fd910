"""The sharding engine: fully_shard, its units, flat buffers, gathers and reductions, and the schedule."""

from ..config import OuterStrategy, Strategy
from .grads import NonFiniteGradError, check_finite, clip_grad_norm_, nonfinite_grads
from .model import fully_shard
from .sharded import MemoryReport, ShardedModel
from .state_dict import StateDictError

__all__ = ["MemoryReport", "NonFiniteGradError", "OuterStrategy", "ShardedModel", "StateDictError", "Strategy",
           "check_finite", "clip_grad_norm_", "fully_shard", "nonfinite_grads"]
