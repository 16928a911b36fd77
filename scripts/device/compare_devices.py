#!/usr/bin/env python3
"""Agreement of the same `fathom ruler` or `fathom agent-steps` run on two devices.

Usage: compare_devices.py A.json B.json [C.json D.json ...]
Each pair is one run on two devices (the same command but for --device); a pair is compared by
its `kind`: for RULER, per method, the fraction of samples whose generations are
token-identical on both devices (and the mean score on each); for agent steps, the fraction of
teacher-forced steps whose argmax agrees (and each device's agreement with its own exact
top-k).
"""
import json
import sys


def load(p):
    with open(p) as f:
        return json.load(f)


def ruler(a, b):
    ra, rb = a["results"], b["results"]
    assert len(ra) == len(rb), "different sample counts"
    print(f"RULER: {a['model']} at {a['context']}, {len(ra)} samples; {a['device']} vs {b['device']}\n")
    print("| method | identical generations | score A | score B |\n|---|---:|---:|---:|")
    for m in a["methods"]:
        same = sum(x["methods"][m]["generation"] == y["methods"][m]["generation"] for x, y in zip(ra, rb))
        sa = sum(x["methods"][m]["score"] for x in ra) / len(ra)
        sb = sum(y["methods"][m]["score"] for y in rb) / len(rb)
        print(f"| {m} | {same}/{len(ra)} | {sa:.3f} | {sb:.3f} |")
    print()


def agent(a, b):
    ra, rb = a["results"], b["results"]
    print(f"Agent steps: {a['model']} at {a['context']}, {len(ra)} sessions; {a['device']} vs {b['device']}\n")
    print("| method | argmax agreement across devices | agree w/ exact A | agree w/ exact B |\n|---|---:|---:|---:|")
    for m in a["methods"]:
        n = agree = 0
        for x, y in zip(ra, rb):
            p, q = x["methods"][m]["argmax"], y["methods"][m]["argmax"]
            n += len(p)
            agree += sum(u == v for u, v in zip(p, q))
        ea = sum(x["methods"][m]["agree_exact"] for x in ra) / len(ra)
        eb = sum(y["methods"][m]["agree_exact"] for y in rb) / len(rb)
        print(f"| {m} | {agree / max(n, 1):.3f} | {ea:.3f} | {eb:.3f} |")
    print()


def check_same_run(a, b):
    """The two files must be one run: same model, context, methods, selection and samples."""
    for key in ("kind", "model", "context", "methods", "select", "seed"):
        if a.get(key) != b.get(key):
            sys.exit(f"not the same run: {key} is {a.get(key)!r} against {b.get(key)!r}")


if __name__ == "__main__":
    paths = sys.argv[1:]
    if not paths or len(paths) % 2:
        sys.exit(__doc__)
    for pa, pb in zip(paths[::2], paths[1::2]):
        a, b = load(pa), load(pb)
        check_same_run(a, b)
        {"ruler": ruler, "agent-steps": agent}[a["kind"]](a, b)
