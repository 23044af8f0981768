"""What keeps the dashboard cheap must not change what it shows.

The jobs table updates cells in place and keeps its own column widths; ages tick only for the
rows in view; a chart repaints only the lines that changed. Each is checked against the same
thing drawn from scratch. No worker: jobs and metrics rows are fed to the app directly, the
clock is the test's.
"""

from __future__ import annotations

from typing import Any

from rich.text import Text
from snapshot_apps import ROWS
from textual.widgets.data_table import ColumnKey

from tui.app import DashboardApp
from tui.feed import MetricRows
from tui.screens.detail import DetailScreen
from tui.screens.jobs import COLUMNS, job_row
from tui.widgets.chart import TimeChart

NOW = 1_790_000_000.0


class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


def _jobs(n: int) -> list[dict[str, Any]]:
    return [{"id": f"job{i:05d}", "name": f"queued-{i}", "kind": "command", "status": "PENDING", "attempt": 0,
             "created_at": NOW - 3 * i} for i in range(n)]


def _cells(table: Any, key: str) -> tuple[str, ...]:
    return tuple(str(table.get_cell(key, col)) for col, _ in COLUMNS)


async def test_table_cells_and_widths_follow_the_jobs() -> None:
    clock = Clock()
    app = DashboardApp(None, url="x", feed=False, clock=clock, refresh_s=3600)
    async with app.run_test(size=(160, 30)) as pilot:
        screen = app.screen
        app.merge_jobs(_jobs(50), full=True)
        screen.sync()
        await pilot.pause()
        table = screen.table
        assert [str(r.key.value) for r in table.ordered_rows][:3] == ["job00000", "job00001", "job00002"]  # newest first
        name = table.columns[ColumnKey("name")]
        narrow = name.content_width
        # A cell wider than its column widens it; back to short, the column shrinks again.
        app.merge_jobs([{"id": "job00007", "name": "a-much-longer-job-name-than-the-others"}])
        screen.sync()
        await pilot.pause()
        assert name.content_width == len("a-much-longer-job-name-than-the-others") > narrow
        app.merge_jobs([{"id": "job00007", "name": "short"}])
        screen.sync()
        await pilot.pause()
        assert name.content_width == narrow
        # A status change, a removed job, a new one: the table holds what a rebuild would.
        app.merge_jobs([{"id": "job00003", "status": "RUNNING", "attempt": 1, "max_attempts": 2,
                         "last_metrics": {"step": 3, "total_steps": 10, "cache_hits": 3, "cache_misses": 1}}])
        jobs = [j for j in _jobs(50) if j["id"] != "job00010"] + [{"id": "new", "name": "[bold]new", "kind": "infer",
                                                                    "status": "PENDING", "created_at": NOW + 1}]
        for j in jobs:
            j.update(app.jobs.get(j["id"], {}))
        app.merge_jobs(jobs, full=True)
        screen.sync()
        await pilot.pause()
        assert "job00010" not in screen.shown and table.row_count == 50
        assert str(table.ordered_rows[0].key.value) == "new"
        assert table.get_cell("new", "name") == Text("[bold]new")  # as typed: no markup
        for key in ("job00003", "job00007", "new"):
            assert _cells(table, key) == tuple(str(c) for c in job_row(app.jobs[key], clock.now))


async def test_ages_tick_for_the_rows_in_view_and_catch_up_when_scrolled_to() -> None:
    clock = Clock()
    app = DashboardApp(None, url="x", feed=False, clock=clock, refresh_s=3600)
    async with app.run_test(size=(120, 20)) as pilot:
        screen = app.screen
        app.merge_jobs(_jobs(200), full=True)
        screen.sync()
        await pilot.pause()
        table = screen.table
        assert str(table.get_cell("job00000", "age")) == "0s"
        clock.now += 3600 * 3
        screen.sync()  # a second has passed (and more): the ages tick
        await pilot.pause()
        assert str(table.get_cell("job00000", "age")) == "3h"  # in view
        assert str(table.get_cell("job00199", "age")) == "9m"  # out of view: not redrawn yet
        table.move_cursor(row=199)  # scrolls it into view
        await pilot.pause()
        assert str(table.get_cell("job00199", "age")) == "3h"


async def test_a_chart_redrawn_line_by_line_shows_what_it_would_from_scratch() -> None:
    class One(DashboardApp):
        def open_initial(self) -> None:
            self.push_screen(DetailScreen("a1"))

    app = One(None, url="x", feed=False, refresh_s=3600)
    app.merge_jobs([{"id": "a1", "name": "x", "kind": "command", "status": "RUNNING", "created_at": NOW}], full=True)
    async with app.run_test(size=(160, 50)) as pilot:
        detail = app.screen
        rows = [dict(ROWS[i % len(ROWS)], step=i + 1) for i in range(700)]  # past the charts' width: runs squeezed
        sent = 0
        for batch in (1, 4, 30, 200, 5, 5, 300, 155):
            app.post_message(MetricRows("a1", rows[sent:sent + batch], False))
            sent += batch
            await pilot.pause()
            detail.sync()
            await pilot.pause()
            for chart in detail.query(TimeChart):
                if not chart.display:  # a trainer option's chart these rows do not write (EMA distance)
                    assert chart.chart.optional, chart.id
                    continue
                drawn = ["".join(seg.text for seg in chart.render_line(y)).rstrip()
                         for y in range(chart.content_size.height)]
                fresh = [line.rstrip() for line in chart.plot_text().plain.split("\n")]
                fresh += [""] * (len(drawn) - len(fresh))
                assert drawn[1:] == fresh[1:], (chart.id, sent)  # the plot
                assert fresh[0].startswith(drawn[0].rstrip("…")), (chart.id, sent)  # the legend, cut to fit
        assert detail.history.rows == 700
