"""CPU a worker spends on idle server-sent-event clients (issue 26: 200 idle clients cost 26% of a core).

    python -m bench.sse_idle_cpu [--repo DIR] [--clients 50] [--seconds 10]

Starts a real worker (`python -m jobs.worker`, the code under --repo: compare two checkouts) on a
temporary state dir, measures its CPU (utime + stime from /proc) over `--seconds` with no client,
then with `--clients` idle `GET /v1/events` streams open, and prints both as a share of one core.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _share(pid: int, seconds: float) -> float:
    c0, t0 = _cpu_s(pid), time.monotonic()
    time.sleep(seconds)
    return (_cpu_s(pid) - c0) / (time.monotonic() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repo", default=str(REPO), help="checkout whose worker to run")
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--seconds", type=float, default=10.0)
    a = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="sse-bench-"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("OFFLOAD_JOBS_")}
    env["PYTHONPATH"] = a.repo
    proc = subprocess.Popen([sys.executable, "-m", "jobs.worker", "--port", str(port), "--home", str(home),
                             "--log-level", "warning"], cwd=a.repo, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    socks: list[socket.socket] = []
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(300):
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        token = (home / "token").read_text().strip()
        time.sleep(2)
        idle = _share(proc.pid, a.seconds)
        for _ in range(a.clients):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(f"GET /v1/events HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {token}\r\n"
                      "Accept: text/event-stream\r\n\r\n".encode())
            socks.append(s)
        time.sleep(2)
        with_clients = _share(proc.pid, a.seconds)
        print(f"repo {a.repo}: worker CPU over {a.seconds:g} s: no client {idle:.1%} of a core, "
              f"{a.clients} idle SSE clients {with_clients:.1%} ({(with_clients - idle) / max(a.clients, 1):.3%} "
              "a client)")
    finally:
        for s in socks:
            s.close()
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
