#!/usr/bin/env bash
# One device call (2x H200, ~6 min): fsdp8 FP8 against torch FSDP2 + torchao float8 on model B.
#   (a) environment; the FP8 kernel tests (Triton vs the torch reference, bit for bit)
#   (b) one compiled decoder layer per FP8 stack on GPU 0: time, what autograd saves, kernels
#   (c) peers.py at 2 GPUs (NPROC=1: one GPU, no communication): bf16 baselines, then the FP8 stacks, then the two compiled FP8
#       stacks again in the reverse order (run-to-run spread is part of the answer)
#   (d) the FP8 engine's distributed tests over NCCL, with what time is left
#   OUT=$OUT bash benchmarks/gpu_fp8_compare.sh        (.whl with torchao carried)
#   PEERS_ARGS adds peers.py flags, e.g. NPROC=1 PEERS_ARGS="--loopback-world 2 --profile $OUT/prof": the
#   2-GPU step minus communication on one GPU (benchmarks/loopback.py)
set -uo pipefail
source benchmarks/gpu_env.sh
BUDGET=${BUDGET:-560}; T0=$SECONDS
left() { echo $(( BUDGET - (SECONDS - T0) )); }
record_env

# (a)
if [ "${SKIP_KERNEL_TESTS:-0}" != 1 ]; then
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fp8_gpu.py >"$OUT/kernels.log" 2>&1
  echo "(kernel tests exit $?)"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/kernels.log" | tail -n 6 | cut -c1-200
fi
# (b)
if [ "${SKIP_LAYER:-0}" != 1 ]; then
  CUDA_VISIBLE_DEVICES=0 timeout 150 python3 benchmarks/debug/fp8_layer_profile.py --top 0 >"$OUT/layer.log" 2>&1
  echo "(layer profile exit $?)"; grep -E "^## |^  [0-9]+ x" "$OUT/layer.log" | cut -c1-160
fi
# (c)
ORDER=${ORDER:-fsdp8,fsdp2,fsdp8-compile,fsdp8-fp8-current-compile,torchao-compile,fsdp8-fp8-block-compile,torchao-compile,fsdp8-fp8-current-compile}
t=$(( $(left) - ${KEEP:-120} )); (( t > 330 )) && t=330
timeout -k 20 "$t" torchrun --nproc_per_node "${NPROC:-2}" benchmarks/peers.py --models B --warmup 2 --steps 8 --stacks "$ORDER" \
  ${PEERS_ARGS:-} --out "$OUT/peers.json" >"$OUT/peers.log" 2>&1
echo "(peers exit $?)"
grep -E "^\| (B|model)|^\|---" "$OUT/peers.log" | cut -c1-240
grep -E "failed:" "$OUT/peers.log" | head -n 3 | cut -c1-200
# (d)
t=$(( $(left) - 10 ))
if (( t > 40 )) && [ "${SKIP_DIST:-0}" != 1 ]; then
  FSDP8_TEST_BACKEND=nccl timeout -s INT "$t" python3 -m pytest -q -p no:cacheprovider tests/dist/test_fp8_engine.py \
    >"$OUT/dist.log" 2>&1
  echo "(dist tests exit $?)"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/dist.log" | tail -n 8 | cut -c1-200
fi
echo "end at $(( SECONDS - T0 )) s"
