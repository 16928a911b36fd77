#!/usr/bin/env bash
# Device session 2026-11-30 (evening): the offload step on REAL captured keys, values and
# queries: SmolLM2-135M's shape (30 layers, Hkv 3, G 3, D 64) from the 2k-token prose eval
# capture of `cargo xtask repro --quick` (16 query positions), tiled to 32k/256k/1M.
set -u
ALL=fathom:48,fathom:64,sparq:16,sparq:32,ds:32,loki:32,thumb2,landmark,quest,exact
CAP=.cache/captures/smollm2-135m-eval-2k.safetensors
timeout 280 .devbin/fathom offload-bench --capture $CAP --context 32k,256k,1m --methods $ALL --steps 20 --instrumented-steps 3 --json $OUT/offload-smollm2-real-host.json > $OUT/offload-smollm2-real-host.txt 2>&1
echo "host rc=$?"
timeout 200 .devbin/fathom offload-bench --capture $CAP --context 32k,256k,1m --residency hbm --methods $ALL --steps 20 --instrumented-steps 3 --probe-mib 1024 --json $OUT/offload-smollm2-real-hbm.json > $OUT/offload-smollm2-real-hbm.txt 2>&1
echo "hbm rc=$?"
grep -E "^(context|[0-9])" $OUT/offload-smollm2-real-host.txt | grep -E "context|fathom:48|sparq:32"
