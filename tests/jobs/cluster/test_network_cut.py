"""A network cut (issue 13's acceptance): a worker in its own network namespace, its link to
Postgres dropped for 15 s (30 s under `-m slow`) while it runs jobs, ends with no duplicate completions.

Worker wa runs in a network namespace joined to the host by a veth pair; worker wb and Postgres are
on the host. While wa's link is down, wa stops its own attempts before its lease can run out (the
launcher enforces the lease file; nothing of wa's still runs when wb may retry), wb's reaper closes
wa's attempts as worker_lost and wb runs the retries; when the link is back, wa's late completions
are fenced and it rejoins. Root only; skipped where the kernel or the container refuses namespaces.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from cluster_helpers import ClusterWorker, audit, ledger, ledger_job, wait_all
from jobs_helpers import wait_until
from pg_helpers import PostgresServer

# leases and heartbeats of a few seconds: run after the parallel part, away from its load (see pyproject)
pytestmark = pytest.mark.serial

TIMEOUT = 6.0
CUT_S = [15.0, pytest.param(30.0, marks=pytest.mark.slow)]  # both well past TIMEOUT


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + ["ip", *args]
    subprocess.run(cmd, check=True, capture_output=True, timeout=20)


@pytest.fixture
def netns():
    """(namespace, host-side IP, namespace IP, namespace-side link), torn down afterwards."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 for a network namespace")
    tag = secrets.token_hex(2)
    ns, vh, vn = f"oj{tag}", f"ojh{tag}", f"ojn{tag}"
    net = int(tag, 16) % 250 + 2
    host_ip, ns_ip = f"10.213.{net}.1", f"10.213.{net}.2"
    try:
        _ip("netns", "add", ns)
    except (subprocess.CalledProcessError, OSError) as exc:
        pytest.skip(f"the kernel refuses network namespaces here: {getattr(exc, 'stderr', exc)!r}")
    try:
        _ip("link", "add", vh, "type", "veth", "peer", "name", vn)
        _ip("link", "set", vn, "netns", ns)
        _ip("addr", "add", f"{host_ip}/24", "dev", vh)
        _ip("link", "set", vh, "up")
        _ip("addr", "add", f"{ns_ip}/24", "dev", vn, ns=ns)
        _ip("link", "set", vn, "up", ns=ns)
        _ip("link", "set", "lo", "up", ns=ns)
    except subprocess.CalledProcessError as exc:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", vh], capture_output=True)
        pytest.skip(f"cannot make a veth pair here: {exc.stderr!r}")
    yield ns, host_ip, ns_ip, vn
    subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    subprocess.run(["ip", "link", "del", vh], capture_output=True)


@pytest.mark.parametrize("cut_s", CUT_S)
def test_a_worker_cut_off_completes_nothing_twice(netns, tmp_path: Path, cut_s: float) -> None:
    ns, host_ip, ns_ip, ns_link = netns
    try:
        server = PostgresServer.start_private(listen=f"127.0.0.1,{host_ip}")
    except Exception as exc:
        pytest.skip(f"no PostgreSQL to test against ({exc})")
    password = secrets.token_hex(8)
    try:
        server.execute(f"ALTER USER postgres PASSWORD '{password}'")
        name, url = server.fresh_database()
        remote_url = url.replace("postgres@127.0.0.1", f"postgres:{password}@{host_ip}")
        book = tmp_path / "ledger"
        book.mkdir()
        a = ClusterWorker(tmp_path / "wa", "wa", remote_url, "--max-cpu-jobs", "4", timeout=TIMEOUT,
                          prefix=["ip", "netns", "exec", ns], host=ns_ip)
        b = ClusterWorker(tmp_path / "wb", "wb", url, "--max-cpu-jobs", "8", timeout=TIMEOUT)
        try:
            a.start()
            with a.client() as ca:
                on_a = [ca.submit(ledger_job(book, seconds=10, name=f"a{i}"))["id"] for i in range(4)]
                wait_until(lambda: all(ca.get(i)["status"] == "RUNNING" for i in on_a), 30, what="wa running 4")
            b.start()
            with b.client() as cb:
                on_b = [cb.submit(ledger_job(book, seconds=3, name=f"b{i}"))["id"] for i in range(4)]
                ids = on_a + on_b
                wait_until(lambda: all(cb.get(i)["status"] in ("RUNNING", "SUCCEEDED") for i in on_b), 30,
                           what="wb running its own")
                _ip("link", "set", ns_link, "down", ns=ns)
                t_cut = time.monotonic()
                try:
                    # while wa is cut off, wb takes wa's jobs over and runs them
                    wait_until(lambda: all(cb.get(i)["attempt"] == 2 for i in on_a), TIMEOUT + 10,
                               what="wb retrying wa's jobs during the cut")
                    took = time.monotonic() - t_cut
                    left = cut_s - (time.monotonic() - t_cut)
                    if left > 0:
                        time.sleep(left)
                finally:
                    _ip("link", "set", ns_link, "up", ns=ns)
                t_back = time.monotonic()
                jobs = wait_all(cb, ids, timeout=60)
                # wa rejoins: heartbeating again, holding nothing, its late completions refused
                wait_until(lambda: {w["id"]: (w["status"], len(w["running"]))
                                    for w in cb.workers()["workers"]}.get("wa") == ("up", 0), 40,
                           what="wa back, holding nothing")
                counts = audit(cb, book, ids)
                print(f"\n[network cut] wa cut off {cut_s:g}s; wb retried its jobs {took:.1f}s into the cut; "
                      f"wa rejoined {time.monotonic() - t_back:.1f}s after; {counts}")
                assert counts == dict.fromkeys(counts, 0)
                for i in on_a:
                    atts = cb.get(i)["attempts"]
                    assert [(x["number"], x["status"], x["reason"], x["worker_id"]) for x in atts] == [
                        (1, "FAILED", "worker_lost", "wa"), (2, "SUCCEEDED", None, "wb")], atts
                    kinds = [ln[0] for ln in ledger(book, i)]
                    assert kinds[0] == "start" and kinds[-2:] == ["start", "end"] and kinds.count("end") == 1, kinds
                assert {jobs[i]["status"] for i in ids} == {"SUCCEEDED"}
                from jobs.store import JobStore

                store = JobStore(url)
                try:  # the store's own history: one completion per job, whatever wa sent when it came back
                    for i in ids:
                        done = [e for e in store.events_since(0, 1000, i) if e.get("status") == "SUCCEEDED"]
                        assert len(done) == 1, (i, done)
                finally:
                    store.close()
                wa_log = tmp_path / "wa" / "worker-test.log"  # each late completion is refused, and said so
                wait_until(lambda: wa_log.read_text().count("was closed by a reaper meanwhile") == len(on_a), 30,
                           what=f"wa's {len(on_a)} late completions refused")
        finally:
            a.stop()
            b.stop()
            server.drop_database(name)
    finally:
        server.stop()
