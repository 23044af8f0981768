"""`DashboardApp`: the Textual dashboard of a worker, and `main()` for `offload-jobs tui`.

The app holds the one copy of what it knows about jobs (`jobs`, merged from polls and events) and
marks each job it changed with the `version` of that change (`changed_at`), so a screen's timer
(every `refresh_s`, a few times a second at most) redraws only the jobs changed since it last
looked, and nothing when nothing changed. It talks to the worker only through
`jobs.client.JobsClient`, on background threads (`tui.feed`), started after the first frame is on
screen: the first frame never waits for the worker.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Callable

from textual.app import App
from textual.binding import Binding

from jobs.client import JobsClient
from jobs.contract import JobState
from tui.feed import ConnectionState, JobsSnapshot, MetricRows, WorkerEvent, WorkerFeed

__all__ = ["DashboardApp", "main"]

# How often the running jobs' rows are re-read (one small request: live jobs only; queued ones
# change by events). The worker records a running job's newest metrics every 0.4 s, so the
# table's progress moves at about 2.5 Hz.
LIVE_POLL_S = 0.4

ClientFactory = Callable[[], JobsClient]


class DashboardApp(App):
    """Jobs, live charts, logs and a submit form for one worker."""

    TITLE = "offload-jobs"
    BINDINGS = [
        Binding("q", "quit", "Quit"),
        Binding("question_mark", "help", "Help", key_display="?"),
    ]
    CSS = """
    Screen { layout: vertical; }
    """

    def __init__(self, make_client: ClientFactory | None = None, *, url: str = "", read_only: bool = False,
                 poll_s: float = LIVE_POLL_S, refresh_s: float = 0.25, open_job: str | None = None, open_logs: bool = False,
                 tail: int | None = None, follow: bool = True, clock: Callable[[], float] = time.time,
                 feed: bool = True, gpu: bool = True, start_dir: str | None = None, retry_max_s: float = 5.0) -> None:
        super().__init__()
        self.make_client = make_client
        self.url = url
        self.read_only = read_only
        self.refresh_s = refresh_s
        self.open_job = open_job
        self.open_logs = open_logs
        self.tail = tail
        self.follow = follow
        self.clock = clock
        self.gpu_enabled = gpu
        self.start_dir = start_dir
        self.jobs: dict[str, dict[str, Any]] = {}
        self.job_events: dict[str, deque[dict[str, Any]]] = {}
        self.version = 0  # bumped on every change to `jobs`
        self.changed_at: dict[str, int] = {}  # job id -> the version that last changed (or removed) it
        self.connection = ConnectionState("connecting", url)
        self.feed = (WorkerFeed(make_client, self.post_message, poll_s=poll_s, max_backoff_s=retry_max_s)
                     if feed and make_client else None)
        self.refreshes = 0  # data refreshes drawn (read by the cost bench)
        self._client: JobsClient | None = None
        self.started = (time.perf_counter(), time.process_time())
        self.first_frame: tuple[float, float] | None = None  # (wall s, process CPU s) from __init__
        self._after_first_frame: list[Callable[[], Any]] = []

    # ------------------------------------------------------------ lifecycle
    def on_mount(self) -> None:
        from tui.screens.jobs import JobsScreen

        self.push_screen(JobsScreen())
        self.open_initial()

    def on_ready(self) -> None:
        """The first frame is on screen: now ask the worker (and NVML) for data."""
        self.first_frame = (time.perf_counter() - self.started[0], time.process_time() - self.started[1])
        if self.feed is not None:
            self.feed.start()
        waiting, self._after_first_frame = self._after_first_frame, []
        for callback in waiting:
            callback()

    def after_first_frame(self, callback: Callable[[], Any]) -> None:
        """Run `callback` once the first frame is drawn (now, if it is): threads that fetch data
        start there, so the first frame does not share the CPU with them."""
        if self.first_frame is not None:
            callback()
        else:
            self._after_first_frame.append(callback)

    def open_initial(self) -> None:
        """The screens to show over the jobs screen at start (`--job`, `--logs`)."""
        if self.open_job:
            self.open_detail(self.open_job, logs=self.open_logs)

    def on_unmount(self) -> None:
        if self.feed is not None:
            self.feed.stop()

    def client(self) -> JobsClient:
        """A client for one-off calls from worker threads (cancel, submit, ...)."""
        if self.make_client is None:
            raise RuntimeError("this dashboard has no worker")
        return self.make_client()

    # ------------------------------------------------------------ the model
    def touch(self, job_id: str) -> None:
        """Mark one job as changed (or gone) for the screens to redraw."""
        self.version += 1
        self.changed_at[job_id] = self.version

    def merge_jobs(self, jobs: list[dict[str, Any]], full: bool = False) -> None:
        """Merge listed jobs; only a job whose fields differ counts as changed."""
        if full:
            keep = {j["id"] for j in jobs if "id" in j}
            for gone in [k for k in self.jobs if k not in keep]:
                del self.jobs[gone]
                self.touch(gone)
        for j in jobs:
            job_id = j.get("id")
            if job_id is None:
                continue
            cur = self.jobs.get(job_id)
            if cur is None:
                self.jobs[job_id] = dict(j)
            elif any(cur.get(k) != v for k, v in j.items()):
                cur.update(j)
            else:
                continue
            self.touch(job_id)

    def on_jobs_snapshot(self, msg: JobsSnapshot) -> None:
        self.merge_jobs(msg.jobs, msg.full)

    def on_worker_event(self, msg: WorkerEvent) -> None:
        ev = msg.event
        job_id = ev.get("job_id")
        if not job_id:
            return
        self.job_events.setdefault(job_id, deque(maxlen=500)).append(ev)
        job = self.jobs.get(job_id)
        if job is None:
            job = self.jobs[job_id] = {"id": job_id, "created_at": ev.get("ts"), "spec": {}}
        for key in ("status", "name", "kind", "attempt"):
            if key in ev:
                job[key] = ev[key]
        if ev.get("type") == "job.status":
            job["reason"] = ev.get("reason")
            if ev.get("status") == JobState.RUNNING:
                job["started_at"] = ev.get("ts")
            if ev.get("status") in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED):
                job["finished_at"] = ev.get("ts")
        self.touch(job_id)

    def on_connection_state(self, msg: ConnectionState) -> None:
        from tui.widgets.panels import ConnectionBar

        self.connection = msg
        for screen in self.screen_stack:
            for bar in screen.query(ConnectionBar):
                bar.sync()

    def on_metric_rows(self, msg: MetricRows) -> None:
        for screen in self.screen_stack:  # the detail screen keeps charting under its logs screen
            handler = getattr(screen, "add_metric_rows", None)
            if handler is not None:
                handler(msg)

    # ------------------------------------------------------------ navigation
    def open_detail(self, job_id: str, logs: bool = False) -> None:
        from tui.screens.detail import DetailScreen
        from tui.screens.logs import LogsScreen

        self.push_screen(DetailScreen(job_id))
        if logs:
            self.push_screen(LogsScreen(job_id, tail=self.tail, follow=self.follow))

    def action_help(self) -> None:
        from tui.screens.dialogs import HelpScreen

        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen(self.screen))


def client_factory(url: str | None = None, token: str | None = None,
                   home: str | None = None) -> tuple[ClientFactory, str]:
    """A factory of clients, and the URL to show. What is not given is looked up at each call
    ($OFFLOAD_JOBS_URL / _TOKEN, else the state dir), so a worker started after the dashboard,
    with a new port or a first token, is found on the next retry."""
    import os

    from jobs.home import DEFAULT_URL, read_token, read_worker_info, state_home

    h = state_home(home)

    def resolve() -> tuple[str, str | None]:
        u = url or os.environ.get("OFFLOAD_JOBS_URL") or (read_worker_info(h) or {}).get("url") or DEFAULT_URL
        t = token if token is not None else (os.environ.get("OFFLOAD_JOBS_TOKEN") or read_token(h))
        return u, t

    def make_client() -> JobsClient:
        u, t = resolve()
        return JobsClient(u, t, timeout=10.0)

    return make_client, resolve()[0]


def main(*, url: str | None = None, token: str | None = None, home: str | None = None, read_only: bool = False,
         job: str | None = None, logs: bool = False, tail: int | None = None, poll_s: float = LIVE_POLL_S) -> None:
    """Run the dashboard against the worker named by `url`/`token`, or by the state dir (`home`)."""
    make_client, shown = client_factory(url, token, home)
    DashboardApp(make_client, url=shown, read_only=read_only, open_job=job, open_logs=logs, tail=tail,
                 poll_s=poll_s).run()
