"""fsdp8: sharded data-parallel training (ZeRO-1/2/3, HSDP) with first-class FP8, tensor and context parallelism.

The names here are what a training script needs; the rest is public under its subpackage:
``fsdp8.engine`` (ShardedModel, MemoryReport, Strategy, gradient checks), ``fsdp8.fp8``
(Float8Linear, Float8Tensor, FSDP2 interop), ``fsdp8.checkpoint`` (latest, verify, export),
``fsdp8.distributed`` (meshes, DesyncError), ``fsdp8.parallel`` (tensor and context
parallelism by hand), ``fsdp8.planner`` (search), ``fsdp8.data``.
"""

from . import checkpoint, data, distributed, engine, fp8, parallel, planner
from .checkpoint import load, load_pretrained, save
from .config import ParallelConfig, Precision
from .distributed import init_distributed, make_mesh
from .engine import clip_grad_norm_, fully_shard
from .fp8 import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling, convert_to_fp8,
                  fp8_init)
from .parallel import parallelize
from .planner import plan

__all__ = [
    "parallelize",
    "ParallelConfig",
    "fully_shard",
    "Precision",
    "init_distributed",
    "make_mesh",
    "clip_grad_norm_",
    "Float8CurrentScaling",
    "DelayedScaling",
    "Float8BlockScaling",
    "MXFP8BlockScaling",
    "convert_to_fp8",
    "fp8_init",
    "save",
    "load",
    "load_pretrained",
    "plan",
]
__version__ = "0.1.0"
