"""What the dashboard costs: CPU of the `offload-jobs tui` process and its screen refresh rate.

A real worker (one CPU job slot) runs bench/tui_job.py streaming 10 metric rows a second while
999 more jobs wait in the queue, so the jobs table holds 1,000 rows. The dashboard runs in tmux
(a real terminal) on the jobs screen, then on the job's detail screen; for each, the TUI's CPU
time over the window (psutil) and how often the pane's text changes (capture-pane at 20 Hz),
and the time from a key press to the cursor moving on the 1,000-row table.

    python -m bench.tui_cost [--seconds 15] [--jobs 1000]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "jobs"))
from jobs_helpers import WorkerProcess  # noqa: E402


def tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], capture_output=True, text=True).stdout


def measure(session: str, pid: int, seconds: float) -> dict[str, float]:
    proc = psutil.Process(pid)
    procs = [proc, *proc.children(recursive=True)]
    cpu0 = sum(p.cpu_times().user + p.cpu_times().system for p in procs)
    t0 = time.monotonic()
    frames, last = 0, None
    while time.monotonic() - t0 < seconds:
        pane = tmux("capture-pane", "-p", "-t", session)
        if pane != last:
            frames += 1
            last = pane
        time.sleep(0.05)
    wall = time.monotonic() - t0
    cpu1 = sum(p.cpu_times().user + p.cpu_times().system for p in procs)
    return {"cpu_pct_of_one_core": round(100 * (cpu1 - cpu0) / wall, 2), "screen_updates_per_s": round(frames / wall, 2)}


def key_latency(session: str, tries: int = 10) -> float:
    """Median seconds from `down` to a changed pane."""
    out = []
    for _ in range(tries):
        before = tmux("capture-pane", "-p", "-t", session)
        t0 = time.monotonic()
        tmux("send-keys", "-t", session, "Down")
        while tmux("capture-pane", "-p", "-t", session) == before and time.monotonic() - t0 < 5:
            time.sleep(0.005)
        out.append(time.monotonic() - t0)
        time.sleep(0.3)
    return sorted(out)[len(out) // 2]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--jobs", type=int, default=1000)
    a = ap.parse_args()
    if shutil.which("tmux") is None:
        print("error: tmux is needed (apt-get install tmux)", file=sys.stderr)
        return 2
    home = Path(tempfile.mkdtemp()) / "home"
    w = WorkerProcess(home, "--max-cpu-jobs", "1").start()
    result: dict[str, object] = {}
    try:
        c = w.client()
        stream = c.submit({"kind": "command", "name": "stream", "workdir": str(REPO),
                           "command": [sys.executable, str(REPO / "bench" / "tui_job.py"), "--steps", "100000",
                                       "--rate", "10", "--log-every", "10"]})["id"]
        t0 = time.monotonic()
        for i in range(a.jobs - 1):
            c.submit({"kind": "command", "name": f"queued-{i}", "command": "true"})
        result["submit_s"] = round(time.monotonic() - t0, 1)
        time.sleep(5)  # the stream job imports torch and starts writing rows
        env = f"OFFLOAD_JOBS_URL={w.url} OFFLOAD_JOBS_TOKEN={w.token}"
        for name, extra in (("jobs_screen", ""), ("detail_screen", f"--job {stream}")):
            session = f"tui-cost-{os.getpid()}"
            tmux("new-session", "-d", "-s", session, "-x", "200", "-y", "50",
                 f"{env} exec {sys.executable} -m jobs tui {extra}")
            time.sleep(4)
            pid = int(tmux("display-message", "-p", "-t", session, "#{pane_pid}").strip())
            r = measure(session, pid, a.seconds)
            if name == "jobs_screen":
                r["key_to_screen_s_median"] = round(key_latency(session), 3)
            result[name] = r
            tmux("kill-session", "-t", session)
            time.sleep(1)
        rows = c.metrics(stream)["records"]
        result["stream_rows_per_s"] = round(len(rows) / max(1e-9, (time.time() - c.get(stream)["started_at"])), 1)
        result["jobs_in_table"] = len(c.list())
    finally:
        w.stop()
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
