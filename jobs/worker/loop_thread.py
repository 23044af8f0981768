"""The worker's background threads (the scheduler, the heartbeat, the LISTEN connection): each one
runs a `_loop` on a daemon thread until `stop()` sets its `_stop` event and waits for it."""

from __future__ import annotations

import threading

__all__ = ["LoopThread"]


class LoopThread:
    """`start()` runs `self._loop` on a daemon thread named `thread_name`; `_loop` returns once `_stop`
    is set. `stop()` sets it and waits up to `join_timeout` seconds for the loop to end."""

    thread_name = "offload-jobs"
    join_timeout = 5.0

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name=self.thread_name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._end_loop()

    def _end_loop(self, *wake: threading.Event) -> None:
        """Set `_stop` (then each of `wake`, so a loop waiting on one sees it now) and join the thread."""
        self._stop.set()
        for event in wake:
            event.set()
        if self._thread is not None:
            self._thread.join(timeout=self.join_timeout)

    def _loop(self) -> None:
        raise NotImplementedError
