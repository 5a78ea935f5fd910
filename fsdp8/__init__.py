"""fsdp8: sharded data-parallel training (ZeRO-1/2/3, HSDP) with first-class FP8."""

from .config import Precision, Strategy, OuterStrategy
from .engine.grads import clip_grad_norm_
from .engine.model import MemoryReport, ShardedModel, fully_shard
from .engine.check import DesyncError
from .engine.state_dict import StateDictError
from .parallel.mesh import init_distributed, make_mesh
from . import data

__all__ = [
    "DesyncError",
    "MemoryReport",
    "OuterStrategy",
    "Precision",
    "ShardedModel",
    "StateDictError",
    "Strategy",
    "clip_grad_norm_",
    "fully_shard",
    "init_distributed",
    "make_mesh",
]
__version__ = "0.1.0"
