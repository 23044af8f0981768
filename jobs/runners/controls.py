"""Controls a running job obeys: `offload-jobs signal JOB save|sample|stop`, and SIGTERM.

The worker appends one JSON line per signal ({"ts", "action", "attempt"}) to the run dir's
control.jsonl; the runner reads new lines once per step and obeys those sent after its process
started (a signal sent to an earlier attempt is not this one's to obey). SIGTERM (cancel, or the worker shutting down) asks
for a checkpoint and a clean stop at the next step boundary.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

__all__ = ["ACTIONS", "Controls"]

ACTIONS = ("save", "sample", "stop")


class Controls:
    def __init__(self, run_dir: Path | None) -> None:
        import psutil

        self.path = Path(run_dir) / "control.jsonl" if run_dir is not None else None
        self.since = psutil.Process().create_time() - 0.05  # the clock's resolution; RUNNING comes after the child exists
        self.offset = 0
        self.terminated = False

    def install_sigterm(self) -> None:
        def on_term(signum: int, frame: Any) -> None:
            self.terminated = True

        signal.signal(signal.SIGTERM, on_term)

    def poll(self) -> list[str]:
        """Actions appended since the last poll (in order); a SIGTERM reads as 'stop'."""
        actions: list[str] = []
        if self.path is not None and self.path.exists():
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
            end = data.rfind(b"\n") + 1
            self.offset += end
            for line in data[:end].splitlines():
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if not isinstance(rec, dict) or float(rec.get("ts") or 0) < self.since:
                    continue
                action = rec.get("action")
                if action in ACTIONS:
                    actions.append(action)
        if self.terminated:
            actions.append("stop")
            self.terminated = False
        return actions
