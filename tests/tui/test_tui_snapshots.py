"""Snapshots of the four screens at 140x44, fed by a recorded metrics stream (no worker, timers idle)."""

from __future__ import annotations

from pathlib import Path

from snapshot_apps import SnapshotApp

from tui.screens.logs import LogsScreen
from tui.screens.submit import SubmitScreen

SIZE = (140, 44)
REPO = Path(__file__).resolve().parents[2]


def test_jobs_screen(snap_compare) -> None:
    assert snap_compare(SnapshotApp("jobs"), terminal_size=SIZE)


def test_detail_screen(snap_compare) -> None:
    assert snap_compare(SnapshotApp("detail"), terminal_size=SIZE)


def test_logs_screen(snap_compare) -> None:
    async def opened(pilot) -> None:
        while not isinstance(pilot.app.screen, LogsScreen):
            await pilot.pause(0.05)
        screen = pilot.app.screen
        while not screen.opened.is_set():
            await pilot.pause(0.05)
        await pilot.pause(0.2)
        screen._status()

    assert snap_compare(SnapshotApp("logs"), terminal_size=SIZE, run_before=opened)


def test_submit_screen_with_a_field_error(snap_compare, monkeypatch) -> None:
    monkeypatch.chdir(REPO)

    async def bad_override(pilot) -> None:
        while not isinstance(pilot.app.screen, SubmitScreen):
            await pilot.pause(0.05)
        screen = pilot.app.screen
        await pilot.press(*"examples/toy.yaml", "enter")
        await pilot.pause(0.2)
        field = next(i for i in screen.query("Input") if i.name == "limits.stop_grace")
        field.value = "forever"
        await pilot.pause(0.3)
        assert "limits.stop_grace" in (screen.error or "")

    assert snap_compare(SnapshotApp("submit"), terminal_size=SIZE, run_before=bad_override)
