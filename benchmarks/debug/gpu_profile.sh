#!/usr/bin/env bash
# One device call (2x H200): the compiled stacks on model B (MODEL=A for A) with one extra profiled step each
# (fsdp8/app/bench/step_profile.py): where the step's GPU time goes (compute, exposed communication,
# idle) and the costliest kernels. Results in $OUT; the tables go to stdout.
#   OUT=$OUT bash benchmarks/debug/gpu_profile.sh          (.whl with torchao carried)
set -uo pipefail
source benchmarks/gpu_env.sh
STACKS=${STACKS:-fsdp8-compile,fsdp8-fp8-current-compile,torchao-compile}
if [ -n "${PRE_TESTS:-}" ]; then  # e.g. the GPU kernel tests a change needs, before the benchmark
  timeout 240 python3 -m pytest -q -p no:cacheprovider $PRE_TESTS >"$OUT/pre_tests.log" 2>&1
  echo "(pre-tests exit $?)"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pre_tests.log" | tail -n 8 | cut -c1-200
fi
timeout -k 20 "${CAP:-420}" torchrun --nproc_per_node "${NPROC:-2}" benchmarks/peers.py --models "${MODEL:-B}" --warmup 2 --steps 6 \
  --stacks "$STACKS" --profile "$OUT/prof" --out "$OUT/peers.json" ${PEERS_ARGS:-} >"$OUT/peers.log" 2>&1
echo "(peers exit $?)"
grep -E "^\| ${MODEL:-B} |^#### |^window|^by category|failed" "$OUT/peers.log" | cut -c1-300
for f in "$OUT"/prof/*rank0.md; do echo; head -n ${PROFILE_LINES:-30} "$f" | cut -c1-200; done
if [ -n "${POST_TESTS:-}" ]; then  # e.g. distributed tests over NCCL, with what time is left
  FSDP8_TEST_BACKEND=nccl timeout "${POST_CAP:-200}" python3 -m pytest -q -p no:cacheprovider $POST_TESTS \
    >"$OUT/post_tests.log" 2>&1
  echo "(post-tests exit $?)"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/post_tests.log" | tail -n 8 | cut -c1-200
fi
