#!/usr/bin/env bash
# Device calls of the engine. Binaries built here by scripts/device/build.sh, i.e.
#   CARGO_TARGET_DIR=/tmp/tgt-cuda RUSTFLAGS="-C target-cpu=x86-64-v3" \
#     cargo test -p fathom-cuda --features cuda --release --no-run
#   ... cargo build --release -p fathom-cuda --features cuda --example paged_decode ...
#   ... cargo build --release -p fathom-cli --features cuda
# and copied, stripped, to .devbin/ (unit, api, cache_gpu, paged_decode, cache_bench,
# graph_step, fathom; for `py`, the fathom-py wheel). Usage on the device:
#   bash scripts/device/engine.sh tests|bench|ab|gather|decode|graph|ncu|ncuscan|ncudecode|sharesweep|stages|sanitize|filtered|pages|py ...
# Every output goes under $OUT. B=DIR takes the binaries from DIR instead of .devbin/ (`ab`
# compares $B with CHANGE=DIR, default .devbin2/).
set -u
B=${B:-.devbin}
export FATHOM_REQUIRE_GPU=1
mode=$1; shift
case $mode in
tests)
  log=$OUT/engine-tests.log
  echo "# FATHOM_REQUIRE_GPU=1, $(date), $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader); commit ${COMMIT:-?}" > $log
  for t in ${TESTS:-unit api cache_gpu}; do
    echo "## $t" >> $log
    # The harness's whole output (test lines, and a failure's message under `failures:`);
    # THREADS=N runs N tests at once (they share the GPU; outputs, not timings, are compared).
    timeout 420 $B/$t --test-threads ${THREADS:-1} 2>&1 | grep -v -E "^(running [0-9]+ tests?|)$" >> $log
    echo "$t rc=${PIPESTATUS[0]}" | tee -a $OUT/summary.txt
  done
  echo "## example paged_decode" >> $log
  timeout 120 $B/paged_decode >> $log 2>&1; echo "paged_decode rc=$?" | tee -a $OUT/summary.txt
  ;;
bench)
  # bench CONTEXTS METHODS STEPS NAME [extra offload-bench args]
  ctx=$1 methods=$2 steps=$3 name=$4; shift 4
  timeout 400 $B/fathom offload-bench --engine cache --context $ctx --methods $methods --steps $steps "$@" \
    --json $OUT/$name.json > $OUT/$name.txt 2>&1
  echo "$name rc=$?" | tee -a $OUT/summary.txt
  grep -E "fathom:48|sparq:32|ds:32" $OUT/$name.txt | head -20
  ;;
ab)
  # ab NAME CONTEXTS METHODS STEPS [extra offload-bench args]: the same offload-bench run with
  # the binaries of two trees, the baseline's in $B (.devbin/) and the change's in $CHANGE
  # (.devbin2/), back to back on one machine (NAME-base.*, NAME-change.*).
  name=$1 ctx=$2 methods=$3 steps=$4; shift 4
  for side in base:$B change:${CHANGE:-.devbin2}; do
    tag=${side%%:*} dir=${side#*:}
    timeout 280 $dir/fathom offload-bench --engine cache --context $ctx --methods $methods --steps $steps "$@" \
      --json $OUT/$name-$tag.json > $OUT/$name-$tag.txt 2>&1
    echo "$name-$tag rc=$?" | tee -a $OUT/summary.txt
    grep -E "^[0-9]+ +(host|hbm)" $OUT/$name-$tag.txt | head -20
  done
  ;;
gather)
  # The host gather (CacheOptions::host_gather_threads, docs/SPEC.md §6.1): its device test (every
  # setting bit-identical to the GPU's own fetch), a captured 36-layer step with it on (graph
  # against plain launches), then offload-bench timing the GPU's fetch against the gather in
  # interleaved rounds. `gather THREADS [extra offload-bench args]`.
  threads=${1:-14}; shift || true
  # SKIP_TEST=1 skips the device test (when `tests` ran it in the same session); SHARE=P
  # runs the captured step with the gather bringing P % of the misses (--host-share in "$@").
  if [ -z "${SKIP_TEST:-}" ]; then
    timeout 240 $B/cache_gpu --test-threads 1 the_host_gather head_groups_and_scan 2>&1 | tee $OUT/gather-test.log | tail -4
    echo "gather test rc=${PIPESTATUS[0]}" | tee -a $OUT/summary.txt
  fi
  timeout 120 $B/graph_step ${GRAPH_CTX:-32768} $OUT/graph-step-gather.json $threads ${SHARE:-100} > $OUT/graph-step-gather.txt 2>&1
  echo "graph_step gather rc=$?" | tee -a $OUT/summary.txt; tail -2 $OUT/graph-step-gather.txt
  timeout ${BENCH_TIMEOUT:-330} $B/fathom offload-bench --engine cache --context ${CTX:-256k,1m} \
    --methods ${METHODS:-fathom:48,sparq:32,ds:32} --steps 10 --residency host --host-gather ${GATHERS:-0,$threads} \
    --rounds ${ROUNDS:-3} "$@" --json $OUT/offload-gather-host.json > $OUT/offload-gather-host.txt 2>&1
  echo "offload gather rc=$?" | tee -a $OUT/summary.txt
  grep -E "^ *[0-9]+ +host +fathom:48" $OUT/offload-gather-host.txt | head -20
  ;;
filtered)
  # The filtered select (docs/SPEC.md §5), first device runs: its device test, then
  # the score path, the filtered select (failed rows rescan) and the filtered select with
  # scores kept, in one run per residency (256k and 1M, the methods the targets name). The
  # JSON's `select`, `filtered_share` and `fallback_rate` say which path each entry timed.
  timeout 200 $B/cache_gpu --test-threads 1 the_filtered_select 2>&1 | tee $OUT/filtered-test.log | tail -3
  echo "filtered test rc=${PIPESTATUS[0]}" | tee -a $OUT/summary.txt
  for res in host hbm; do
    timeout 280 $B/fathom offload-bench --engine cache --context 256k,1m --methods fathom:48,fathom:64,sparq:32,ds:32 \
      --steps 10 --residency $res --select scores,8192,8192+scores --probe-mib 2048 \
      --json $OUT/offload-qwen3-8b-filtered-$res.json > $OUT/offload-qwen3-8b-filtered-$res.txt 2>&1
    echo "filtered $res rc=$?" | tee -a $OUT/summary.txt
    grep -E "^[0-9]" $OUT/offload-qwen3-8b-filtered-$res.txt | head -20
  done
  ;;
groups)
  # Head groups per attend and 16-byte scan loads (CacheOptions::attend_groups, scan_vector_words):
  # the device tests that decide correctness (every setting
  # bit-identical to one group of 8-byte loads; 2^20 tokens against the CPU reference), then
  # one run per residency timing 1, 2, 4 and 8 groups × 8- and 16-byte loads over fathom:48
  # and the two 136-bit scans, at 256k and 1M. `groups [RESIDENCY...]` (default host hbm);
  # the tests run with the first; GROUPS=1,2 narrows the group counts.
  [ $# -eq 0 ] && set -- host hbm
  if [ "$1" = host ] || [ $# -eq 2 ]; then
    timeout 240 $B/cache_gpu --test-threads 1 head_groups_and_scan_loads a_million 2>&1 | tee $OUT/groups-tests.log | tail -4
    echo "groups tests rc=${PIPESTATUS[0]}" | tee -a $OUT/summary.txt
  fi
  for res in "$@"; do
    timeout 280 $B/fathom offload-bench --engine cache --context 256k,1m --methods fathom:48,sparq:32,ds:32 \
      --steps 10 --residency $res --groups ${GROUPS:-1,2,4,8} --scan-vec 1,2 --probe-mib 2048 \
      --json $OUT/offload-qwen3-8b-groups-$res.json > $OUT/offload-qwen3-8b-groups-$res.txt 2>&1
    echo "groups $res rc=$?" | tee -a $OUT/summary.txt
    grep -E "^[0-9]" $OUT/offload-qwen3-8b-groups-$res.txt | head -30
  done
  ;;
decode)
  # decode NAME ARGS...: one `fathom decode-bench` run with the given arguments,
  # JSON, text and plot under $OUT/NAME.*.
  name=$1; shift
  /usr/bin/time -f "wall %e s" timeout ${DECODE_TIMEOUT:-280} $B/fathom decode-bench "$@" \
    --json $OUT/$name.json --plot $OUT/$name.png > $OUT/$name.txt 2>&1
  echo "$name rc=$? $(tail -1 $OUT/$name.txt)" | tee -a $OUT/summary.txt
  grep -E "^B=|capacity|Error|error" $OUT/$name.txt | head -30
  ;;
graph)
  # The whole decode step as one CUDA graph: its device test (replays sample
  # what plain launches sample, host and split residency), then decode-bench with and without
  # the graph at 8 x 64k (the target's B = 8): the host overhead per step is the difference of
  # the step times of the two entries of each method.
  LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} timeout 200 $B/gpu_graph --test-threads 1 --nocapture > $OUT/gpu-graph-test.log 2>&1
  echo "gpu_graph rc=$? $(grep 'test result' $OUT/gpu-graph-test.log)" | tee -a $OUT/summary.txt
  DECODE_TIMEOUT=250 bash $0 decode decode-bench-qwen3-8b-8x64k-graph --model qwen3-8b --context 64k --batch 8 --steps 16 \
    --row-cache 8192 --graph --methods fathom:48,sparq:32
  ;;
rowsweep)
  # rowsweep SLOTS...: the row cache's size, one offload-bench run per setting,
  # fathom:48 at 256k and 1M, host residency; hit rate and step per setting (8192, the
  # default, is in the `filtered` runs). Text output goes to one log (8 files come back).
  for rows in "$@"; do
    echo "## --cache-rows $rows" >> $OUT/rowsweep.log
    timeout 200 $B/fathom offload-bench --engine cache --context 256k,1m --methods fathom:48 \
      --steps 10 --residency host --cache-rows $rows --probe-mib 256 \
      --json $OUT/offload-qwen3-8b-rows$rows.json >> $OUT/rowsweep.log 2>&1
    echo "rows $rows rc=$?" | tee -a $OUT/summary.txt
  done
  grep -E "^[0-9]" $OUT/rowsweep.log
  ;;
py)
  # The Python package's tests with the device's torch and transformers (the wheel built here
  # by `maturin build --release` in crates/fathom-py and carried in .devbin/): nothing that
  # needs torch may skip (FATHOM_REQUIRE_GPU=1 above).
  # python3 there is itself a virtual environment (/opt/torch/.venv) that holds torch, so a
  # venv made from it would not see torch: the wheel goes to a folder on PYTHONPATH instead.
  # The GGUF parity test (the CPU runtime against transformers on the real weights) needs the
  # models and corpus staged first (stage_model.sh, then `model` or a join) and gguf (carried
  # by build.sh): FATHOM_REQUIRE_DATA=1 makes a missing one a failure, not a skip.
  lib=$(mktemp -d)
  python3 -m pip install --no-index --no-deps --quiet --target $lib $B/fathom-*.whl $B/gguf-*.whl
  (cd crates/fathom-py/tests && FATHOM_REQUIRE_DATA=1 FATHOM_CACHE=$HOME/.cache/fathom FATHOM_BIN=$PWD/../../../$B/fathom \
    PYTHONPATH=$lib python3 -m pytest -v -rs -s -p no:cacheprovider .) > $OUT/pytest-device.log 2>&1
  echo "pytest rc=$? $(tail -1 $OUT/pytest-device.log)" | tee -a $OUT/summary.txt
  # The README's generation example (a random Qwen3-style model) next to HF's own generate.
  PYTHONPATH=$lib python3 crates/fathom-py/examples/generate_example.py --device cuda \
    --json $OUT/generate-example.json > $OUT/generate-example.txt 2>&1
  echo "generate example rc=$?" | tee -a $OUT/summary.txt
  rm -rf $lib
  ;;
model)
  # model MODEL...: the GPU forward on real models staged by
  # scripts/device/stage_model.sh in the calls just before (join checks every sha256), with
  # the real-text corpus's pinned sdist carried in .stage/sources/: the fathom-gpu device tests
  # and `fathom gpu-parity` (8 prompts × 32 greedy tokens) per model.
  export FATHOM_CACHE=$HOME/.cache/fathom
  mkdir -p $FATHOM_CACHE/sources && cp .stage/sources/* $FATHOM_CACHE/sources/
  for m in "$@"; do
    bash scripts/device/stage_model.sh join $m $FATHOM_CACHE 2>&1 | tee -a $OUT/summary.txt
  done
  log=$OUT/gpu-forward-tests.log
  echo "# FATHOM_REQUIRE_GPU=1, $(date), $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader); commit ${COMMIT:-?}" > $log
  for t in gpu_unit gpu_forward; do
    echo "## $t" >> $log
    LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} timeout 300 $B/$t --test-threads 1 --nocapture >> $log 2>&1
    echo "$t rc=$?" | tee -a $OUT/summary.txt
  done
  for m in "$@"; do
    LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} timeout 300 $B/fathom gpu-parity --model $m --offline \
      --prompts 8 --new-tokens 32 --json $OUT/gpu-parity-$m.json > $OUT/gpu-parity-$m.txt 2>&1
    echo "gpu-parity $m rc=$?" | tee -a $OUT/summary.txt
    head -3 $OUT/gpu-parity-$m.txt
  done
  ;;
pages)
  # Host pages (docs/SPEC.md §6.1, "Host pages"): the random-row sweep (512-byte rows drawn at
  # random from 0.25, 4 and 32 GiB of pinned host memory, beside back-to-back rows, driver
  # pages against 2 MiB transparent huge pages), then the library path at 256k and 1M in host
  # residency with the pools on each kind of page, every method of the grammar the cache runs.
  timeout 150 $B/row_sweep $OUT/row-sweep.json 32 > $OUT/row-sweep.txt 2>&1
  echo "row_sweep rc=$?" | tee -a $OUT/summary.txt
  cat $OUT/row-sweep.txt
  for pages in ${PAGES:-driver huge}; do
    timeout ${BENCH_TIMEOUT:-240} $B/fathom offload-bench --engine cache --context 256k,1m \
      --methods ${METHODS:-fathom:48,fathom:64,sparq:32,ds:32,exact,loki:32,landmark,quest} --steps 20 \
      --host-pages $pages --json $OUT/offload-qwen3-8b-cache-host-$pages.json > $OUT/offload-qwen3-8b-cache-host-$pages.txt 2>&1
    echo "bench $pages rc=$?" | tee -a $OUT/summary.txt
    grep -E "^[0-9]|huge pages|H2D" $OUT/offload-qwen3-8b-cache-host-$pages.txt | head -30
  done
  ;;
repeat)
  # repeat N FILTER: one cache_gpu test N times (a flaky failure's rate), full output.
  n=$1 filter=$2
  for i in $(seq $n); do
    timeout 100 $B/cache_gpu --test-threads 1 $filter > $OUT/repeat-$i.log 2>&1
    echo "repeat $i rc=$?" | tee -a $OUT/summary.txt
  done
  cat $OUT/repeat-*.log | grep -A3 panicked | head -20
  ;;
sanitize)
  # compute-sanitizer (memcheck, racecheck, initcheck) on one append and two attends of every
  # method on both select paths (the every_method example: dense, exact, fathom, sparq, ds,
  # loki through the PCA index, thumb2, landmark and quest through the block tables), with the
  # pages in host memory and split (index in HBM). `sanitize cache` also runs memcheck over the
  # whole cache_gpu suite (long: its own call).
  if [ "${1:-}" = cache ]; then
    timeout 560 compute-sanitizer --tool memcheck $B/cache_gpu --test-threads 1 > $OUT/cache-memcheck.log 2>&1
    echo "memcheck cache_gpu rc=$? $(grep -h 'ERROR SUMMARY' $OUT/cache-memcheck.log | tail -1)" | tee -a $OUT/summary.txt
  else
    for res in host index-hbm; do
      for tool in memcheck racecheck initcheck; do
        timeout 150 compute-sanitizer --tool $tool --error-exitcode 9 $B/every_method $res > $OUT/sanitize-$tool-$res.log 2>&1
        echo "$tool $res rc=$? $(grep -h 'SUMMARY' $OUT/sanitize-$tool-$res.log | tail -1)" | tee -a $OUT/summary.txt
      done
    done
  fi
  ;;
esac
# ncu BIN NAME: the attend kernels of three layers of the third step at 256k, fathom:48, and
# the decode appends of the same steps (kernel times, caches not flushed between kernels).
case $mode in
ncu)
  bin=$1 name=$2
  timeout 200 ncu --cache-control none --clock-control none -k regex:'paged_|attend_queries|fathom_plan' \
    --launch-skip 648 --launch-count 27 --metrics gpu__time_duration.sum \
    $B/$bin offload-bench --engine cache --context 256k --methods fathom:48 --steps 3 --probe-mib 64 > $OUT/ncu-$name.txt 2>&1
  echo "ncu $name rc=$?" | tee -a $OUT/summary.txt
  timeout 200 ncu --cache-control none --clock-control none -k regex:'append_' \
    --launch-skip 2340 --launch-count 12 --metrics gpu__time_duration.sum \
    $B/$bin offload-bench --engine cache --context 256k --methods fathom:48 --steps 2 --probe-mib 64 > $OUT/ncu-append-$name.txt 2>&1
  echo "ncu append $name rc=$?" | tee -a $OUT/summary.txt
  ;;
ncuappend)
  # Where the decode append's time goes: the full Nsight Compute set (warp stalls, source
  # counters) of one decode append_quant (32k context: the append's work does not depend on it;
  # the prefill is 4 chunks of 8192 tokens x 36 layers = 144 launches, so 200 skips land in the
  # second decode step; 120 caught a prefill chunk's, 832 us, at 2133e9d).
  # `ncuappend [RESIDENCY...]` (default host): one profile per residency (hbm: the pools'
  # plane words are written to HBM instead of across the link).
  for res in ${@:-host}; do
    timeout 200 ncu --set full --import-source yes -k regex:'append_quant' --launch-skip 200 --launch-count 1 \
      $B/fathom offload-bench --engine cache --context 32k --methods fathom:48 --steps 4 --probe-mib 64 \
      --residency $res > $OUT/ncu-append-full-$res.txt 2>&1
    echo "ncu append full $res rc=$? $(grep -E '^ +Duration' $OUT/ncu-append-full-$res.txt | head -1)" | tee -a $OUT/summary.txt
  done
  ;;
ncuhbm)
  # One 1M layer's kernels with the whole cache in HBM (the 1M HBM target), fathom:48
  # against sparq:32: two layers of the third step each, 10 matching kernels per layer.
  for m in fathom:48 sparq:32; do
    timeout 200 ncu --cache-control none --clock-control none -k regex:'paged_|attend_queries|fathom_plan' \
      --launch-skip 300 --launch-count 20 --metrics gpu__time_duration.sum \
      $B/fathom offload-bench --engine cache --context 1m --methods $m --steps 3 --probe-mib 64 \
      --residency hbm > $OUT/ncu-1m-hbm-${m%%:*}.txt 2>&1
    echo "ncu 1m hbm $m rc=$?" | tee -a $OUT/summary.txt
  done
  ;;
ncu1m)
  # One 1M layer's kernels (fathom:48, host residency, 15 layers timed, the third step), the
  # score path ("before") and the filtered select ("after"): 10 and 12 matching kernels per
  # layer, two layers each.
  for cfg in "scores 300 20 scores" "8192 360 24 filtered"; do
    set -- $cfg
    timeout 280 ncu --cache-control none --clock-control none -k regex:'paged_|attend_queries|fathom_plan' \
      --launch-skip $2 --launch-count $3 --metrics gpu__time_duration.sum \
      $B/fathom offload-bench --engine cache --context 1m --methods fathom:48 --steps 3 --probe-mib 64 \
      --select $1 > $OUT/ncu-1m-$4.txt 2>&1
    echo "ncu 1m $4 rc=$?" | tee -a $OUT/summary.txt
  done
  ;;
ncuscan)
  # The 1M HBM scan kernel alone under Nsight Compute's full set (the 1M HBM target):
  # its instruction mix, stall reasons and pipe use, fathom:48 against sparq:32, one launch of
  # the second step each.
  for m in fathom:48 sparq:32; do
    timeout 240 ncu --set full --cache-control none --clock-control none -k regex:'paged_scan' \
      --launch-skip ${SKIP:-20} --launch-count 1 \
      $B/fathom offload-bench --engine cache --context 1m --methods $m --steps 3 --probe-mib 64 \
      --residency hbm > $OUT/ncu-scan-1m-hbm-${m%%:*}.txt 2>&1
    echo "ncu scan 1m hbm $m rc=$?" | tee -a $OUT/summary.txt
  done
  ;;
sharesweep)
  # decode-bench at one batch shape with the host gather's share swept: one run per
  # share, fathom:48 and the whole step as a graph; SHARES lists them (0: the gather off).
  # sharesweep NAME ARGS... (the decode-bench arguments without --host-gather/--host-share)
  name=$1; shift
  for s in ${SHARES:-0 50 65 80 100}; do
    g=""; [ "$s" != 0 ] && g="--host-gather ${THREADS:-14} --host-share $s"
    timeout ${DECODE_TIMEOUT:-150} $B/fathom decode-bench "$@" $g --json $OUT/$name-s$s.json > $OUT/$name-s$s.txt 2>&1
    echo "$name share $s rc=$?" | tee -a $OUT/summary.txt
    grep -E "tok/s|host gather" $OUT/$name-s$s.txt | head -6
  done
  ;;
ncudecode)
  # Where an 8 x 64k decode layer's attention goes (the split host gather does not
  # shorten it there): the durations of about four layers' attend kernels of fathom:48's second
  # step, plain launches, random-weight Qwen3-8B shape.
  timeout 300 ncu --cache-control none --clock-control none -k regex:'paged_' \
    --launch-skip ${SKIP:-400} --launch-count ${COUNT:-40} --metrics gpu__time_duration.sum \
    $B/fathom decode-bench --model qwen3-8b --context 64k --batch 8 --steps 2 --row-cache 8192 \
    --scan-vec 2 --methods fathom:48 > $OUT/ncu-decode-8x64k.txt 2>&1
  echo "ncu decode 8x64k rc=$?" | tee -a $OUT/summary.txt
  ;;
stages)
  # Per-stage GPU time of attends (CacheOptions::stage_timing; not yet run on a device when
  # written): its device test, then offload-bench at 1M in HBM and host residency (each
  # entry's stage_ms from the steps after the timed ones) and decode-bench at 8 x 64k (each
  # entry's split.attend_ms): where a layer's time goes without a profiler.
  timeout 200 $B/cache_gpu stage_timing --test-threads 1 2>&1 | grep -v -E "^(running [0-9]+ tests?|)$" > $OUT/stages-test.log
  echo "stages test rc=${PIPESTATUS[0]} $(grep 'test result' $OUT/stages-test.log)" | tee -a $OUT/summary.txt
  for res in hbm host; do
    timeout 200 $B/fathom offload-bench --engine cache --context 1m --methods fathom:48,sparq:32 --steps 10 \
      --residency $res --scan-vec ${VEC:-1} --json $OUT/stages-1m-$res.json > $OUT/stages-1m-$res.txt 2>&1
    echo "stages 1m $res rc=$?" | tee -a $OUT/summary.txt
    grep -E "^[0-9]+ +(host|hbm)|stages ms" $OUT/stages-1m-$res.txt | head -8
  done
  DECODE_TIMEOUT=150 bash $0 decode stages-8x64k --model qwen3-8b --context 64k --batch 8 --steps 8 \
    --row-cache 8192 --scan-vec 2 --methods fathom:48,sparq:32
  grep -E "attends by stage" $OUT/stages-8x64k.txt
  ;;
esac
