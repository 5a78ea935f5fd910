#!/usr/bin/env bash
# One device call (1 GPU): why block scaling's compiled quantization is slow, and whether
# Inductor's tiled reductions fix it. The isolated pattern (block_quant_compile.py), one
# compiled model-A layer (fp8_layer_profile.py), then model A end to end, each stack in
# its own process, with and without the settings.
#   OUT=$OUT [SETTINGS=triton.tile_reductions=1,triton.prefer_nd_tiling=1] bash benchmarks/debug/gpu_block_quant.sh
set -uo pipefail
source benchmarks/gpu_env.sh >/dev/null 2>&1
record_env
SETTINGS=${SETTINGS:-triton.tile_reductions=1,triton.prefer_nd_tiling=1}
python3 benchmarks/debug/block_quant_compile.py --top ${TOP:-0} 2>&1 | grep -v Warning | tee "$OUT/quant.txt"
A="--hidden 2048 --ffn 8192 --heads 16 --kv-heads 8 --tokens 8192 --top 15"
python3 benchmarks/debug/fp8_layer_profile.py $A --kinds bf16,fsdp8-fp8-current,fsdp8-fp8-block >"$OUT/layer.txt" 2>&1
python3 benchmarks/debug/fp8_layer_profile.py $A --kinds fsdp8-fp8-block --inductor "$SETTINGS" >"$OUT/layer-tiled.txt" 2>&1
grep "^## .*ms" "$OUT/layer.txt" "$OUT/layer-tiled.txt"
MODEL=${MODEL:-A} STEPS=${STEPS:-10} PEERS_ARGS=--skip-packed-check STACKS="${STACKS:-fsdp8-fp8-current-compile fsdp8-fp8-block-compile}" \
  bash benchmarks/gpu_fp8_table.sh
mkdir -p "$OUT/tiled"
OUT="$OUT/tiled" MODEL=${MODEL:-A} STEPS=${STEPS:-10} PEERS_ARGS="--skip-packed-check --inductor $SETTINGS" \
  STACKS="${TILED_STACKS:-fsdp8-fp8-block-compile fsdp8-fp8-current-compile}" bash benchmarks/gpu_fp8_table.sh
