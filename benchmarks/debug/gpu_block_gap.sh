#!/usr/bin/env bash
# One device call (1 GPU): where block scaling's compiled step loses to current scaling's
# (model A, one profiled step each, GEMMs and quantization kernels apart), the linears alone
# (fp8_gemm.py), the isolated quantization pattern, and MXFP8's peak on model B beside
# current scaling and torchao float8, each stack in its own process.
#   OUT=$OUT bash benchmarks/debug/gpu_block_gap.sh   (carry .whl for torchao)
set -uo pipefail
source benchmarks/gpu_env.sh >/dev/null 2>&1
record_env
python3 benchmarks/debug/block_quant_compile.py --top ${TOP:-8} 2>&1 | grep -v Warning >"$OUT/quant.txt"
grep "^|" "$OUT/quant.txt"
python3 benchmarks/fp8_gemm.py --hidden 2048 --ffn 8192 --kv-dim 1024 --tokens 8192 --recipes fp8-current,fp8-block \
  --compile-only >"$OUT/gemm.txt" 2>&1; grep "^|" "$OUT/gemm.txt"
MODEL=A STEPS=10 PEERS_ARGS="--skip-packed-check --profile $OUT/prof" \
  STACKS="fsdp8-fp8-current-compile fsdp8-fp8-block-compile" bash benchmarks/gpu_fp8_table.sh
rm -f "$OUT"/prof/*.json.gz
MODEL=B STEPS=10 PEERS_ARGS=--skip-packed-check \
  STACKS="${B_STACKS:-fsdp8-fp8-mxfp8-compile fsdp8-fp8-current-compile torchao-compile}" bash benchmarks/gpu_fp8_table.sh
