#!/usr/bin/env bash
# One device call (1 GPU): every FP8 recipe, eager and compiled, against bf16 and torchao
# float8, each stack in its own process (peak memory is the stack's own), same call.
#   OUT=$OUT MODEL=B [LOOPBACK=2] [STEPS=6] [STACKS="..."] [PEERS_ARGS=--skip-packed-check] bash benchmarks/gpu_fp8_table.sh
#   (carry .whl with the torchao wheel for the torchao rows)
set -uo pipefail
source benchmarks/gpu_env.sh >/dev/null 2>&1
MODEL=${MODEL:-B}
LOOP=${LOOPBACK:+--loopback-world $LOOPBACK}
STACKS=${STACKS:-fsdp8 fsdp8-compile fsdp8-fp8-current fsdp8-fp8-current-compile fsdp8-fp8-delayed fsdp8-fp8-delayed-compile fsdp8-fp8-block fsdp8-fp8-block-compile fsdp8-fp8-mxfp8 fsdp8-fp8-mxfp8-compile torchao torchao-compile}
tag="$MODEL${LOOPBACK:+-loop$LOOPBACK}"
for stack in $STACKS; do
  timeout -k 20 ${STACK_TIMEOUT:-120} torchrun --nproc_per_node 1 benchmarks/peers.py --models "$MODEL" $LOOP --warmup 2 \
    --steps ${STEPS:-6} --stacks "$stack" ${PEERS_ARGS:-} --out "$OUT/$tag-$stack.json" >"$OUT/$tag-$stack.log" 2>&1
  rc=$?; row=$(grep -E "^\| $MODEL " "$OUT/$tag-$stack.log" | cut -c1-160)
  echo "${row:-| $MODEL | $stack | failed (exit $rc): $(grep -E "Error|error" "$OUT/$tag-$stack.log" | tail -n 1 | cut -c1-120) |}"
done
