"""The dashboard stays light: no torch (nor the worker's server stack), and it starts at once.

Start-up is timed in CPU seconds of the process (imports included), which a loaded box does not
inflate the way it does wall time; the wall time is printed alongside. The first frame must not
wait for the worker: here the "worker" accepts connections and never answers.
"""

from __future__ import annotations

import resource
import socket
import subprocess
import sys

from tui_helpers import REPO

HEAVY = ("torch", "diffusers", "peft", "accelerate", "fastapi", "uvicorn", "sqlalchemy", "offload_core")

START = """
import sys, time
t0 = time.perf_counter()
from tui.app import DashboardApp, client_factory
from tui.screens.jobs import JobsScreen
imports_cpu = time.process_time()
make_client, url = client_factory(url=%(url)r, token="t")
app = DashboardApp(make_client, url=url)
async def ready(pilot):
    while app.first_frame is None:
        await pilot.pause(0.01)
    # On the app's own clock: CPU seconds from the process start, wall seconds from the first import.
    wall = app.started[0] - t0 + app.first_frame[0]
    cpu = app.started[1] + app.first_frame[1]
    print("FIRST", wall, cpu, imports_cpu, app.connection.state, len(app.jobs))
    pilot.app.exit()
app.run(headless=True, size=(120, 40), auto_pilot=ready)
from tui.screens import detail, logs, submit  # every screen, and the report: still no torch
import tui.report
heavy = [m for m in %(heavy)r if m in sys.modules]
print("HEAVY", heavy)
"""


def _run(code: str) -> str:
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_first_frame_needs_no_worker_answer_no_torch_and_under_a_cpu_second() -> None:
    with socket.socket() as silent:  # listens (connects succeed), never accepts nor answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        outs = [_run(START % {"url": url, "heavy": HEAVY}) for _ in range(2)]
    assert all("HEAVY []" in o for o in outs), outs
    runs = [o.split("FIRST")[1].splitlines()[0].split() for o in outs]
    for wall, cpu, imports, state, jobs in runs:
        # Drawn while the worker has not answered anything: the first frame waited for no reply.
        assert (state, jobs) == ("connecting", "0"), runs
    cpu = min(float(r[1]) for r in runs)
    imports = min(float(r[2]) for r in runs)
    print(f"first frame: {cpu:.2f} s CPU (imports {imports:.2f} s), {min(float(r[0]) for r in runs):.2f} s wall")
    assert cpu < 1.0, f"the first frame took {cpu:.2f} s of CPU from the process start (imports {imports:.2f} s)"


def test_tui_help_under_a_cpu_second() -> None:
    spent = []
    for _ in range(2):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        r = subprocess.run([sys.executable, "-m", "jobs", "tui", "--help"], capture_output=True, text=True, cwd=REPO)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        spent.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
        assert r.returncode == 0 and "--read-only" in r.stdout and "--url" in r.stdout
    assert min(spent) < 1.0, spent


def test_no_module_of_tui_imports_torch() -> None:
    for path in (REPO / "tui").rglob("*.py"):
        text = path.read_text()
        assert "import torch" not in text and "from torch" not in text, path
