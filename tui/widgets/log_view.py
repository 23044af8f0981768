"""`LogView`: draws only the visible lines of a `LogSource` (Textual's line API), so size does not matter."""

from __future__ import annotations

import re

from rich.segment import Segment
from rich.style import Style
from textual.geometry import Size
from textual.scroll_view import ScrollView
from textual.strip import Strip

from tui.logsource import LogSource

__all__ = ["LogView"]

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[@-_]")
_MATCH = Style(reverse=True, bold=True)
_CURRENT = Style(bgcolor="grey23")


def clean(text: str) -> str:
    return _ANSI.sub("", text).expandtabs(8).replace("\x00", "")


class LogView(ScrollView, can_focus=True):
    DEFAULT_CSS = """
    LogView { height: 1fr; background: $surface; }
    """

    def __init__(self, source: LogSource, **kwargs) -> None:
        super().__init__(**kwargs)
        self.source = source
        self.pattern: re.Pattern[str] | None = None
        self.current: int | None = None  # the line the last search landed on

    def sync_size(self) -> None:
        # No width: long lines are cut at the edge, so there is nothing to scroll sideways; a width
        # would bring a horizontal scrollbar once the vertical one narrows the view, and with it a
        # last line hidden under the bar.
        self.virtual_size = Size(0, self.source.line_count)

    def on_resize(self) -> None:
        self.sync_size()

    @property
    def top_line(self) -> int:
        return int(self.scroll_y)

    @property
    def at_end(self) -> bool:
        return self.scroll_y >= self.max_scroll_y

    def render_line(self, y: int) -> Strip:
        n = int(self.scroll_y) + y
        width = self.size.width
        if n >= self.source.line_count:
            return Strip.blank(width)
        text = clean(self.source.line(n))[int(self.scroll_x):][: width]
        base = _CURRENT if n == self.current else Style()
        segments: list[Segment] = []
        if self.pattern is not None:
            pos = 0
            for m in self.pattern.finditer(text):
                if m.start() > pos:
                    segments.append(Segment(text[pos:m.start()], base))
                if m.end() > m.start():
                    segments.append(Segment(text[m.start():m.end()], _MATCH))
                pos = m.end()
            if pos < len(text):
                segments.append(Segment(text[pos:], base))
        else:
            segments.append(Segment(text, base))
        return Strip(segments).extend_cell_length(width, base).crop(0, width)

    def go_to(self, n: int) -> None:
        self.current = n
        target = max(0, n - self.size.height // 3)
        self.scroll_to(y=target, animate=False)
        self.refresh()
