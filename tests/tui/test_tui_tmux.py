"""Under tmux, as a user runs it: the screen's VRAM, pinned pool and cache-hit values match metrics.jsonl."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tui_helpers import engine_job

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (.ci/run installs it)")


def _tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], capture_output=True, text=True, check=True).stdout


def test_screen_values_match_the_jobs_metrics(worker, tmp_path: Path) -> None:
    with worker.client() as c:
        jid = c.submit(engine_job("tui-tmux", 20, 20))["id"]
    session = f"tui-test-{os.getpid()}"
    # A tmux server started without a terminal (as here, under pytest) gives its panes COLUMNS=80
    # and LINES=24, which Textual prefers to the pane's real size: drop them.
    cmd = (f"env -u COLUMNS -u LINES OFFLOAD_JOBS_URL={worker.url} OFFLOAD_JOBS_TOKEN={worker.token} "
           f"{sys.executable} -m jobs tui --job {jid}")
    _tmux("new-session", "-d", "-s", session, "-x", "200", "-y", "50", cmd)
    try:
        with worker.client() as c:
            assert c.wait(jid, timeout=120)["status"] == "SUCCEEDED"
        rows = [json.loads(ln) for ln in (worker.home / "runs" / jid / "metrics.jsonl").read_text().splitlines()]
        last = rows[-1]
        deadline = time.monotonic() + 20
        screen = ""
        while time.monotonic() < deadline:
            screen = _tmux("capture-pane", "-p", "-t", session)
            if "SUCCEEDED" in screen and "step 20/20" in screen:
                break
            time.sleep(0.3)
        flat = " ".join(screen.split())
        assert "SUCCEEDED" in flat and "step 20/20" in flat, screen
        # The numbers, formatted independently of the app (binary units, one decimal).
        mib = lambda b: f"{b / 2**20:.1f} MiB" if b < 100 * 2**20 else f"{b / 2**20:.0f} MiB"  # noqa: E731
        kib = lambda b: f"{b / 2**10:.1f} KiB" if b < 100 * 2**10 else f"{b / 2**10:.0f} KiB"  # noqa: E731
        size = lambda b: f"{b} B" if b < 1024 else kib(b) if b < 2**20 else mib(b)  # noqa: E731
        assert f"VRAM {size(last['vram_allocated_bytes'])}" in flat
        assert f"pinned {size(last['pinned_used_bytes'])} / {size(last['pinned_capacity_bytes'])}" in flat
        hits, misses = last["cache_hits"], last["cache_misses"]
        rate = round(100 * hits / (hits + misses))
        m = re.search(r"cache hits (\d+)% \((\d+) hit, (\d+) miss", flat)
        assert m, flat
        assert (int(m.group(1)), int(m.group(2)), int(m.group(3))) == (rate, hits, misses)
        assert f"loss {last['loss']:.5g}"[:10] in flat
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
