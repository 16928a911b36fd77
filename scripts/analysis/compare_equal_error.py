#!/usr/bin/env python3
"""Old against new equal-error savings, setting by setting.

Usage: python3 scripts/analysis/compare_equal_error.py OLD_DIR NEW_DIR [--json OUT]

OLD_DIR and NEW_DIR are result trees of `cargo xtask repro` (`results/quick`, `results/full`),
for example an older commit's tree extracted with `git archive`. Every `<setting>/fidelity.json`
present in either is read; each row is one (setting, baseline) with Fathom's bits at the
baseline's error and the saving in each tree. Prints a Markdown table.
"""
import json
import sys
from pathlib import Path


def savings(root: Path) -> dict:
    out = {}
    for f in sorted(root.glob("*/fidelity.json")):
        d = json.loads(f.read_text())
        for e in d.get("equal_error", []):
            out[(f.parent.name, e["baseline"])] = e
    return out


def main() -> int:
    args = sys.argv[1:]
    if len(args) not in (2, 4) or (len(args) == 4 and args[2] != "--json"):
        print(__doc__, file=sys.stderr)
        return 2
    old, new = savings(Path(args[0])), savings(Path(args[1]))
    rows = []
    for key in sorted(set(old) | set(new)):
        o, n = old.get(key), new.get(key)
        rows.append(
            {
                "setting": key[0],
                "baseline": key[1],
                "old_fathom_bits": o and o["fathom_bits"],
                "old_saving": o and o["saving"],
                "new_fathom_bits": n and n["fathom_bits"],
                "new_saving": n and n["saving"],
            }
        )
    fmt = lambda x, p: "—" if x is None else f"{x:.{p}f}"
    print("| setting | baseline | old bits | old saving | new bits | new saving |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['setting']} | {r['baseline']} | {fmt(r['old_fathom_bits'], 1)} | "
            f"{fmt(r['old_saving'], 2)}× | {fmt(r['new_fathom_bits'], 1)} | {fmt(r['new_saving'], 2)}× |"
        )
    if len(args) == 4:
        Path(args[3]).write_text(json.dumps({"old": args[0], "new": args[1], "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
