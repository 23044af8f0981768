"""The logs screen: a job's output.log, opened at its end, followed (`f`), searched (`/`, `n`, `N`).

It reads through the logs API by byte offset: the last block first (so a 100 MB log opens at
once), the blocks before it counted in the background, new output every half second.
"""

from __future__ import annotations

import re
import threading
from typing import Callable

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import Footer, Header, Input, Static

from jobs.errors import JobsError
from tui.logsource import Chunk, LogSource
from tui.widgets.log_view import LogView
from tui.widgets.panels import ConnectionBar
from tui.widgets.popup_input import PopupInput

__all__ = ["LogsScreen"]


class LogsScreen(Screen):
    BINDINGS = [
        Binding("escape", "back", "Back"),
        Binding("f", "toggle_follow", "Follow"),
        Binding("slash", "search", "Search", key_display="/"),
        Binding("n", "next_match", "Next"),
        Binding("N", "prev_match", "Previous", key_display="N"),
        Binding("g", "top", "Top", show=False),
        Binding("G", "bottom", "Bottom", show=False),
    ]
    DEFAULT_CSS = """
    LogsScreen #logstatus { height: 1; padding: 0 1; background: $boost; }
    """

    def __init__(self, job_id: str, *, tail: int | None = None, follow: bool = True, poll_s: float = 0.5,
                 fetch: Callable[[int, int], dict] | None = None) -> None:
        super().__init__()
        self._own_fetch = fetch  # a recorded log (snapshots); else the worker's logs API
        self.job_id = job_id
        self.follow = follow
        self.poll_s = poll_s
        self.needle = ""
        self.search_note = ""
        self.error = ""
        self._client = None
        self._stop = threading.Event()
        self.source = LogSource(fetch or self._fetch, max_lines=tail)
        self.opened = threading.Event()

    def _fetch(self, offset: int, limit: int) -> dict:
        if self._client is None:
            self._client = self.app.client()
        return self._client.logs(self.job_id, offset, limit)

    def compose(self) -> ComposeResult:
        yield Header(show_clock=False)
        yield PopupInput(placeholder="search (Enter: find; n/N: next/previous; Esc: close)", id="search")
        yield LogView(self.source, id="log")
        yield Static(id="logstatus")
        yield ConnectionBar()
        yield Footer()

    @property
    def view(self) -> LogView:
        return self.query_one("#log", LogView)

    def on_mount(self) -> None:
        self.sub_title = f"logs of job {self.job_id}"
        self.view.focus()
        self._status()
        if self.app.make_client is not None or self._own_fetch is not None:
            self.run_worker(self._reader, thread=True, group=f"logs-{self.job_id}", exit_on_error=False)
        self.set_interval(self.app.refresh_s, self._status)

    def on_unmount(self) -> None:
        self._stop.set()
        if self._client is not None:
            self._client.close()

    # ------------------------------------------------------------ reading (a worker thread)
    def _reader(self) -> None:
        call = self.app.call_from_thread
        try:
            call(self._opened, self.source.fetch_tail())
            while not self._stop.is_set() and not self.source.fully_indexed:
                call(self._prepend, self.source.fetch_before(self.source.blocks[0].start))
            while not self._stop.wait(self.poll_s):
                chunk = self.source.fetch_after()
                if chunk.text:
                    call(self._append, chunk)
        except JobsError as exc:
            self.error = str(exc)
        except RuntimeError:  # the app is closing
            return

    def _opened(self, chunk: Chunk) -> None:
        self.source.apply_append(chunk)
        # force: right after sync_size the scrollbars are not recomputed yet (that waits for a
        # refresh) and an unforced scroll is refused: a log that was complete stayed at its top.
        self.view.sync_size()
        self.view.scroll_end(animate=False, immediate=True, force=True)
        self.opened.set()
        self.view.refresh()

    def _prepend(self, chunk: Chunk) -> None:
        was_end = self.view.at_end
        added = self.source.apply_prepend(chunk)
        if not added:
            return
        y = self.view.scroll_y
        self.view.sync_size()
        if self.view.current is not None:
            self.view.current += added
        if was_end and self.follow:
            self.view.scroll_end(animate=False, immediate=True, force=True)
        else:  # keep the same lines in view
            self.view.scroll_to(y=y + added, animate=False, immediate=True)
        self.view.refresh()

    def _append(self, chunk: Chunk) -> None:
        if self.source.apply_append(chunk):
            self.view.sync_size()
            if self.follow:
                self.view.scroll_end(animate=False, immediate=True, force=True)
            self.view.refresh()

    # ------------------------------------------------------------ the status line
    def _status(self) -> None:
        src = self.source
        t = Text(no_wrap=True, overflow="ellipsis")
        shown = min(src.line_count, self.view.top_line + self.view.size.height)
        t.append(f"line {shown:,} of {src.line_count:,}", style="bold")
        if not src.fully_indexed:
            t.append(" (counting earlier lines...)", style="dim")
        t.append(f"  {src.size / 1e6:.1f} MB")
        t.append("  follow ", style="dim")
        t.append("on" if self.follow else "off", style="green" if self.follow else "yellow")
        if src.status:
            t.append(f"  job {src.status}")
        if self.search_note:
            t.append(f"  {self.search_note}", style="cyan")
        if self.error:
            t.append(f"  {self.error}", style="red")
        self.query_one("#logstatus", Static).update(t)

    # ------------------------------------------------------------ keys
    def action_back(self) -> None:
        box = self.query_one("#search", PopupInput)
        if box.revealed:
            box.conceal()
            self.view.focus()
            return
        self.app.pop_screen()

    def action_toggle_follow(self) -> None:
        self.follow = not self.follow
        if self.follow:
            self.view.scroll_end(animate=False)
        self._status()

    def action_top(self) -> None:
        self.follow = False
        self.view.scroll_home(animate=False)

    def action_bottom(self) -> None:
        self.view.scroll_end(animate=False)

    def action_search(self) -> None:
        self.query_one("#search", PopupInput).reveal()

    @on(Input.Submitted, "#search")
    def _search_submitted(self, event: Input.Submitted) -> None:
        self.needle = event.value
        self.view.pattern = re.compile(re.escape(self.needle), re.IGNORECASE) if self.needle else None
        self.query_one("#search", PopupInput).conceal()
        self.view.focus()
        # From the end, the first search looks backwards: the newest match is the likely one.
        forward = self.view.current is not None
        self._find(forward=forward)

    def action_next_match(self) -> None:
        self._find(forward=True)

    def action_prev_match(self) -> None:
        self._find(forward=False)

    def _find(self, forward: bool) -> None:
        if not self.needle:
            return
        self.follow = False
        if self.view.current is not None:
            start = self.view.current
        else:
            start = self.source.line_count if not forward else self.view.top_line - 1
        needle = self.needle
        self.search_note = f"searching for {needle!r}..."

        def run() -> None:
            n = self.source.find(needle, start, forward=forward)
            self.app.call_from_thread(self._found, needle, n)

        self.run_worker(run, thread=True, group="log-search", exclusive=True, exit_on_error=False)

    def _found(self, needle: str, n: int | None) -> None:
        if n is None:
            self.search_note = f"{needle!r}: no more matches"
        else:
            self.search_note = f"{needle!r}: line {n + 1:,}"
            self.view.go_to(n)
        self._status()
