"""Parallel dimensions beside data parallelism (tensor, context) and parallelize, the one call that lays
a model out."""

from .cp import context_parallel, loss_divisor, shard_sequence
from .manager import ParallelizedModel, parallelize
from .tp import tensor_parallel

__all__ = ["ParallelizedModel", "context_parallel", "loss_divisor", "parallelize", "shard_sequence", "tensor_parallel"]
