"""Followers ride through a worker restart: `logs -f` and an attached `submit` reconnect (to the
new worker, on a new port), resume the log at their offset and the status at their event id, and
end when the job ends, with every line printed once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from jobs_helpers import WorkerProcess, wait_until

COMMAND = ('for i in 1 2 3; do echo "before $i"; done; '
           'while [ ! -e "$OFFLOAD_JOBS_RUN_DIR/go-on" ]; do sleep 0.05; done; '
           'for i in 1 2 3; do echo "after $i"; done')


class _Follower:
    """An `offload-jobs` child whose stdout is collected as it comes."""

    def __init__(self, home: Path, *args: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OFFLOAD_JOBS_")}
        env["OFFLOAD_JOBS_HOME"] = str(home)
        exe = str(Path(sys.executable).parent / "offload-jobs")
        self.proc = subprocess.Popen([exe, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.out: list[str] = []
        self._reader = threading.Thread(target=lambda: self.out.extend(iter(self.proc.stdout.readline, "")), daemon=True)
        self._reader.start()

    def printed(self, text: str) -> bool:
        return text in "".join(self.out)

    def finish(self, timeout: float) -> tuple[str, str]:
        err = self.proc.stderr.read()
        self.proc.wait(timeout)
        self._reader.join(5)
        return "".join(self.out), err


def test_logs_follow_and_attached_submit_survive_a_worker_restart(tmp_path: Path) -> None:
    home = tmp_path / "home"
    w = WorkerProcess(home).start()
    spec = tmp_path / "job.yaml"
    spec.write_text(json.dumps({"kind": "command", "name": "follow-me", "command": COMMAND}))
    attached = _Follower(home, "submit", str(spec))
    c = w.client()
    job = wait_until(lambda: next(iter(c.list(summary=True)), None), 30, what="the job")
    follower = _Follower(home, "logs", "-f", job["id"])
    for f in (attached, follower):
        wait_until(lambda: f.printed("before 3"), 60, what="both to be following")
    w.kill9()
    time.sleep(1.0)
    w2 = WorkerProcess(home)  # a new worker, on another port: found again through worker.json
    assert w2.port != w.port
    w2.start()
    try:
        (Path(job["run_dir"]) / "go-on").touch()
        for f in (attached, follower):
            out, err = f.finish(timeout=60)
            assert f.proc.returncode == 0, err
            for word in ("before 1", "before 2", "before 3", "after 1", "after 2", "after 3"):
                assert out.count(word) == 1, (word, out)
            assert "lost the worker" in err and "reconnected" in err, err
            assert "SUCCEEDED" in err and "Traceback" not in err
        assert w2.client().get(job["id"])["attempt"] == 1  # adopted, not run again
    finally:
        for f in (attached, follower):
            if f.proc.poll() is None:
                f.proc.kill()
        w2.stop()
