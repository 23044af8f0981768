"""Formatting for the dashboard: the shared formatters of jobs/display.py, and chart values in their unit."""

from __future__ import annotations

import math

from jobs.display import fmt_age, fmt_bytes, fmt_duration, fmt_num, fmt_pct, fmt_ratio_bytes, num

__all__ = ["num", "fmt_bytes", "fmt_pct", "fmt_num", "fmt_age", "fmt_duration", "fmt_ratio_bytes", "fmt_value"]


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
