"""Formatting for the dashboard: the shared formatters of jobs/display.py, and chart values in their unit."""

from __future__ import annotations

import math
from typing import Any, Mapping

from jobs.contract import Metric
from jobs.display import fmt_age, fmt_bytes, fmt_duration, fmt_num, fmt_pct, fmt_ratio_bytes, num

__all__ = ["num", "fmt_bytes", "fmt_pct", "fmt_num", "fmt_age", "fmt_duration", "fmt_ratio_bytes", "fmt_value",
           "fmt_host_store"]

# The engine reports "no pinned limit" as a huge number (offload_core's 1 << 62); no spec can set
# a size past 1 EiB (jobs.spec_yaml.MAX_BYTES), so a limit past that is none.
_NO_PINNED_LIMIT = 1 << 60


def fmt_value(value: float | None, unit: str, *, short: bool = False) -> str:
    """A chart value in its unit ("bytes", "pct", "gbps", "ms", else a number); `short` for the
    terminal's charts (1.2G, 5.28, 0.3ms), the long form for the report (1.2 GiB, 5.28 GB/s, 0.3 ms)."""
    if value is None or not math.isfinite(value):
        return "-"
    if unit == "bytes":
        return fmt_bytes(value, short=short)
    if unit == "pct":
        return fmt_pct(value)
    if unit == "gbps":
        return f"{value:.2f}" if short else f"{value:.2f} GB/s"
    if unit == "ms":
        return f"{value:.1f}ms" if short else f"{value:.1f} ms"
    return fmt_num(value, 4)


def fmt_host_store(m: Mapping[str, Any]) -> str | None:
    """Where the engine's streamed bytes live, and why, from a metrics row: "host store bounce: pinned
    64.0 KiB / limit 64.0 KiB, fill 3.1 GB/s — <reason>", "host store arena: <reason>"; None when the
    row does not say (not an engine job, or a store that does not report it)."""
    store = m.get(Metric.host_store)
    if not isinstance(store, str) or not store:
        return None
    reason = m.get(Metric.host_store_reason)
    reason = reason if isinstance(reason, str) and reason else None
    details = []
    if store != "arena" or reason is None:  # the arena's reason says what it pinned, and its limit
        limit = num(m.get(Metric.pinned_limit_bytes))
        shown = "none" if limit is None or limit >= _NO_PINNED_LIMIT else fmt_bytes(limit)
        details.append(f"pinned {fmt_bytes(m.get(Metric.pinned_used_bytes))} / limit {shown}")
    if m.get(Metric.bounce_fill_gbps) is not None:
        details.append(f"fill {fmt_num(m.get(Metric.bounce_fill_gbps), 3)} GB/s")
    line = f"host store {store}: " + ", ".join(details)
    if reason is not None:
        line += (" — " if details else "") + reason
    return line
