"""The dashboard stays light: no torch (nor the worker's server stack), and it starts at once."""

from __future__ import annotations

import subprocess
import sys
import time

from conftest import REPO

HEAVY = ("torch", "diffusers", "peft", "accelerate", "fastapi", "uvicorn", "sqlalchemy", "offload_core")

START = """
import sys, time
t0 = time.perf_counter()
from tui.app import DashboardApp
from tui.screens.jobs import JobsScreen
print(f"IMPORT {time.perf_counter() - t0:.3f}")
app = DashboardApp(None, url="http://127.0.0.1:9", feed=False)
async def ready(pilot):
    await pilot.pause(0)
    print(f"{time.perf_counter() - t0:.3f}")
    pilot.app.exit()
app.run(headless=True, size=(120, 40), auto_pilot=ready)
from tui.screens import detail, logs, submit  # every screen, and the report: still no torch
import tui.report
heavy = [m for m in %r if m in sys.modules]
print("HEAVY", heavy)
"""


def _run(code: str) -> str:
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_tui_imports_no_torch_and_starts_under_a_second() -> None:
    outs = [_run(START % (HEAVY,)) for _ in range(3)]
    assert all("HEAVY []" in o for o in outs), outs
    imports = min(float(o.split("IMPORT")[1].split()[0]) for o in outs)
    first = min(float(o.split()[2]) for o in outs)
    # Imports are ours to keep small; the first frame also counts Textual's own start on a busy box.
    assert imports < 1.0, f"importing the dashboard took {imports:.2f} s"
    assert first < 5.0, f"the first screen took {first:.2f} s"


def test_tui_help_under_a_second() -> None:
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "jobs", "tui", "--help"], capture_output=True, text=True, cwd=REPO)
        times.append(time.perf_counter() - t0)
        assert r.returncode == 0 and "--read-only" in r.stdout and "--url" in r.stdout
    assert min(times) < 1.0, times


def test_no_module_of_tui_imports_torch() -> None:
    for path in (REPO / "tui").rglob("*.py"):
        text = path.read_text()
        assert "import torch" not in text and "from torch" not in text, path
