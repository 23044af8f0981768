"""The dashboard's keys: `?` help, the pinned detail summary, columns chosen by width, sorting, `d` delete.

The screens are fed by the recorded snapshot data (no worker) except `d`, which deletes a real job
on a real worker process.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from snapshot_apps import SnapshotApp
from textual.widgets import Static
from tui_helpers import WorkerProcess, make_app, until

from jobs.errors import JobsError
from tui.screens.detail import DetailScreen
from tui.screens.dialogs import ConfirmScreen, HelpScreen
from tui.screens.jobs import COLUMNS, JobsScreen

SMALL = (80, 24)


def _help_text(app: Any) -> str:
    box = app.screen.query_one("#help-keys", Static)
    assert box.size.width > 0 and box.size.height > 0, f"the help text has no room: {box.size}"
    return str(box.content)


async def test_help_lists_every_key_of_the_jobs_screen() -> None:
    app = SnapshotApp("jobs")
    async with app.run_test(size=SMALL) as pilot:
        await pilot.pause(0.2)
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        text = _help_text(app)
        screen = app.screen_stack[-2]
        assert isinstance(screen, JobsScreen)
        for b in [*screen.BINDINGS, *app.BINDINGS]:
            assert app.get_key_display(b) in text, b
        for active in screen.active_bindings.values():  # each key with what it does (Enter: the table's)
            assert active.binding.description in text, active.binding
        for key in ("Sort", "Delete", "Cancel", "Filter", "Cursor down"):  # the table's keys too
            assert key in text
        await pilot.press("question_mark")  # closes it again
        assert app.screen is screen


async def test_help_on_the_detail_screen_and_read_only() -> None:
    app = SnapshotApp("detail")
    app.read_only = True
    async with app.run_test(size=SMALL) as pilot:
        await pilot.pause(0.2)
        assert isinstance(app.screen, DetailScreen)
        await pilot.press("question_mark")
        text = _help_text(app)
        assert "Back" in text and "Logs" in text and "Page Down" in text
        for hidden in ("Delete", "Cancel", "Retry"):  # --read-only: keys that would write are not offered
            assert hidden not in text
        await pilot.press("escape")
        assert isinstance(app.screen, DetailScreen)


def test_help_snapshot(snap_compare) -> None:
    assert snap_compare(SnapshotApp("jobs"), terminal_size=SMALL, press=["question_mark"])


async def test_detail_summary_stays_in_view_at_80x24() -> None:
    app = SnapshotApp("detail")
    async with app.run_test(size=SMALL) as pilot:
        await pilot.pause(0.3)
        screen = app.screen
        summary = screen.query_one("#summary", Static)
        body = screen.query_one("#body")
        assert summary.region.y == 1 and summary.region.height > 0  # right under the header
        assert body.scroll_y == 0  # opened at the charts, not scrolled to the tabs
        await pilot.press("pagedown", "pagedown")
        await pilot.pause(0.1)
        assert body.scroll_y > 0
        assert summary.region.y == 1 and "a1b2c3d4e5f6" in str(summary.content)


def test_detail_snapshot_80x24_on_open(snap_compare) -> None:
    assert snap_compare(SnapshotApp("detail"), terminal_size=SMALL)


def test_detail_snapshot_80x24_scrolled(snap_compare) -> None:
    assert snap_compare(SnapshotApp("detail"), terminal_size=SMALL, press=["pagedown", "pagedown"])


def _column_keys(table: Any) -> list[str]:
    return [str(c.key.value) for c in table.ordered_columns]


async def test_columns_chosen_by_width() -> None:
    app = SnapshotApp("jobs")
    async with app.run_test(size=SMALL) as pilot:
        await pilot.pause(0.2)
        table = app.screen.table
        shown = _column_keys(table)
        assert shown[0] == "id" and {"status", "name", "progress", "age", "hit"} <= set(shown)
        assert len(shown) < len(COLUMNS)  # 80 columns cannot hold all nine
        width = sum(c.get_render_width(table) for c in table.ordered_columns)
        assert width <= table.size.width  # nothing cut off at the right
        await pilot.resize_terminal(160, 30)
        await pilot.pause(0.2)
        assert _column_keys(table) == [k for k, _ in COLUMNS]  # room for all: all, in their order
        assert str(table.get_cell("a1b2c3d4e5f6", "vram")) == "0B/8.0G"  # a column that came back is current


def test_jobs_snapshot_80x24(snap_compare) -> None:
    assert snap_compare(SnapshotApp("jobs"), terminal_size=SMALL)


def _order(table: Any) -> list[str]:
    return [str(r.key.value) for r in table.ordered_rows]


async def test_sort_key_cycles_column_and_direction() -> None:
    app = SnapshotApp("jobs")
    async with app.run_test(size=(160, 30)) as pilot:
        await pilot.pause(0.2)
        screen = app.screen
        table = screen.table
        newest_first = ["0f9e8d7c6b5a", "a1b2c3d4e5f6", "99aa88bb77cc", "1234abcd5678"]
        assert _order(table) == newest_first
        await pilot.press("O")  # oldest first
        assert _order(table) == newest_first[::-1]
        assert str(table.ordered_columns[-1].label) == "AGE ▼"
        await pilot.press("o")  # the column after AGE wraps round to ID, ascending
        assert screen.sort_column == "id"
        assert _order(table) == sorted(newest_first)
        await pilot.press("o", "o", "o")  # NAME, KIND, STATUS
        assert screen.sort_column == "status"
        assert _order(table) == ["0f9e8d7c6b5a", "a1b2c3d4e5f6", "1234abcd5678", "99aa88bb77cc"]  # lifecycle order
        await pilot.press("o", "o")  # ATT, PROGRESS: most done last, the job with none at the end
        assert screen.sort_column == "progress"
        assert _order(table) == ["99aa88bb77cc", "a1b2c3d4e5f6", "1234abcd5678", "0f9e8d7c6b5a"]
        await pilot.press("O")
        assert _order(table) == ["1234abcd5678", "a1b2c3d4e5f6", "99aa88bb77cc", "0f9e8d7c6b5a"]
        assert str(table.ordered_columns[_column_keys(table).index("progress")].label) == "PROGRESS ▼"
        table.move_cursor(row=_order(table).index("99aa88bb77cc"))
        await pilot.press("O")
        assert screen.selected_job_id() == "99aa88bb77cc"  # the cursor stays on its job


@pytest.fixture(scope="module")
def own_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    """A worker of this module's own (the session one runs an engine job at start: not needed here)."""
    w = WorkerProcess(Path(tmp_path_factory.mktemp("tui-keys")) / "home").start()
    yield w
    w.stop()


async def test_delete_asks_then_deletes_on_the_worker(own_worker: WorkerProcess) -> None:
    with own_worker.client() as c:
        done = c.submit({"kind": "command", "name": "tui-delete-me", "command": "echo hi"})["id"]
        c.wait(done, timeout=60)
    app = make_app(own_worker)
    async with app.run_test(size=(160, 30)) as pilot:
        screen = app.screen
        await until(pilot, lambda: done in screen.shown, what="the row")
        screen.table.move_cursor(row=screen.table.get_row_index(done))
        await pilot.press("d")
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.press("n")  # keep it
        await pilot.pause(0.5)
        with own_worker.client() as c:
            assert c.get(done)["id"] == done
        assert done in screen.shown
        await pilot.press("d")
        await pilot.press("y")
        await until(pilot, lambda: done not in screen.shown, what="the row to go", timeout=30)
        with own_worker.client() as c, pytest.raises(JobsError):
            c.get(done)
        # From the detail screen: it closes once its job is gone.
        with own_worker.client() as c:
            shown = c.submit({"kind": "command", "name": "tui-delete-from-detail", "command": "echo hi"})["id"]
            c.wait(shown, timeout=60)
        await until(pilot, lambda: shown in screen.shown, what="the second row")
        app.open_detail(shown)
        await pilot.pause(0.2)
        assert isinstance(app.screen, DetailScreen)
        await pilot.press("d", "y")
        await until(pilot, lambda: app.screen is screen and shown not in screen.shown, what="back on the jobs screen")
        with own_worker.client() as c, pytest.raises(JobsError):
            c.get(shown)

    with own_worker.client() as c:
        kept = c.submit({"kind": "command", "name": "tui-keep-me", "command": "echo hi"})["id"]
        c.wait(kept, timeout=60)
    ro = make_app(own_worker, read_only=True)
    async with ro.run_test(size=(160, 30)) as pilot:
        await until(pilot, lambda: kept in ro.screen.shown, what="rows")
        await pilot.press("d")
        await pilot.pause(0.3)
        assert not isinstance(ro.screen, ConfirmScreen)
    with own_worker.client() as c:
        assert c.get(kept)["id"] == kept
