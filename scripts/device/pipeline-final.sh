#!/usr/bin/env bash
# Device session 2026-11-30 (evening), second call: correctness tests with the warp-aggregated
# top-k collect, the pipelining sweep (head groups × gather grid cap) at 256k and 1M, then the
# full host-residency benchmark with the setting that was fastest for fathom:48 at 1M in the
# sweep (one setting for every method and context).
set -u
B=.devbin
ALL=fathom:48,fathom:64,sparq:16,sparq:32,ds:32,loki:32,thumb2,landmark,quest,exact
timeout 120 $B/gpu_tests --test-threads 1 > $OUT/gpu-tests.log 2>&1; echo "gpu_tests rc=$?" | tee -a $OUT/summary.txt
timeout 200 $B/fathom offload-bench --shape qwen3-8b --context 256k,1m --methods fathom:48,sparq:32 --groups 1,2,4 --gather-ctas 0,64,96,128,192 --steps 8 --instrumented-steps 1 --probe-mib 1024 --json $OUT/pipeline-sweep.json > $OUT/pipeline-sweep.txt 2>&1
echo "sweep rc=$?" | tee -a $OUT/summary.txt
read G C < <(python3 -c "
import json
d=json.load(open('$OUT/pipeline-sweep.json'))
r=min((x for x in d['results'] if x['context']==1048576 and x['method']=='fathom:48'), key=lambda x: x['gpu_ms'])
print(r['groups'], r['gather_ctas'])")
echo "picked groups=$G gather_ctas=$C" | tee -a $OUT/summary.txt
timeout 300 $B/fathom offload-bench --shape qwen3-8b --context 32k,256k,1m --methods $ALL --groups $G --gather-ctas $C --steps 20 --instrumented-steps 3 --json $OUT/offload-qwen3-8b-host.json > $OUT/offload-host.txt 2>&1
echo "host rc=$?" | tee -a $OUT/summary.txt
