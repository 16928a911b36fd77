#!/usr/bin/env python3
"""Joins `fathom ruler` runs of one setting split by `--tasks` into one run document.

Usage: merge_ruler.py [--replace] OUT.json PART.json [PART.json ...]

A run that does not fit one device call (10 minutes) is made as several calls with disjoint
`--tasks` (downstream.sh eval with TASKS=...). Every field but the tasks, their summaries and
results, the command and the timings must be equal across the parts (the same model,
methods, seed, shape, calibration...), or nothing is written. The joined document lists the
parts' tasks in order, their commands joined by " ; ", and the sums of their seconds
(calibration's too: each part calibrates again, identically but for its time).

`--replace`: a later part's tasks replace the same tasks of the earlier parts (their results,
summaries and seconds are dropped), for a task re-run after a change that concerns it alone.
The fields in TASK_FIELDS belong to one task (`vt_example`: whether `vt` opened with RULER's
in-context example; `vt_haystack`: whether it read RULER's noise or the real-text haystack): a part that does not hold that task is not compared on them, and the
joined document takes them from the part that holds it.
"""
import json
import os
import sys

PER_PART = {"tasks", "summary", "results", "command", "seconds", "load_seconds"}
TASK_FIELDS = {"vt_example": "vt", "vt_haystack": "vt"}


def drop_tasks(doc, tasks):
    """`doc` without `tasks`: their results, summaries and seconds."""
    out = dict(doc)
    gone = [t for t in doc["tasks"] if t in tasks]
    out["tasks"] = [t for t in doc["tasks"] if t not in tasks]
    out["summary"] = {k: v for k, v in doc["summary"].items() if k not in tasks}
    out["results"] = [r for r in doc["results"] if r["sample"]["task"] not in tasks]
    out["seconds"] = doc["seconds"] - sum(doc["summary"][t]["seconds"] for t in gone)
    return out


def without_seconds(v):
    """A calibration block without its timing (each part calibrates again, identically)."""
    return {k: x for k, x in v.items() if k != "seconds"} if isinstance(v, dict) else v


def main():
    args = sys.argv[1:]
    replace = bool(args) and args[0] == "--replace"
    args = args[1:] if replace else args
    if len(args) < 2:
        sys.exit(__doc__)
    out, parts = args[0], args[1:]
    docs = [json.load(open(p)) for p in parts]
    if replace:
        for i in range(len(docs)):
            later = {t for d in docs[i + 1:] for t in d["tasks"]}
            docs[i] = drop_tasks(docs[i], later)
        kept = [(p, d) for p, d in zip(parts, docs) if d["tasks"]]
        parts, docs = [p for p, _ in kept], [d for _, d in kept]
    first = docs[0]
    for p, d in zip(parts[1:], docs[1:]):
        for k in set(first) | set(d):
            task = TASK_FIELDS.get(k)
            if task is not None and not (task in first["tasks"] and task in d["tasks"]):
                continue
            if k not in PER_PART and without_seconds(first.get(k)) != without_seconds(d.get(k)):
                sys.exit(f"merge_ruler: {p} differs from {parts[0]} in {k!r}")
        if set(first["tasks"]) & set(d["tasks"]):
            sys.exit(f"merge_ruler: {p} repeats a task of an earlier part")
    merged = dict(first)
    for k, task in TASK_FIELDS.items():
        merged.pop(k, None)
        for d in docs:
            if task in d["tasks"] and k in d:
                merged[k] = d[k]
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
