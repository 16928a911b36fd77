#!/usr/bin/env bash
# The last device call of 2026-12-02: the split residency (index in HBM, records on the host):
# its device tests, decode-bench at 4 x 128k against dense with the whole cache in HBM, and the
# Python device tests. Run on the device with .devbin/ carried (scripts/device/build.sh).
export COMMIT=737b053
L=$OUT/device-tests.log
echo "# FATHOM_REQUIRE_GPU=1 $(date) commit $COMMIT" > $L
timeout 80 .devbin/cache_gpu --test-threads 1 forks_diverge head_groups ragged_prefill read_rows_returns 2>&1 | grep -E "^test |test result|panicked" >> $L
echo "cache_gpu split rc=${PIPESTATUS[0]}" | tee -a $OUT/summary.txt
timeout 90 .devbin/cache_gpu --test-threads 1 attend_matches 2>&1 | grep -E "^test |test result|panicked" >> $L
echo "cache_gpu attend rc=${PIPESTATUS[0]}" | tee -a $OUT/summary.txt
DECODE_TIMEOUT=100 bash scripts/device/engine.sh decode decode-bench-qwen3-8b-4x128k-index-hbm --model qwen3-8b --context 128k --batch 4 --steps 8 --residency index-hbm --methods fathom:48,fathom:92,sparq:32,ds:32
DECODE_TIMEOUT=30 bash scripts/device/engine.sh decode decode-bench-qwen3-8b-4x128k-hbm-dense --model qwen3-8b --context 128k --batch 4 --steps 8 --residency hbm --methods dense,fathom:48
timeout 70 bash scripts/device/engine.sh py
cd $OUT; for f in decode-bench-*.txt generate-example.txt; do echo "## $f"; cat $f; done > decode-bench.log; rm -f decode-bench-*.txt *.png generate-example.txt; ls; cat summary.txt
