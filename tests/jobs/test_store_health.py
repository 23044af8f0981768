"""A store that survives bad data: NaN metrics and NaN rows never break a listing, and a worker
refuses, with a message naming the file, to start over a store that lost the history beside it."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from jobs.errors import StoreError
from jobs.store import JobStore
from jobs.worker.app import open_store


def test_nan_metrics_leave_ps_show_and_events_answering(worker) -> None:
    cmd = ('echo \'{"step": 1, "loss": NaN, "grad": Infinity, "lr": -Infinity}\' >> "$OFFLOAD_JOBS_METRICS"; '
           'python3 -c "import json, math; print(json.dumps({\'step\': 2, \'loss\': math.nan}))" >> "$OFFLOAD_JOBS_METRICS"')
    auth = {"Authorization": f"Bearer {worker.token}"}
    with worker.client() as c:
        job = c.wait(c.submit({"kind": "command", "command": cmd})["id"], timeout=30)
        assert job["status"] == "SUCCEEDED"
        assert job["last_metrics"] == {"step": 2, "loss": None}
        for path in ("/v1/jobs", "/v1/jobs?view=summary", f"/v1/jobs/{job['id']}", f"/v1/jobs/{job['id']}/metrics"):
            r = httpx.get(worker.url + path, headers=auth)
            assert r.status_code == 200, (path, r.text)
            json.loads(r.text, parse_constant=lambda c: pytest.fail(f"{path} sent {c}, which is not JSON"))
        records = c.metrics(job["id"])["records"]
        assert records == [{"step": 1, "loss": None, "grad": None, "lr": None}, {"step": 2, "loss": None}]
        it = c.events(last_event_id=0, job_id=job["id"])
        assert next(it)["job_id"] == job["id"]
        it.close()


def test_rows_with_nan_written_by_an_older_version(tmp_path: Path) -> None:
    db = tmp_path / "jobs.db"
    store = JobStore(db)
    good = store.create_job({"kind": "command", "command": "true"}, kind="command", name="good")
    bad = store.create_job({"kind": "command", "command": "true"}, kind="command", name="bad")
    store.close()
    raw = sqlite3.connect(db)  # what json.dumps (allow_nan=True) used to write
    raw.execute("UPDATE jobs SET spec = ?, last_metrics = ? WHERE id = ?",
                ('{"kind": "command", "priority": NaN}', '{"loss": NaN}', bad["id"]))
    raw.execute("INSERT INTO events (ts, job_id, type, data) VALUES (0, ?, 'job.metrics', '{\"loss\": NaN}')", (bad["id"],))
    raw.commit()
    raw.close()
    store = JobStore(db)
    listed = json.loads(store.list_jobs_json())  # json() of a NaN row used to fail the whole query
    assert {j["name"] for j in listed["jobs"]} == {"good", "bad"} and listed["total"] == 2
    row = next(j for j in listed["jobs"] if j["name"] == "bad")
    assert row["spec"] is None and row["last_metrics"] is None
    assert store.get_job(bad["id"])["last_metrics"] == {"loss": None}
    assert [e.get("loss", "absent") for e in store.events_since(0, job_id=bad["id"])][-1] is None
    store.request_cancel(bad["id"])
    store.delete_job(bad["id"])  # and it can be deleted
    assert [j["id"] for j in store.list_jobs()] == [good["id"]]
    store.close()


def _runs(home: Path, n: int = 3) -> None:
    for i in range(n):
        (home / "runs" / f"job{i}").mkdir(parents=True)


def test_zero_byte_store_beside_runs_is_refused(tmp_path: Path) -> None:
    home = tmp_path / "home"
    _runs(home)
    (home / "jobs.db").write_bytes(b"")
    with pytest.raises(StoreError) as e:
        open_store(home)
    msg = str(e.value)
    assert str(home / "jobs.db") in msg and "0 bytes" in msg and "3 jobs" in msg and "mv " in msg
    assert (home / "jobs.db").stat().st_size == 0, "nothing was written over it"


def test_corrupt_store_is_refused(tmp_path: Path) -> None:
    home = tmp_path / "home"
    _runs(home)
    (home / "jobs.db").write_bytes(os.urandom(64 * 1024))
    with pytest.raises(StoreError) as e:
        open_store(home)
    assert str(home / "jobs.db") in str(e.value) and "backup" in str(e.value) and "\n" not in str(e.value)
    # A store whose pages are damaged after a valid header: the integrity check catches it.
    home2 = tmp_path / "home2"
    _runs(home2)
    store = JobStore(home2 / "jobs.db")
    for i in range(200):
        store.create_job({"kind": "command", "command": "x" * 500}, kind="command", name=f"j{i}")
    store.close()
    data = bytearray((home2 / "jobs.db").read_bytes())
    for page in range(3, len(data) // 4096):
        data[page * 4096 + 100: page * 4096 + 300] = os.urandom(200)
    (home2 / "jobs.db").write_bytes(bytes(data))
    for f in ("jobs.db-wal", "jobs.db-shm"):
        (home2 / f).unlink(missing_ok=True)
    with pytest.raises(StoreError, match="jobs.db"):
        open_store(home2)


def test_zero_byte_store_without_history_starts_fresh(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / "jobs.db").write_bytes(b"")
    store = open_store(home)
    assert store.list_jobs() == []
    store.close()


def test_up_local_shows_the_real_startup_error(tmp_path: Path) -> None:
    home = tmp_path / "home"
    _runs(home)
    (home / "jobs.db").write_bytes(b"")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OFFLOAD_JOBS_")}
    env["OFFLOAD_JOBS_HOME"] = str(home)
    exe = str(Path(sys.executable).parent / "offload-jobs")
    res = subprocess.run([exe, "up", "--local", "--port", "0"], capture_output=True, text=True, env=env, timeout=60)
    assert res.returncode == 2, res
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr
    assert "is empty (0 bytes)" in lines[0] and str(home / "jobs.db") in lines[0]
    assert "sqlalche.me" not in lines[0] and "Background on this error" not in lines[0]
