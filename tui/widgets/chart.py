"""`TimeChart`: a few series drawn as braille lines, with a ceiling line (budget, capacity).

Cheap on purpose: a chart is redrawn only when its data changed or it was resized, and a redraw
is one pass over at most two points per cell column. It draws through Textual's line API: the
plot's lines become strips once per change (Rich's renderer, straight to segments), and a
repaint hands them out; going through a `render()` Text cost more than drawing the plot itself.
NaN and missing values are gaps.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual.geometry import Region
from textual.strip import Strip
from textual.widget import Widget

from tui.fmt import fmt_value
from tui.history import ChartSpec, MetricHistory, Series

__all__ = ["TimeChart", "braille_plot", "format_value"]

# Bits of a braille cell's dots, [column][row]; row 0 is the top.
_DOTS = ((0x01, 0x02, 0x04, 0x40), (0x08, 0x10, 0x20, 0x80))
COLORS = ("cyan", "magenta", "green", "yellow")
LIMIT_COLOR = "red"


def format_value(value: float | None, unit: str) -> str:
    return fmt_value(value, unit, short=True)


def braille_plot(series: list[Series], width: int, height: int, lo: float, hi: float,
                 limit: float | None = None) -> list[list[tuple[int, int]]]:
    """Cells [row][col] = (dot bits, color index; -1 for none, -2 for the limit line)."""
    if width <= 0 or height <= 0:
        return [[(0, -1)] * max(0, width) for _ in range(max(0, height))]
    bits = [0] * (width * height)
    colors = [-1] * (width * height)
    span = (hi - lo) or 1.0
    rows = height * 4
    last_row = rows - 1
    dots = _DOTS

    def ypix(v: float) -> int:
        return min(last_row, max(0, int(round((hi - v) / span * last_row))))

    if limit is not None and math.isfinite(limit) and lo <= limit <= hi:
        py = ypix(limit)
        bit, base = dots[0][py & 3], (py >> 2) * width
        for cx in range(width):
            bits[base + cx] |= bit
            if colors[base + cx] < 0:
                colors[base + cx] = -2
    for idx, s in enumerate(series):
        cols = s.columns(width * 2)
        if not cols:
            continue
        scale = (width * 2 - 1) / max(1, len(cols) - 1)  # few points: stretch them over the width
        prev: tuple[int, int] | None = None
        for j, y in enumerate(cols):
            if y != y:  # NaN: a gap
                prev = None
                continue
            px, py = int(round(j * scale)), ypix(y)
            if prev is None:
                spans = ((px, py, py),)
            else:  # a line from the previous point: interpolate across, then a vertical run
                x0, y0 = prev
                spans = []
                for x in range(x0 + 1, px + 1):
                    yi = int(round(y0 + (py - y0) * (x - x0) / (px - x0)))
                    yp = int(round(y0 + (py - y0) * (x - 1 - x0) / (px - x0)))
                    spans.append((x, min(yi, yp), max(yi, yp)))
            for x, y_lo, y_hi in spans:
                cx = x >> 1
                if not 0 <= cx < width:
                    continue
                col_bits = dots[x & 1]
                for q in range(y_lo, y_hi + 1):
                    i = (q >> 2) * width + cx
                    bits[i] |= col_bits[q & 3]
                    colors[i] = idx
            prev = (px, py)
    return [list(zip(bits[r * width:(r + 1) * width], colors[r * width:(r + 1) * width])) for r in range(height)]


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
        # (rows, width, height, base style), each line's runs, each line's strip
        self._drawn: tuple[tuple[Any, ...], list[Any], list[Strip]] | None = None
        self.border_title = chart.title

    def refresh_data(self) -> None:
        """Redraw after new rows: only the lines that differ are repainted (in steady state the
        legend and the plot's last columns), the rest of the chart stays as it is on screen."""
        h = self._history_of()
        if h.rows == self._version:
            return
        self._version = h.rows
        w = self.content_size.width
        changed = self._build() if w and self._drawn is not None else None
        if changed is None:
            self.refresh()
        elif changed:
            self.refresh(*(Region(0, y, w, 1) for y in changed))

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

    def _build(self) -> list[int] | None:
        """Make the strips for the current rows and size; returns the lines that differ from the
        strips before (None: all of them)."""
        h = self._history_of()
        w, ht = self.content_size.width, self.content_size.height
        base = self.rich_style
        key = (h.rows, w, ht, base)
        old = self._drawn
        if old is not None and old[0] == key:
            return []
        legend = self._legend(h)
        legend.truncate(w, overflow="ellipsis")
        lines: list[Any] = [legend, *(tuple(runs) for runs in self._plot_rows(h, w, ht))]
        same_shape = old is not None and old[0][1:] == key[1:]
        styles = {name: base + Style.parse(name) if name else base for name in (*COLORS, LIMIT_COLOR, "dim", None)}
        strips: list[Strip] = []
        changed: list[int] = []
        for y, line in enumerate(lines):
            if same_shape and y < len(old[1]) and old[1][y] == line:
                strips.append(old[2][y])
                continue
            changed.append(y)
            if y == 0:
                strips.append(Strip(legend.render(self.app.console), legend.cell_len).apply_style(base))
            else:
                strips.append(Strip([Segment(text, styles[style]) for text, style in line]))
        if same_shape:
            changed.extend(range(len(lines), len(old[1])))  # lines gone (now blank)
        self._drawn = (key, lines, strips)
        return changed if same_shape else None

    def render_line(self, y: int) -> Strip:
        self._build()
        strips = self._drawn[2] if self._drawn is not None else []
        return strips[y] if y < len(strips) else Strip.blank(self.content_size.width, self.rich_style)

    def plot_text(self) -> Text:
        """The chart as Text: the legend line, then the plot's lines (what `render_line` draws)."""
        h = self._history_of()
        text = self._legend(h)
        for runs in self._plot_rows(h, self.content_size.width, self.content_size.height):
            text.append("\n")
            for run, style in runs:
                text.append(run, style=style)
        return text

    def _plot_rows(self, h: MetricHistory, w: int, ht: int) -> list[list[tuple[str, str | None]]]:
        """The lines under the legend, as runs of (text, style)."""
        plot_h = max(0, ht - 1)
        label_w = 7
        plot_w = max(0, w - label_w - 1)
        series = [h.get(name) for name, _ in self.chart.series]
        ranges = [r for r in (s.range() for s in series) if r is not None]
        limit = h.get(self.chart.limit).last() if self.chart.limit else None
        if self.chart.unit == "pct":
            lo, hi = 0.0, 1.0
        elif ranges:
            hi = max(r[1] for r in ranges)
            hi = max(hi, limit) if limit else hi
            lo = 0.0 if self.chart.unit in ("bytes", "gbps", "ms") else min(r[0] for r in ranges)
            if hi == lo:
                hi = lo + (abs(lo) * 0.1 or 1.0)
        else:
            lo, hi = 0.0, (limit or 1.0)
        if not ranges:
            return [[("waiting for metrics", "dim")]] if plot_h else []
        if not (plot_h and plot_w):
            return []
        rows = []
        top, bottom = format_value(hi, self.chart.unit), format_value(lo, self.chart.unit)
        for r, row in enumerate(braille_plot(series, plot_w, plot_h, lo, hi, limit)):
            label = top if r == 0 else bottom if r == plot_h - 1 else ""
            runs: list[tuple[str, str | None]] = [(label.rjust(label_w)[:label_w] + " ", "dim")]
            run_style, run = None, []
            for bits, color in row:
                style = LIMIT_COLOR if color == -2 else COLORS[color % len(COLORS)] if color >= 0 else None
                if style != run_style and run:
                    runs.append(("".join(run), run_style))
                    run = []
                run_style = style
                run.append(chr(0x2800 + bits) if bits else " ")
            if run:
                runs.append(("".join(run), run_style))
            rows.append(runs)
        return rows
