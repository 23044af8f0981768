"""The jobs screen: a keyed DataTable of every job, updated cell by cell from what changed.

What keeps it light with 1,000 jobs:
- a redraw looks only at the jobs changed since the last one (`DashboardApp.changed_at`) and
  updates only their cells that differ, repainting only their rows (`KeyedTable`); nothing
  changed, nothing is drawn;
- ages tick once a second, for the rows in view only (the others catch up when scrolled to);
- cells are `Text`, never markup strings (parsing markup per cell per measure was most of the
  cost, and a job named "[bold]" must show as typed).
"""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual import on
from textual.coordinate import Coordinate
from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Header, Input

from jobs.contract import JobState, Metric
from jobs.display import STATUS_STYLE
from tui.fmt import fmt_age, fmt_bytes, fmt_pct, num
from tui.history import budget_of, hit_rate_of, progress_of
from tui.screens.actions import JobActions
from tui.widgets.keyed_table import KeyedTable
from tui.widgets.panels import ConnectionBar, GpuPanel
from tui.widgets.popup_input import PopupInput

__all__ = ["JobsScreen", "job_row", "COLUMNS", "STATUS_STYLE"]

COLUMNS = (("id", "ID"), ("name", "NAME"), ("kind", "KIND"), ("status", "STATUS"), ("attempt", "ATT"),
           ("progress", "PROGRESS"), ("vram", "PEAK VRAM/BUDGET"), ("hit", "HIT"), ("age", "AGE"))
AGE = len(COLUMNS) - 1
# The columns kept when the table is narrow, most wanted first (those that fit are shown).
PRIORITY = ("id", "status", "name", "progress", "vram", "age", "hit", "attempt", "kind")
SORT_ARROWS = {False: "▲", True: "▼"}
AGE_TICK_S = 1.0
COVERED_POLL_S = 1.0  # the live jobs' re-read while another screen covers this one (statuses come by events)


def _bar(frac: float | None, width: int = 8) -> str:
    if frac is None:
        return ""
    full = int(round(frac * width))
    return "█" * full + "░" * (width - full)


def job_row(job: dict[str, Any], now: float) -> tuple[Text, ...]:
    """The table cells of one job (Rich Text; equal when nothing visible changed)."""
    status = str(job.get("status") or "?")
    reason = job.get("reason")
    st = Text(status, style=STATUS_STYLE.get(status, ""))
    if reason and status != JobState.SUCCEEDED:
        st.append(f" ({reason})", style="dim")
    m = job.get("last_metrics") if isinstance(job.get("last_metrics"), dict) else {}
    spec = job.get("spec") if isinstance(job.get("spec"), dict) else {}
    frac, steps = progress_of(m, spec)
    if status == JobState.SUCCEEDED and frac is None:
        frac = 1.0
    progress = f"{_bar(frac)} {fmt_pct(frac)} {steps}".strip() if frac is not None else (steps or "-")
    peak = num(m.get(Metric.vram_peak_bytes))
    if peak is None:
        peak = num(m.get(Metric.vram_allocated_bytes))
    budget = budget_of(spec)
    vram = fmt_bytes(peak, short=True) if peak is not None else "-"
    if budget:
        vram += f"/{fmt_bytes(budget, short=True)}"
    attempt = job.get("attempt")
    att = f"{attempt}/{job['max_attempts']}" if attempt and job.get("max_attempts") else str(attempt or "-")
    return (Text(str(job.get("id", "?"))), Text(str(job.get("name") or "-")), Text(str(job.get("kind") or "-")), st,
            Text(att), Text(progress), Text(vram), Text(fmt_pct(hit_rate_of(m))), age_cell(job, now))


def age_cell(job: dict[str, Any], now: float) -> Text:
    return Text(fmt_age(job.get("created_at"), now))


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and value != value)


def sort_value(job: dict[str, Any], column: str) -> Any:
    """What the jobs are ordered by for `column` (None: no value, listed last either way)."""
    m = job.get("last_metrics") if isinstance(job.get("last_metrics"), dict) else {}
    if column == "age":
        created = num(job.get("created_at"))
        return None if created is None else -created  # youngest first: the smallest age
    if column == "status":
        order = list(STATUS_STYLE)  # the lifecycle order
        status = job.get("status")
        return order.index(status) if status in order else len(order)
    if column == "attempt":
        return num(job.get("attempt"))
    if column == "progress":
        spec = job.get("spec") if isinstance(job.get("spec"), dict) else {}
        frac = progress_of(m, spec)[0]
        return 1.0 if frac is None and job.get("status") == JobState.SUCCEEDED else frac  # as `job_row` shows it
    if column == "vram":
        peak = num(m.get(Metric.vram_peak_bytes))
        return peak if peak is not None else num(m.get(Metric.vram_allocated_bytes))
    if column == "hit":
        return hit_rate_of(m)
    value = job.get(column)
    return None if value is None else str(value).lower()


def sorted_ids(jobs: dict[str, dict[str, Any]], keys: Any, column: str, descending: bool) -> list[str]:
    """`keys` ordered by `column` (ties and jobs with no value: newest first, the latter last)."""
    newest = sorted(keys, key=lambda k: num(jobs[k].get("created_at")) or 0.0, reverse=True)
    values = {k: sort_value(jobs[k], column) for k in newest}
    have = [k for k in newest if not _missing(values[k])]
    have.sort(key=lambda k: values[k], reverse=descending)  # stable: ties stay newest first
    return have + [k for k in newest if _missing(values[k])]


def _matches(job: dict[str, Any], needle: str) -> bool:
    if not needle:
        return True
    hay = " ".join(str(job.get(k) or "") for k in ("id", "name", "kind", "status", "reason")).lower()
    return all(part in hay for part in needle.lower().split())


class JobsScreen(JobActions, Screen):
    """Every job, newest first. `/` filters, Enter opens the detail, Esc clears the filter, `o`
    sorts by the next column and `O` turns the order round."""

    AUTO_FOCUS = "#jobs"

    BINDINGS = [
        Binding("slash", "filter", "Filter", key_display="/"),
        Binding("enter", "open", "Detail", show=True),
        Binding("escape", "clear_filter", "Clear filter", show=False),
        Binding("n", "submit", "New job"),
        Binding("o", "sort_next", "Sort"),
        Binding("O", "sort_reverse", "Reverse sort", key_display="O"),
        *JobActions.ACTION_BINDINGS,
    ]
    DEFAULT_CSS = """
    JobsScreen DataTable { height: 1fr; }
    """

    def __init__(self) -> None:
        super().__init__()
        self.filter_text = ""
        self._seen = -1  # the app's version drawn
        self._age_tick = 0.0
        self._poll_s: float | None = None  # the feed's interval while this screen is covered
        self.sort_column = "age"
        self.sort_descending = False  # with "age": newest first

    def compose(self) -> ComposeResult:
        yield Header(show_clock=False)
        yield GpuPanel(reader=getattr(self.app, "gpu_reader", None), interval=1.0 if self.app.feed else 0)
        yield PopupInput(placeholder="filter: id, name, kind or status (Enter: back to the table, Esc: clear)", id="filter")
        yield KeyedTable(COLUMNS, priority=PRIORITY, id="jobs", cursor_type="row", zebra_stripes=True)
        yield ConnectionBar()
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = self.app.url
        self._mark_sort()
        self.sync()
        self._timer = self.set_interval(self.app.refresh_s, self.sync)
        self.watch(self.table, "scroll_y", self._scrolled, init=False)

    def on_screen_suspend(self) -> None:
        self._timer.pause()  # under another screen: nothing to draw
        self.query_one(GpuPanel).pause()
        feed = getattr(self.app, "feed", None)
        if feed is not None:  # the rows' progress is not on view: re-read the live jobs less often
            self._poll_s = feed.poll_s
            feed.set_poll_s(max(feed.poll_s, COVERED_POLL_S))

    def on_screen_resume(self) -> None:
        self._timer.resume()
        self.query_one(GpuPanel).resume()
        feed = getattr(self.app, "feed", None)
        if feed is not None and self._poll_s is not None:
            feed.set_poll_s(self._poll_s)
            self._poll_s = None
        self.sync()  # back from the detail screen: what changed meanwhile

    # ------------------------------------------------------------ drawing
    @property
    def table(self) -> KeyedTable:
        return self.query_one("#jobs", KeyedTable)

    @property
    def shown(self) -> dict[str, tuple[Text, ...]]:
        """The rows on the table, by job id."""
        return self.table.shown

    def selected_job_id(self) -> str | None:
        t = self.table
        if t.row_count == 0:
            return None
        try:
            return str(t.coordinate_to_cell_key(t.cursor_coordinate).row_key.value)
        except Exception:
            return None

    def sync(self, rebuild: bool = False) -> None:
        """Apply what changed since the last call: new rows, removed rows, and changed cells only."""
        if not rebuild and not self.is_current:
            return  # under another screen: caught up when shown again
        app = self.app
        now = app.clock()
        keep = self.selected_job_id() if rebuild else None
        if rebuild:
            self.table.clear()
            changed: Any = list(app.jobs)
        elif app.version != self._seen:
            seen = self._seen
            changed = [k for k, v in app.changed_at.items() if v > seen]
        else:
            changed = ()
        self._seen = app.version
        drew = self._apply(changed, now) if changed else False
        if now - self._age_tick >= AGE_TICK_S:
            self._age_tick = now
            drew = self._tick_ages(now) or drew
        if keep and keep in self.shown:
            self.table.move_cursor(row=self.table.get_row_index(keep))
        if drew:
            app.refreshes += 1

    def _apply(self, job_ids: Any, now: float) -> bool:
        table, shown, jobs = self.table, self.shown, self.app.jobs
        gone = [k for k in job_ids if k in shown and (k not in jobs or not _matches(jobs[k], self.filter_text))]
        if len(gone) > 100:  # DataTable.remove_row re-indexes every row: many at once are cheaper rebuilt
            self.sync(rebuild=True)
            return True
        for key in gone:
            table.drop(key)
        before = len(shown)  # after the removals
        wanted = [(k, jobs[k]) for k in job_ids if k in jobs and _matches(jobs[k], self.filter_text)]
        drew = table.put_many([(key, job_row(job, now)) for key, job in wanted]) or bool(gone)
        # Rows were added, or (sorted by a value that changes) rows changed: in order again.
        changing = self.sort_column not in ("age", "id", "name", "kind")
        if len(shown) > 1 and (len(shown) > before or (wanted and changing)):
            self._sort()
        return drew

    def _sort(self) -> None:
        table, shown = self.table, self.shown
        order = sorted_ids(self.app.jobs, [k for k in shown if k in self.app.jobs], self.sort_column,
                           self.sort_descending)
        if order == [str(row.key.value) for row in table.ordered_rows]:
            return
        # The cursor stays on its job, except on the top row: there it follows what comes first
        # (the newest job, by default), as a log follows its end.
        keep = self.selected_job_id() if table.cursor_row > 0 else None
        rank = {k: i for i, k in enumerate(order)}
        table.sort("id", key=lambda cell: rank.get(str(cell), len(rank)))  # "id" is always shown
        if keep is not None and keep in shown:
            table.move_cursor(row=table.get_row_index(keep))

    def _mark_sort(self) -> None:
        """The sort column's title carries an arrow (▲: smallest first, as the column shows it)."""
        for key, label in COLUMNS:
            arrow = ""
            if key == self.sort_column:
                # Ages sort by creation time: "newest first" is the smallest age first.
                arrow = " " + SORT_ARROWS[self.sort_descending]
            self.table.set_title(key, label + arrow)

    def _visible_keys(self) -> list[str]:
        t = self.table
        first = int(t.scroll_y)
        keys = []
        for y in range(first, min(t.row_count, first + t.size.height)):
            try:
                keys.append(str(t.coordinate_to_cell_key(Coordinate(y, 0)).row_key.value))
            except Exception:
                break
        return keys

    def _tick_ages(self, now: float) -> bool:
        jobs, shown = self.app.jobs, self.shown
        return self.table.put_many([(key, shown[key][:AGE] + (age_cell(jobs[key], now),))
                                    for key in self._visible_keys() if key in jobs and key in shown])

    def _scrolled(self) -> None:
        if self.is_current:
            self._tick_ages(self.app.clock())  # rows scrolled into view show their age now

    # ------------------------------------------------------------ keys
    def action_filter(self) -> None:
        self.query_one("#filter", PopupInput).reveal()

    @on(Input.Changed, "#filter")
    def _filter_changed(self, event: Input.Changed) -> None:
        self.filter_text = event.value.strip()
        self.sync(rebuild=True)

    @on(Input.Submitted, "#filter")
    def _filter_done(self) -> None:
        self.table.focus()

    def action_clear_filter(self) -> None:
        box = self.query_one("#filter", PopupInput)
        if self.filter_text or box.revealed:
            box.value = ""
            box.conceal()
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

    def action_sort_next(self) -> None:
        keys = [key for key, _ in COLUMNS]
        self.sort_column = keys[(keys.index(self.sort_column) + 1) % len(keys)]
        self.sort_descending = False
        self._resort()

    def action_sort_reverse(self) -> None:
        self.sort_descending = not self.sort_descending
        self._resort()

    def _resort(self) -> None:
        self._mark_sort()
        self._sort()
        self.notify(f"sorted by {dict(COLUMNS)[self.sort_column]}"
                    f" {'descending' if self.sort_descending else 'ascending'}", timeout=2)

    def action_submit(self) -> None:
        from tui.screens.submit import SubmitScreen

        self.app.push_screen(SubmitScreen(start_dir=self.app.start_dir))
