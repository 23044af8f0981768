"""`outputs` and `report` against a worker whose run dirs are not on the client's disk (a container's
/state): the files come through the API. Stand-in: a worker on its own state dir, and a client on
another one told OFFLOAD_JOBS_RUN_DIRS=remote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from jobs_helpers import WorkerProcess

WRITE = ('mkdir -p "$OFFLOAD_JOBS_OUTPUTS/samples" && printf "lora-bytes-123" > "$OFFLOAD_JOBS_OUTPUTS/lora.safetensors"'
         ' && printf "png" > "$OFFLOAD_JOBS_OUTPUTS/samples/step-1.png"')


def _cli(w: WorkerProcess, client_home: Path, *args: str, remote: bool = True) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OFFLOAD_JOBS_")}
    env.update(OFFLOAD_JOBS_URL=w.url, OFFLOAD_JOBS_TOKEN=w.token, OFFLOAD_JOBS_HOME=str(client_home))
    if remote:
        env["OFFLOAD_JOBS_RUN_DIRS"] = "remote"
    return subprocess.run([sys.executable, "-m", "jobs.cli", *args], capture_output=True, text=True, env=env,
                          cwd=client_home, timeout=60)


def test_outputs_and_report_download_through_the_api(tmp_path: Path) -> None:
    w = WorkerProcess(tmp_path / "worker-state").start()
    client_home = tmp_path / "client"
    client_home.mkdir()
    try:
        with w.client() as c:
            job = c.wait(c.submit({"kind": "command", "command": WRITE})["id"], timeout=60)
        assert job["status"] == "SUCCEEDED"
        listed = json.loads(_cli(w, client_home, "outputs", job["id"], "--json").stdout)
        assert listed["on_this_machine"] is False
        assert sorted(f["path"] for f in listed["files"]) == ["lora.safetensors", "samples/step-1.png"]
        assert json.loads(_cli(w, client_home, "outputs", job["id"], "--json", remote=False).stdout)["on_this_machine"]

        text = _cli(w, client_home, "outputs", job["id"])
        assert text.returncode == 0 and "on the worker" in text.stdout and "lora.safetensors" in text.stdout

        dest = tmp_path / "copied"
        res = _cli(w, client_home, "outputs", job["id"], "--copy", str(dest))
        assert res.returncode == 0, res.stderr
        assert (dest / "lora.safetensors").read_bytes() == b"lora-bytes-123"
        assert (dest / "samples" / "step-1.png").read_bytes() == b"png"

        out = client_home / "r.html"
        res = _cli(w, client_home, "report", job["id"], "-o", str(out))
        assert res.returncode == 0, res.stderr
        assert job["id"] in out.read_text()
    finally:
        w.stop()
