"""Fault-injection points for the crash tests (off unless $OFFLOAD_JOBS_FAULTS is set).

`OFFLOAD_JOBS_FAULTS="prepared=0.3,recorded=0.3"` makes the scheduler sleep at those points of a
launch: `prepared` (the child exists, held, its identity not yet in the store) and `recorded` (the
identity is committed, the child not yet let go), `ended` (an attempt ended, its end not yet
written to the store), `received` (a submit read, nothing made yet) and `submitted` (a submit's job is committed, its answer not yet sent). While it sleeps, the file `fault-<point>` exists
in the state dir, so a test can kill the worker inside exactly the windows where a crash used to
run a job twice.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

__all__ = ["FaultPoints"]


class FaultPoints:
    def __init__(self, home: Path, spec: str | None = None) -> None:
        self.home = home
        spec = os.environ.get("OFFLOAD_JOBS_FAULTS", "") if spec is None else spec
        self.pauses: dict[str, float] = {}
        for item in spec.split(","):
            name, _, secs = item.partition("=")
            try:
                if name.strip():
                    self.pauses[name.strip()] = float(secs or "0.1")
            except ValueError:
                pass

    def pause(self, point: str) -> None:
        secs = self.pauses.get(point)
        if not secs:
            return
        marker = self.home / f"fault-{point}"
        marker.write_text(str(os.getpid()))
        try:
            time.sleep(secs)
        finally:
            marker.unlink(missing_ok=True)
