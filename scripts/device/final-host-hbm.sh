#!/usr/bin/env bash
# Device session 2026-11-30 (evening), third call: tests, memcheck of the grid-stride gather and
# warp-aggregated collect (sequential and pipelined), then the committed host and HBM runs with
# the auto pipelining rule (4 head groups + 64-CTA gather from 512k tokens on, else sequential).
set -u
B=.devbin
ALL=fathom:48,fathom:64,sparq:16,sparq:32,ds:32,loki:32,thumb2,landmark,quest,exact
SMALL="--shape 2,2,4,128 --context 8k --source-layers 2 --source-tokens 2048 --steps 1 --instrumented-steps 1 --probe-mib 64 --methods $ALL"
timeout 120 $B/gpu_tests --test-threads 1 > $OUT/gpu-tests.log 2>&1; echo "gpu_tests rc=$?" | tee -a $OUT/summary.txt
for g in 1 2; do
  timeout 120 compute-sanitizer --tool memcheck $B/fathom offload-bench $SMALL --groups $g --gather-ctas 8 > $OUT/memcheck-groups$g.log 2>&1
  echo "memcheck groups=$g rc=$? $(grep -h 'ERROR SUMMARY' $OUT/memcheck-groups$g.log | tail -1)" | tee -a $OUT/summary.txt
done
timeout 260 $B/fathom offload-bench --shape qwen3-8b --context 32k,256k,1m --methods $ALL --steps 20 --instrumented-steps 3 --json $OUT/offload-qwen3-8b-host.json > $OUT/offload-host.txt 2>&1
echo "host rc=$?" | tee -a $OUT/summary.txt
timeout 200 $B/fathom offload-bench --shape qwen3-8b --context 32k,256k,1m --residency hbm --methods $ALL --steps 20 --instrumented-steps 3 --probe-mib 1024 --json $OUT/offload-qwen3-8b-hbm.json > $OUT/offload-hbm.txt 2>&1
echo "hbm rc=$?" | tee -a $OUT/summary.txt
