"""`offload-jobs report`: a self-contained HTML file, checked in headless Chromium (Debian's package)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tui_helpers import REPO

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-default-apps",
         "--disable-extensions", "--metrics-recording-only", "--enable-logging=stderr", "--v=0"]


def chromium(page: Path, shot: Path, tmp: Path) -> list[str]:
    """Load `page`, save a screenshot; returns the console messages Chromium logged."""
    r = subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={tmp / 'profile'}", "--window-size=1280,2600",
                        f"--screenshot={shot}", page.resolve().as_uri()],
                       capture_output=True, text=True, timeout=120)
    assert shot.exists() and shot.stat().st_size > 1000, r.stderr[-2000:]
    return [ln for ln in r.stderr.splitlines() if ":CONSOLE" in ln]


@pytest.fixture(scope="module")
def report_file(worker, finished_job, tmp_path_factory) -> Path:
    jid = finished_job("report")  # bench/tui_job.py, 20 steps, with samples and checkpoints
    out = tmp_path_factory.mktemp("report") / "report.html"
    env = {**os.environ, "OFFLOAD_JOBS_URL": worker.url, "OFFLOAD_JOBS_TOKEN": worker.token}
    r = subprocess.run([sys.executable, "-m", "jobs", "report", jid[:6], "-o", str(out)],
                       capture_output=True, text=True, env=env, cwd=REPO, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(out)
    return out


def test_report_holds_everything_and_needs_no_network(report_file: Path) -> None:
    html = report_file.read_text()
    assert html.count("<svg") == 7  # loss, VRAM, pinned, hit rate, GB/s, stall, predicted vs measured
    assert html.count('src="data:image/png;base64,') == 2  # both sample images, inlined
    assert "<polyline" in html and "measured_step_ms" not in html  # drawn, not dumped
    assert "streamed_units" in html and "predicted step" in html  # the engine's plan and its prediction
    assert "job.status" in html and "SUCCEEDED" in html  # the timeline
    assert "complete" in html and "checkpoints/step-00020" in html
    # Self-contained: no script, no external fetch (an SVG namespace is a name, not a request).
    assert "<script" not in html
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//)""", html)
    assert "url(" not in html and "@import" not in html


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (.ci/run installs it)")
def test_report_loads_in_headless_chromium_without_console_errors(report_file: Path, tmp_path: Path) -> None:
    # The check itself: a page with a console error is caught.
    bad = tmp_path / "bad.html"
    bad.write_text('<html><body><script>console.error("broken page")</script></body></html>')
    assert any("broken page" in ln for ln in chromium(bad, tmp_path / "bad.png", tmp_path))
    shot = REPO / ".tui-report-screenshot.png" if os.environ.get("TUI_KEEP_SCREENSHOT") else tmp_path / "report.png"
    assert chromium(report_file, shot, tmp_path) == []
