"""Pilot tests of the dashboard against a real worker running real tiny CPU jobs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml
from tui_helpers import REPO, cell_text, engine_job, make_app, until

from tui.screens.detail import DetailScreen
from tui.screens.dialogs import ConfirmScreen
from tui.screens.logs import LogsScreen
from tui.screens.submit import SubmitScreen
from tui.widgets.chart import TimeChart


async def test_table_shows_status_change_live_and_detail_charts_fill(worker) -> None:
    # The poller waits 30 s between lists: what the table shows meanwhile came through the event stream.
    app = make_app(worker, poll_s=30.0)
    async with app.run_test(size=(160, 50)) as pilot:
        table = app.screen.table
        await until(pilot, lambda: app.connection.state == "ok", what="the first list")
        await until(pilot, app.feed.positioned.is_set, what="the event stream's start")  # no event missed from here
        with worker.client() as c:
            jid = c.submit(engine_job("tui-live", steps=30, rate=15))["id"]
        await until(pilot, lambda: table.row_count and jid in app.screen.shown, what="the job's row")
        seen = set()

        def status() -> str:
            s = cell_text(table, jid, "status")
            seen.add(s.split()[0])
            return s

        await until(pilot, lambda: status().startswith("RUNNING"), what="RUNNING in the table")
        assert app.feed.events_seen > 0  # the change came through the event stream
        await pilot.press("enter")
        assert isinstance(app.screen, DetailScreen) and app.screen.job_id == jid
        detail = app.screen
        await until(pilot, lambda: detail.history.rows >= 5, what="metrics rows in the detail screen")
        pinned = detail.query_one("#chart-pinned", TimeChart)
        await pilot.pause(0.3)
        assert detail.history.get("pinned_used").finite()
        assert any(0x2800 < ord(ch) <= 0x28FF for ch in pinned.plot_text().plain)  # braille points drawn
        assert detail.history.get("loss").finite() and detail.history.get("loss_ema").finite()
        await until(pilot, lambda: detail.job.get("status") == "SUCCEEDED", what="SUCCEEDED", timeout=90)
        await until(pilot, lambda: detail.replayed, what="the last rows")
        rows = [json.loads(ln) for ln in (Path(worker.home) / "runs" / jid / "metrics.jsonl").read_text().splitlines()]
        assert detail.history.rows == len(rows) == 30
        assert detail.history.latest["cache_hits"] == rows[-1]["cache_hits"]
        assert detail.history.latest["pinned_used_bytes"] == rows[-1]["pinned_used_bytes"]
        await pilot.press("escape")
        await until(pilot, lambda: status().startswith("SUCCEEDED"), what="SUCCEEDED in the table")
        assert "RUNNING" in seen and "SUCCEEDED" in seen


async def test_filter_cancel_with_confirm_and_read_only(worker) -> None:
    with worker.client() as c:
        sleeper = c.submit({"kind": "command", "name": "tui-sleeper", "command": "sleep 120",
                            "limits": {"stop_grace": 1}})["id"]
        other = c.submit({"kind": "command", "name": "tui-other", "command": "true"})["id"]
        c.wait(other, timeout=30)
    app = make_app(worker)
    async with app.run_test(size=(160, 40)) as pilot:
        screen = app.screen
        await until(pilot, lambda: sleeper in screen.shown and other in screen.shown, what="both rows")
        await pilot.press("slash")
        await pilot.press(*"sleeper")
        await until(pilot, lambda: list(screen.shown) == [sleeper], what="the filter to leave one row")
        await pilot.press("enter")  # back to the table
        await until(pilot, lambda: cell_text(screen.table, sleeper, "status").startswith("RUNNING"), what="RUNNING")
        await pilot.press("c")
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.press("n")  # keep it
        await pilot.pause(0.5)
        with worker.client() as c:
            assert c.get(sleeper)["status"] == "RUNNING"
        await pilot.press("c")
        await pilot.press("y")
        await until(pilot, lambda: cell_text(screen.table, sleeper, "status").startswith("CANCELLED"),
                    what="CANCELLED in the table", timeout=30)
        await pilot.press("escape")  # clears the filter
        await until(pilot, lambda: other in screen.shown, what="the other row back")

    ro = make_app(worker, read_only=True)
    async with ro.run_test(size=(160, 40)) as pilot:
        await until(pilot, lambda: sleeper in ro.screen.shown, what="rows")
        assert ro.screen.check_action("cancel", ()) is False and ro.screen.check_action("retry", ()) is False
        await pilot.press("c")
        await pilot.press("r")
        await pilot.pause(0.3)
        assert not isinstance(ro.screen, ConfirmScreen)
        footer = " ".join(b.description for b in ro.screen.active_bindings_descriptions()) \
            if hasattr(ro.screen, "active_bindings_descriptions") else ""
        assert "Cancel" not in footer and "Retry" not in footer


async def test_logs_follow_and_search(worker) -> None:
    cmd = "for i in $(seq 1 40); do echo \"log line $i\"; sleep 0.03; done"
    with worker.client() as c:
        jid = c.submit({"kind": "command", "name": "tui-logs", "command": cmd})["id"]
    app = make_app(worker, open_job=jid, open_logs=True)
    async with app.run_test(size=(120, 30)) as pilot:
        await until(pilot, lambda: isinstance(app.screen, LogsScreen), what="the logs screen")
        logs = app.screen
        view = logs.view

        def last_visible() -> str:
            return logs.source.line(min(logs.source.line_count, view.top_line + view.size.height) - 1)

        await until(pilot, lambda: "log line 5" in " ".join(logs.source.line(i) for i in range(logs.source.line_count)),
                    what="early lines")
        # Follow: the view stays at the end while lines arrive, through the end of the job.
        await until(pilot, lambda: "[offload-jobs] attempt 1 ended" in last_visible(), what="the last line in view",
                    timeout=30)
        assert view.at_end and logs.follow
        await pilot.press("f")
        assert not logs.follow
        await pilot.press("slash")
        await pilot.press(*"ne 7", "enter")
        assert logs.needle == "ne 7"

        def hit() -> str | None:
            return logs.source.line(view.current) if view.current is not None else None

        # From the end, the first search looks back: the newest match first, then n/N move on.
        await until(pilot, lambda: hit() == "log line 7", what="the match")
        await pilot.press("slash", "ctrl+a", "ctrl+k", "7", "enter")  # a new search, from the current line on
        await until(pilot, lambda: hit() == "log line 17", what="the next match")
        await pilot.press("n")
        await until(pilot, lambda: hit() == "log line 27", what="the match after")
        await pilot.press("N")
        await until(pilot, lambda: hit() == "log line 17", what="the previous match")


async def test_a_finished_jobs_log_opens_at_its_end(worker) -> None:
    with worker.client() as c:
        jid = c.submit({"kind": "command", "name": "tui-done-log", "command": "seq 1 300"})["id"]
        assert c.wait(jid, timeout=30)["status"] == "SUCCEEDED"
    app = make_app(worker, open_job=jid, open_logs=True)  # `offload-jobs tui --job ID --logs`
    async with app.run_test(size=(120, 30)) as pilot:
        await until(pilot, lambda: isinstance(app.screen, LogsScreen), what="the logs screen")
        logs = app.screen
        await until(pilot, lambda: logs.opened.is_set() and logs.view.at_end, what="the view at the log's end")
        view = logs.view
        last = logs.source.line(min(logs.source.line_count, view.top_line + view.size.height) - 1)
        assert "[offload-jobs] attempt 1 ended" in last, last  # the worker's last line, in view


def _validate_line(path: Path, sets: list[str]) -> str:
    args = [sys.executable, "-m", "jobs", "validate", str(path)] + [a for s in sets for a in ("--set", s)]
    r = subprocess.run(args, capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 2
    return r.stderr.strip()


async def test_submit_screen_bad_override_then_a_job_that_succeeds(worker, monkeypatch) -> None:
    monkeypatch.chdir(REPO)
    app = make_app(worker)
    async with app.run_test(size=(160, 50)) as pilot:
        await pilot.pause(0.3)
        await pilot.press("n")
        sub = app.screen
        assert isinstance(sub, SubmitScreen)
        await pilot.press(*"examples/toy.yaml", "enter")
        await until(pilot, lambda: sub.spec is not None, what="the toy spec to validate")
        before = {j["id"] for j in worker.client().list()}
        # A bad edit: the exact line `offload-jobs validate --set` prints, and nothing submitted.
        grace = next(i for i in sub.query("Input") if i.name == "limits.stop_grace")
        grace.value = "forever"
        await until(pilot, lambda: sub.spec is None, what="the error")
        assert sub.error == _validate_line(Path("examples/toy.yaml"), ["limits.stop_grace=forever"])
        assert "limits.stop_grace" in sub.error
        await pilot.press("ctrl+s")
        await pilot.pause(0.5)
        assert isinstance(app.screen, SubmitScreen)
        assert {j["id"] for j in worker.client().list()} == before
        grace.value = "3s"
        steps = next(i for i in sub.query("Input") if i.name == "env.TOY_STEPS")
        steps.value = "3"
        width = next(i for i in sub.query("Input") if i.name == "env.TOY_WIDTH")
        width.value = "64"
        await until(pilot, lambda: sub.spec is not None, what="the fixed spec")
        await pilot.press("ctrl+s")
        await until(pilot, lambda: isinstance(app.screen, DetailScreen), what="the new job's detail screen")
        jid = app.screen.job_id
        assert jid not in before
        await until(pilot, lambda: app.jobs.get(jid, {}).get("status") == "SUCCEEDED", what="SUCCEEDED",
                    timeout=120)
    job = worker.client().get(jid)
    assert job["spec"]["env"]["TOY_STEPS"] == "***" and job["spec"]["limits"]["stop_grace"] == 3.0  # env values never leave
    stored = yaml.safe_load((Path(job["run_dir"]) / "spec.yaml").read_text())  # what the job ran with
    assert stored["env"]["TOY_STEPS"] == "3"


async def test_live_rows_are_reread_less_often_while_the_table_is_covered(worker) -> None:
    """The jobs table re-reads its running rows every poll (their progress moves); the detail
    screen covering it has its own metrics tail, so meanwhile the poller slows to COVERED_POLL_S."""
    from tui.screens.jobs import COVERED_POLL_S

    app = make_app(worker, poll_s=0.2)
    async with app.run_test(size=(160, 40)) as pilot:
        with worker.client() as c:
            jid = c.submit(engine_job("tui-poll", steps=5, rate=20))["id"]
        await until(pilot, lambda: jid in app.screen.shown, what="the job's row")
        assert app.feed.poll_s == 0.2
        app.screen.table.move_cursor(row=app.screen.table.get_row_index(jid))
        await pilot.press("enter")
        assert isinstance(app.screen, DetailScreen)
        assert app.feed.poll_s == COVERED_POLL_S
        await pilot.press("escape")
        await pilot.pause(0.1)
        assert app.feed.poll_s == 0.2
