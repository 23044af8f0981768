"""The worker: one long-lived process that owns the store and runs jobs (`python -m jobs.worker`)."""

from __future__ import annotations

__all__ = ["run_worker", "create_app"]


def run_worker(host: str = "127.0.0.1", port: int = 8765, home: str | None = None, **kwargs: object) -> None:
    from jobs.worker.main import run_worker as _run

    _run(host=host, port=port, home=home, **kwargs)  # type: ignore[arg-type]


def __getattr__(name: str) -> object:
    if name == "create_app":
        from jobs.worker.app import create_app

        return create_app
    raise AttributeError(name)
