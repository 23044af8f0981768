"""Snapshots of the four screens at 140x44, fed by a recorded metrics stream (no worker, timers idle)."""

from __future__ import annotations

import time
from pathlib import Path

from snapshot_apps import SnapshotApp
from textual.widgets import Input

from tui.screens.logs import LogsScreen
from tui.screens.submit import SubmitScreen

SIZE = (140, 44)
REPO = Path(__file__).resolve().parents[2]


def test_jobs_screen(snap_compare) -> None:
    assert snap_compare(SnapshotApp("jobs"), terminal_size=SIZE)


def test_detail_screen(snap_compare) -> None:
    assert snap_compare(SnapshotApp("detail"), terminal_size=SIZE)


async def _until(pilot, cond, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await pilot.pause(0.05)


async def _settle(pilot) -> None:
    """Cursors drawn solid (a blinking one is in either state at the shot), then one more frame."""
    for box in pilot.app.screen.query(Input):
        box.cursor_blink = False
    await pilot.pause(0.1)


def test_logs_screen(snap_compare) -> None:
    async def opened(pilot) -> None:
        await _until(pilot, lambda: isinstance(pilot.app.screen, LogsScreen), "the logs screen")
        screen = pilot.app.screen
        await _until(pilot, screen.opened.is_set, "the log to open")
        screen._status()
        await _settle(pilot)

    assert snap_compare(SnapshotApp("logs"), terminal_size=SIZE, run_before=opened)


def test_submit_screen_with_a_field_error(snap_compare, monkeypatch) -> None:
    monkeypatch.chdir(REPO)

    async def bad_override(pilot) -> None:
        await _until(pilot, lambda: isinstance(pilot.app.screen, SubmitScreen), "the submit screen")
        screen = pilot.app.screen
        await pilot.press(*"examples/toy.yaml", "enter")
        await _until(pilot, lambda: screen.spec is not None, "the toy spec to load and validate")
        field = next(i for i in screen.query("Input") if i.name == "limits.stop_grace")
        field.value = "forever"
        await _until(pilot, lambda: "limits.stop_grace" in (screen.error or ""), "the field's error")
        await _settle(pilot)

    assert snap_compare(SnapshotApp("submit"), terminal_size=SIZE, run_before=bad_override)
