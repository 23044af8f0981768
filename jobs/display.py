"""How the CLI and the dashboard show things: sizes, rates, durations, ages, numbers that may be
missing or NaN, and the colour of each job state.

Stdlib only (the styles are Rich style names, but Rich is not imported): `offload-jobs ps`, `show`,
`follow` (jobs/_cli/output.py) and the dashboard (tui/fmt.py re-exports these) draw with the same
functions, so a duration or a FAILED looks the same in both.
"""

from __future__ import annotations

import math
import time
from typing import Any

from jobs.contract import JobState, Metric

__all__ = ["num", "fmt_bytes", "fmt_pct", "fmt_num", "fmt_age", "fmt_duration", "fmt_ratio_bytes", "STATUS_STYLE",
           "STATUS_ANSI", "status_markup", "progress_line", "batch_line"]

# Rich style of each state (tables, the detail screen, `show`), and the same as ANSI codes for the
# plain-text `ps` table.
STATUS_STYLE: dict[str, str] = {
    JobState.PENDING: "dim",
    JobState.STARTING: "cyan",
    JobState.RUNNING: "bold cyan",
    JobState.CANCELLING: "yellow",
    JobState.SUCCEEDED: "green",
    JobState.FAILED: "bold red",
    JobState.CANCELLED: "yellow",
}
STATUS_ANSI = {"bold": "1", "dim": "2", "cyan": "36", "bold cyan": "1;36", "yellow": "33", "green": "32", "bold red": "1;31"}


def num(value: Any) -> float | None:
    """`value` as a finite float, or None (missing, null, NaN, inf, a string, a bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    f = float(value)
    return f if math.isfinite(f) else None


def fmt_bytes(value: Any, *, short: bool = False) -> str:
    """1536 -> '1.5 KiB' (binary units; '-' when unknown)."""
    b = num(value)
    if b is None:
        return "-"
    units = ("B", "K", "M", "G", "T") if short else ("B", "KiB", "MiB", "GiB", "TiB")
    sep = "" if short else " "
    for unit in units:
        if abs(b) < 1024 or unit == units[-1]:
            if unit == "B":
                return f"{int(b)}{sep}{unit}"
            return f"{b:.1f}{sep}{unit}" if abs(b) < 100 else f"{b:.0f}{sep}{unit}"
        b /= 1024
    return "-"  # pragma: no cover


def fmt_ratio_bytes(used: Any, total: Any) -> str:
    """'1.2 GiB / 7.5 GiB (16%)', or just the used part when the total is unknown."""
    u, t = num(used), num(total)
    if u is None:
        return "-"
    if t is None or t <= 0:
        return fmt_bytes(u)
    return f"{fmt_bytes(u)} / {fmt_bytes(t)} ({100 * u / t:.0f}%)"


def fmt_pct(value: Any, digits: int = 0) -> str:
    """0.873 -> '87%'."""
    f = num(value)
    return "-" if f is None else f"{100 * f:.{digits}f}%"


def fmt_num(value: Any, digits: int = 4) -> str:
    """A number to `digits` significant figures; NaN shows as 'nan', missing as '-'."""
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    f = num(value)
    if f is None:
        return "-" if value is None else str(value)
    if f == int(f) and abs(f) < 1e15:
        return str(int(f))
    return f"{f:.{digits}g}"


def fmt_duration(seconds: Any) -> str:
    s = num(seconds)
    if s is None:
        return "-"
    s = max(0.0, s)
    if s < 60:
        return f"{s:.1f}s" if s < 10 else f"{int(s)}s"
    i = int(s)
    if i < 3600:
        return f"{i // 60}m{i % 60:02d}s"
    if i < 86400:
        return f"{i // 3600}h{i % 3600 // 60:02d}m"
    return f"{i // 86400}d{i % 86400 // 3600:02d}h"


def fmt_age(ts: Any, now: float | None = None) -> str:
    """Coarse age of an epoch timestamp: '15s', '3m', '5h', '2d' (changes rarely, so tables diff little).

    Under a minute it counts in steps of 5 s: a table of fresh jobs then repaints a fifth of its
    rows a second rather than all of them.
    """
    t = num(ts)
    if t is None:
        return "-"
    s = max(0, int((time.time() if now is None else now) - t))
    if s < 60:
        return f"{s - s % 5}s"
    if s < 3600:
        return f"{s // 60}m"
    if s < 86400:
        return f"{s // 3600}h"
    return f"{s // 86400}d"


def status_markup(status: str | None, reason: str | None = None) -> str:
    """A state in Rich markup, coloured, with its reason dimmed after it (none for a success)."""
    status = status or "?"
    style = STATUS_STYLE.get(status, "")
    text = f"[{style}]{status}[/]" if style else status
    if reason and status != JobState.SUCCEEDED:
        text += f" [dim]({reason})[/]"
    return text


def progress_line(m: Any) -> str:
    """A job's progress from a metrics row: 'step 6/30  loss 0.1318  8.66 it/s  ETA 2.8s' (what it has)."""
    if not isinstance(m, dict) or m.get(Metric.step) is None:
        return ""
    total = m.get(Metric.total_steps)
    parts = [f"step {fmt_num(m.get(Metric.step))}" + (f"/{fmt_num(total)}" if total is not None else "")]
    if Metric.loss in m:
        parts.append(f"loss {fmt_num(m.get(Metric.loss), 4)}")
    if m.get(Metric.it_s) is not None:
        parts.append(f"{fmt_num(m.get(Metric.it_s), 3)} it/s")
    if m.get(Metric.eta_seconds) is not None:
        parts.append(f"ETA {fmt_duration(m.get(Metric.eta_seconds))}")
    return "  ".join(parts)


def batch_line(m: Any) -> str:
    """Which jobs ran together (co-scheduled inference) and the per-image time, from a metrics row:
    'in the batch of 3f2a (3 jobs: 3f2a, 9c01, d4e7), 0.412s an image'; '' for a job that ran alone."""
    if not isinstance(m, dict) or not m.get(Metric.batch_of):
        return ""
    with_ = m.get(Metric.batch_with) or []
    text = f"in the batch of {m[Metric.batch_of]}"
    if isinstance(with_, list) and with_:
        text += f" ({len(with_)} jobs: {', '.join(str(j) for j in with_)})"
    if m.get(Metric.image_seconds) is not None:
        text += f", {fmt_num(m.get(Metric.image_seconds), 3)}s an image"
    return text
