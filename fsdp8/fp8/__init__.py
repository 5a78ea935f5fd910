"""FP8 as a precision: formats, quantization kernels, recipes, the FP8 GEMM, Float8Linear and conversion."""

from .convert import convert_to_fp8, fp8_init
from .fsdp2 import precompute_fp8_scales, prepare_fp8_modules_for_fsdp, use_fp8_all_gather
from .grouped import fp8_grouped_mm
from .linear import Float8Linear
from .recipes import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling
from .tensor import Float8Tensor
from .tp import Float8ColwiseParallel

__all__ = ["DelayedScaling", "Float8BlockScaling", "Float8ColwiseParallel", "Float8CurrentScaling", "Float8Linear",
           "Float8Tensor", "MXFP8BlockScaling", "convert_to_fp8", "fp8_grouped_mm", "fp8_init", "precompute_fp8_scales",
           "prepare_fp8_modules_for_fsdp", "use_fp8_all_gather"]
