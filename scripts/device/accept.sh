#!/usr/bin/env bash
# The acceptance runs of the cache pipeline on the device, each one `run` call (at most 10
# minutes), with the binaries scripts/device/build.sh made in .devbin/ (and, for `ab`, the
# pre-change tree's `fathom` in .devbase/). Outputs under $OUT (at most 8 files come back, so
# each call writes few). COMMIT names the commit in every log.
#
#   bash scripts/device/accept.sh checks   # the seeded soak beside the device tests and the sanitizers
#   bash scripts/device/accept.sh ab       # offload-bench, the pre-change tree then this one, one machine
#   bash scripts/device/accept.sh decode   # decode-bench at 4 x 128k, both trees, one machine
#   bash scripts/device/accept.sh models   # fathom-gpu's model tests, the Python GPU tests, a second soak
set -u
B=${B:-.devbin}
BASE=${BASE:-.devbase}
export FATHOM_REQUIRE_GPU=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
stamp() { echo "# $(date -u +%FT%TZ), $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader), commit ${COMMIT:-?}, FATHOM_REQUIRE_GPU=1"; }
case $1 in
checks)
  # The soak (correctness only, so it may share the GPU) runs beside everything else.
  (timeout 595 $B/soak --seed ${SEED:-1} --seconds ${SOAK_S:-560} --residency all --json $OUT/soak-seed${SEED:-1}.json \
    > $OUT/soak-seed${SEED:-1}.log 2>&1; echo "soak seed ${SEED:-1} rc=$?" >> $OUT/summary.txt) &
  log=$OUT/device-tests.log
  stamp > $log
  for t in unit api cache_gpu gpu_unit gpu_graph; do
    echo "## $t" >> $log
    timeout 420 $B/$t --test-threads ${THREADS:-2} 2>&1 | grep -v -E "^(running [0-9]+ tests?|)$" >> $log
    echo "$t rc=${PIPESTATUS[0]}" | tee -a $OUT/summary.txt
  done
  for e in "paged_decode" "graph_step 4096"; do
    echo "## example $e" >> $log
    timeout 180 $B/$e >> $log 2>&1; echo "example $e rc=$?" | tee -a $OUT/summary.txt
  done
  # compute-sanitizer on one append and two attends of every method (both select paths), in
  # each residency: the four tools, one residency at a time, the tools side by side.
  slog=$OUT/sanitize.log
  stamp > $slog
  for res in host index-hbm hbm; do
    for tool in memcheck racecheck initcheck synccheck; do
      timeout 300 compute-sanitizer --tool $tool --error-exitcode 9 $B/every_method $res > $OUT/san-$tool-$res.tmp 2>&1 &
    done
    wait $(jobs -p | tail -4)
    for tool in memcheck racecheck initcheck synccheck; do
      echo "## $tool $res" >> $slog; cat $OUT/san-$tool-$res.tmp >> $slog
      echo "sanitize $tool $res: $(grep -h 'SUMMARY' $OUT/san-$tool-$res.tmp | tail -1)" | tee -a $OUT/summary.txt
      rm -f $OUT/san-$tool-$res.tmp
    done
  done
  wait
  ;;
ab)
  # offload-bench at 256k and 1M, host and HBM, fathom:48 against sparq:32 and ds:32, plain
  # and as a replayed graph, in 3 rounds: the pre-change tree's `fathom`, then this tree's.
  for res in ${RESIDENCIES:-host hbm}; do
    for side in base:$BASE change:$B; do
      tag=${side%%:*} dir=${side#*:}
      timeout 290 $dir/fathom offload-bench --engine cache --context 256k,1m --methods fathom:48,sparq:32,ds:32 \
        --residency $res --graph --rounds 3 --json $OUT/ab-$res-$tag.json > $OUT/ab-$res-$tag.txt 2>&1
      echo "ab $res $tag rc=$?" | tee -a $OUT/summary.txt
    done
  done
  ;;
decode)
  # decode-bench at 4 x 128k (random weights at the Qwen3-8B shape), both trees.
  for side in base:$BASE change:$B; do
    tag=${side%%:*} dir=${side#*:}
    timeout 280 $dir/fathom decode-bench --model qwen3-8b --context 128k --batch 4 --steps 8 --row-cache 8192 \
      --methods dense,fathom:48,sparq:32,ds:32 --json $OUT/decode-$tag.json > $OUT/decode-$tag.txt 2>&1
    echo "decode $tag rc=$?" | tee -a $OUT/summary.txt
  done
  ;;
models)
  # After scripts/device/stage_model.sh joined smollm2-135m (and gemma3-270m) in this warm
  # machine: fathom-gpu's model tests, the Python package's GPU tests, and a second soak.
  (timeout 400 $B/soak --seed 2 --seconds ${SOAK_S:-300} --residency all --json $OUT/soak-seed2.json \
    > $OUT/soak-seed2.log 2>&1; echo "soak seed 2 rc=$?" >> $OUT/summary.txt) &
  log=$OUT/device-tests-models.log
  stamp > $log
  echo "## gpu_forward" >> $log
  timeout 300 $B/gpu_forward --test-threads 1 2>&1 | grep -v -E "^(running [0-9]+ tests?|)$" >> $log
  echo "gpu_forward rc=${PIPESTATUS[0]}" | tee -a $OUT/summary.txt
  if ls $B/fathom-*.whl >/dev/null 2>&1; then
    python3 -m pip install --quiet --no-deps --force-reinstall $B/fathom-*.whl $B/gguf-*.whl >> $log 2>&1
    echo "## pytest crates/fathom-py/tests" >> $log
    FATHOM_REQUIRE_TORCH=1 timeout 240 python3 -m pytest -q -rs crates/fathom-py/tests >> $log 2>&1
    echo "pytest rc=$?" | tee -a $OUT/summary.txt
  fi
  wait
  ;;
esac
