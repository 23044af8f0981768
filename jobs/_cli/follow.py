"""Following a job: print its log as it grows and report status changes until it ends.

Shared by `submit` (attached) and `logs -f`. The log is read by byte offset and status changes
arrive as server-sent events of that job; both resume where they left off (the offset, the last
event id) when the worker restarts or the connection drops, so a follower rides through a
worker restart instead of exiting. The job's status is read *before* the log is drained, so
once a terminal status is seen the log read after it is complete.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, TextIO

from jobs.contract import JobState, TERMINAL

if TYPE_CHECKING:
    from jobs.client import JobsClient

__all__ = ["read_log", "follow_job", "tail_lines", "ProgressLine", "EventFeed"]

POLL_S = 0.2
REFRESH_S = 1.0  # the job itself (metrics for the live line) is re-read at least this often


def read_log(client: JobsClient, job_id: str, offset: int = 0) -> tuple[str, int]:
    """Everything in the job's log from `offset` now; returns (text, next offset)."""
    parts: list[str] = []
    while True:
        chunk = client.logs(job_id, offset=offset)
        data = chunk.get("data") or ""
        if isinstance(data, bytes):
            data = data.decode("utf-8", errors="replace")
        nxt = int(chunk.get("next_offset", offset))
        if data:
            parts.append(data)
        if not data or nxt <= offset or chunk.get("eof", True):
            return "".join(parts), nxt
        offset = nxt


def tail_lines(text: str, n: int) -> str:
    """The last `n` lines of `text` (n <= 0: nothing)."""
    if n <= 0 or not text:
        return ""
    lines = text.splitlines(keepends=True)
    return "".join(lines[-n:])


class EventFeed:
    """A thread reading one job's server-sent events into a queue, reconnecting with the last id."""

    def __init__(self, make_client: Callable[[], JobsClient], job_id: str, *, own_clients: bool = False) -> None:
        self.make_client = make_client
        self.own_clients = own_clients  # make_client makes new clients (not the caller's): close them at exit
        self.job_id = job_id
        self.last_id = 0  # the job's whole history is a handful of events: replaying it is cheap
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="offload-jobs-events", daemon=True)
        self._client: JobsClient | None = None  # the one the thread reads the stream with

    def __enter__(self) -> EventFeed:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        client = self._client
        if client is not None and self.own_clients:  # end the thread's blocked read now, not at its read timeout or at exit
            try:
                client.close()
            except Exception:
                pass

    def drain(self) -> list[dict[str, Any]]:
        out = []
        while True:
            try:
                out.append(self.events.get_nowait())
            except queue.Empty:
                return out

    def _run(self) -> None:
        from jobs.errors import JobsError

        backoff = POLL_S
        while not self._stop.is_set():
            try:
                client = self._client = self.make_client()
                if self._stop.is_set():
                    return
                for ev in client.events(last_event_id=self.last_id, job_id=self.job_id, read_timeout=60.0):
                    if isinstance(ev.get("id"), int):
                        self.last_id = ev["id"]
                    self.events.put(ev)
                    backoff = POLL_S
                    if self._stop.is_set():
                        return
            except JobsError:
                pass  # the worker is away; ask again
            except Exception:  # a broken stream of any kind: the log polling still goes on
                pass
            self._stop.wait(backoff)
            backoff = min(2.0, backoff * 2)


def follow_job(
    client: JobsClient,
    job_id: str,
    *,
    offset: int = 0,
    out: TextIO | None = None,
    on_status: Callable[[dict[str, Any]], None] | None = None,
    poll: float = POLL_S,
    reconnect: Callable[[], JobsClient] | None = None,
) -> dict[str, Any]:
    """Write the job's log from `offset` to `out` until the job ends; return the final job.

    `reconnect` makes a new client (the worker may come back on another port); without it the
    same client is retried. Either way an unreachable worker is waited for, not given up on.
    """
    from jobs.errors import StoreError, WorkerUnreachable

    make = reconnect or (lambda: client)
    stream = out if out is not None else sys.stdout
    lost_since: float | None = None
    job: dict[str, Any] | None = None
    last_get = 0.0
    with EventFeed(make, job_id, own_clients=reconnect is not None) as feed:
        while True:
            try:
                changed = any(ev.get("type") == "job.status" for ev in feed.drain())
                if job is None or changed or time.monotonic() - last_get > REFRESH_S:
                    job = client.get(job_id)
                    last_get = time.monotonic()
                    if on_status is not None:
                        on_status(job)
                text, offset = read_log(client, job_id, offset)
                if lost_since is not None:
                    print(f"offload-jobs: reconnected to the worker at {client.url}", file=sys.stderr, flush=True)
                    lost_since = None
                if text:
                    stream.write(text)
                    stream.flush()
                if job.get("status") in TERMINAL:
                    return job
            except (WorkerUnreachable, StoreError) as exc:
                if lost_since is None:
                    lost_since = time.monotonic()
                    print(f"offload-jobs: lost the worker ({exc}); reconnecting, the job keeps running "
                          "(Ctrl-C to stop following)", file=sys.stderr, flush=True)
                try:
                    client = make()
                except WorkerUnreachable:
                    pass  # no worker.json yet: it is still starting
                time.sleep(min(2.0, poll * 5))
                continue
            time.sleep(poll)


class ProgressLine:
    """The live status line of an attached job.

    On a terminal it is a Rich Live line under the scrolling log (status, attempt, runtime and the
    latest metrics). Elsewhere it prints one plain line to stderr per status change, so pipes and
    CI logs stay clean.
    """

    def __init__(self, job_id: str, name: str | None = None, live: bool | None = None):
        self.job_id = job_id
        self.name = name
        self.job: dict[str, Any] = {"id": job_id, "status": JobState.PENDING}
        self._last_status: str | None = None
        self._live_enabled = sys.stdout.isatty() and sys.stderr.isatty() if live is None else live
        self._live: Any = None

    # Rich calls this on every refresh, so the runtime ticks even between polls.
    def __rich__(self) -> Any:
        from rich.text import Text

        from jobs._cli.output import fmt_duration, job_runtime, status_markup

        job = self.job
        line = Text.from_markup(f"[bold]{self.job_id}[/] ")
        if self.name:
            line.append(f"{self.name} ")
        line.append_text(Text.from_markup(status_markup(job.get("status"), job.get("reason"))))
        if job.get("attempt"):
            line.append(f"  attempt {job['attempt']}", style="dim")
        runtime = job_runtime(job)
        if runtime is not None:
            line.append(f"  {fmt_duration(runtime)}", style="dim")
        metrics = job.get("last_metrics")
        if isinstance(metrics, dict) and metrics:
            shown = [f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in list(metrics.items())[:4]]
            line.append("  " + " ".join(shown), style="dim")
        return line

    def __enter__(self) -> ProgressLine:
        if self._live_enabled:
            from rich.live import Live

            from jobs._cli.output import console

            # Live redirects sys.stdout, so log lines scroll above the status line.
            self._live = Live(self, console=console(stderr=True), refresh_per_second=4,
                              transient=True, redirect_stdout=True, redirect_stderr=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)
            self._live = None

    def update(self, job: dict[str, Any]) -> None:
        self.job = job
        status = job.get("status")
        if status != self._last_status:
            self._last_status = status
            # Plain mode leaves the terminal status to the caller's closing line.
            if self._live is None and status not in TERMINAL:
                reason = f" ({job['reason']})" if job.get("reason") and status != JobState.SUCCEEDED else ""
                attempt = f", attempt {job['attempt']}" if job.get("attempt") else ""
                print(f"offload-jobs: job {self.job_id} {status}{reason}{attempt}", file=sys.stderr, flush=True)
