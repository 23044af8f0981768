"""What the dashboard hears from the worker, on background threads, as Textual messages.

Two threads per app, each with its own `JobsClient` (the SSE stream holds its connection open):

- the poller lists the active jobs every `poll_s` (their last metrics: progress, VRAM, cache
  hits), fetches the jobs that left the active set, and the whole list on (re)connect and every
  `full_every_s`; it also says whether the worker answers, and why not (down, bad token, error);
- the event follower first asks the worker for its newest event id, then has the poller list
  every job, then reads the server-sent events from that id: nothing that happens between the
  list and the stream is lost. When the stream breaks (the worker restarted) it reconnects with
  the last event id it saw, so no status change is lost either.

Both threads block on the network or on a timer between rounds; neither spins.

`MetricsTail` reads one job's metrics.jsonl by byte offset while its detail screen is open: a
finished job replays from the start, a running one streams. It asks only for the bytes added
since its last read, and takes the job's status from the app (which events keep current)
instead of asking the worker for the whole job each round.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from textual.message import Message

from jobs.client import TERMINAL_STATES, JobsClient
from jobs.contract import TERMINAL, JobState
from jobs.errors import AuthError, JobsError, WorkerUnreachable

__all__ = ["WorkerFeed", "MetricsTail", "JobsSnapshot", "WorkerEvent", "ConnectionState", "MetricRows",
           "ACTIVE_STATES"]

ACTIVE_STATES = (JobState.PENDING, JobState.STARTING, JobState.RUNNING, JobState.CANCELLING)
LIVE_STATES = (JobState.STARTING, JobState.RUNNING, JobState.CANCELLING)
ClientFactory = Callable[[], JobsClient]
Post = Callable[[Message], Any]


class JobsSnapshot(Message):
    """Jobs as the worker lists them; `full` when it is every job."""

    def __init__(self, jobs: list[dict[str, Any]], full: bool) -> None:
        super().__init__()
        self.jobs = jobs
        self.full = full


class WorkerEvent(Message):
    """One server-sent event (`id`, `type`, `job_id`, ...)."""

    def __init__(self, event: dict[str, Any]) -> None:
        super().__init__()
        self.event = event


class ConnectionState(Message):
    """ok, down (nothing answers), auth (token refused) or error (the worker answered with an error)."""

    def __init__(self, state: str, detail: str = "", retry_s: float = 0.0) -> None:
        super().__init__()
        self.state = state
        self.detail = detail
        self.retry_s = retry_s


class MetricRows(Message):
    def __init__(self, job_id: str, rows: list[dict[str, Any]], done: bool) -> None:
        super().__init__()
        self.job_id = job_id
        self.rows = rows
        self.done = done


def _classify(exc: Exception) -> str:
    if isinstance(exc, AuthError):
        return "auth"
    if isinstance(exc, WorkerUnreachable):
        return "down"
    return "error"


class WorkerFeed:
    def __init__(self, make_client: ClientFactory, post: Post, *, poll_s: float = 1.0,
                 full_every_s: float = 30.0, max_backoff_s: float = 5.0) -> None:
        self.make_client = make_client
        self.post = post
        self.poll_s = poll_s
        self.full_every_s = full_every_s
        self.max_backoff_s = max_backoff_s
        self.last_event_id: int | None = None
        self.events_seen = 0
        self.positioned = threading.Event()  # the stream's start is known: no event is missed from here
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._relist = threading.Event()
        self._threads: list[threading.Thread] = []
        self._clients: list[JobsClient] = []

    def set_poll_s(self, seconds: float) -> None:
        """Change how often the live jobs are re-read; a shorter interval starts with a read now."""
        shorter = seconds < self.poll_s
        self.poll_s = seconds
        if shorter:
            self._wake.set()

    def start(self) -> None:
        for target, name in ((self._poll_loop, "tui-poll"), (self._event_loop, "tui-events")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        for c in list(self._clients):
            try:
                c.close()  # breaks a blocked SSE read
            except Exception:
                pass

    def poke(self) -> None:
        """Poll now (after an action such as cancel)."""
        self._wake.set()

    def _client(self) -> JobsClient:
        c = self.make_client()
        self._clients.append(c)
        return c

    def _renew(self, client: JobsClient) -> JobsClient:
        try:
            client.close()
        except Exception:
            pass
        if client in self._clients:
            self._clients.remove(client)
        return self._client()

    # ------------------------------------------------------------ the poller
    def _poll_loop(self) -> None:
        client = self._client()
        active: set[str] = set()
        last_full = 0.0
        backoff = 0.5
        state = None
        # The first list after the stream's start is known (one small request), so it need not be taken twice.
        self.positioned.wait(min(1.0, self.poll_s))
        while not self._stop.is_set():
            try:
                full = state != "ok" or self._relist.is_set() or time.monotonic() - last_full > self.full_every_s
                if full:
                    self._relist.clear()
                    jobs = client.list()
                    last_full = time.monotonic()
                else:
                    # Running jobs only: their metrics change; queued ones change by events (and the full list).
                    jobs = client.list(status=",".join(LIVE_STATES))
                    seen = {j["id"] for j in jobs}
                    for gone in active - seen:  # ended since the last poll: its final row
                        try:
                            jobs.append(client.get(gone))
                        except JobsError:
                            pass
                active = {j["id"] for j in jobs if j.get("status") in LIVE_STATES}
                if self._stop.is_set():
                    return
                self.post(JobsSnapshot(jobs, full))
                if state != "ok":
                    self.post(ConnectionState("ok", client.url))
                state, backoff = "ok", 0.5
                wait = self.poll_s
            except JobsError as exc:
                state = _classify(exc)
                wait = backoff
                self.post(ConnectionState(state, str(exc), retry_s=wait))
                backoff = min(self.max_backoff_s, backoff * 2)
                client = self._renew(client)  # the worker may come back elsewhere, or with a new token
            except Exception as exc:  # a bug must not kill the thread silently
                state = "error"
                wait = backoff
                self.post(ConnectionState("error", f"{type(exc).__name__}: {exc}", retry_s=wait))
                backoff = min(self.max_backoff_s, backoff * 2)
            self._wake.wait(wait)
            self._wake.clear()

    # ------------------------------------------------------------ the event follower
    def _event_loop(self) -> None:
        client = self._client()
        backoff = 0.5
        while not self._stop.is_set():
            try:
                if not self.positioned.is_set():
                    self.last_event_id = _newest_event_id(client)
                    self.positioned.set()
                    self._relist.set()  # what happened before that id: in a list taken after it
                    self._wake.set()
                for ev in client.events(self.last_event_id):
                    if self._stop.is_set():
                        return
                    if isinstance(ev.get("id"), int):
                        self.last_event_id = ev["id"]
                    self.events_seen += 1
                    self.post(WorkerEvent(ev))
                    backoff = 0.5
                # The stream ended: the worker is stopping or restarting. Resume after a pause.
            except JobsError:
                client = self._renew(client)
            except Exception:
                if self._stop.is_set():
                    return
            self._wake.set()  # the poller re-lists at once
            self._stop.wait(backoff)
            backoff = min(self.max_backoff_s, backoff * 2)


def _newest_event_id(client: JobsClient) -> int | None:
    try:
        return client.last_event_id()  # type: ignore[attr-defined]
    except (WorkerUnreachable, AuthError):
        raise
    except JobsError:
        return None  # a worker without the endpoint: stream from now on


class MetricsTail:
    """Streams one job's metrics rows from byte 0 (a replay) while it runs; stops when asked.

    `status_of()` gives the job's status as the app knows it; without it the tail asks the worker.
    """

    def __init__(self, make_client: ClientFactory, job_id: str, post: Post, *, poll_s: float = 0.5,
                 status_of: Callable[[], str | None] | None = None) -> None:
        self.make_client = make_client
        self.job_id = job_id
        self.post = post
        self.poll_s = poll_s
        self.status_of = status_of
        self.offset = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"tui-metrics-{job_id}", daemon=True)

    def start(self) -> "MetricsTail":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        client = self.make_client()
        try:
            while not self._stop.is_set():
                try:
                    # The status first: if it was terminal before the read, the file is final.
                    status = self.status_of() if self.status_of is not None else client.get(self.job_id).get("status")
                    chunk = client.metrics(self.job_id, self.offset)
                except JobsError:
                    self._stop.wait(2.0)
                    continue
                rows = chunk.get("records") or []
                self.offset = int(chunk.get("next_offset", self.offset))
                done = status in TERMINAL_STATES
                if rows or done:
                    self.post(MetricRows(self.job_id, rows, done))
                if done and not rows:
                    return
                if not done:
                    self._stop.wait(self.poll_s)
        finally:
            client.close()
