#!/usr/bin/env bash
# Builds, on the 2-core machine, everything the device calls of engine.sh and downstream.sh
# carry in .devbin/ (git-ignored): the fathom-cuda and fathom-gpu test binaries (unit, api,
# cache_gpu, select_gpu, gpu_forward, gpu_graph, gpu_unit), fathom-cuda's examples paged_decode, graph_step
# and every_method, fathom-bench's cache_bench and row_sweep, the `fathom` CLI with CUDA, and the fathom-py wheel; stripped (about 32 MB).
# x86-64-v3, not native: the binaries run on the device host. Needs no CUDA toolkit (NVRTC
# compiles the kernels there at run time). The wheel needs maturin (`pip install maturin`).
#
#   bash scripts/device/build.sh            # everything
#   NO_WHEEL=1 bash scripts/device/build.sh # without the wheel
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/tmp/tgt-cuda}
export RUSTFLAGS="-C target-cpu=x86-64-v3"
cargo test -q -p fathom-cuda -p fathom-gpu --features fathom-cuda/cuda,fathom-gpu/cuda --release --no-run
cargo build -q -p fathom-cuda --features cuda --release --example paged_decode --example graph_step --example every_method --example soak
cargo build -q -p fathom-bench --features cuda --release --example cache_bench --example row_sweep
cargo build -q --release -p fathom-cli --features cuda
rm -rf .devbin && mkdir -p .devbin
for t in fathom_cuda:unit api:api cache_gpu:cache_gpu select_gpu:select_gpu gpu_forward:gpu_forward gpu_graph:gpu_graph fathom_gpu:gpu_unit; do
  src=${t%%:*} dst=${t##*:}
  f=$(ls -t "$CARGO_TARGET_DIR"/release/deps/"$src"-* | grep -v '\.d$' | head -1)
  cp "$f" .devbin/"$dst"
done
for e in cache_bench paged_decode graph_step every_method row_sweep soak; do cp "$CARGO_TARGET_DIR"/release/examples/$e .devbin/; done
cp "$CARGO_TARGET_DIR"/release/fathom .devbin/
strip .devbin/*
if [ -z "${NO_WHEEL:-}" ]; then
  wheels=$(mktemp -d)
  (cd crates/fathom-py && CARGO_TARGET_DIR=${PY_TARGET_DIR:-/tmp/tgt-py} maturin build --release -o "$wheels")
  cp "$wheels"/fathom-*.whl .devbin/
  rm -rf "$wheels"
  # The GGUF parity test's one package the device's Python lacks (torch, transformers,
  # accelerate, numpy, pyyaml, requests and tqdm are there): pinned, pure Python.
  python3 -m pip download --quiet --no-deps --only-binary=:all: -d .devbin gguf==0.19.0
fi
du -sh .devbin
ls -la .devbin
