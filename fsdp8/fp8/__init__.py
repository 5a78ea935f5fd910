"""FP8 as a precision: formats, quantization kernels, recipes, the FP8 GEMM, Float8Linear and conversion."""
