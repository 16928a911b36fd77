#!/usr/bin/env python3
"""Summarise fathom ruler / agent-steps JSON files: where each method departs from exact top-k."""
import json, sys, glob, os

def ruler(d):
    out = []
    names = d["methods"]
    out.append(f"### `{d['command'].split('/')[-1]}`\n")
    out.append(f"model {d['model']}, context {d['context']}, k {d['select']['k']}, "
               f"{d['samples_per_task']} sample(s) per task, {len(d['results'])} samples run, wall {d['seconds']:.0f} s "
               f"(calibration {d['calibration']['seconds']:.0f} s)\n" if d.get('calibration') else "")
    tasks = []
    for r in d["results"]:
        if r["sample"]["task"] not in tasks:
            tasks.append(r["sample"]["task"])
    out.append("| task (samples) | " + " | ".join(names) + " |")
    out.append("|---|" + "---|" * len(names))
    for t in tasks:
        rs = [r for r in d["results"] if r["sample"]["task"] == t]
        cells = [f"{sum(r['methods'][m]['score'] for r in rs) / len(rs):.3f}" for m in names]
        out.append(f"| {t} ({len(rs)}) | " + " | ".join(cells) + " |")
    out.append("")
    out.append("Departures from exact top-k (token-identical generations / samples; samples that differ: task#index exact-score→method-score @first differing token):\n")
    out.append("| method | identical to exact | mean score | differing samples |")
    out.append("|---|---|---|---|")
    for m in names:
        same, tot, sc, diffs = 0, 0, 0.0, []
        for r in d["results"]:
            x = r["methods"][m]; e = r["methods"]["exact"]
            tot += 1; sc += x["score"]
            if x["same_as_exact"]:
                same += 1
            else:
                diffs.append(f"{r['sample']['task']}#{r['sample']['index']} {e['score']:.2f}→{x['score']:.2f} @{x['first_divergence_from_exact']}")
        out.append(f"| {m} | {same}/{tot} | {sc/tot:.3f} | {'; '.join(diffs) if diffs else '—'} |")
    return "\n".join(out) + "\n"

def agent(d):
    out = [f"### `{d['command'].split('/')[-1]}`\n",
           f"model {d['model']}, context {d['context']}, k {d['select']['k']}, {d['sessions']} session(s) × {d['steps']} steps, wall {d['seconds']:.0f} s\n",
           "| method | steps differing from exact (per session) |", "|---|---|"]
    for m in d["methods"]:
        per = [str(len(r["methods"][m]["steps_differing_from_exact"])) for r in d["results"]]
        out.append(f"| {m} | {', '.join(per)} |")
    return "\n".join(out) + "\n"

ORDER = ["dense", "exact", "fathom:48", "fathom:64", "fathom:92", "sparq:16", "sparq:32", "ds:32", "loki:32", "thumb2", "landmark"]

for f in sorted(sys.argv[1:]):
    d = json.load(open(f))
    if d.get("complete") is False:  # an interrupted run's OUT.partial: results only
        r0 = d["results"][0]
        names = [m for m in ORDER if m in r0["methods"]] + sorted(set(r0["methods"]) - set(ORDER))
        d = {"command": f + " (interrupted; partial results)", "methods": names, "results": d["results"],
             "task": "ruler" if "sample" in r0 else "agent-steps", "model": "?", "context": "?",
             "select": {"k": "?"}, "samples_per_task": "?", "sessions": len(d["results"]), "steps": "?",
             "seconds": sum(r["seconds"] for r in d["results"])}
    print(ruler(d) if d.get("task") == "ruler" else agent(d))
