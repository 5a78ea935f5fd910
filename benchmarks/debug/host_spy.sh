#!/usr/bin/env bash
# Where the host's time goes in a host-bound compiled FP8 step (issue 17, model A): py-spy
# samples every thread of one peers.py process (bf16 + compile, then FP8 current + compile),
# raw collapsed stacks into $OUT (carry .whl2 with the py-spy wheel).
#   OUT=$OUT [STACKS="..."] [PEERS_ARGS=...] bash benchmarks/debug/host_spy.sh
# PEERS_ARGS defaults to --skip-packed-check, as the tables run (transformers' packed-sequence
# check otherwise synchronizes with the device at every forward).
set -uo pipefail
WHEELS=".whl2/*.whl" source benchmarks/gpu_env.sh >/dev/null 2>&1
export PATH=/tmp/site/bin:$PATH RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29533
for stack in ${STACKS:-fsdp8-compile fsdp8-fp8-current-compile}; do
  timeout -k 10 200 py-spy record -r 400 --nonblocking -f raw -o "$OUT/$stack.stacks" -- \
    python3 benchmarks/peers.py --models A --warmup 3 --steps 25 --stacks "$stack" ${PEERS_ARGS---skip-packed-check} --out "$OUT/$stack.json" \
    >"$OUT/$stack.log" 2>&1
  echo "($stack exit $?)"; grep -E "^\| A " "$OUT/$stack.log" | cut -c1-120
done
cd "$OUT" && gzip -f *.stacks && tar czf spy.tgz --remove-files *.stacks.gz *.json *.log
