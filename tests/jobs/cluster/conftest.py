"""Fixtures of the cluster tests: a real PostgreSQL (one per session), a fresh database per test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from pg_helpers import PostgresServer


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PostgresServer]:
    server = PostgresServer.from_env()
    if server is not None:
        yield server
        return
    try:
        server = PostgresServer.start_private()
    except Exception as exc:  # no binaries, no postgres user, initdb refused: skip, never fail
        pytest.skip(f"no PostgreSQL to test against ({exc}); set OFFLOAD_JOBS_TEST_PG or install postgresql")
    yield server
    server.stop()


@pytest.fixture
def pg_url(pg_server: PostgresServer) -> Iterator[str]:
    """A SQLAlchemy URL of an empty database of this test's own."""
    name, url = pg_server.fresh_database()
    yield url
    pg_server.drop_database(name)
