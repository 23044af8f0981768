"""python -m bench.summary RESULT.json [...]: the acceptance rows of one or more bench runs, in one table.

For each of our rows: time, its ratio to resident (the baseline run in the same process), to its
floor, to the floor with resident timed in turn (paired), the target, and for vram_budget rows the
peak allocated VRAM over the budget. Rows of several runs (each with its own resident and copy
ceiling) print together.
"""

from __future__ import annotations

import json
import sys
from typing import Any

__all__ = ["main", "summarize"]

HEAD = ["workload", "variant", "time ms", "x resident", "x floor", "x floor paired", "target", "peak GiB", "peak/budget",
        "H2D GB/step", "depth", "plan"]


def _f(v: Any, fmt: str = "{:.3f}") -> str:
    return "-" if v is None else fmt.format(v)


def summarize(results: list[dict[str, Any]]) -> list[list[str]]:
    rows = [HEAD]
    for res in results:
        for r in res.get("rows", []):
            if r.get("status") != "ok":
                if r.get("family") == "ours" or r.get("variant") == "resident":
                    rows.append([r["workload"], r["variant"], r.get("status", "?")] + ["-"] * (len(HEAD) - 4)
                                + [(r.get("reason") or "").splitlines()[0][:80] if r.get("reason") else ""])
                continue
            if r.get("family") != "ours" and r.get("variant") != "resident":
                continue
            st = r.get("stats") or {}
            target = r.get("target_x_floor")
            tgt = "-" if target is None else f"<={target:g} " + ("ok" if r.get("meets_target") else "MISS")
            pb = r.get("peak_over_budget")
            peak = r.get("peak_vram_bytes")
            h2d = r.get("h2d_bytes_per_step")
            rows.append([
                r["workload"], r["variant"], _f(r.get("time_ms"), "{:.2f}"), _f(r.get("x_resident")), _f(r.get("x_floor")),
                _f(r.get("x_floor_paired")), tgt, _f(None if peak is None else peak / 2**30),
                "-" if pb is None else f"{pb:.4f} " + ("ok" if r.get("within_budget") else "OVER"),
                _f(None if h2d is None else h2d / 1e9), str(st.get("prefetch_depth", "-")),
                str(st.get("plan_chosen_by", "-")),
            ])
    return rows


def main(argv: list[str] | None = None) -> int:
    paths = sys.argv[1:] if argv is None else argv
    results = []
    for p in paths:
        try:
            with open(p) as f:
                results.append(json.load(f))
        except (OSError, ValueError) as e:
            print(f"{p}: not read ({e})", file=sys.stderr)
    if not results:
        print("error: no bench result could be read", file=sys.stderr)
        return 2
    rows = summarize(results)
    widths = [max(len(row[i]) for row in rows) for i in range(len(HEAD))]
    for j, row in enumerate(rows):
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        if j == 0:
            print("  ".join("-" * w for w in widths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
