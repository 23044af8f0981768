"""Dashboards fed by a recorded metrics stream and log, with no worker, for the snapshot tests.

The clock is fixed and the refresh timers are an hour long, so every snapshot is the same.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tui.app import DashboardApp
from tui.feed import ConnectionState
from tui.gpu import DeviceInfo, PanelData

DATA = Path(__file__).parent / "data"
NOW = 1_790_000_000.0
ROWS = [json.loads(ln) for ln in (DATA / "recorded_metrics.jsonl").read_text().splitlines()]
SPEC = {"kind": "command", "name": "toy-train", "offload": {"vram_budget": 8 << 30}, "command": "python train.py"}


def _jobs() -> list[dict[str, Any]]:
    base = {"max_attempts": 3, "spec": SPEC, "run_dir": "/state/runs/x"}
    return [
        {**base, "id": "a1b2c3d4e5f6", "name": "toy-train", "kind": "command", "status": "RUNNING", "attempt": 1,
         "created_at": NOW - 95, "started_at": NOW - 90, "last_metrics": ROWS[24]},
        {**base, "id": "0f9e8d7c6b5a", "name": "flux-lora", "kind": "train", "status": "PENDING", "attempt": 0,
         "created_at": NOW - 30, "spec": {"kind": "train", "train": {"steps": 1000}}},
        {**base, "id": "99aa88bb77cc", "name": "sample-grid", "kind": "infer", "status": "FAILED",
         "reason": "cuda_oom", "attempt": 3, "created_at": NOW - 7200, "started_at": NOW - 7100,
         "finished_at": NOW - 7000, "last_metrics": {"step": 3, "total_steps": 28, "vram_peak_bytes": 23 << 30}},
        {**base, "id": "1234abcd5678", "name": "shard-flux", "kind": "shard", "status": "SUCCEEDED", "attempt": 1,
         "created_at": NOW - 86400 * 2, "finished_at": NOW - 86000},
    ]


class SnapshotApp(DashboardApp):
    def __init__(self, screen: str) -> None:
        super().__init__(None, url="http://127.0.0.1:8765", refresh_s=3600.0, clock=lambda: NOW, feed=False,
                         start_dir=str(DATA.parents[2]))
        self.which = screen
        self.connection = ConnectionState("offline")
        self.gpu_reader = lambda: PanelData([DeviceInfo(0, "NVIDIA GeForce RTX 4090", 9 << 30, 24 << 30, 87, 64, 310.0)],
                                            host_used=20 << 30, host_total=64 << 30)
        self.replay = {"a1b2c3d4e5f6": ROWS}
        self.merge_jobs(_jobs(), full=True)

    def open_initial(self) -> None:
        if self.which == "detail":
            self.open_detail("a1b2c3d4e5f6")
        elif self.which == "logs":
            from jobs.rundir import RunDir
            from tui.screens.logs import LogsScreen

            rd = RunDir(DATA)
            rd_log = DATA / "recorded_output.log"

            def fetch(offset: int, limit: int) -> dict[str, Any]:
                size = rd_log.stat().st_size
                start = max(0, size + offset) if offset < 0 else min(offset, size)
                data = rd_log.read_bytes()[start:start + limit]
                return {"offset": start, "next_offset": start + len(data), "data": data.decode(), "eof": True,
                        "size": size, "status": "SUCCEEDED"}

            assert rd  # the same layout as a run dir
            self.push_screen(LogsScreen("a1b2c3d4e5f6", fetch=fetch, follow=False))
        elif self.which == "submit":
            from tui.screens.submit import SubmitScreen

            self.push_screen(SubmitScreen(start_dir=str(DATA.parents[2])))
