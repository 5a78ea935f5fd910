"""fsdp8: sharded data-parallel training (ZeRO-1/2/3, HSDP) with first-class FP8, tensor and context parallelism."""

from .config import ParallelConfig, Precision, Strategy, OuterStrategy
from .engine.grads import NonFiniteGradError, check_finite, clip_grad_norm_, nonfinite_grads
from .engine.model import fully_shard
from .engine.sharded import MemoryReport, ShardedModel
from .distributed.check import DesyncError
from .engine.state_dict import StateDictError
from .distributed.mesh import data_parallel_mesh, make_mesh, tp_mesh
from .distributed.process_group import init_distributed
from .parallel.tp import tensor_parallel
from .parallel.cp import context_parallel, loss_divisor, shard_sequence
from .parallel.manager import ParallelizedModel, parallelize
from .fp8.recipes import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling
from .fp8.linear import Float8Linear
from .fp8.tensor import Float8Tensor
from .fp8.convert import convert_to_fp8, fp8_init
from .fp8.fsdp2 import precompute_fp8_scales, prepare_fp8_modules_for_fsdp, use_fp8_all_gather
from .fp8.tp import Float8ColwiseParallel
from . import checkpoint, data, fp8
from .checkpoint import latest, load, load_pretrained, save, wait_for_saves
from .planner import plan

__all__ = [
    "latest",
    "load",
    "load_pretrained",
    "save",
    "wait_for_saves",
    "DelayedScaling",
    "Float8BlockScaling",
    "Float8CurrentScaling",
    "Float8ColwiseParallel",
    "Float8Linear",
    "Float8Tensor",
    "MXFP8BlockScaling",
    "convert_to_fp8",
    "fp8_init",
    "precompute_fp8_scales",
    "prepare_fp8_modules_for_fsdp",
    "use_fp8_all_gather",
    "DesyncError",
    "MemoryReport",
    "OuterStrategy",
    "ParallelConfig",
    "ParallelizedModel",
    "parallelize",
    "Precision",
    "ShardedModel",
    "StateDictError",
    "Strategy",
    "clip_grad_norm_",
    "check_finite",
    "nonfinite_grads",
    "NonFiniteGradError",
    "fully_shard",
    "init_distributed",
    "make_mesh",
    "data_parallel_mesh",
    "tp_mesh",
    "tensor_parallel",
    "context_parallel",
    "loss_divisor",
    "shard_sequence",
    "plan",
]
__version__ = "0.1.0"
