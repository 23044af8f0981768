"""Print the results: ceilings and floors first, then the reasons for n/a and errors, the table last."""

from __future__ import annotations

from typing import Any, Callable

from .tiers import tier_label

__all__ = ["format_header", "format_markdown", "format_table", "format_tier_table", "render"]

COLUMNS = [
    "workload", "variant", "time ms", "x res", "x floor", "x wl floor", "x floor paired", "target", "peak GB", "peak/budget",
    "H2D GB/step",
    "RSS/W", "pin/W", "setup s/GB", "pack s/GB", "exact", "max diff", "stall ms", "misses", "pred ms", "note",
]


def _f(v: Any, fmt: str = "{:.2f}") -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    try:
        return fmt.format(v)
    except (TypeError, ValueError):
        return str(v)


def _exact(r: dict[str, Any]) -> str:
    eq = r.get("bitwise_equal")
    if eq is None:
        return "-"
    if "trajectory_bitwise_equal" in r and eq and not r["trajectory_bitwise_equal"]:
        return "step1"  # first step exact, later steps drift (optimizer rounding)
    return "yes" if eq else "NO"


def _tag(r: dict[str, Any]) -> str:
    """The workload, and the link tier where the run had tiers (--link-gbps)."""
    return r["workload"] + (f" @{r['tier']}" if r.get("tier") else "")


def _cells(r: dict[str, Any]) -> list[str]:
    head = [_tag(r), r["variant"]]
    if r.get("status") != "ok":
        reason = (r.get("reason") or "").splitlines()[0] if r.get("reason") else ""
        short = (reason[:60] + "...") if len(reason) > 60 else reason
        return head + [r.get("status", "?")] + ["-"] * (len(COLUMNS) - 4) + [short]
    target = r.get("target_x_floor")
    tgt = "-" if target is None else f"<={target:g} " + ("ok" if r.get("meets_target") else "MISS")
    peak = r.get("peak_vram_bytes")
    if peak is not None:
        peak /= 1e9
    h2d = r.get("h2d_bytes_per_step")
    h2d_s = "-" if h2d is None else f"{h2d / 1e9:.3f}" + ("" if r.get("h2d_source") == "engine" else "*")
    diff = r.get("max_abs_diff")
    return head + [
        _f(r.get("time_ms")),
        _f(r.get("x_resident")),
        _f(r.get("x_floor")),
        _f(r.get("x_workload_floor")),
        _f(r.get("x_floor_paired")),
        tgt,
        _f(peak),
        "-" if r.get("peak_over_budget") is None else (f"{r['peak_over_budget']:.3f} "
                                                        + ("ok" if r.get("within_budget") else "OVER")),
        h2d_s,
        _f(r.get("rss_over_weight")),
        _f(r.get("pinned_over_weight"), "{:.3f}"),
        _f(r.get("setup_s_per_gb"), "{:.3f}"),
        _f(r.get("pack_s_per_gb"), "{:.3f}"),
        _exact(r),
        "-" if diff is None else f"{diff:.2e}",
        _f(r.get("stall_ms_per_step")),
        _f(r.get("prefetch_misses_per_step"), "{:g}"),
        _f(r.get("predicted_step_ms")),
        _short_note(r),
    ]


def _compile_note(r: dict[str, Any]) -> str:
    """A compiled variant's first step: its wall time, the part spent compiling, graphs and recompiles."""
    if not r.get("config", {}).get("compile") or r.get("first_step_s") is None:
        return ""
    st = r.get("stats") or {}
    cache = r.get("inductor_cache") or {}
    return (f"compiled: first step {r['first_step_s']:.1f} s ({st.get('compile_seconds', 0.0):.1f} s compiling, "
            f"{st.get('compile_graphs', '?')} graphs, {st.get('recompiles', '?')} recompiles; inductor cache "
            f"{cache.get('hit', 0)} hit / {cache.get('miss', 0)} miss)")


def _short_note(r: dict[str, Any]) -> str:
    cfg = r.get("config", {})
    if r.get("family") != "ours":
        return _compile_note(r)
    st = r.get("stats") or {}
    depth = st.get("prefetch_depth", cfg.get("prefetch"))
    pinned = cfg.get("prefetch") is not None
    bits = [f"pf{depth}{'' if pinned else ' (auto)'}/{cfg.get('offload_granularity') or st.get('granularity') or 'auto'}"]
    if st.get("optimizer_kernel"):
        bits.append(f"cpu step {st['optimizer_kernel']}{' overlapped' if st.get('optimizer_step_overlapped') else ''}")
    if not cfg.get("use_streams", True):
        bits.append("no streams")
    if cfg.get("weight_dtype"):
        bits.append(str(cfg["weight_dtype"]) + (f" {cfg['fp8_scaling']}" if cfg.get("fp8_scaling") else ""))
    if _compile_note(r):
        bits.append(_compile_note(r))
    if isinstance(cfg.get("vram_budget"), (int, float)):
        b = cfg["vram_budget"]
        bits.append(f"budget {b / 1e9:.2f} GB" if b >= 1e8 else f"budget {b / 1e6:.2f} MB")
    plan = r.get("stats") or {}
    if plan.get("plan_chosen_by") == "measured":
        bits.append(f"planned: {plan.get('plan_sticky_units')} sticky +{plan.get('plan_extra_slots')} slots")
    if plan.get("plan_stray_resident_bytes"):
        bits.append(f"strays {plan['plan_stray_resident_bytes'] / 1e6:.0f} MB resident")
    return " ".join(bits)


def format_header(result: dict[str, Any]) -> list[str]:
    c = result["ceiling"]
    m = result["meta"]
    lines = [
        f"device: {m['device_name']}  torch {m['torch']}  diffusers {m.get('diffusers')}  accelerate {m.get('accelerate')}  "
        f"peft {m.get('peft')}  tiny={m['tiny']}  warmup {m['warmup']}  repeats {m['repeats']}  whole run {m.get('wall_s', 0):.0f} s"
    ]
    line = f"ceiling ({c['kind']}, {c['bytes'] / 1e9:.2f} GB x {c.get('repeats', '?')}): H2D {c['h2d_gbps']:.2f} GB/s (max {c['h2d_gbps_max']:.2f})"
    if c.get("d2h_gbps"):
        line += f", D2H {c['d2h_gbps']:.2f} GB/s, both at once {c['bidir_gbps']:.2f} GB/s"
    if c.get("floor_h2d_gbps") and c["floor_h2d_gbps"] > c["h2d_gbps"]:
        line += f"; floors at {c['floor_h2d_gbps']:.2f} GB/s, the rate of our engine's own copies (faster than the probe)"
    lines.append(line)
    tiers = result.get("tiers")
    if not tiers:
        return lines + _workload_lines(result["workloads"])
    for t in tiers:
        how = "this machine's link" if t["link_gbps"] is None else f"emulated, {t['link_gbps']:g} GB/s asked"
        line = f"tier {t['tier']} ({how}): floors at {t['floor_h2d_gbps']:.2f} GB/s, {t['floor_rate']}"
        if t.get("engine_h2d_gbps"):
            lo, hi = t["engine_h2d_gbps"]
            line += f"; our copies measured {lo:.2f}" + ("" if hi - lo < 0.005 else f"-{hi:.2f}") + " GB/s"
        if t.get("engine_real_link_gbps"):
            line += f" (the pacer's probe of the real link: {t['engine_real_link_gbps']:.2f} GB/s)"
        lines.append(line)
        lines += ["  " + x for x in _workload_lines(t["workloads"])]
    return lines


def _workload_lines(workloads: dict[str, Any]) -> list[str]:
    lines = []
    for name, m in workloads.items():
        res = m.get("resident_ms")
        lines.append(
            f"{name}: {m['title']}; weights {m['weight_bytes'] / 1e9:.3f} GB; must cross {m['must_cross_bytes'] / 1e9:.3f} GB "
            f"({m['floor_note']}) = {m['bytes_ms']:.2f} ms; resident {_f(res)} ms; floor {m['floor_ms']:.2f} ms"
            + (f"; optimistic floor (both directions at once) {m['floor_optimistic_ms']:.2f} ms" if m.get("floor_optimistic_ms") else "")
        )
    return lines


def format_notes(rows: list[dict[str, Any]]) -> list[str]:
    out = []
    for r in rows:
        tag = f"{_tag(r)}/{r['variant']}"
        if r.get("status") != "ok":
            out.append(f"{tag}: {r.get('status')}: {r.get('reason')}")
            continue
        bits = []
        if r.get("note"):
            bits.append(r["note"])
        if r.get("sweep"):
            bits.append("chose " + ", ".join(f"{k}={v}" for k, v in r["config"].items() if k in ("prefetch", "offload_granularity")))
        if r.get("floor_basis") and r["floor_basis"] != "workload floor":
            bits.append(f"floor {r['floor_ms']:.2f} ms ({r['floor_basis']})")
        if r.get("paired"):
            pr = r["paired"]
            bits.append(f"paired x{pr['rounds']}: resident {pr['resident_median_ms']:.2f} ms, ours {pr['ours_median_ms']:.2f} ms"
                        + (f" (per-round ratio median {pr['x_resident_per_round_median']:.3f})"
                           if pr.get("x_resident_per_round_median") else ""))
            slow = [x for x in pr.get("per_round", []) if x.get("ours_ms", 0) > 1.1 * pr["ours_median_ms"]]
            if slow:
                bits.append("slow rounds (ours ms/enqueue ms/stall ms): " + ", ".join(
                    f"{x['ours_ms']:.0f}/{x['ours_enqueue_ms']:.0f}/{x.get('ours_stall_ms', float('nan')):.1f}" for x in slow))
        if r.get("paired_skipped"):
            bits.append(f"no paired rounds: {r['paired_skipped']}")
        if r.get("vram_cap_bytes"):
            bits.append(f"under a {r['vram_cap_bytes'] / 2**30:.0f} GiB per-process cap")
        st = r.get("stats") or {}
        if st.get("plan_chosen_by") not in (None, "none", "bytes"):
            bits.append(f"plan: {st['plan_chosen_by']}, {st.get('slot_count')} slots, depth {st.get('prefetch_depth')}"
                        + (f", {st['plan_sticky_units']} sticky" if st.get("plan_sticky_units") else "")
                        + (f", planned {st['plan_planned_step_ms']:.1f} ms" if st.get("plan_planned_step_ms") else ""))
        if r.get("peak_over_budget") is not None:
            bits.append(f"peak allocated {r['peak_vram_bytes'] / 2**30:.3f} GiB = {r['peak_over_budget']:.3f} x the budget")
        if r.get("rel_l2_err") is not None and r.get("bitwise_equal") is None:
            bits.append(f"rel L2 error vs bf16 resident {r['rel_l2_err']:.2e}")
        if r.get("vram_within_bound") is not None:
            bits.append(f"peak VRAM {'within' if r['vram_within_bound'] else 'OVER'} {r['vram_bound_basis']} ({r['vram_bound_bytes'] / 1e9:.2f} GB)")
        prof, eng = r.get("profiler"), r.get("profiled_engine")
        if prof and eng and prof.get("h2d_bytes"):
            bits.append(f"engine / profiler over one step: H2D bytes {eng['h2d_bytes'] / prof['h2d_bytes']:.4f}"
                        + (f", H2D ms {eng['h2d_ms'] / prof['h2d_ms']:.4f}" if prof.get("h2d_ms") and eng.get("h2d_ms") is not None
                           else ", H2D ms not timed that step"))
        elif prof and r.get("h2d_source") == "engine" and r.get("h2d_bytes_per_step"):
            bits.append(f"engine H2D counter / profiler = {r['h2d_bytes_per_step'] / max(prof['h2d_bytes'], 1):.4f}")
        if r.get("vram_after_teardown_bytes") and r.get("vram_baseline_bytes") is not None and r["vram_after_teardown_bytes"] > r["vram_baseline_bytes"]:
            bits.append(f"{(r['vram_after_teardown_bytes'] - r['vram_baseline_bytes']) / 1e6:.1f} MB of VRAM left after teardown")
        if bits:
            out.append(f"{tag}: " + "; ".join(bits))
    return out


def format_table(rows: list[dict[str, Any]], markdown: bool = False) -> str:
    table = [COLUMNS] + [_cells(r) for r in rows]
    if markdown:
        out = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
        out += ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in table[1:]]
        return "\n".join(out)
    widths = [max(len(row[i]) for row in table) for i in range(len(COLUMNS))]
    lines = []
    for j, row in enumerate(table):
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def render(result: dict[str, Any], echo: Callable[[str], None] = print) -> None:
    for line in format_header(result):
        echo(line)
    notes = format_notes(result["rows"])
    if notes:
        echo("")
        echo("notes:")
        for line in notes:
            echo("  " + line)
    echo("")
    echo("x floor: time / the row's floor (ours: its own, from the bytes it streams).  x wl floor: time / the workload floor.")
    echo("x floor paired: ours / max(resident, own bytes floor), with resident and ours timed in turn (--paired).")
    echo("H2D GB/step: from the engine's counters, or * from torch.profiler.")
    echo("setup s/GB: the whole session's setup (engine, optimizer offload, optimizer).  pack s/GB: the engine's pack and pin.")
    echo("exact: output bit-for-bit equal to resident (training: step-1 loss; 'step1' = later steps drift).")
    echo("peak/budget: peak allocated VRAM of the whole process / vram_budget (must be <= 1.01).")
    echo(format_table(_by_tier(result)))
    if result.get("tiers"):
        echo("")
        echo("link tiers: each row against its tier's floor, max(resident, bytes that must cross / the tier's rate);")
        echo("H2D GB/s: the engine's own measured (paced) copy rate; plan: what the planner chose at that tier.")
        echo(format_tier_table(result["rows"], [t["link_gbps"] for t in result["tiers"]]))


def _by_tier(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows, one block per link tier where the run had tiers."""
    tiers = result.get("tiers")
    if not tiers:
        return result["rows"]
    return [r for t in tiers for r in result["rows"] if r.get("tier") == t["tier"]]


def format_markdown(result: dict[str, Any]) -> str:
    """The same report as markdown, ready to paste into bench/RESULTS.md (with link tiers: their table first)."""
    parts = ["```", *format_header(result), "```", ""]
    if result.get("tiers"):
        parts += [format_tier_table(result["rows"], [t["link_gbps"] for t in result["tiers"]], markdown=True), ""]
    parts += [format_table(_by_tier(result), markdown=True)]
    notes = format_notes(result["rows"])
    if notes:
        parts += ["", *[f"- {n}" for n in notes]]
    return "\n".join(parts) + "\n"


# ---------------------------------------------------------------- link tiers (--link-gbps, bench/tiers.py)
TIER_COLUMNS = ["tier", "workload", "variant", "time ms", "floor ms", "x floor", "target", "H2D GB/s", "plan", "exact"]


def _tier_plan(r: dict[str, Any]) -> str:
    """What the planner chose: depth, ring slots, sticky and resident units, granularity (stats()["plan"])."""
    st = r.get("stats") or {}
    if r.get("family") != "ours" or not st:
        return "-"
    bits = [f"depth {st.get('prefetch_depth')}", f"{st.get('slot_count')} slots",
            f"{st.get('sticky_units', 0)} sticky", f"{st.get('plan_resident_units', 0)} resident",
            str(st.get("plan_granularity") or (r.get("config") or {}).get("offload_granularity") or "auto")]
    chosen = st.get("plan_chosen_by")
    if chosen not in (None, "none"):
        bits.append(f"({chosen})")
    return ", ".join(bits)


def _tier_cells(r: dict[str, Any]) -> list[str]:
    head = [r.get("tier", "real"), r["workload"], r["variant"]]
    if r.get("status") != "ok":
        reason = (r.get("reason") or "").splitlines()[0] if r.get("reason") else ""
        return head + [r.get("status", "?"), "-", "-", "-", "-", reason[:70], "-"]
    target = r.get("target_x_floor")
    gbps = (r.get("stats") or {}).get("h2d_gbps") if r.get("family") == "ours" else None
    return head + [
        f"{r['time_ms']:.2f}",
        "-" if r.get("floor_ms") is None else f"{r['floor_ms']:.2f}",
        "-" if r.get("x_floor") is None else f"{r['x_floor']:.3f}",
        "-" if target is None else f"<={target:g} " + ("ok" if r.get("meets_target") else "MISS"),
        "-" if not gbps else f"{gbps:.1f}",
        _tier_plan(r),
        _exact(r),
    ]


def format_tier_table(rows: list[dict[str, Any]], tiers: list[float | None], markdown: bool = False) -> str:
    """One block of rows per tier (in the order asked), each row against its tier's floor."""
    blocks = [[_tier_cells(r) for r in rows if r.get("tier") == tier_label(g)] for g in tiers]
    if markdown:
        out = ["| " + " | ".join(TIER_COLUMNS) + " |", "|" + "---|" * len(TIER_COLUMNS)]
        out += ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for block in blocks for row in block]
        return "\n".join(out)
    table = [TIER_COLUMNS] + [row for block in blocks for row in block]
    widths = [max(len(row[i]) for row in table) for i in range(len(TIER_COLUMNS))]
    line = "  ".join("-" * w for w in widths)
    lines = ["  ".join(c.ljust(w) for c, w in zip(TIER_COLUMNS, widths)).rstrip(), line]
    for i, block in enumerate(blocks):
        if i:
            lines.append("")
        lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in block]
    return "\n".join(lines)
