#!/usr/bin/env python3
"""Picks a RULER task shape from dense-only probe runs (docs/SPEC.md §7: tuning seeds, then fresh evaluation seeds).

Usage: pick_shape.py OUT.md LABEL@PROBE.json [LABEL@PROBE.json ...]

Each PROBE.json is a `fathom ruler --methods dense` run (dense and exact) of one candidate
(LABEL: `SHAPE/HAYSTACK` as downstream.sh tune writes it, any text without `@`),
on a probe seed that the evaluation does not use, so the choice is not fitted to the samples
it is judged on. The shape kept is the one on which dense scores at least 0.5 on the most
tasks, ties broken by the higher mean dense score over tasks; it is printed on stdout, and a
table of every probe's dense score per task is written to OUT.md.
"""
import json
import sys
from collections import defaultdict

THRESHOLD = 0.5


def dense_by_task(path):
    doc = json.load(open(path))
    acc = defaultdict(list)
    for r in doc["results"]:
        acc[r["sample"]["task"]].append(r["methods"]["dense"]["score"])
    return doc["tasks"], {t: sum(v) / len(v) for t, v in acc.items()}, doc["samples_per_task"]


def main():
    out, pairs = sys.argv[1], sys.argv[2:]
    rows, best = [], None
    for pair in pairs:
        shape, path = pair.rsplit("@", 1)
        try:
            tasks, scores, n = dense_by_task(path)
        except (OSError, KeyError, ValueError) as e:
            print(f"pick_shape: {path}: {e}", file=sys.stderr)
            continue
        passing = sum(s >= THRESHOLD for s in scores.values())
        mean = sum(scores.values()) / max(len(scores), 1)
        rows.append((shape, tasks, scores, n, passing, mean))
        if best is None or (passing, mean) > (best[4], best[5]):
            best = rows[-1]
    if best is None:
        sys.exit("pick_shape: no probe could be read")
    tasks = best[1]
    with open(out, "w") as f:
        f.write(f"| shape (samples per task) | {' | '.join(tasks)} | tasks ≥ {THRESHOLD} | mean |\n")
        f.write("|---|" + "---:|" * (len(tasks) + 2) + "\n")
        for shape, _, scores, n, passing, mean in rows:
            mark = " **(kept)**" if shape == best[0] else ""
            cells = " | ".join(f"{scores.get(t, float('nan')):.2f}" for t in tasks)
            f.write(f"| `{shape}` ({n}){mark} | {cells} | {passing} | {mean:.3f} |\n")
    print(best[0])


if __name__ == "__main__":
    main()
