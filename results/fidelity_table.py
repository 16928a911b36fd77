#!/usr/bin/env python3
"""The README's fidelity table, read from a `cargo xtask repro --full` tree.

Usage: python3 results/fidelity_table.py [results/full]

One row per `<setting>/fidelity.json`: model, context, k, evaluated layers x KV heads and
positions, the basis rule of the calibration, and the equal-error savings against each
baseline with their 95 % bootstrap interval over positions (`>=` marks a lower bound: Fathom's
lowest budget already beats the baseline).
"""
import json
import sys
from pathlib import Path


def cell(e):
    if e is None or e.get("saving") is None:
        return "—"
    ge = "≥ " if e.get("lower_bound") else ""
    ci = e.get("saving_ci95")
    ci = f" [{ci[0]:.2f}–{ci[1]:.2f}]" if ci else ""
    return f"{ge}{e['saving']:.2f}×{ci}"


def main() -> int:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "results/full")
    print("| model, context, k | layers × KV heads, positions | basis rule (raw vs KLT error) "
          "| vs ds:32 | vs loki:32 | vs sparq:32 | vs ds / loki / sparq at r = D/4 |")
    print("|---|---|---|---:|---:|---:|---|")
    for f in sorted(root.glob("*/fidelity.json")):
        d = json.loads(f.read_text())
        rows = {e["baseline"]: e for e in d.get("equal_error", [])}
        quarter = [e for e in d.get("equal_error", []) if e.get("convention") == "r = D/4"]
        rule = "—"
        cs = f.parent / "calibration-summary.json"
        if cs.exists():
            r = json.loads(cs.read_text()).get("basis_rule") or {}
            if r:
                rule = f"{r['choice'].lower()} ({r['raw_error']:.2e} vs {r['klt_error']:.2e})"
        q = " / ".join(f"{e['baseline']} {cell(e)}" for e in quarter) or "= r = 32"
        print(
            f"| {d['model']}, {d['n'] // 1024}k, {d['k']} | {len(d['layers'])} × {d['hkv']}, "
            f"{d['positions']} | {rule} | {cell(rows.get('ds:32'))} | {cell(rows.get('loki:32'))} "
            f"| {cell(rows.get('sparq:32'))} | {q} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
