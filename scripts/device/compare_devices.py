#!/usr/bin/env python3
"""Agreement of the same `fathom ruler` and `fathom agent-steps` runs on two devices.

Usage: compare_devices.py RULER_A.json RULER_B.json AGENT_A.json AGENT_B.json
Prints, per method, the fraction of RULER samples whose generations are token-identical on
both devices (and the mean score on each), and the fraction of teacher-forced agent steps
whose argmax agrees (and each device's agreement with its own exact top-k).
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


if __name__ == "__main__":
    if len(sys.argv) != 5:
        sys.exit(__doc__)
    ruler(load(sys.argv[1]), load(sys.argv[2]))
    agent(load(sys.argv[3]), load(sys.argv[4]))
