#!/usr/bin/env bash
# Downstream runs on the GPU (`--device cuda`; docs/SPEC.md §7), after the models were staged
# (scripts/device/stage_model.sh; engine.sh model joins them) and the binary built on the CPU
# machine into .devbin/.
#
# The judged runs (results/downstream/README.md lists them in order, one device call each):
#   probe MODEL CONTEXT K [HAYSTACK...]   dense-only task-shape probes on the tuning seed
#   pick MODEL CONTEXT                    (CPU) the shape and haystack the probes support
#   judged MODEL CONTEXT K PART           RULER at the kept shape, 40 samples, fresh seed
#   ingest TGZ_OR_DIR...                  (CPU) place a call's outputs for pick and merge
#   merge MODEL CONTEXT                   (CPU) join a setting's parts into one document
#   agent-judged SETTING...               agent steps, 16 sessions x 64 steps
#   compare | parity                      CPU against GPU, token by token; gpu-parity
# Earlier runs (kept as their records): ruler|agent|rowcache|throughput|tune|eval|own|parity-pedantic.
# Outputs under $OUT: <name>.json, <name>.md (the table), <name>.log, summary.txt; where more
# than 8 files would come back (the device tool's limit), every one but summary.txt is packed
# into $OUT/downstream.tgz at the end.
#
# RUN_S (default 560): each `fathom` process's own time limit, under the call's 600 s.
# PAR (default 3): probe, judged and agent-judged run that many `fathom` processes at once on
# the one GPU (each task of a judged part its own process; RAYON_NUM_THREADS shares the
# machine's cores). The runs measure accuracy, never time, and each process draws its own seeded
# samples, so PAR changes no result, only the call's wall time. PAR=1 runs them one by one.
# DEVICE (default cuda): `--device` of every `fathom` run. The dense-only probes choose a shape
# and measure no method, so `DEVICE=cpu B=target/release` runs them on the CPU machine,
# saving device time (slowly: a Gemma 3 16k prefill took 65 s on the 2-core machine).
set -u
B=${B:-.devbin}
export FATHOM_CACHE=$HOME/.cache/fathom
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
SM="dense,exact,fathom:48,fathom:64,fathom:92,sparq:16,sparq:32,ds:16,ds:32,loki:16,loki:32,thumb2,landmark,quest"
GM="dense,exact,fathom:48,fathom:64,fathom:92,sparq:16,sparq:32,sparq:64,ds:32,ds:64,loki:32,loki:64,thumb2,landmark,quest"
# The judged runs (docs/SPEC.md §7): every method at r = 32 and r = D/4 (D = 64, D = 256), and
# Fathom at 32-92 bits plus two budgets per channel that make the two head sizes' grids meet
# (the budget rule, SPEC §4): D = 64 then reads 0.25, 0.375, 0.5, 0.75, 1 and 1.44 bits per
# channel, D = 256 0.125, 0.1875, 0.25, 0.36, 0.5 and 0.75.
SM_J="dense,exact,fathom:0.25c,fathom:0.375c,fathom:32,fathom:48,fathom:64,fathom:92,sparq:32,sparq:16,ds:32,ds:16,loki:32,loki:16,thumb2,landmark,quest"
GM_J="dense,exact,fathom:32,fathom:48,fathom:64,fathom:92,fathom:0.5c,fathom:0.75c,sparq:32,sparq:64,ds:32,ds:64,loki:32,loki:64,thumb2,landmark,quest"
SAMPLES=${SAMPLES:-40} TUNE_SEED=${TUNE_SEED:-1} EVAL_SEED=${EVAL_SEED:-2} TUNE_SAMPLES=${TUNE_SAMPLES:-5}
TUNE_DIR=${TUNE_DIR:-results/downstream/gpu/tune}
# Shapes `tune` and `probe` try: RULER's counts for small models with its needle or the pass key, at 7 or
# 4 digits, and vt's chain of 2 or 1 (every one keeps each task's RULER structure).
TUNE_SHAPES=${TUNE_SHAPES:-"small small,digits=4,chain=1 small,needle=passkey small,needle=passkey,digits=4,chain=1"}
PAR=${PAR:-3}
run() {  # run NAME ARGS...
  name=$1; shift
  /usr/bin/time -f "wall %e s" timeout ${RUN_S:-560} $B/fathom "$@" --device ${DEVICE:-cuda} --offline --json $OUT/$name.json \
    > $OUT/$name.md 2> $OUT/$name.log
  echo "$name rc=$? $(tail -1 $OUT/$name.log)" | tee -a $OUT/summary.txt
}
run_bg() {  # run_bg NAME ARGS...: `run` in the background, at most $PAR at once
  while [ "$(jobs -rp | wc -l)" -ge "$PAR" ]; do wait -n; done
  RAYON_NUM_THREADS=$(( ($(nproc) + PAR - 1) / PAR )) run "$@" &
}
pack() {  # at most 8 files come back: the rest in one archive beside summary.txt
  [ -n "${OUT:-}" ] || return 0
  [ "$(ls $OUT | wc -l)" -gt 8 ] || return 0
  (cd $OUT && tar czf downstream.tgz --exclude summary.txt --exclude downstream.tgz -- * \
    && find . -maxdepth 1 -type f ! -name summary.txt ! -name downstream.tgz -delete)
}
trap 'wait; pack' EXIT
case $1 in
ruler)
  # The first GPU runs (results/downstream/gpu/ruler-*-8k.json, ...-32k-interrupted.json): shape
  # `small`. The committed runs at the tuned shape are `tune` then `eval` (a Gemma 3 32k run
  # of every method takes two calls: TASKS=... eval, then merge_ruler.py).
  samples=${2:-20}
  run ruler-smollm2-135m-8k ruler --model smollm2-135m --context 8192 --k 256 --prompt chat --shape small --samples $samples --methods $SM
  run ruler-gemma3-270m-32k ruler --model gemma3-270m --context 32768 --k 512 --prompt chat --shape small --samples $samples --methods $GM
  ;;
agent)
  run agent-smollm2-135m-8k agent-steps --model smollm2-135m --context 8192 --k 256 --sessions 16 --steps 64 --methods $SM
  run agent-gemma3-270m-32k agent-steps --model gemma3-270m --context 32768 --k 512 --sessions 16 --steps 64 --methods $GM
  ;;
rowcache)
  # Row-cache hits on real decode steps, measured: the runs of
  # results/downstream/rowcache/ (CPU, modelled by RowCacheModel) on the GPU with its own
  # counters at --row-cache 8192 and 1024, the same sessions, tasks and methods.
  for c in 8192 1024; do
    run agent-smollm2-135m-8k-rc$c agent-steps --model smollm2-135m --context 8192 --sessions 2 --steps 64 \
      --methods dense,exact,fathom:48,sparq:32,ds:32 --row-cache $c
    run agent-gemma3-270m-32k-rc$c agent-steps --model gemma3-270m --context 32768 --k 512 --sessions 2 --steps 64 \
      --methods dense,exact,fathom:48,sparq:32,ds:32 --row-cache $c
  done
  run ruler-smollm2-135m-8k-rc8192 ruler --model smollm2-135m --context 8192 --samples 2 \
    --methods dense,exact,fathom:48,sparq:32,ds:32 --row-cache 8192
  ;;
throughput)
  # Decode throughput with real weights (the random-weight Qwen3-8B runs are in results/device/decode-bench/):
  # sessions of real prose, B = 1, 4, 16, with the row cache on, so that each entry's
  # `row_hit_rate` is the hit rate on real decode steps. `throughput MODEL...`
  # (default both staged models).
  shift
  [ $# -eq 0 ] && set -- smollm2-135m gemma3-270m
  for model in "$@"; do
    set -- $model 32k
    timeout ${DECODE_TIMEOUT:-170} $B/fathom decode-bench --model $1 --context $2 --batch 1,4,16 --steps 32 --row-cache 8192 \
      --methods dense,exact,fathom:48,fathom:92,sparq:32,ds:32 --offline --json $OUT/decode-bench-$1-$2.json --plot $OUT/decode-bench-$1-$2.png \
      > $OUT/decode-bench-$1-$2.txt 2>&1
    echo "decode-bench $1 $2 rc=$?" | tee -a $OUT/summary.txt; tail -15 $OUT/decode-bench-$1-$2.txt
  done
  ;;
tune)
  # tune MODEL CONTEXT K: the earlier tuning. Dense-only probes (dense and exact, 5 samples per
  # task, seed 1: not the evaluation's seed 0, so the choice is not fitted to the samples it
  # is judged on) of each shape in $TUNE_SHAPES on each haystack in $TUNE_HAYSTACKS (default
  # docs); scripts/device/pick_shape.py keeps the SHAPE/HAYSTACK on which dense reaches 0.5 on
  # the most tasks and writes $OUT/tune-MODEL.md; the choice is saved on the device for `eval`
  # (next call) as $FATHOM_CACHE/tune-MODEL.shape.
  model=$2 ctx=$3 k=$4 pairs=""
  for hay in ${TUNE_HAYSTACKS:-docs}; do
    for shape in $TUNE_SHAPES; do
      tag=$(echo $shape | tr ',=' '-_')$([ $hay = docs ] || echo -$hay)
      run tune-$model-$tag ruler --model $model --context $ctx --k $k --prompt chat --shape $shape \
        --haystack $hay --samples ${TUNE_SAMPLES:-5} --seed 1 --methods dense
      pairs="$pairs $shape/$hay@$OUT/tune-$model-$tag.json"
    done
  done
  best=$(python3 scripts/device/pick_shape.py $OUT/tune-$model.md $pairs) || exit 1
  echo "$best" > $FATHOM_CACHE/tune-$model.shape
  echo "tune $model: kept $best" | tee -a $OUT/summary.txt; cat $OUT/tune-$model.md
  ;;
eval)
  # eval MODEL CONTEXT K METHODS [SAMPLES]: the RULER run at the shape and haystack `tune` kept
  # (seed 0).
  model=$2 ctx=$3 k=$4 methods=$5 samples=${6:-20}
  kept=$(cat $FATHOM_CACHE/tune-$model.shape) || { echo "no tune-$model.shape: run tune first"; exit 1; }
  case $kept in */*) shape=${kept%/*} hay=${kept##*/} ;; *) shape=$kept hay=docs ;; esac
  # TASKS=a,b (optional): only these tasks, in a file named after them (a run split over two
  # calls to fit the device's 10-minute limit; scripts/device/merge_ruler.py joins them).
  name=ruler-$model-$((ctx / 1024))k${TASKS:+-$(echo $TASKS | tr ',' '-')}
  run $name ruler --model $model --context $ctx --k $k --prompt chat --shape $shape --haystack $hay \
    --samples $samples --methods $methods ${TASKS:+--tasks $TASKS}
  grep -A12 "^| task" $OUT/$name.md | head -14
  ;;
compare)
  # The same small ruler and agent-steps case on both paths (the CPU runtime with the GPU's
  # bf16 roundings, 16 host cores, and the GPU), then per method the fraction of generations
  # (RULER) and of teacher-forced argmaxes (agent steps) that agree across the two.
  # The CPU half may come made (it measures no time, so any machine's CPU serves): with
  # compare-ruler-cpu.json and compare-agent-cpu.json in $CPU_DIR (default the committed
  # results/downstream/gpu/compare/), only the GPU half runs here.
  CM="dense,exact,fathom:48,fathom:92,sparq:16,ds:16"
  CPU_DIR=${CPU_DIR:-results/downstream/gpu/compare}
  devs="cpu cuda"
  if [ -f $CPU_DIR/compare-ruler-cpu.json ] && [ -f $CPU_DIR/compare-agent-cpu.json ]; then
    cp $CPU_DIR/compare-ruler-cpu.json $CPU_DIR/compare-agent-cpu.json $OUT/ && devs=cuda
    echo "compare: the CPU half from $CPU_DIR" | tee -a $OUT/summary.txt
  fi
  for dev in $devs; do
    # Both devices in one call: the CPU (16 cores) at most 220 + 150 s, the GPU 90 + 60 s.
    t=$([ $dev = cpu ] && echo 220 || echo 90)
    timeout $t $B/fathom ruler --model smollm2-135m --context 2048 --k 128 --prompt chat --shape small \
      --tasks niah_single,niah_multikey,vt --samples 4 --methods $CM --device $dev --cpu-weights bf16 --offline \
      --json $OUT/compare-ruler-$dev.json > $OUT/compare-ruler-$dev.md 2> $OUT/compare-ruler-$dev.log
    echo "compare ruler $dev rc=$?" | tee -a $OUT/summary.txt
    timeout $((t * 2 / 3)) $B/fathom agent-steps --model smollm2-135m --context 2048 --k 128 --sessions 4 --steps 32 \
      --methods $CM --device $dev --cpu-weights bf16 --offline \
      --json $OUT/compare-agent-$dev.json > $OUT/compare-agent-$dev.md 2> $OUT/compare-agent-$dev.log
    echo "compare agent $dev rc=$?" | tee -a $OUT/summary.txt
  done
  python3 scripts/device/compare_devices.py $OUT/compare-ruler-cpu.json $OUT/compare-ruler-cuda.json \
    $OUT/compare-agent-cpu.json $OUT/compare-agent-cuda.json | tee $OUT/compare.md
  ;;
own)
  # own [ruler-gemma]: the methods that read their own basis or tables: Loki in its PCA basis through the cache's PCA index (loki:32 and the r = D/4
  # baseline: SmolLM2 D 64 loki:16, Gemma 3 D 256 loki:64), landmark and Quest through its block
  # tables, beside dense and exact, at the committed runs' settings (shape small,needle=passkey,
  # seed 0, 20 samples; agent steps 16 sessions x 64 steps), so each entry pairs with the exact
  # top-k of its own run. Without an argument: SmolLM2's RULER and agent steps and Gemma's agent
  # steps; `ruler-gemma`: Gemma's RULER at 32k, TASKS=a,b,c for part of the tasks (two calls,
  # joined by merge_ruler.py).
  shape=small,needle=passkey
  if [ "${2:-}" = ruler-gemma ]; then
    run ruler-gemma3-270m-32k-passkey-own${TASKS:+-$(echo $TASKS | tr ',' '-')} ruler --model gemma3-270m --context 32768 \
      --k 512 --prompt chat --shape $shape --samples 20 --methods dense,exact,loki:32,loki:64,landmark,quest ${TASKS:+--tasks $TASKS}
  else
    run ruler-smollm2-135m-8k-passkey-own ruler --model smollm2-135m --context 8192 --k 256 --prompt chat \
      --shape $shape --samples 20 --methods dense,exact,loki:16,loki:32,landmark,quest
    run agent-smollm2-135m-8k-own agent-steps --model smollm2-135m --context 8192 --k 256 --sessions 16 --steps 64 \
      --methods dense,exact,loki:16,loki:32,landmark,quest
    run agent-gemma3-270m-32k-own agent-steps --model gemma3-270m --context 32768 --k 512 --sessions 16 --steps 64 \
      --methods dense,exact,loki:32,loki:64,landmark,quest
  fi
  ;;
parity-pedantic)
  for m in smollm2-135m gemma3-270m; do
    FATHOM_GPU_MATH=pedantic timeout 300 $B/fathom gpu-parity --model $m --offline --prompts 8 --new-tokens 32 \
      --json $OUT/gpu-parity-$m-pedantic.json > $OUT/gpu-parity-$m-pedantic.txt 2>&1
    echo "parity pedantic $m rc=$?" | tee -a $OUT/summary.txt; head -1 $OUT/gpu-parity-$m-pedantic.txt
  done
  ;;
probe)
  # probe MODEL CONTEXT K [HAYSTACK...]: dense-only probes (dense and exact, $TUNE_SAMPLES
  # samples per task, base seed $TUNE_SEED, which the judged runs' seed $EVAL_SEED never
  # draws: `fathom ruler --tuning-seed` refuses an overlap) of each shape in $TUNE_SHAPES on
  # each haystack given (default docs). One device call per haystack at 16k and above.
  # KEEP=DIR also copies the probes there (a git-ignored DIR such as .stage/tune stays on a warm
  # device between calls), so the next call can `TUNE_DIR=DIR … pick` and run `judged` at once.
  model=$2 ctx=$3 k=$4; shift 4
  for hay in ${@:-docs}; do
    for shape in $TUNE_SHAPES; do
      tag=$(echo $shape | tr ',=' '-_')-$hay
      run_bg tune-$model-$((ctx / 1024))k-$tag ruler --model $model --context $ctx --k $k --prompt chat \
        --shape $shape --haystack $hay --samples $TUNE_SAMPLES --seed $TUNE_SEED --methods dense
    done
  done
  wait
  if [ -n "${KEEP:-}" ]; then mkdir -p "$KEEP" && cp $OUT/tune-$model-* "$KEEP"/; fi
  ;;
pick)
  # pick MODEL CONTEXT (CPU, from the repository root): the probes committed under $TUNE_DIR
  # for this setting; keeps the shape/haystack on which dense reaches 0.5 on the most tasks
  # (pick_shape.py) and writes $TUNE_DIR/tune-MODEL-Ck.md (every probe's dense scores) and
  # .choice (what `judged` reads).
  model=$2 c=$(($3 / 1024))k pairs=""
  for f in $TUNE_DIR/tune-$model-$c-*.json; do
    tag=${f#$TUNE_DIR/tune-$model-$c-}; tag=${tag%.json}
    hay=${tag##*-} shape=$(echo ${tag%-*} | tr '_' '=' | sed 's/-\([a-z]*=\)/,\1/g')
    pairs="$pairs $shape/$hay@$f"
  done
  [ -n "$pairs" ] || { echo "pick: no probes $TUNE_DIR/tune-$model-$c-*.json"; exit 1; }
  python3 scripts/device/pick_shape.py $TUNE_DIR/tune-$model-$c.md $pairs > $TUNE_DIR/tune-$model-$c.choice || exit 1
  echo "pick $model $c: kept $(cat $TUNE_DIR/tune-$model-$c.choice)"; cat $TUNE_DIR/tune-$model-$c.md
  ;;
judged)
  # judged MODEL CONTEXT K PART: the judged RULER run of one setting at the shape and haystack
  # `pick` kept, $SAMPLES samples per task on the fresh base seed $EVAL_SEED, every method of
  # the setting's model (r = 32 and r = D/4), the tuning seeds recorded (`tuning` in the JSON).
  # PART: all | h1 h2 (halves) | t1 t2 t3 (thirds), so each call fits the 10-minute limit;
  # `merge` joins the parts.
  model=$2 ctx=$3 k=$4 part=${5:-all} c=$(($3 / 1024))k
  kept=$(cat $TUNE_DIR/tune-$model-$c.choice) || { echo "no $TUNE_DIR/tune-$model-$c.choice: run probe, commit, pick"; exit 1; }
  shape=${kept%/*} hay=${kept##*/}
  case $model in smollm2-135m) methods=$SM_J ;; *) methods=$GM_J ;; esac
  case $part in
    all) tasks=niah_single,niah_multikey,niah_multivalue,niah_multiquery,vt,fwe ;;
    h1) tasks=niah_single,niah_multikey,niah_multivalue ;; h2) tasks=niah_multiquery,vt,fwe ;;
    t1) tasks=niah_single,niah_multikey ;; t2) tasks=niah_multivalue,niah_multiquery ;; t3) tasks=vt,fwe ;;
    *) echo "judged: PART is all, h1, h2, t1, t2 or t3"; exit 1 ;;
  esac
  # Each task its own process (PAR at once), its own part file: ruler-MODEL-Ck-judged-TASK.
  for t in $(echo $tasks | tr ',' ' '); do
    run_bg ruler-$model-$c-judged-$t ruler --model $model --context $ctx --k $k --prompt chat \
      --shape $shape --haystack $hay --samples $SAMPLES --seed $EVAL_SEED \
      --tuning-seed $TUNE_SEED --tuning-samples $TUNE_SAMPLES --tasks $t --methods $methods
  done
  wait
  for t in $(echo $tasks | tr ',' ' '); do grep -A3 "^| task" $OUT/ruler-$model-$c-judged-$t.md | tail -1; done
  ;;
ingest)
  # ingest TGZ_OR_DIR... (CPU, from the repository root): places a call's outputs where the
  # next step reads them: probes in $TUNE_DIR, judged RULER parts and agent runs in
  # results/downstream/gpu/ (each part's table and log appended to its setting's .md and
  # .log, in RULER's task order), the comparison's GPU half in gpu/compare/, parity runs in
  # results/device/gpu-forward/. A DIR holding the call's downstream.tgz is unpacked too.
  # Nothing is placed when a judged part is already there or given twice, or when another
  # file would replace a different one of the same name; then run `pick` or `merge`.
  shift
  d=results/downstream/gpu tmp=$(mktemp -d) froms=() i=0
  trap 'rm -rf "$tmp"' EXIT
  dest() {  # dest NAME: where NAME goes ("" for nowhere)
    case $1 in
      tune-*) echo $TUNE_DIR ;; ruler-*-judged-*.json|agent-*) echo $d ;;
      compare*) echo $d/compare ;; gpu-parity-*) echo results/device/gpu-forward ;; *) echo "" ;;
    esac
  }
  for src in "$@"; do
    i=$((i + 1)) && mkdir -p "$tmp/$i"
    if [ -d "$src" ]; then
      cp -r "$src"/. "$tmp/$i"/
      [ -f "$tmp/$i/downstream.tgz" ] && { tar xzf "$tmp/$i/downstream.tgz" -C "$tmp/$i" || exit 1; }
    else
      tar xzf "$src" -C "$tmp/$i" || { echo "ingest: cannot unpack $src"; exit 1; }
    fi
    froms+=("$tmp/$i")
  done
  seen=" "
  for from in "${froms[@]}"; do
    for f in "$from"/*; do
      [ -f "$f" ] || continue
      b=$(basename "$f") to=$(dest "$b")
      [ -n "$to" ] || continue
      case $b in
        ruler-*-judged-*.json)
          if [ -e $d/$b ] || [ -e $d/parts/${b%.json}.json.part.gz ] || [[ $seen == *" $b "* ]]; then
            echo "ingest: $b is already in $d or given twice: nothing placed"; exit 1
          fi
          seen="$seen$b " ;;
        *) if [ -e "$to/$b" ] && ! cmp -s "$f" "$to/$b"; then
             echo "ingest: $to/$b exists and differs from $b: nothing placed"; exit 1
           fi ;;
      esac
    done
  done
  for from in "${froms[@]}"; do
    n=0
    for f in "$from"/*; do
      [ -f "$f" ] || continue
      b=$(basename "$f") to=$(dest "$b")
      case $b in
        summary.txt|downstream.tgz|ruler-*-judged-*.md|ruler-*-judged-*.log) ;;
        *) if [ -n "$to" ]; then mkdir -p "$to" && cp "$f" "$to"/ && n=$((n + 1));
           else echo "ingest: left $b (no place for it)"; fi ;;
      esac
    done
    # A part's table and log follow its JSON (a task that timed out has none: left out).
    for t in niah_single niah_multikey niah_multivalue niah_multiquery vt fwe; do
      for f in "$from"/ruler-*-judged-$t.md "$from"/ruler-*-judged-$t.log; do
        [ -e "$f" ] || continue
        b=$(basename "$f") ext=${f##*.}
        [ -e "${f%.*}.json" ] || { echo "ingest: left $b (its task wrote no JSON)"; continue; }
        { echo "## $t"; echo; cat "$f"; echo; } >> $d/${b%-judged-*}-judged.$ext
      done
    done
    echo "ingest: placed $n files from ${@:$((${from##*/})):1}"
  done
  ls $d/ruler-*-judged-*.json 2>/dev/null | sed 's|.*/ruler-\(.*\)-judged-.*|\1|' | sort -u \
    | sed 's/^/ingest: judged parts of /; s/$/: `merge MODEL CONTEXT` once every task is in/'
  ;;
merge)
  # merge MODEL CONTEXT (CPU, from the repository root): joins the committed parts
  # results/downstream/gpu/ruler-MODEL-Ck-judged-TASK.json into ruler-MODEL-Ck-judged.json
  # (merge_ruler.py refuses parts that differ in anything but their tasks and timings); the
  # parts move to parts/ gzipped (NAME.json.part.gz: the raw per-task records, timings included,
  # kept small because every device call carries the tracked tree), where the report does not
  # read them.
  c=$(($3 / 1024))k d=results/downstream/gpu
  parts=""  # in RULER's task order, so the joined document lists its tasks that way
  for t in niah_single niah_multikey niah_multivalue niah_multiquery vt fwe; do
    [ -f $d/ruler-$2-$c-judged-$t.json ] && parts="$parts $d/ruler-$2-$c-judged-$t.json"
  done
  [ -n "$parts" ] || { echo "merge: no $d/ruler-$2-$c-judged-TASK.json"; exit 1; }
  python3 scripts/device/merge_ruler.py $d/ruler-$2-$c-judged.json $parts || exit 1
  mkdir -p $d/parts && for p in $parts; do
    gzip -9n < $p > $d/parts/$(basename $p .json).json.part.gz && rm $p || exit 1
  done
  ;;
agent-judged)
  # agent-judged SETTING...: 16 sessions x 64 teacher-forced steps on the pinned code corpus,
  # every method of the model, ds:32 and ds:64 in each (SmolLM2's ds:64 reads all 64
  # channels). SETTING: gemma3-32k (k 512), smollm2-8k, gemma3-8k (k 256); PAR of them at once.
  shift
  for st in "$@"; do
    case $st in
      gemma3-32k) m=gemma3-270m ctx=32768 k=512 methods=$GM_J ;;
      gemma3-8k) m=gemma3-270m ctx=8192 k=256 methods=$GM_J ;;
      smollm2-8k) m=smollm2-135m ctx=8192 k=256 methods=$SM_J,ds:64 ;;  # ds:64 in every setting's table
      *) echo "agent-judged: unknown setting $st"; exit 1 ;;
    esac
    run_bg agent-$m-$((ctx / 1024))k-judged agent-steps --model $m --context $ctx --k $k --sessions 16 \
      --steps 64 --seed $EVAL_SEED --methods $methods
  done
  ;;
parity)
  # gpu-parity at cuBLAS's default math and at pedantic math (no reduced-
  # precision tensor-core reductions), 16 prompts: whether the GPU's per-step distance from
  # the f32 model beyond the CPU bf16 forward's (SmolLM2's worst step ratio 2.85 against the
  # 2x rule) is cuBLAS's accumulation, or the ratio's own spread (the report measures it).
  # `parity [MODEL...]` (default smollm2-135m; each model is one call: ~3 min per run).
  shift
  for m in ${@:-smollm2-135m}; do
    for math in default pedantic; do
      FATHOM_GPU_MATH=$math timeout 280 $B/fathom gpu-parity --model $m --offline --prompts 16 --new-tokens 32 \
        --json $OUT/gpu-parity-$m-$math.json > $OUT/gpu-parity-$m-$math.txt 2>&1
      echo "parity $m $math rc=$?" | tee -a $OUT/summary.txt; head -1 $OUT/gpu-parity-$m-$math.txt
    done
  done
  ;;
esac
