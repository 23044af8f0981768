"""LISTEN/NOTIFY: idle workers wake the moment a job is submitted, retried or cancelled.

One thread with its own autocommit connection (psycopg), listening on `offload_jobs_queue`
(a job became claimable, or one is being cancelled: wake the scheduler) and `offload_jobs_events`
(an event was written anywhere: wake this worker's event streams). Without it a worker still
polls every `tick`, so a lost connection only costs latency; it reconnects with back-off and
wakes the scheduler once on every reconnect (a NOTIFY sent meanwhile was missed).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from sqlalchemy.engine import make_url

from jobs.store_base import EVENTS_CHANNEL, PG_CONNECT_ARGS, QUEUE_CHANNEL
from jobs.worker.loop_thread import LoopThread

__all__ = ["Listener"]

log = logging.getLogger("offload_jobs.listen")


def libpq_url(url: str) -> str:
    """The SQLAlchemy URL as libpq takes it (`postgresql+psycopg://` -> `postgresql://`)."""
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


class Listener(LoopThread):
    thread_name = "offload-jobs-listen"

    def __init__(self, url: str, on_queue: Callable[[], None], on_events: Callable[[], None]) -> None:
        super().__init__()
        self.url = libpq_url(url)
        self.on_queue = on_queue
        self.on_events = on_events
        self.connected = threading.Event()
        self.received = 0

    def _loop(self) -> None:
        import psycopg

        backoff = 0.5
        given = set(make_url(self.url).query)
        kwargs = {k: v for k, v in PG_CONNECT_ARGS.items() if k not in given}
        while not self._stop.is_set():
            try:
                with psycopg.connect(self.url, autocommit=True, **kwargs) as conn:
                    conn.execute(f"LISTEN {QUEUE_CHANNEL}")
                    conn.execute(f"LISTEN {EVENTS_CHANNEL}")
                    self.connected.set()
                    backoff = 0.5
                    self.on_queue()  # whatever was announced while we were not listening
                    while not self._stop.is_set():
                        for note in conn.notifies(timeout=1.0):
                            self.received += 1
                            (self.on_queue if note.channel == QUEUE_CHANNEL else self.on_events)()
                        conn.execute("SELECT 1")  # a dead link fails here, not never
            except Exception as exc:  # psycopg.Error, OSError: reconnect
                self.connected.clear()
                if self._stop.is_set():
                    return
                log.info("LISTEN connection lost (%s); reconnecting in %.1fs", exc, backoff)
                self._stop.wait(backoff)
                backoff = min(5.0, backoff * 2)
            time.sleep(0)
