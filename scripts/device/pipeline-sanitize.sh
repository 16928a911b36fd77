#!/usr/bin/env bash
# Device session 2026-11-30 (evening): correctness tests, compute-sanitizer racecheck and
# initcheck on one step of every method, the head-group pipelining × gather-grid sweep at 1M,
# and an ncu profile of one layer's kernels at 1M. Binaries built here:
#   cargo build --release -p fathom-cli --features cuda (the `fathom` binary, stripped)
#   cargo test -p fathom-cuda --features cuda --release --no-run
# and copied (stripped) to .devbin/. Run on the device with `bash scripts/device/pipeline-sanitize.sh`.
set -u
B=.devbin
ALL=fathom:48,fathom:64,sparq:16,sparq:32,ds:32,loki:32,thumb2,landmark,quest,exact
SMALL="--shape 2,2,4,128 --context 8k --source-layers 2 --source-tokens 2048 --steps 1 --instrumented-steps 1 --probe-mib 64 --methods $ALL"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > $OUT/nvidia-smi.txt 2>&1
timeout 120 $B/gpu_tests --test-threads 1 > $OUT/gpu-tests.log 2>&1; echo "gpu_tests rc=$?" >> $OUT/summary.txt
for tool in racecheck initcheck; do
  for g in 1 2; do
    timeout 150 compute-sanitizer --tool $tool $B/fathom offload-bench $SMALL --groups $g --gather-ctas 8 > $OUT/$tool-groups$g.log 2>&1
    echo "$tool groups=$g rc=$? $(grep -h 'ERROR SUMMARY' $OUT/$tool-groups$g.log | tail -1)" >> $OUT/summary.txt
  done
done
timeout 240 $B/fathom offload-bench --shape qwen3-8b --context 1m --methods fathom:48,sparq:32 --groups 1,2,4,8 --gather-ctas 0,16,32,64 --steps 8 --instrumented-steps 1 --probe-mib 1024 --json $OUT/pipeline-1m.json > $OUT/pipeline-1m.txt 2>&1
echo "pipeline rc=$?" >> $OUT/summary.txt
timeout 150 ncu --clock-control none -k regex:'scan_planes|topk_|rows_|attn_|gather_runs|fathom_plan' --launch-skip 0 --launch-count 16 --section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats $B/fathom offload-bench --shape 1,8,4,128 --context 1m --source-layers 1 --methods fathom:48 --steps 1 --instrumented-steps 0 --probe-mib 64 > $OUT/ncu-1m.txt 2>&1
echo "ncu rc=$?" >> $OUT/summary.txt
cat $OUT/summary.txt
