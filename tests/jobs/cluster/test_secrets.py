"""Secrets never leave (issue 26, point 3): a spec's `env:` values are stored and reach the job, but
no answer shows them (`***`, names kept), and nothing OFFLOAD_JOBS_* of the worker's own (its store
URL with the Postgres password) reaches a job.

A planted value is grepped for in every output: `show --json`, `ps --json`, the API's job list,
job, events (the run dir's and the SSE stream), logs and metrics, the HTML report, the worker's
own log and the run dir's events.jsonl; the job's environment dump must hold the env value (the
job needs it) and no worker secret.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
from cluster_helpers import ClusterWorker
from jobs_helpers import REPO, WorkerProcess

ENV_SECRET = "hf_PLANTED_env_value_7f3a9c"
WORKER_SECRET = "PLANTED_worker_secret_51be"

# The job dumps its whole environment to a file outside the run dir (the test reads it), and
# prints one line to its log.
DUMP = 'env > "$DUMP_TO"; echo "started"; echo \'{"step": 1, "loss": 0.25}\' >> "$OFFLOAD_JOBS_METRICS"'


def _cli(w: WorkerProcess, *args: str) -> str:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("OFFLOAD_JOBS_")},
           "OFFLOAD_JOBS_URL": w.url, "OFFLOAD_JOBS_TOKEN": w.token,
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    res = subprocess.run([sys.executable, "-m", "jobs", *args], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, (args, res.stderr)
    return res.stdout + res.stderr


def _outputs_of_every_kind(w: WorkerProcess, jid: str, tmp_path: Path) -> dict[str, str]:
    auth = {"Authorization": f"Bearer {w.token}"}

    def get(path: str) -> str:
        r = httpx.get(f"{w.url}{path}", headers=auth, timeout=30)
        assert r.status_code == 200, (path, r.status_code, r.text[:300])
        return r.text

    report = tmp_path / "report.html"
    seen = {
        "GET /v1/jobs": get("/v1/jobs"),
        "GET /v1/jobs?view=summary": get("/v1/jobs?view=summary"),
        "GET /v1/jobs/ID": get(f"/v1/jobs/{jid}"),
        "GET /v1/jobs/ID/events": get(f"/v1/jobs/{jid}/events"),
        "GET /v1/jobs/ID/logs": get(f"/v1/jobs/{jid}/logs"),
        "GET /v1/jobs/ID/metrics": get(f"/v1/jobs/{jid}/metrics"),
        "GET /v1/workers": get("/v1/workers"),
        "GET /healthz": get("/healthz"),
        "show --json": _cli(w, "show", jid, "--json"),
        "ps --json": _cli(w, "ps", "--json"),
        "report": (_cli(w, "report", jid, "-o", str(report)), report.read_text())[1],
        "worker log": w.log.read_text(errors="replace"),
    }
    with w.client() as c:
        seen["SSE /v1/events"] = json.dumps(list(c.events(last_event_id=0, read_timeout=2.0)))
        # what a submit and a retry answer carry back
        seen["submit answer"] = json.dumps(c.submit({"kind": "command", "command": "true",
                                                     "env": {"HF_TOKEN": ENV_SECRET}}))
    rd = w.home / "runs" / jid
    if rd.is_dir():
        seen["run dir events.jsonl"] = (rd / "events.jsonl").read_text()
    return seen


def _check(w: WorkerProcess, tmp_path: Path, worker_secret_in: str) -> None:
    dump = tmp_path / "job-env.txt"
    with w.client() as c:
        job = c.submit({"kind": "command", "command": ["bash", "-c", DUMP],
                        "env": {"HF_TOKEN": ENV_SECRET, "DUMP_TO": str(dump)}})
        assert job["spec"]["env"]["HF_TOKEN"] == "***"
        done = c.wait(job["id"], timeout=60)
    assert done["status"] == "SUCCEEDED", w.log.read_text()[-2000:]
    job_env = dict(line.split("=", 1) for line in dump.read_text().splitlines() if "=" in line)
    assert job_env["HF_TOKEN"] == ENV_SECRET  # stored and given to the job
    assert WORKER_SECRET not in dump.read_text(), f"the worker's {worker_secret_in} reached the job"
    allowed = {"OFFLOAD_JOBS_RUN_DIR", "OFFLOAD_JOBS_METRICS", "OFFLOAD_JOBS_OUTPUTS", "OFFLOAD_JOBS_EXIT_REPORT",
               "OFFLOAD_JOBS_JOB_ID", "OFFLOAD_JOBS_ATTEMPT", "OFFLOAD_JOBS_WORKER_ID"}
    assert {k for k in job_env if k.startswith("OFFLOAD_JOBS_")} <= allowed
    seen = _outputs_of_every_kind(w, job["id"], tmp_path)
    for where, text in seen.items():
        assert ENV_SECRET not in text, f"the env value leaks through {where}"
        assert WORKER_SECRET not in text, f"the worker's {worker_secret_in} leaks through {where}"
    assert "HF_TOKEN" in seen["show --json"] and "***" in seen["show --json"]  # the name is kept
    assert "HF_TOKEN" in seen["report"]


def test_env_values_and_worker_settings_never_leave_sqlite(tmp_path: Path) -> None:
    home = tmp_path / "home"
    w = WorkerProcess(home, env={"OFFLOAD_JOBS_DB": f"sqlite:///{home}/jobs.db",
                                 "OFFLOAD_JOBS_ALLOWED_HOSTS": f"h-{WORKER_SECRET}.example",
                                 "OFFLOAD_JOBS_FAULTS": ""}).start()
    try:
        _check(w, tmp_path, "OFFLOAD_JOBS_ALLOWED_HOSTS")
    finally:
        w.stop()


def test_the_postgres_password_never_reaches_a_job(tmp_path: Path, pg_url: str) -> None:
    from sqlalchemy.engine import make_url

    url = make_url(pg_url).set(password=WORKER_SECRET).render_as_string(hide_password=False)  # trusted: ignored
    w = ClusterWorker(tmp_path / "home", "w1", url).start()
    try:
        _check(w, tmp_path, "OFFLOAD_JOBS_DB")
    finally:
        w.stop()
