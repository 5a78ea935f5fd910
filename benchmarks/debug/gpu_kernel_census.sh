#!/usr/bin/env bash
# One device call (1 GPU): which kernels a compiled step launches, stack by stack, and the code
# Inductor generated for them. Each stack in its own process, one extra profiled step, every
# kernel listed (name, ms, count); Inductor's output code (TORCH_LOGS=output_code) kept gzipped.
#   MODEL=A STACKS="fsdp8-compile fsdp8-fp8-current-compile" bash benchmarks/debug/gpu_kernel_census.sh
set -uo pipefail
source benchmarks/gpu_env.sh
record_env
for stack in ${STACKS:-fsdp8-compile fsdp8-fp8-current-compile}; do
  TORCH_LOGS=output_code timeout -k 20 "${CAP:-240}" torchrun --nproc_per_node 1 benchmarks/peers.py \
    --models "${MODEL:-A}" --warmup 2 --steps "${STEPS:-4}" --stacks "$stack" --skip-packed-check \
    --profile "$OUT/prof_$stack" --profile-top 400 --out "$OUT/peers_$stack.json" ${PEERS_ARGS:-} \
    >"$OUT/peers_$stack.log" 2>"$OUT/code_$stack.log"
  echo "($stack exit $?)"
  grep -E "^\| ${MODEL:-A} " "$OUT/peers_$stack.log" | cut -c1-200
  rm -f "$OUT"/prof_$stack/*.json*
  mv "$OUT"/prof_$stack/*rank0.md "$OUT/kernels_$stack.md" 2>/dev/null; rm -rf "$OUT/prof_$stack"
  head -n 4 "$OUT/kernels_$stack.md" | cut -c1-300
  gzip -f "$OUT/code_$stack.log"; rm -f "$OUT/peers_$stack.json"
done
