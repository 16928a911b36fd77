#!/usr/bin/env bash
# The PyTorch path on the device, each mode one `run` call (at most 10 minutes), with what
# scripts/device/build.sh made in .devbin/ (the test binaries, `fathom`, the wheel). Outputs
# under $OUT (at most 8 files come back); COMMIT names the commit in every log.
#
#   bash scripts/device/torch_path.sh tests          # select and cache device tests, the Python GPU tests, a short soak
#   SHAPE=qwen3-8b bash scripts/device/torch_path.sh bench   # decode-bench, then bench_hf, one machine
set -u
B=${B:-.devbin}
export FATHOM_REQUIRE_GPU=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
stamp() { echo "# $(date -u +%FT%TZ), $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader), commit ${COMMIT:-?}, FATHOM_REQUIRE_GPU=1"; }
python3 -m pip install --quiet --no-deps --force-reinstall $B/fathom-*.whl $B/gguf-*.whl >/dev/null 2>&1 \
  || echo "torch_path: the wheel did not install" | tee -a $OUT/summary.txt
# The package's Python files from this tree over the wheel's (the extension is the wheel's).
cp crates/fathom-py/python/fathom/*.py "$(python3 -c 'import fathom, os; print(os.path.dirname(fathom.__file__))')"/
case $1 in
tests)
  (timeout 200 $B/soak --seed ${SEED:-3} --seconds ${SOAK_S:-150} --residency all --json $OUT/soak.json \
    > $OUT/soak.log 2>&1; echo "soak seed ${SEED:-3} rc=$?" >> $OUT/summary.txt) &
  log=$OUT/device-tests.log
  stamp > $log
  for t in select_gpu api cache_gpu gpu_graph; do
    echo "## $t" >> $log
    timeout 300 $B/$t --test-threads ${THREADS:-2} 2>&1 | grep -v -E "^(running [0-9]+ tests?|)$" >> $log
    echo "$t rc=${PIPESTATUS[0]}" | tee -a $OUT/summary.txt
  done
  echo "## pytest" >> $log
  FATHOM_RESULTS=$OUT/gen timeout 400 python3 -m pytest -q -rs crates/fathom-py/tests/test_hf_cache_device.py \
    crates/fathom-py/tests/test_gpu_device.py crates/fathom-py/tests/test_ops_cpu.py >> $log 2>&1
  echo "pytest rc=$?" | tee -a $OUT/summary.txt
  python3 - "$OUT/gen" > $OUT/generation.json <<'EOF'
import json, os, sys
d = sys.argv[1]
print(json.dumps([json.load(open(os.path.join(d, f))) for f in sorted(os.listdir(d))] if os.path.isdir(d) else [], indent=1))
EOF
  rm -rf $OUT/gen
  wait
  ;;
bench)
  shape=${SHAPE:-qwen3-8b}
  # The Rust decode step at the same shape, batches and contexts, for the ratio.
  timeout 240 $B/fathom decode-bench --model $shape --context ${DB_CONTEXT:-32k} --batch ${DB_BATCH:-1,4} \
    --methods fathom:48 --steps 8 --json $OUT/decode-bench-$shape.json > $OUT/decode-bench-$shape.txt 2>&1
  echo "decode-bench rc=$?" | tee -a $OUT/summary.txt
  if [ -n "${DB_CONTEXT2:-}" ]; then
    timeout 200 $B/fathom decode-bench --model $shape --context $DB_CONTEXT2 --batch ${DB_BATCH2:-4} \
      --methods fathom:48 --steps 8 --json $OUT/decode-bench2.json >> $OUT/decode-bench-$shape.txt 2>&1
    echo "decode-bench 2 rc=$?" | tee -a $OUT/summary.txt
    python3 - $OUT/decode-bench-$shape.json $OUT/decode-bench2.json <<'EOF'
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
a["entries"] += b["entries"]; a["command"] = a["command"] + " && " + b["command"]
json.dump(a, open(sys.argv[1], "w"), indent=1)
EOF
    rm -f $OUT/decode-bench2.json
  fi
  timeout ${BENCH_S:-360} python3 -m fathom.bench_hf --shape $shape --grid ${GRID:-32k:1,4,8/128k:1,4} \
    ${CACHES:+--caches $CACHES} --decode-bench $OUT/decode-bench-$shape.json --out $OUT > $OUT/bench-hf-$shape.txt 2>&1
  echo "bench_hf rc=$?" | tee -a $OUT/summary.txt
  ;;
esac
