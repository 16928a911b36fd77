"""Compares two offload-bench (or decode-bench) JSONs of the same command run back to back on
one machine (the tree before a change, `base`, and after it, `change`): per context, residency,
launch mode and method, the median GPU step time and each speedup over the 136-bit scans,
change / base, against a ±tolerance band. Writes a Markdown table and a JSON summary.

    python3 scripts/analysis/ab_compare.py offload BASE.json CHANGE.json OUT_PREFIX [--tol 0.03]
    python3 scripts/analysis/ab_compare.py decode BASE.json CHANGE.json OUT_PREFIX [--tol 0.03]
"""
import json
import statistics
import sys


def offload_rows(doc):
    """{(context, residency, graph, method): (median gpu ms over rounds, {vs: mean speedup})}"""
    acc = {}
    for r in doc["results"]:
        key = (r["context"], r["residency"], bool(r.get("graph", False)), r["method"])
        a = acc.setdefault(key, {"ms": [], "sp": {}})
        a["ms"].append(r["gpu_ms"])
        for vs, x in r.get("speedup_vs_136", {}).items():
            a["sp"].setdefault(vs, []).append(x)
    return {k: (statistics.median(v["ms"]), {vs: statistics.fmean(x) for vs, x in v["sp"].items()})
            for k, v in acc.items()}


def decode_rows(doc):
    """{(batch, graph, method): (median step ms, fathom:48's speedup over each other method)}"""
    ms = {(e["batch"], bool(e.get("graph", False)), e["method"]): e["step_ms_p50"] for e in doc["entries"]}
    out = {}
    for (b, g, m), t in ms.items():
        sp = {o: ms[(b, g, o)] / t for (bb, gg, o) in ms if (bb, gg) == (b, g) and o != m} if m == "fathom:48" else {}
        out[(b, g, m)] = (t, sp)
    return out


def main():
    kind, base_p, change_p, prefix = sys.argv[1:5]
    tol = float(sys.argv[sys.argv.index("--tol") + 1]) if "--tol" in sys.argv else 0.03
    base, change = json.load(open(base_p)), json.load(open(change_p))
    rows = offload_rows if kind == "offload" else decode_rows
    b, c = rows(base), rows(change)
    lines = ["| setting | method | base ms | change ms | change / base | ratios: change / base | within ±%g%% |" % (100 * tol),
             "|---|---|---:|---:|---:|---|---|"]
    worst, checks = 0.0, []
    for key in sorted(b, key=str):
        if key not in c:
            continue
        (bms, bsp), (cms, csp) = b[key], c[key]
        t = cms / bms
        ratios = {vs: csp[vs] / bsp[vs] for vs in bsp if vs in csp}
        # The step time of fathom:48 and every ratio are held to the band.
        held = ([t] if "fathom:48" in key[-1] else []) + list(ratios.values())
        ok = all(abs(x - 1) <= tol for x in held)
        worst = max([worst] + [abs(x - 1) for x in held])
        checks.append({"setting": [str(x) for x in key[:-1]], "method": key[-1], "base_ms": bms, "change_ms": cms,
                       "time_ratio": t, "ratio_ratios": ratios, "held": held, "within": ok})
        lines.append("| %s | %s | %.3f | %.3f | %.4f | %s | %s |" % (
            ", ".join(str(x) for x in key[:-1]), key[-1], bms, cms, t,
            ", ".join("%s %.4f" % kv for kv in sorted(ratios.items())) or "-", "yes" if ok else "**no**"))
    summary = {"kind": kind, "base": {"command": base.get("command"), "device": base.get("device")},
               "change": {"command": change.get("command"), "device": change.get("device")},
               "tolerance": tol, "worst_deviation": worst, "all_within": all(x["within"] for x in checks),
               "rows": checks}
    json.dump(summary, open(prefix + ".json", "w"), indent=1)
    open(prefix + ".md", "w").write("\n".join(lines) + "\n\nworst deviation %.2f%%; all within ±%g%%: %s\n" % (
        100 * worst, 100 * tol, summary["all_within"]))
    print("\n".join(lines))
    print("worst deviation %.2f%%, all within: %s" % (100 * worst, summary["all_within"]))


if __name__ == "__main__":
    main()
