#!/usr/bin/env python3
"""How many host accesses a union fetch would make if a miss brought an aligned run of B tokens.

Random reads from host memory are bound per access up to 2 KiB (results/device/engine/
row-sweep-sizes-3c8d194.txt: about 27 million reads a second whether a read is 512 B or 2 KiB),
so a fetch of aligned runs of 4 records (2 KiB at D = 128) costs what a fetch of one record
costs, and saves accesses exactly where selected tokens cluster. This measures the clustering
on a real capture (`fathom capture … --dtype f16`; by default the one embedded in the CLI:
SmolLM2-135M, layers 4/14/24, 2,048 tokens of the Python 3.11 docs, 16 positions): exact top-k
per query head over the middle (sink 4, local 32) at each of the capture's
positions, the union per KV head (what the fetch reads), and the distinct aligned runs of
B = 2, 4, 8 tokens it touches, beside the same counts for uniformly random sets of the same
size (the clustering a selection would show by density alone). A bf16 K|V record is 4·D bytes,
so 2 KiB is 4 tokens at D = 128 (8 at D = 64, 2 at D = 256). Sliding-window layers are skipped
(their attention is dense). Needs numpy.

    python3 scripts/analysis/fetch_locality.py [--capture CAP.safetensors] [--k 64,128,256] [--json OUT]
    fathom capture --model gemma3-270m --corpus prose --split eval --context 32768 --positions 16 \
        --layers 5,11,17 --dtype f16 --out g32k.safetensors
    python3 scripts/analysis/fetch_locality.py --capture g32k.safetensors --k 128,256,512
"""
import argparse
import json
import struct
import sys
from pathlib import Path

import numpy as np

CAPTURE = Path(__file__).resolve().parents[2] / "crates/fathom-cli/data/smollm2-prose-eval-2k.safetensors"
SINK, LOCAL = 4, 32
RUNS = (2, 4, 8)


def load(path):
    b = path.read_bytes()
    n = struct.unpack("<Q", b[:8])[0]
    header = json.loads(b[8 : 8 + n])

    def tensor(name):
        v = header[name]
        s, e = v["data_offsets"]
        if v["dtype"] != "F16":
            sys.exit(f"{path}: {name} is {v['dtype']}, want F16")
        return np.frombuffer(b[8 + n + s : 8 + n + e], dtype=np.float16).reshape(v["shape"]).astype(np.float32)

    return header["__metadata__"], tensor


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--capture", type=Path, default=CAPTURE, help="an f16 capture (default: the embedded one)")
    ap.add_argument("--k", default="64,128,256", help="top-k per query head, a comma-separated list")
    ap.add_argument("--json", help="write the table as JSON here")
    args = ap.parse_args()
    ks = [int(x) for x in args.k.split(",")]
    meta, tensor = load(args.capture)
    positions = json.loads(meta["positions"])
    kinds = json.loads(meta.get("layer_kinds", "[]"))
    layers = [l for l in json.loads(meta["layers"]) if not kinds or kinds[l] == "global"]
    if not layers:
        sys.exit(f"{args.capture}: no global layer captured")
    hkv, hq = int(meta["n_kv_heads"]), int(meta["n_heads"])
    g = hq // hkv
    rng = np.random.default_rng(0)
    rows = []
    for k in ks:
        real = {b: 0 for b in (1,) + RUNS}
        rand = {b: 0 for b in (1,) + RUNS}
        cases = 0
        for layer in layers:
            keys, queries = tensor(f"layers.{layer}.k"), tensor(f"layers.{layer}.q")
            for pi, p in enumerate(positions):
                middle = np.arange(SINK, p + 1 - LOCAL)
                for h in range(hkv):
                    union = set()
                    for j in range(g):
                        scores = keys[middle, h, :] @ queries[pi, h * g + j, :]
                        union |= set(middle[np.argsort(-scores, kind="stable")[:k]].tolist())
                    drawn = set(rng.choice(middle, size=len(union), replace=False).tolist())
                    for b in real:
                        real[b] += len({t // b for t in union})
                        rand[b] += len({t // b for t in drawn})
                    cases += 1
        row = {"k": k, "union_rows": real[1] / cases}
        for b in RUNS:
            row[f"runs_{b}"] = real[b] / cases
            row[f"rows_per_run_{b}"] = real[1] / real[b]
            row[f"random_rows_per_run_{b}"] = rand[1] / rand[b]
        rows.append(row)
    d = int(meta["head_dim"])
    print(f"{args.capture.name} ({meta.get('model')}, {meta.get('n_tokens')} tokens, D = {d}: a 2 KiB run is {2048 // (4 * d)} tokens): layers {layers} x {len(positions)} positions x {hkv} KV heads (G = {g}), sink {SINK}, local {LOCAL}")
    print("| k | union rows per KV head | rows per aligned run of 2 / 4 / 8 tokens | same for random sets of the union's size |")
    print("|---:|---:|---|---|")
    for r in rows:
        real = " / ".join(f"{r[f'rows_per_run_{b}']:.2f}" for b in RUNS)
        rand = " / ".join(f"{r[f'random_rows_per_run_{b}']:.2f}" for b in RUNS)
        print(f"| {r['k']} | {r['union_rows']:.0f} | {real} | {rand} |")
    if args.json:
        doc = {"what": "union-fetch locality on the embedded real capture (scripts/analysis/fetch_locality.py)", "capture": args.capture.name, "model": meta.get("model"), "n_tokens": meta.get("n_tokens"), "layers": layers, "sink": SINK, "local": LOCAL, "rows": rows}
        tmp = Path(args.json + ".tmp")
        tmp.write_text(json.dumps(doc, indent=2) + "\n")
        tmp.replace(args.json)


if __name__ == "__main__":
    main()
