#!/usr/bin/env python3
"""Joins two `fathom ruler` or `fathom agent-steps` runs of one setting that ran different
methods into one run document.

Usage: join_methods.py OUT.json BASE.json EXTRA.json

A method added later (downstream.sh `own`: Loki, landmark and Quest, once the paged cache ran
them) is run again beside dense and exact at the base run's setting, so that it pairs with
exact top-k over the same samples. The join refuses, writing nothing, unless every field but
the methods, their summaries and results, the command and the timings is equal (the same
model, seed, tasks, samples, shape, calibration apart from its time...), the samples or
sessions are the same in order, and every method both runs share (dense, exact) gave the same
result on every sample apart from its time: the evidence that the two runs decoded the same
prefills the same way. The joined document lists BASE's methods, then EXTRA's others; its
command is both commands joined by " ; " and its seconds their sums.
"""
import json
import os
import sys

PER_RUN = {"methods", "summary", "results", "command", "seconds", "load_seconds", "calibration"}


def untimed(v):
    """A result, method entry or calibration block without its timings."""
    if isinstance(v, dict):
        return {k: untimed(x) for k, x in v.items() if k not in ("seconds", "prefill_seconds")}
    return v


def main():
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    out, pa, pb = sys.argv[1:]
    a, b = json.load(open(pa)), json.load(open(pb))
    for k in set(a) | set(b):
        if k not in PER_RUN and a.get(k) != b.get(k):
            sys.exit(f"join_methods: {pb} differs from {pa} in {k!r}")
    if untimed(a.get("calibration")) != untimed(b.get("calibration")):
        sys.exit(f"join_methods: {pb} was calibrated differently from {pa}")
    if len(a["results"]) != len(b["results"]):
        sys.exit(f"join_methods: {len(a['results'])} results in {pa}, {len(b['results'])} in {pb}")
    shared = [m for m in b["methods"] if m in a["methods"]]
    extra = [m for m in b["methods"] if m not in a["methods"]]
    if not extra:
        sys.exit(f"join_methods: {pb} adds no method to {pa}")
    unit = "sample" if a["kind"].startswith("ruler") else "session"
    results = []
    for i, (ra, rb) in enumerate(zip(a["results"], b["results"])):
        if ra.get(unit) != rb.get(unit):
            sys.exit(f"join_methods: result {i}: the {unit} differs")
        for m in shared:
            if untimed(ra["methods"].get(m)) != untimed(rb["methods"].get(m)):
                sys.exit(f"join_methods: result {i}: {m} differs between the runs")
        r = dict(ra)
        r["methods"] = dict(ra["methods"])
        r["methods"].update({m: rb["methods"][m] for m in extra})
        r["seconds"] = ra["seconds"] + sum(rb["methods"][m].get("seconds", 0.0) for m in extra)
        results.append(r)
    joined = dict(a)
    joined["methods"] = a["methods"] + extra
    joined["results"] = results
    summary = json.loads(json.dumps(a["summary"]))
    if unit == "sample":
        for task, t in b["summary"].items():
            summary[task]["methods"].update({m: t["methods"][m] for m in extra})
    else:
        summary.update({m: b["summary"][m] for m in extra})
    joined["summary"] = summary
    joined["command"] = a["command"] + " ; " + b["command"]
    joined["seconds"] = a["seconds"] + b["seconds"]
    joined["load_seconds"] = a["load_seconds"] + b["load_seconds"]
    tmp = out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(joined, f, indent=2)
        f.write("\n")
    os.replace(tmp, out)
    print(f"join_methods: {out}: {len(joined['methods'])} methods ({', '.join(extra)} from {pb}), {len(results)} {unit}s")


if __name__ == "__main__":
    main()
