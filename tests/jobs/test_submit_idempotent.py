"""Idempotent submits (issue 26): every submit carries a client-made key; a repeated key gets the
first submit's job; a CLI whose submit was cut off (the worker killed mid-request) asks again by
that key before calling anything failed, so no kill ever makes a job twice or loses one.

The kill loop: 10 kills by default, 50 under `-m slow`. Half are inside the window where the job is
committed and its answer not yet sent (the `submitted` fault point), half at a random moment.
"""

from __future__ import annotations

import json
import random
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml
from jobs_helpers import WorkerProcess, wait_until
from sqlalchemy import text
from test_cli_e2e import console_script, cli_env

from jobs.store import SCHEMA_VERSION, JobStore

SPEC = {"kind": "command", "name": "once", "command": "true"}


@pytest.fixture
def worker(tmp_path: Path):
    w = WorkerProcess(tmp_path / "home").start()
    yield w
    w.stop()


def _post(w: WorkerProcess, spec: dict, key: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {w.token}"}
    if key is not None:
        headers["Idempotency-Key"] = key
    return httpx.post(f"{w.url}/v1/jobs", json={"spec": spec}, headers=headers, timeout=30)


def test_a_repeated_key_gets_the_first_job(worker: WorkerProcess) -> None:
    first = _post(worker, SPEC, "key-0001-abcdef")
    again = _post(worker, SPEC, "key-0001-abcdef")
    assert first.status_code == 201 and again.status_code == 200
    assert again.json()["id"] == first.json()["id"] and again.json()["existing"] is True
    other = _post(worker, SPEC, "key-0002-abcdef")
    assert other.status_code == 201 and other.json()["id"] != first.json()["id"]
    clash = _post(worker, {**SPEC, "name": "else"}, "key-0001-abcdef")
    assert clash.status_code == 409 and "key-0001-abcdef" in clash.json()["error"]
    bad = _post(worker, SPEC, "no spaces allowed")
    assert bad.status_code in (400, 422) and bad.json()["field"] == "Idempotency-Key"
    with worker.client() as c:
        assert sorted(j["id"] for j in c.list(summary=True)) == sorted([first.json()["id"], other.json()["id"]])
    # no run dir was made for the repeats
    assert len(list((worker.home / "runs").iterdir())) == 2


def test_a_store_of_schema_3_gains_the_key_column(tmp_path: Path) -> None:
    db = tmp_path / "jobs.db"
    store = JobStore(db)
    with store.engine.begin() as conn:  # as schema 3 left it
        conn.execute(text("DROP INDEX ux_jobs_submit_key"))
        conn.execute(text("ALTER TABLE jobs DROP COLUMN submit_key"))
        conn.execute(text("UPDATE schema_version SET version = 3"))
    store.close()
    store = JobStore(db)
    assert store.schema_version() == SCHEMA_VERSION == 4
    a = store.create_job({"k": 1}, kind="command", name="a", submit_key="k" * 16)
    b = store.create_job({"k": 1}, kind="command", name="a", submit_key="k" * 16)
    assert a["id"] == b["id"] and b["existing"] is True and store.count_jobs() == 1
    store.close()


def _kill_mid_submit(tmp_path: Path, kills: int) -> dict[str, int]:
    home = tmp_path / "home"
    w = WorkerProcess(home, env={"OFFLOAD_JOBS_FAULTS": "received=1,submitted=1"}).start()
    rng = random.Random(26)
    exe = console_script()
    names, outcomes = [], {"cli_ok": 0, "cli_failed": 0, "submitted": 0, "received": 0}
    try:
        for i in range(kills):
            name = f"sub{i}"
            spec = tmp_path / f"{name}.yaml"
            spec.write_text(yaml.safe_dump({**SPEC, "name": name}))
            names.append(name)
            cli = subprocess.Popen([exe, "submit", "-d", "--json", str(spec)], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, env=cli_env(home), cwd=tmp_path)
            # committed and not yet answered, or read and not yet made; a random moment inside either
            point = "submitted" if i % 2 == 0 else "received"
            wait_until(lambda: (home / f"fault-{point}").exists(), 30, what=f"a submit at {point}")
            time.sleep(rng.uniform(0.0, 0.5))
            outcomes[point] += 1
            w.kill9()
            for p in ("submitted", "received"):
                (home / f"fault-{p}").unlink(missing_ok=True)
            w.start()
            out, err = cli.communicate(timeout=60)
            if cli.returncode == 0:
                outcomes["cli_ok"] += 1
                assert json.loads(out)["name"] == name
            else:
                outcomes["cli_failed"] += 1
                print(f"[{name}] exit {cli.returncode}: {err.strip()}")
        with w.client() as c:
            jobs = c.list(summary=True)
    finally:
        w.stop()
    per_name = {n: sum(1 for j in jobs if j["name"] == n) for n in names}
    outcomes["duplicates"] = sum(1 for n in names if per_name[n] > 1)
    outcomes["missing"] = sum(1 for n in names if per_name[n] == 0)
    print(f"\n[{kills} mid-submit kills] {outcomes}")
    return outcomes


def test_10_kills_mid_submit_make_no_duplicate(tmp_path: Path) -> None:
    out = _kill_mid_submit(tmp_path, 10)
    assert out["duplicates"] == 0 and out["missing"] == 0 and out["cli_failed"] == 0, out


@pytest.mark.slow
def test_50_kills_mid_submit_make_no_duplicate(tmp_path: Path) -> None:
    out = _kill_mid_submit(tmp_path, 50)
    assert out["duplicates"] == 0 and out["missing"] == 0 and out["cli_failed"] == 0, out
