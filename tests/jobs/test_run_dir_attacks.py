"""A job that turns its own run-dir files into FIFOs, symlinks, hard links or devices cannot freeze
the worker's API or make it serve a file from outside the run dir (issue 26, points 1 and 2).

Every request runs under a short client timeout: a route that blocks on a FIFO (as `job_events`
did with a plain `open()`) fails the test as a timeout, not as a slow answer.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from jobs_helpers import REPO, WorkerProcess

HANG_CHECK_S = 5.0  # a hang check, not a performance bound: the answers come in milliseconds

# The job replaces each file the API reads with the attack, then exits. $1: the attack, $2: a file
# outside the run dir (the target of links).
PLANT = r"""
set -e
cd "$OFFLOAD_JOBS_RUN_DIR"
echo '{"step": 1, "loss": 0.5}' >> metrics.jsonl
printf 'PNGDATA' > outputs/sample.png
plant() {
  rm -f "$1"
  case "$ATTACK" in
    fifo) mkfifo "$1" ;;
    symlink) ln -s "$OUTSIDE" "$1" ;;
    hardlink) ln "$OUTSIDE" "$1" ;;
    device) mknod "$1" c 1 5 2>/dev/null || ln -s /dev/zero "$1" ;;
  esac
}
for f in events.jsonl output.log metrics.jsonl outputs/sample.png; do plant "$f"; done
"""

ROUTES = {  # route -> the file it must name in its refusal
    "events": "events.jsonl",
    "logs": "output.log",
    "metrics": "metrics.jsonl",
    "outputs/sample.png": "sample.png",
}


@pytest.fixture(scope="module")
def attacked(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("attacks")
    outside = root / "outside.jsonl"
    outside.write_text('{"type": "planted", "secret": "OUTSIDE-LINE"}\n')
    w = WorkerProcess(root / "home").start()
    c = w.client()
    jobs = {}
    for attack in ("fifo", "symlink", "hardlink", "device"):
        job = c.submit({"kind": "command", "name": attack, "command": ["bash", "-c", PLANT],
                        "env": {"ATTACK": attack, "OUTSIDE": str(outside)}})
        jobs[attack] = job["id"]
    for attack, jid in jobs.items():
        assert c.wait(jid, timeout=60)["status"] == "SUCCEEDED", (attack, w.log.read_text()[-2000:])
    try:
        yield w, jobs
    finally:
        w.stop()


def _get(w: WorkerProcess, path: str) -> httpx.Response:
    return httpx.get(f"{w.url}{path}", headers={"Authorization": f"Bearer {w.token}"}, timeout=HANG_CHECK_S)


@pytest.mark.parametrize("attack", ["fifo", "symlink", "hardlink", "device"])
def test_every_file_route_refuses_by_name_and_never_hangs(attacked, attack: str) -> None:
    w, jobs = attacked
    jid = jobs[attack]
    assert Path(w.home / "runs" / jid / "events.jsonl").is_symlink() or attack != "symlink", "the job planted it"
    for _ in range(3):  # more requests than one: a pinned thread each would pile up
        for route, name in ROUTES.items():
            r = _get(w, f"/v1/jobs/{jid}/{route}")
            assert r.status_code == 409, (attack, route, r.status_code, r.text[:200])
            err = r.json()["error"]
            assert err.startswith("refusing ") and name in err, (attack, route, err)
            assert "OUTSIDE-LINE" not in r.text and "PNGDATA" not in r.text
        # the listing shows no file the reader would refuse
        assert _get(w, f"/v1/jobs/{jid}/outputs").json()["files"] == []
        assert _get(w, "/healthz").status_code == 200
        assert _get(w, f"/v1/jobs/{jid}").json()["status"] == "SUCCEEDED"
        assert _get(w, "/v1/jobs").status_code == 200 and _get(w, "/metrics").status_code == 200


def test_report_and_show_still_answer_with_the_refusal_noted(attacked, tmp_path: Path) -> None:
    w, jobs = attacked
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("OFFLOAD_JOBS_")},
           "OFFLOAD_JOBS_URL": w.url, "OFFLOAD_JOBS_TOKEN": w.token,
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    for attack in ("fifo", "symlink"):
        out = tmp_path / f"{attack}.html"
        res = subprocess.run([sys.executable, "-m", "jobs", "report", jobs[attack], "-o", str(out)],
                             capture_output=True, text=True, env=env, timeout=60)
        assert res.returncode == 0, res.stderr
        html = out.read_text()
        assert "not included: " in html and "events.jsonl" in html
        assert "OUTSIDE-LINE" not in html and "planted" not in html
        res = subprocess.run([sys.executable, "-m", "jobs", "show", jobs[attack], "--json"],
                             capture_output=True, text=True, env=env, timeout=60)
        assert res.returncode == 0, res.stderr
    for attack in ("symlink", "hardlink"):  # `outputs --copy` reads the run dir from this machine's disk
        dest = tmp_path / f"copy-{attack}"
        res = subprocess.run([sys.executable, "-m", "jobs", "outputs", jobs[attack], "--copy", str(dest), "--json"],
                             capture_output=True, text=True, env=env, timeout=60)
        assert res.returncode == 0, res.stderr
        assert '"files": []' in res.stdout and not any(p.is_file() for p in dest.rglob("*")), res.stdout


def test_sigterm_stops_the_worker_after_the_attacks(attacked) -> None:
    w, jobs = attacked
    for jid in jobs.values():
        _get(w, f"/v1/jobs/{jid}/events")
    assert w.proc is not None
    w.proc.send_signal(signal.SIGTERM)
    assert w.proc.wait(HANG_CHECK_S) == 0  # raises TimeoutExpired when a request still pins it
