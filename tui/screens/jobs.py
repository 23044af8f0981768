"""The jobs screen: a keyed DataTable of every job, updated cell by cell from what changed."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Header, Input

from tui.fmt import fmt_age, fmt_bytes, fmt_pct, num
from tui.history import budget_of, hit_rate_of, progress_of
from tui.screens.actions import JobActions
from tui.widgets.panels import ConnectionBar, GpuPanel

__all__ = ["JobsScreen", "job_row", "COLUMNS", "STATUS_STYLE"]

COLUMNS = (("id", "ID"), ("name", "NAME"), ("kind", "KIND"), ("status", "STATUS"), ("attempt", "ATT"),
           ("progress", "PROGRESS"), ("vram", "PEAK VRAM/BUDGET"), ("hit", "HIT"), ("age", "AGE"))
STATUS_STYLE = {"PENDING": "dim", "STARTING": "cyan", "RUNNING": "bold cyan", "CANCELLING": "yellow",
                "SUCCEEDED": "green", "FAILED": "bold red", "CANCELLED": "yellow"}


def _bar(frac: float | None, width: int = 8) -> str:
    if frac is None:
        return ""
    full = int(round(frac * width))
    return "█" * full + "░" * (width - full)


def job_row(job: dict[str, Any], now: float) -> tuple[Any, ...]:
    """The table cells of one job (strings and Rich Text; equal when nothing visible changed)."""
    status = str(job.get("status") or "?")
    reason = job.get("reason")
    st = Text(status, style=STATUS_STYLE.get(status, ""))
    if reason and status != "SUCCEEDED":
        st.append(f" ({reason})", style="dim")
    m = job.get("last_metrics") if isinstance(job.get("last_metrics"), dict) else {}
    spec = job.get("spec") if isinstance(job.get("spec"), dict) else {}
    frac, steps = progress_of(m, spec)
    if status == "SUCCEEDED" and frac is None:
        frac = 1.0
    progress = f"{_bar(frac)} {fmt_pct(frac)} {steps}".strip() if frac is not None else (steps or "-")
    peak = num(m.get("vram_peak_bytes"))
    if peak is None:
        peak = num(m.get("vram_allocated_bytes"))
    budget = budget_of(spec)
    vram = fmt_bytes(peak, short=True) if peak is not None else "-"
    if budget:
        vram += f"/{fmt_bytes(budget, short=True)}"
    attempt = job.get("attempt")
    att = f"{attempt}/{job['max_attempts']}" if attempt and job.get("max_attempts") else str(attempt or "-")
    return (str(job.get("id", "?")), str(job.get("name") or "-"), str(job.get("kind") or "-"), st, att,
            progress, vram, fmt_pct(hit_rate_of(m)), fmt_age(job.get("created_at"), now))


def _matches(job: dict[str, Any], needle: str) -> bool:
    if not needle:
        return True
    hay = " ".join(str(job.get(k) or "") for k in ("id", "name", "kind", "status", "reason")).lower()
    return all(part in hay for part in needle.lower().split())


class JobsScreen(JobActions, Screen):
    """Every job, newest first. `/` filters, Enter opens the detail, Esc clears the filter."""

    AUTO_FOCUS = "#jobs"

    BINDINGS = [
        Binding("slash", "filter", "Filter", key_display="/"),
        Binding("enter", "open", "Detail", show=True),
        Binding("escape", "clear_filter", "Clear filter", show=False),
        Binding("n", "submit", "New job"),
        *JobActions.ACTION_BINDINGS,
    ]
    DEFAULT_CSS = """
    JobsScreen #filter { display: none; height: 3; }
    JobsScreen #filter.-shown { display: block; }
    JobsScreen DataTable { height: 1fr; }
    """

    def __init__(self) -> None:
        super().__init__()
        self.filter_text = ""
        self._rows: dict[str, tuple[Any, ...]] = {}
        self._seen = -1
        self._age_tick = 0.0

    def compose(self) -> ComposeResult:
        yield Header(show_clock=False)
        yield GpuPanel(reader=getattr(self.app, "gpu_reader", None), interval=1.0 if self.app.feed else 0)
        yield Input(placeholder="filter: id, name, kind or status (Enter: back to the table, Esc: clear)", id="filter")
        table: DataTable = DataTable(id="jobs", cursor_type="row", zebra_stripes=True)
        for key, label in COLUMNS:
            table.add_column(label, key=key)
        yield table
        yield ConnectionBar()
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = self.app.url
        self.sync()
        self.set_interval(self.app.refresh_s, self.sync)

    # ------------------------------------------------------------ drawing
    @property
    def table(self) -> DataTable:
        return self.query_one("#jobs", DataTable)

    def selected_job_id(self) -> str | None:
        t = self.table
        if t.row_count == 0:
            return None
        try:
            return str(t.coordinate_to_cell_key(t.cursor_coordinate).row_key.value)
        except Exception:
            return None

    def _visible_jobs(self) -> list[dict[str, Any]]:
        jobs = [j for j in self.app.jobs.values() if _matches(j, self.filter_text)]
        jobs.sort(key=lambda j: num(j.get("created_at")) or 0.0, reverse=True)
        return jobs

    def sync(self, rebuild: bool = False) -> None:
        """Apply what changed since the last call: new rows, removed rows, and changed cells only."""
        if not self.is_current and not rebuild:
            return  # under the detail screen: caught up when shown again
        now = self.app.clock()
        ages_due = now - self._age_tick >= 1.0
        if not rebuild and self.app.version == self._seen and not ages_due:
            return
        self._seen = self.app.version
        if ages_due:
            self._age_tick = now
        table = self.table
        jobs = self._visible_jobs()
        wanted = {str(j["id"]): j for j in jobs}
        if rebuild:
            keep = self.selected_job_id()
            table.clear()
            self._rows.clear()
        added = False
        for key in [k for k in self._rows if k not in wanted]:
            table.remove_row(key)
            del self._rows[key]
        for key, job in wanted.items():
            row = job_row(job, now)
            old = self._rows.get(key)
            if old is None:
                table.add_row(*row, key=key)
                added = True
            elif old != row:
                for (col, _), new_cell, old_cell in zip(COLUMNS, row, old):
                    if new_cell != old_cell:
                        table.update_cell(key, col, new_cell, update_width=True)
            self._rows[key] = row
        if added and len(wanted) > 1:
            order = {k: i for i, k in enumerate(wanted)}
            table.sort("id", key=lambda cell: order.get(str(cell), 0))
        if rebuild and keep and keep in self._rows:
            table.move_cursor(row=table.get_row_index(keep))
        self.app.refreshes += 1

    # ------------------------------------------------------------ keys
    def action_filter(self) -> None:
        box = self.query_one("#filter", Input)
        box.add_class("-shown")
        box.focus()

    @on(Input.Changed, "#filter")
    def _filter_changed(self, event: Input.Changed) -> None:
        self.filter_text = event.value.strip()
        self.sync(rebuild=True)

    @on(Input.Submitted, "#filter")
    def _filter_done(self) -> None:
        self.table.focus()

    def action_clear_filter(self) -> None:
        box = self.query_one("#filter", Input)
        if self.filter_text or box.has_class("-shown"):
            box.value = ""
            box.remove_class("-shown")
            self.filter_text = ""
            self.sync(rebuild=True)
            self.table.focus()

    def action_open(self) -> None:
        job_id = self.selected_job_id()
        if job_id:
            self.app.open_detail(job_id)

    @on(DataTable.RowSelected, "#jobs")
    def _row_selected(self, event: DataTable.RowSelected) -> None:
        if event.row_key.value:
            self.app.open_detail(str(event.row_key.value))

    def action_submit(self) -> None:
        from tui.screens.submit import SubmitScreen

        self.app.push_screen(SubmitScreen(start_dir=self.app.start_dir))
