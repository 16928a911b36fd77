#!/usr/bin/env python3
"""Joins `fathom ruler` runs of one setting split by `--tasks` into one run document.

Usage: merge_ruler.py OUT.json PART.json [PART.json ...]

A run that does not fit one device call (10 minutes) is made as several calls with disjoint
`--tasks` (downstream.sh eval with TASKS=...). Every field but the tasks, their summaries and
results, the command and the timings must be equal across the parts (the same model,
methods, seed, shape, calibration...), or nothing is written. The joined document lists the
parts' tasks in order, their commands joined by " ; ", and the sums of their seconds
(calibration's too: each part calibrates again, identically but for its time).
"""
import json
import os
import sys

PER_PART = {"tasks", "summary", "results", "command", "seconds", "load_seconds"}


def without_seconds(v):
    """A calibration block without its timing (each part calibrates again, identically)."""
    return {k: x for k, x in v.items() if k != "seconds"} if isinstance(v, dict) else v


def main():
    out, parts = sys.argv[1], sys.argv[2:]
    docs = [json.load(open(p)) for p in parts]
    first = docs[0]
    for p, d in zip(parts[1:], docs[1:]):
        for k in set(first) | set(d):
            if k not in PER_PART and without_seconds(first.get(k)) != without_seconds(d.get(k)):
                sys.exit(f"merge_ruler: {p} differs from {parts[0]} in {k!r}")
        if set(first["tasks"]) & set(d["tasks"]):
            sys.exit(f"merge_ruler: {p} repeats a task of an earlier part")
    merged = dict(first)
    merged["tasks"] = [t for d in docs for t in d["tasks"]]
    merged["summary"] = {k: v for d in docs for k, v in d["summary"].items()}
    merged["results"] = [r for d in docs for r in d["results"]]
    merged["command"] = " ; ".join(d["command"] for d in docs)
    merged["seconds"] = sum(d["seconds"] for d in docs)
    merged["load_seconds"] = sum(d["load_seconds"] for d in docs)
    if isinstance(first.get("calibration"), dict) and "seconds" in first["calibration"]:
        merged["calibration"] = dict(first["calibration"])
        merged["calibration"]["seconds"] = sum(d["calibration"]["seconds"] for d in docs)
    tmp = out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(merged, f, indent=2)
        f.write("\n")
    os.replace(tmp, out)
    print(f"merge_ruler: {out}: {len(merged['tasks'])} tasks, {len(merged['results'])} samples")


if __name__ == "__main__":
    main()
