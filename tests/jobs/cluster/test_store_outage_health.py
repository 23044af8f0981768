"""/healthz and /readyz tell a store outage (issue 26, point 11): while the worker's Postgres
database refuses connections, /readyz answers 503 naming the problem and /healthz (still 200: the
process lives) says `store.ok: false`; both answer at once, and /readyz is 200 again after."""

from __future__ import annotations

from pathlib import Path

import httpx
from cluster_helpers import ClusterWorker
from jobs_helpers import wait_until
from sqlalchemy.engine import make_url


def _cut(pg_server, db: str, allow: bool) -> None:
    pg_server.execute(f'ALTER DATABASE "{db}" ALLOW_CONNECTIONS {"true" if allow else "false"}')
    if not allow:
        pg_server.execute(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{db}'")


def test_readyz_follows_a_store_outage(tmp_path: Path, pg_server, pg_url: str) -> None:
    db = make_url(pg_url).database
    w = ClusterWorker(tmp_path / "w1", "w1", pg_url, timeout=30.0).start()
    try:
        with httpx.Client(base_url=w.url, timeout=5) as http:  # one client: a new one per poll costs ~30 ms of CPU
            assert http.get("/readyz").status_code == 200
            _cut(pg_server, db, allow=False)
            try:
                r = wait_until(lambda: (x := http.get("/readyz")).status_code == 503 and x,
                               timeout=30, what="/readyz to answer 503")
                assert r.json()["ready"] is False and r.json()["store"]["error"]
                h = http.get("/healthz")
                assert h.status_code == 200 and h.json()["store"]["ok"] is False
            finally:
                _cut(pg_server, db, allow=True)
            wait_until(lambda: http.get("/readyz").status_code == 200, timeout=30,
                       what="/readyz to answer 200 again")
    finally:
        w.stop()
