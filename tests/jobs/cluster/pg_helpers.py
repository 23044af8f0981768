"""A real PostgreSQL for the cluster tests: CI's ($OFFLOAD_JOBS_TEST_PG, from
scripts/cluster_services.sh), else a private throwaway cluster made with Debian's initdb.

Each test gets a database of its own in it (`fresh_database`), dropped afterwards.
"""

from __future__ import annotations

import glob
import os
import pwd
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg

__all__ = ["PostgresServer", "find_pg_bin", "free_port"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_pg_bin() -> Path | None:
    for d in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if os.access(os.path.join(d, "initdb"), os.X_OK):
            return Path(d)
    return None


def _as_user() -> list[str]:
    """The server refuses to run as root: run its tools as the package's postgres user."""
    if os.geteuid() != 0:
        return []
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        return ["__no_postgres_user__"]
    return ["runuser", "-u", "postgres", "--"]


class PostgresServer:
    """A running server and an admin URL (`postgresql+psycopg://...`)."""

    def __init__(self, admin_url: str, data_dir: Path | None = None, bin_dir: Path | None = None,
                 host: str = "127.0.0.1", port: int | None = None) -> None:
        self.admin_url = admin_url
        self.data_dir = data_dir
        self.bin_dir = bin_dir
        self.host = host
        self.port = port

    @classmethod
    def from_env(cls) -> "PostgresServer | None":
        url = os.environ.get("OFFLOAD_JOBS_TEST_PG")
        if not url:
            return None
        from sqlalchemy.engine import make_url

        u = make_url(url)
        return cls(url, host=u.host or "127.0.0.1", port=u.port)

    @classmethod
    def start_private(cls, listen: str = "127.0.0.1") -> "PostgresServer":
        """initdb + pg_ctl start in a temp dir owned by the postgres user; raises RuntimeError if it cannot."""
        bin_dir = find_pg_bin()
        if bin_dir is None:
            raise RuntimeError("no PostgreSQL server binaries (apt-get install postgresql)")
        run_as = _as_user()
        if run_as == ["__no_postgres_user__"]:
            raise RuntimeError("running as root and there is no postgres user to run the server as")
        data = Path(tempfile.mkdtemp(prefix="offload-pg-"))
        if run_as:
            shutil.chown(data, "postgres", "postgres")
        os.chmod(data, 0o700)
        port = free_port()
        subprocess.run([*run_as, str(bin_dir / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres",
                        "--no-sync"], check=True, capture_output=True, timeout=120)
        with open(data / "postgresql.conf", "a") as f:
            f.write(f"listen_addresses = '{listen}'\nport = {port}\nunix_socket_directories = '{data}'\n"
                    "max_connections = 300\nfsync = off\nsynchronous_commit = off\nfull_page_writes = off\n")
        # Trusted on loopback only; other addresses (the network-namespace test) need the password.
        (data / "pg_hba.conf").write_text("local all all trust\nhost all all 127.0.0.1/32 trust\n"
                                           "host all all 0.0.0.0/0 scram-sha-256\n")
        if run_as:
            for p in (data / "postgresql.conf", data / "pg_hba.conf"):
                shutil.chown(p, "postgres", "postgres")
        subprocess.run([*run_as, str(bin_dir / "pg_ctl"), "-D", str(data), "-l", str(data / "server.log"), "-w",
                        "-t", "60", "start"], check=True, capture_output=True, timeout=90)
        return cls(f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres", data, bin_dir, "127.0.0.1", port)

    def stop(self) -> None:
        if self.data_dir is None or self.bin_dir is None:
            return
        subprocess.run([*_as_user(), str(self.bin_dir / "pg_ctl"), "-D", str(self.data_dir), "-m", "immediate",
                        "-w", "stop"], capture_output=True, timeout=60)
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def _dsn(self, dbname: str = "postgres") -> str:
        from sqlalchemy.engine import make_url

        u = make_url(self.admin_url).set(drivername="postgresql", database=dbname)
        return u.render_as_string(hide_password=False)

    def execute(self, sql: str, dbname: str = "postgres") -> None:
        with psycopg.connect(self._dsn(dbname), autocommit=True, connect_timeout=10) as conn:
            conn.execute(sql)  # type: ignore[arg-type]

    def fresh_database(self) -> tuple[str, str]:
        """(name, url) of a new empty database."""
        name = "t_" + secrets.token_hex(6)
        self.execute(f'CREATE DATABASE "{name}"')
        from sqlalchemy.engine import make_url

        return name, make_url(self.admin_url).set(database=name).render_as_string(hide_password=False)

    def drop_database(self, name: str) -> None:
        deadline = time.monotonic() + 10
        while True:
            try:
                self.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
                return
            except psycopg.Error:
                if time.monotonic() > deadline:
                    return
                time.sleep(0.2)
