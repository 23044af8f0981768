"""What the dashboard costs: CPU of the `offload-jobs tui` process, its screen refresh rate, start-up.

A real worker (one CPU job slot) runs bench/tui_job.py streaming 10 metric rows a second while
999 more jobs wait in the queue, so the jobs table holds 1,000 rows. The dashboard runs in tmux
(a real terminal), on the jobs screen and then on the streaming job's detail screen. For each:

- CPU: the TUI process's user+sys time over the window (psutil, i.e. /proc/PID/stat) divided by
  the window's wall time. The box may be shared and loaded; load lengthens waits, but barely
  changes the CPU time a process itself uses, so this figure holds up; the load average is printed.
- refresh rate: how often the pane's text changes (capture-pane at 20 Hz);
- the achieved metric row rate of the stream job over the same window (it runs slower than asked
  when the box is too loaded to keep up, and then the dashboard has less to draw);
- on the jobs screen, the time from a key press (Down, PageDown) to the pane changing (colours
  included: Down only moves the highlighted row).

Start-up: the wall time from launching `offload-jobs tui` to its first frame on the pane (the
table's header), and to the first job rows; with the process's CPU time at the first frame.

The floor, in the same run and the same tmux: bench/tui_floor_app.py, a bare Textual app with
the same widgets holding 1,000 static rows (no worker, no feed): its start-up, its CPU while
idle, and its key latency.

    python -m bench.tui_cost [--seconds 15] [--jobs 1000] [--py-spy DIR]

--py-spy DIR records each window with py-spy (folded stacks, `pip install py-spy`) into DIR.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "_helpers"))
from jobs_helpers import WorkerProcess  # noqa: E402


def tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], capture_output=True, text=True).stdout


def pane(session: str, colours: bool = False) -> str:
    return tmux("capture-pane", "-p", *(["-e"] if colours else []), "-t", session)


def cpu_s(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def has_braille(text: str) -> bool:
    return any(0x2800 < ord(ch) <= 0x28FF for ch in text)


def load() -> float:
    return round(os.getloadavg()[0], 2)


class Stream:
    """Counts the stream job's metric rows by byte offset (only the new bytes are read)."""

    def __init__(self, client: Any, job_id: str) -> None:
        self.client, self.job_id = client, job_id
        self.offset = 0
        self.rows = 0

    def poll(self) -> int:
        chunk = self.client.metrics(self.job_id, self.offset)
        self.offset = chunk["next_offset"]
        self.rows += len(chunk["records"])
        return self.rows


def launch(session: str, env: str, extra: str, command: str = "") -> int:
    command = command or f"{sys.executable} -m jobs tui {extra}"
    # A tmux server started without a terminal gives its panes COLUMNS=80 and LINES=24, which Textual
    # prefers to the pane's real 200x50: drop them (`env` execs the command, so the pane's pid is it).
    tmux("new-session", "-d", "-s", session, "-x", "200", "-y", "50", f"{env} exec env -u COLUMNS -u LINES {command}")
    return int(tmux("display-message", "-p", "-t", session, "#{pane_pid}").strip())


FLOOR = f"{sys.executable} {REPO / 'bench' / 'tui_floor_app.py'} --rows 1000"


def startup(env: str, newest: str, tries: int = 3, command: str = "") -> dict[str, float]:
    """Launch to first frame (the header drawn) and to rows (the newest job's name shown)."""
    firsts, cpus, rows = [], [], []
    for i in range(tries):
        session = f"tui-start-{os.getpid()}-{i}"
        t0 = time.monotonic()
        pid = launch(session, env, "", command)
        first = filled = None
        while time.monotonic() - t0 < 30 and filled is None:
            text = pane(session)
            if first is None and "PEAK VRAM" in text:
                first = time.monotonic() - t0
                cpus.append(cpu_s(pid))
            if newest in text:
                filled = time.monotonic() - t0
            time.sleep(0.005)
        tmux("kill-session", "-t", session)
        if first is not None:
            firsts.append(first)
        if filled is not None:
            rows.append(filled)
        time.sleep(0.5)
    med = lambda xs: round(statistics.median(xs), 3) if xs else None  # noqa: E731
    return {"first_frame_wall_s_median": med(firsts), "first_frame_cpu_s_median": med(cpus),
            "rows_shown_wall_s_median": med(rows), "load_avg": load()}


def measure(session: str, pid: int, seconds: float, stream: Stream, spy: Path | None, name: str) -> dict[str, float]:
    spy_proc = None
    if spy is not None:
        spy.mkdir(parents=True, exist_ok=True)
        spy_proc = subprocess.Popen([shutil.which("py-spy") or "py-spy", "record", "--pid", str(pid), "-d",
                                     str(int(seconds)), "-r", "100", "-f", "raw", "-o", str(spy / f"{name}.txt")],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    load0, rows0 = load(), stream.poll()
    cpu0, t0 = cpu_s(pid), time.monotonic()
    frames, last = 0, None
    while time.monotonic() - t0 < seconds:
        text = pane(session)
        if text != last:
            frames += 1
            last = text
        time.sleep(0.05)
    wall = time.monotonic() - t0
    cpu1 = cpu_s(pid)
    rows1 = stream.poll()
    if spy_proc is not None:
        spy_proc.wait(30)
    return {"cpu_pct_of_one_core": round(100 * (cpu1 - cpu0) / wall, 2),
            "screen_updates_per_s": round(frames / wall, 2),
            "stream_rows_per_s": round((rows1 - rows0) / wall, 2),
            "load_avg": [load0, load()]}


def key_latency(session: str, key: str, tries: int = 10) -> float:
    """Median seconds from a key press to a changed pane."""
    out = []
    for _ in range(tries):
        before = pane(session, colours=True)
        t0 = time.monotonic()
        tmux("send-keys", "-t", session, key)
        while pane(session, colours=True) == before and time.monotonic() - t0 < 5:
            time.sleep(0.005)
        out.append(time.monotonic() - t0)
        time.sleep(0.3)
    return round(statistics.median(out), 3)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--jobs", type=int, default=1000)
    ap.add_argument("--py-spy", type=Path, default=None, dest="spy")
    a = ap.parse_args()
    if shutil.which("tmux") is None:
        print("error: tmux is needed (apt-get install tmux)", file=sys.stderr)
        return 2
    home = Path(tempfile.mkdtemp()) / "home"
    w = WorkerProcess(home, "--max-cpu-jobs", "1").start()
    result: dict[str, object] = {"cores": os.cpu_count(), "load_avg_at_start": load()}
    try:
        c = w.client()
        stream_id = c.submit({"kind": "command", "name": "stream", "workdir": str(REPO),
                              "command": [sys.executable, str(REPO / "bench" / "tui_job.py"), "--steps", "100000",
                                          "--rate", "10", "--log-every", "10"]})["id"]
        t0 = time.monotonic()
        for i in range(a.jobs - 1):
            c.submit({"kind": "command", "name": f"queued-{i}", "command": "true"})
        result["submit_s"] = round(time.monotonic() - t0, 1)
        stream = Stream(c, stream_id)
        deadline = time.monotonic() + 120
        while stream.poll() < 10 and time.monotonic() < deadline:  # torch imported, rows flowing
            time.sleep(0.5)
        env = f"OFFLOAD_JOBS_URL={w.url} OFFLOAD_JOBS_TOKEN={w.token}"
        result["startup"] = startup(env, f"queued-{a.jobs - 2}")
        result["floor_startup"] = startup("", "queued-0", command=FLOOR)
        session = f"tui-floor-{os.getpid()}"
        pid = launch(session, "", "", FLOOR)
        time.sleep(3)
        cpu0, t0 = cpu_s(pid), time.monotonic()
        time.sleep(min(a.seconds, 10))
        result["floor"] = {"idle_cpu_pct_of_one_core": round(100 * (cpu_s(pid) - cpu0) / (time.monotonic() - t0), 2),
                           "key_down_to_screen_s_median": key_latency(session, "Down"),
                           "key_pagedown_to_screen_s_median": key_latency(session, "PageDown")}
        tmux("kill-session", "-t", session)
        newest = f"queued-{a.jobs - 2}"
        for name, extra, ready in (("jobs_screen", "", lambda t: newest in t),
                                   ("detail_screen", f"--job {stream_id}", lambda t: "runtime" in t and has_braille(t))):
            session = f"tui-cost-{os.getpid()}"
            pid = launch(session, env, extra)
            deadline = time.monotonic() + 60
            while not ready(pane(session)) and time.monotonic() < deadline:  # the table filled, the charts drawn
                time.sleep(0.1)
            time.sleep(3)  # and settled: start-up is not part of the window
            keys: dict[str, Any] = {}
            if name == "jobs_screen":  # keys from the top of the table (Down must have a row to move to)
                keys["key_down_to_screen_s_median"] = key_latency(session, "Down")
                keys["key_pagedown_to_screen_s_median"] = key_latency(session, "PageDown")
                # the streaming job, submitted first, is the table's last row: bring it into view
                tmux("send-keys", "-t", session, "C-End")
                time.sleep(1)
            r: dict[str, Any] = {**measure(session, pid, a.seconds, stream, a.spy, name), **keys}
            result[name] = r
            tmux("kill-session", "-t", session)
            time.sleep(1)
        result["jobs_in_table"] = len(c.list())
    finally:
        w.stop()
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
