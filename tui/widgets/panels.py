"""The GPU panel and the connection bar: one line or two each, at the edges of every screen."""

from __future__ import annotations

from typing import Callable

from rich.text import Text
from textual.widgets import Static

from tui.fmt import fmt_ratio_bytes
from tui.gpu import PanelData, read_panel

__all__ = ["GpuPanel", "ConnectionBar"]


class GpuPanel(Static):
    """Device totals from NVML (or why there are none) and the host's RAM, read once a second
    on a thread from the first frame on; redrawn only when the text changes."""

    DEFAULT_CSS = """
    GpuPanel { height: auto; max-height: 4; padding: 0 1; background: $boost; }
    """

    def __init__(self, reader: Callable[[], PanelData] | None = None, interval: float = 1.0, **kwargs) -> None:
        super().__init__("", **kwargs)
        self.reader = reader or read_panel
        self.interval = interval
        self.data: PanelData | None = None
        self._shown: Text | None = None

    def on_mount(self) -> None:
        # NVML's init and psutil's import happen on the reading thread, after the first frame.
        after = getattr(self.app, "after_first_frame", None)
        if after is not None:
            after(self._start)
        else:
            self._start()

    _timer = None
    _paused = False

    def _start(self) -> None:
        if not self.is_attached:
            return
        if self.interval > 0:
            self._timer = self.set_interval(self.interval, self._poll, pause=self._paused)
        if not self._paused:
            self._poll()

    def pause(self) -> None:
        """Stop reading while its screen is covered: a covered screen that changes makes Textual
        repaint the whole screen on top. `resume` reads again at once."""
        self._paused = True
        if self._timer is not None:
            self._timer.pause()

    def resume(self) -> None:
        was, self._paused = self._paused, False
        if self._timer is not None and was:
            self._timer.resume()
            self._poll()

    def _poll(self) -> None:
        self.run_worker(self._read, thread=True, exclusive=True, group="gpu-panel", exit_on_error=False)

    def _read(self) -> None:
        data = self.reader()
        self.app.call_from_thread(self.show, data)

    def show(self, data: PanelData) -> None:
        self.data = data
        text = Text(no_wrap=True, overflow="ellipsis")
        if data.no_gpu:
            text.append(data.no_gpu, style="dim")
        for d in data.devices:
            if text:
                text.append("\n")
            text.append(f"GPU{d.index} ", style="bold")
            text.append(f"{d.name}  ")
            text.append(f"VRAM {fmt_ratio_bytes(d.used, d.total)}", style="cyan")
            if d.util is not None:
                text.append(f"  util {d.util}%")
            if d.temp is not None:
                text.append(f"  {d.temp}C")
            if d.power_w is not None:
                text.append(f"  {d.power_w:.0f}W")
        if data.host_total:
            text.append("   host RAM ", style="bold")
            text.append(fmt_ratio_bytes(data.host_used, data.host_total))
        if text != self._shown:
            lines_before = self._shown.plain.count("\n") if self._shown is not None else -1
            self._shown = text
            self.update(text, layout=text.plain.count("\n") != lines_before)  # same height: no layout pass


class ConnectionBar(Static):
    """Whether the worker answers, and what the dashboard does about it when it does not.

    Drawn when the state changes: the app calls `sync()` on every bar it shows."""

    DEFAULT_CSS = """
    ConnectionBar { height: 1; padding: 0 1; background: $boost; }
    ConnectionBar.-bad { background: $error 40%; }
    """

    _drawn: tuple | None = None

    def on_mount(self) -> None:
        self.sync()  # and again whenever the connection changes (DashboardApp.on_connection_state)

    def sync(self) -> None:
        conn = self.app.connection  # type: ignore[attr-defined]
        url = self.app.url  # type: ignore[attr-defined]
        key = (conn.state, conn.detail, conn.retry_s, url)
        if key == self._drawn:
            return
        self._drawn = key
        text = Text(no_wrap=True, overflow="ellipsis")
        bad = conn.state not in ("ok", "connecting", "offline")
        if conn.state == "ok":
            text.append("● ", style="green")
            text.append(f"worker {url}")
        elif conn.state == "connecting":
            text.append(f"connecting to {url} ...", style="dim")
        elif conn.state == "offline":
            text.append("replay (no worker)", style="dim")
        else:
            label = {"down": "worker unreachable", "auth": "token refused", "error": "worker error"}[conn.state] \
                if conn.state in ("down", "auth", "error") else conn.state
            text.append(f"✖ {label}: ", style="bold")
            text.append(conn.detail.removeprefix("error: "))
            if conn.retry_s:
                text.append(f" (retrying every {conn.retry_s:.0f}s)" if conn.retry_s >= 1 else " (retrying)")
        self.set_class(bad, "-bad")
        self.update(text, layout=False)  # always one line
