"""The dashboard when things go wrong: no worker, a restart mid-session, a bad token, NaN metrics."""

from __future__ import annotations

import math

from conftest import engine_job, make_app, until
from jobs_helpers import WorkerProcess

from tui.screens.detail import DetailScreen
from tui.widgets.chart import TimeChart
from tui.widgets.panels import ConnectionBar


def _bar(app) -> str:
    return str(app.screen.query_one(ConnectionBar).render())


async def test_worker_down_at_start_says_so_and_retries_until_it_is_up(tmp_path, monkeypatch) -> None:
    from tui.app import DashboardApp, client_factory

    w = WorkerProcess(tmp_path / "home")  # its port is chosen; nothing listens yet, no token exists
    monkeypatch.setenv("OFFLOAD_JOBS_URL", w.url)
    make_client, url = client_factory(home=str(w.home))  # as `offload-jobs tui` finds a worker
    app = DashboardApp(make_client, url=url, poll_s=0.2, refresh_s=0.2)
    async with app.run_test(size=(160, 30)) as pilot:
        await until(pilot, lambda: app.connection.state == "down", what="the down state")
        await pilot.pause(0.3)
        text = _bar(app)
        assert f"worker unreachable: no offload-jobs worker reachable at {w.url}" in text
        assert "retrying" in text and "offload-jobs up --local" in text
        w.start()  # writes the token the dashboard has not seen yet
        try:
            with w.client() as c:
                jid = c.submit({"kind": "command", "name": "after-start", "command": "true"})["id"]
            await until(pilot, lambda: app.connection.state == "ok", what="connected", timeout=30)
            await until(pilot, lambda: jid in app.screen.shown, what="the job in the table")
            assert "● worker" in _bar(app)
        finally:
            w.stop()


async def test_bad_token_is_a_clear_message(worker) -> None:
    app = make_app(worker, token="wrong-token")
    async with app.run_test(size=(160, 30)) as pilot:
        await until(pilot, lambda: app.connection.state == "auth", what="the auth state")
        await pilot.pause(0.3)
        text = _bar(app)
        assert "token refused" in text and "refused the token" in text and "OFFLOAD_JOBS_TOKEN" in text


async def test_worker_restart_mid_session_loses_no_events(tmp_path) -> None:
    w = WorkerProcess(tmp_path / "home").start()
    try:
        app = make_app(w)
        async with app.run_test(size=(140, 30)) as pilot:
            await until(pilot, lambda: app.connection.state == "ok", what="connected")
            await pilot.pause(1.0)
            with w.client() as c:
                jid = c.submit({"kind": "command", "name": "survivor", "command": "sleep 2; echo done",
                                "retry": {"max_attempts": 2, "on": ["worker_lost"]}})["id"]
            await until(pilot, lambda: app.jobs.get(jid, {}).get("status") == "RUNNING", what="RUNNING")
            w.kill9()  # mid-job: the restart records worker_lost and retries it
            await until(pilot, lambda: app.connection.state == "down", what="the worker gone")
            w.start()
            await until(pilot, lambda: app.jobs.get(jid, {}).get("status") == "SUCCEEDED", what="SUCCEEDED",
                        timeout=60)
            await pilot.pause(0.5)
            with w.client() as c:
                stored = [(e["type"], e.get("status"), e.get("attempt")) for e in c.job_events(jid)]
            seen = [(e["type"], e.get("status"), e.get("attempt")) for e in app.job_events[jid]]
            assert seen == stored
            assert ("job.status", "FAILED", 1) in seen or any(s == "PENDING" and a == 1 for _, s, a in seen[2:])
            assert [a for _, s, a in seen if s == "RUNNING"] == [1, 2]
            ids = [e["id"] for e in app.job_events[jid]]
            assert ids == sorted(ids) and len(set(ids)) == len(ids)
    finally:
        w.stop()


async def test_nan_metrics_still_draw(worker) -> None:
    with worker.client() as c:
        jid = c.submit(engine_job("tui-nan", 12, 40, "--nan-from", "5"))["id"]
        c.wait(jid, timeout=120)
    app = make_app(worker, open_job=jid)
    async with app.run_test(size=(160, 50)) as pilot:
        await until(pilot, lambda: isinstance(app.screen, DetailScreen), what="the detail screen")
        detail = app.screen
        await until(pilot, lambda: detail.history.rows == 12, what="all rows")
        await pilot.pause(0.5)
        loss = detail.history.get("loss").ys
        assert all(math.isfinite(y) for y in loss[:4]) and all(math.isnan(y) for y in loss[4:])
        text = detail.query_one("#chart-loss", TimeChart).plot_text().plain
        assert any(0x2800 < ord(ch) <= 0x28FF for ch in text)  # the finite part is drawn
        assert "loss nan" in str(detail.query_one("#summary").render())
        for chart in detail.query(TimeChart):
            chart.plot_text()  # every chart draws with NaN rows in its history
