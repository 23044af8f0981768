"""The worker's HTTP edges (issue 26, point 11): a strict Host header, a bound on how long a
request's headers may take (a client trickling bytes is cut, a long event stream is not), and
/healthz and /readyz telling the store's health (the Postgres outage case is in
tests/jobs/cluster/test_store_outage_health.py).
"""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest
from jobs_helpers import WorkerProcess

HEADER_TIMEOUT = 1.0  # the worker's bound in this test ($OFFLOAD_JOBS_HEADER_TIMEOUT)
HANG_CHECK_S = 15.0  # far above the bound: only a connection that is never cut reaches it


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory):
    w = WorkerProcess(tmp_path_factory.mktemp("hygiene") / "home",
                      env={"OFFLOAD_JOBS_HEADER_TIMEOUT": str(HEADER_TIMEOUT)}).start()
    yield w
    w.stop()


def _raw(w: WorkerProcess, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", w.port), timeout=10) as s:
        s.sendall(request)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
        return data


@pytest.mark.parametrize("host", ["127.0.0.1:{port}@evil.com", "evil.com", "127.0.0.1:{port}/x", "127.0.0.1:x",
                                  "evil.com#127.0.0.1", "127.0.0.1 .evil.com"])
def test_a_host_header_that_is_not_a_plain_allowed_host_is_refused(guarded: WorkerProcess, host: str) -> None:
    host = host.format(port=guarded.port)
    reply = _raw(guarded, f"GET /v1/jobs HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {guarded.token}\r\n"
                          f"Connection: close\r\n\r\n".encode())
    assert reply.startswith(b"HTTP/1.1 400") and b"refused Host header" in reply, reply[:200]


@pytest.mark.parametrize("host", ["127.0.0.1:{port}", "localhost:{port}", "LOCALHOST", "[::1]:{port}"])
def test_plain_allowed_hosts_still_pass(guarded: WorkerProcess, host: str) -> None:
    host = host.format(port=guarded.port)
    reply = _raw(guarded, f"GET /v1/jobs HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {guarded.token}\r\n"
                          f"Connection: close\r\n\r\n".encode())
    assert reply.startswith(b"HTTP/1.1 200"), reply[:200]


def _trickle(port: int, result: dict, key: int) -> None:
    """Send a request's headers a byte at a time, forever; record when the worker closes on us."""
    s = socket.create_connection(("127.0.0.1", port), timeout=HANG_CHECK_S)
    start = time.monotonic()
    payload = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 10_000
    try:
        for b in payload:
            s.sendall(bytes([b]))
            s.settimeout(0.2)
            try:
                if s.recv(1) == b"":
                    result[key] = "closed"
                    return
            except socket.timeout:
                pass
            if time.monotonic() - start > HANG_CHECK_S:
                result[key] = "still open"
                return
    except OSError:  # reset by the worker
        result[key] = "closed"
    finally:
        s.close()


def test_clients_trickling_their_headers_are_cut(guarded: WorkerProcess) -> None:
    result: dict[int, str] = {}
    threads = [threading.Thread(target=_trickle, args=(guarded.port, result, i)) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HANG_CHECK_S + 10)
    assert result == {i: "closed" for i in range(20)}
    assert httpx.get(f"{guarded.url}/healthz", timeout=5).status_code == 200  # and the worker still answers


def test_an_event_stream_outlives_the_header_bound(guarded: WorkerProcess) -> None:
    """A request whose headers came in time runs as long as it needs (an idle SSE client)."""
    seen: list[dict] = []
    with guarded.client() as c:
        last = c.last_event_id()

        def listen() -> None:
            for ev in c.events(last_event_id=last, read_timeout=HANG_CHECK_S):
                seen.append(ev)
                return

        t = threading.Thread(target=listen)
        t.start()
        time.sleep(HEADER_TIMEOUT * 3)  # idle well past the bound
        with guarded.client() as c2:
            job = c2.submit({"kind": "command", "command": "true"})
        t.join(HANG_CHECK_S + 5)
    assert seen and seen[0]["job_id"] == job["id"]


def test_healthz_and_readyz_report_the_store(guarded: WorkerProcess) -> None:
    h = httpx.get(f"{guarded.url}/healthz", timeout=5).json()
    assert h["ok"] is True and h["store"] == {"ok": True}
    r = httpx.get(f"{guarded.url}/readyz", timeout=5)  # open, like /healthz: no token
    assert r.status_code == 200 and r.json()["ready"] is True
