"""`TimeChart`: a few series drawn as braille lines, with a ceiling line (budget, capacity).

Cheap on purpose: a chart is redrawn only when its data changed or it was resized, and a redraw
is one pass over at most two points per cell column. NaN and missing values are gaps.
"""

from __future__ import annotations

import math
from typing import Callable

from rich.text import Text
from textual.widget import Widget

from tui.fmt import fmt_bytes, fmt_num, fmt_pct
from tui.history import ChartSpec, MetricHistory, Series

__all__ = ["TimeChart", "braille_plot", "format_value"]

# Bits of a braille cell's dots, [column][row]; row 0 is the top.
_DOTS = ((0x01, 0x02, 0x04, 0x40), (0x08, 0x10, 0x20, 0x80))
COLORS = ("cyan", "magenta", "green", "yellow")
LIMIT_COLOR = "red"


def format_value(value: float | None, unit: str) -> str:
    if value is None or not math.isfinite(value):
        return "-"
    if unit == "bytes":
        return fmt_bytes(value, short=True)
    if unit == "pct":
        return fmt_pct(value)
    if unit == "gbps":
        return f"{value:.2f}"
    if unit == "ms":
        return f"{value:.1f}ms"
    return fmt_num(value, 4)


def _columns(series: Series, n: int) -> list[float]:
    """The series squeezed (or not) into `n` x positions: the max of each bucket, NaN for none."""
    ys = series.ys
    if not ys:
        return []
    if len(ys) <= n:
        return list(ys)
    out = []
    for i in range(n):
        lo, hi = i * len(ys) // n, (i + 1) * len(ys) // n
        bucket = [y for y in ys[lo:max(hi, lo + 1)] if math.isfinite(y)]
        out.append(max(bucket) if bucket else math.nan)
    return out


def braille_plot(series: list[Series], width: int, height: int, lo: float, hi: float,
                 limit: float | None = None) -> list[list[tuple[int, int]]]:
    """Cells [row][col] = (dot bits, color index; -1 for none, -2 for the limit line)."""
    cells = [[(0, -1) for _ in range(width)] for _ in range(height)]
    if width <= 0 or height <= 0:
        return cells
    span = (hi - lo) or 1.0
    rows = height * 4

    def ypix(v: float) -> int:
        return min(rows - 1, max(0, int(round((hi - v) / span * (rows - 1)))))

    def dot(px: int, py: int, color: int) -> None:
        cx, cy = px // 2, py // 4
        if 0 <= cx < width and 0 <= cy < height:
            bits, c = cells[cy][cx]
            cells[cy][cx] = (bits | _DOTS[px % 2][py % 4], color if c < 0 or color >= 0 else c)

    if limit is not None and math.isfinite(limit) and lo <= limit <= hi:
        py = ypix(limit)
        for px in range(0, width * 2, 2):
            dot(px, py, -2)
    for idx, s in enumerate(series):
        cols = _columns(s, width * 2)
        if not cols:
            continue
        scale = (width * 2 - 1) / max(1, len(cols) - 1)  # few points: stretch them over the width
        prev: tuple[int, int] | None = None
        for j, y in enumerate(cols):
            if not math.isfinite(y):
                prev = None
                continue
            px, py = int(round(j * scale)), ypix(y)
            if prev is None:
                dot(px, py, idx)
            else:  # a line from the previous point: interpolate across, then a vertical run
                x0, y0 = prev
                for x in range(x0 + 1, px + 1):
                    yi = int(round(y0 + (py - y0) * (x - x0) / (px - x0)))
                    yp = int(round(y0 + (py - y0) * (x - 1 - x0) / (px - x0)))
                    lo_y, hi_y = min(yi, yp), max(yi, yp)
                    for q in range(lo_y, hi_y + 1):
                        dot(x, q, idx)
            prev = (px, py)
    return cells


class TimeChart(Widget):
    """One `ChartSpec` of a `MetricHistory`, redrawn by `refresh_data()` when rows arrive."""

    DEFAULT_CSS = """
    TimeChart {
        height: 8;
        border: round $panel-lighten-2;
        border-title-color: $text;
        padding: 0 1 0 0;
    }
    """

    def __init__(self, chart: ChartSpec, history_of: Callable[[], MetricHistory], **kwargs) -> None:
        super().__init__(**kwargs)
        self.chart = chart
        self._history_of = history_of
        self._version = -1
        self._cache: tuple[tuple[int, int, int], Text] | None = None
        self.border_title = chart.title

    def refresh_data(self) -> None:
        h = self._history_of()
        if h.rows != self._version:
            self._version = h.rows
            self.refresh()

    def _legend(self, h: MetricHistory) -> Text:
        text = Text(no_wrap=True, overflow="ellipsis")
        for i, (name, label) in enumerate(self.chart.series):
            last = h.get(name).last()
            if last is None and i > 0:
                continue
            text.append(f"{label} ", style=COLORS[i % len(COLORS)])
            text.append(format_value(last, self.chart.unit) + "  ", style="bold")
        if self.chart.limit:
            cap = h.get(self.chart.limit).last()
            label = "budget" if "budget" in self.chart.limit else "capacity"
            text.append(f"{label} ", style=LIMIT_COLOR)
            text.append(format_value(cap, self.chart.unit) if cap else "none", style="bold")
        return text

    def render(self) -> Text:
        h = self._history_of()
        w, ht = self.content_size.width, self.content_size.height
        key = (h.rows, w, ht)
        if self._cache is not None and self._cache[0] == key:
            return self._cache[1]
        text = self._legend(h)
        plot_h = max(0, ht - 1)
        label_w = 7
        plot_w = max(0, w - label_w - 1)
        series = [h.get(name) for name, _ in self.chart.series]
        values = [y for s in series for y in s.finite()]
        limit = h.get(self.chart.limit).last() if self.chart.limit else None
        if self.chart.unit == "pct":
            lo, hi = 0.0, 1.0
        elif values:
            hi = max(values + ([limit] if limit else []))
            lo = 0.0 if self.chart.unit in ("bytes", "gbps", "ms") else min(values)
            if hi == lo:
                hi = lo + (abs(lo) * 0.1 or 1.0)
        else:
            lo, hi = 0.0, (limit or 1.0)
        if not values:
            text.append("\n" + "waiting for metrics" if plot_h else "", style="dim")
        elif plot_h and plot_w:
            cells = braille_plot(series, plot_w, plot_h, lo, hi, limit)
            top, bottom = format_value(hi, self.chart.unit), format_value(lo, self.chart.unit)
            for r, row in enumerate(cells):
                text.append("\n")
                label = top if r == 0 else bottom if r == plot_h - 1 else ""
                text.append(label.rjust(label_w)[:label_w] + " ", style="dim")
                run_style, run = None, []
                for bits, color in row:
                    style = LIMIT_COLOR if color == -2 else COLORS[color % len(COLORS)] if color >= 0 else None
                    ch = chr(0x2800 + bits) if bits else " "
                    if style != run_style and run:
                        text.append("".join(run), style=run_style)
                        run = []
                    run_style = style
                    run.append(ch)
                if run:
                    text.append("".join(run), style=run_style)
        self._cache = (key, text)
        return text
