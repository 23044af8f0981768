"""The dashboard when things go wrong: no worker, a restart mid-session, a bad token, NaN metrics."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from typing import Any

import pytest
from tui_helpers import engine_job, make_app, until
from jobs_helpers import WorkerProcess

import tui.feed as feed_module
from jobs.client import JobsClient
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
    app = DashboardApp(make_client, url=url, poll_s=0.2, refresh_s=0.2, retry_max_s=0.5)
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
            await until(pilot, app.feed.positioned.is_set, what="the event stream's start")
            # The worker is killed under a running job; the restarted worker adopts the live attempt
            # (issue 10's exactly-once recovery), which then finishes.
            with w.client() as c:
                jid = c.submit({"kind": "command", "name": "survivor", "command": "sleep 4; echo done",
                                "retry": {"max_attempts": 2, "on": ["worker_lost"]}})["id"]
            await until(pilot, lambda: app.jobs.get(jid, {}).get("status") == "RUNNING", what="RUNNING")
            w.kill9()  # mid-job
            await until(pilot, lambda: app.connection.state == "down", what="the worker gone")
            w.start()
            await until(pilot, lambda: app.jobs.get(jid, {}).get("status") == "SUCCEEDED", what="SUCCEEDED",
                        timeout=60)
            await pilot.pause(0.5)
            with w.client() as c:
                stored = [(e["type"], e.get("status"), e.get("attempt")) for e in c.job_events(jid)]
            seen = [(e["type"], e.get("status"), e.get("attempt")) for e in app.job_events[jid]]
            assert seen == stored, "the dashboard's events differ from the worker's after the restart"
            assert [s for _, s, _ in seen if s in ("RUNNING", "SUCCEEDED")][-1] == "SUCCEEDED"
            assert [a for _, s, a in seen if s == "RUNNING"] == [1], "the adopted attempt ran once"
            ids = [e["id"] for e in app.job_events[jid]]
            assert ids == sorted(ids) and len(set(ids)) == len(ids)
    finally:
        w.stop()


@pytest.fixture(scope="module")
def nan_worker(tmp_path_factory) -> Iterator[tuple[WorkerProcess, str]]:
    """A worker of its own with a finished job whose loss is NaN from step 5 (bench/tui_job.py, 12 steps).

    Of its own, so the NaN job is the only one its job list holds.
    """
    w = WorkerProcess(tmp_path_factory.mktemp("nan-worker") / "home").start()
    try:
        with w.client() as c:
            jid = c.submit(engine_job("tui-nan", 12, 40, "--nan-from", "5"))["id"]
            assert c.wait(jid, timeout=180)["status"] == "SUCCEEDED"
        yield w, jid
    finally:
        w.stop()


async def test_nan_metrics_still_draw(nan_worker) -> None:
    worker, jid = nan_worker
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
        await until(pilot, lambda: detail.replayed, what="the replay to end (the job's status known)")


def test_a_job_with_nan_metrics_leaves_the_job_list_working(nan_worker) -> None:
    # the store writes strict JSON (NaN becomes null), so one diverging job never breaks the list
    worker, jid = nan_worker
    with worker.client() as c:
        assert jid in {j["id"] for j in c.list()}


def test_an_event_between_the_first_list_and_the_stream_is_not_lost(worker, monkeypatch) -> None:
    # The race made certain: a job is created right after the feed has read where the stream starts,
    # before the stream connects. It must arrive as an event (the poller lists only every 30 s here).
    real = feed_module._newest_event_id
    created: dict[str, str] = {}

    def newest_then_submit(client: JobsClient) -> int | None:
        start = real(client)
        with worker.client() as c:
            created["id"] = c.submit({"kind": "command", "name": "in-the-gap", "command": "true"})["id"]
        return start

    monkeypatch.setattr(feed_module, "_newest_event_id", newest_then_submit)
    heard: list[Any] = []
    feed = feed_module.WorkerFeed(lambda: JobsClient(worker.url, worker.token), heard.append, poll_s=30.0)
    feed.start()
    try:
        deadline = time.monotonic() + 30
        while not any(isinstance(m, feed_module.WorkerEvent) and m.event.get("job_id") == created.get("id")
                      and m.event.get("type") == "job.created" for m in list(heard)):
            assert time.monotonic() < deadline, "the job created in the gap never came as an event"
            time.sleep(0.05)
    finally:
        feed.stop()
