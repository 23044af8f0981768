"""Prometheus metrics (`offload_jobs_*`, base units, `_total` counters) on a private registry."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from jobs.contract import JobState

__all__ = ["WorkerMetrics", "TimingMiddleware"]


class _StoreCollector:
    def __init__(self, counts: Callable[[], dict[str, int]], running: Callable[[], int]) -> None:
        self.counts = counts
        self.running = running

    def collect(self) -> Iterator[Any]:
        g = GaugeMetricFamily("offload_jobs_jobs", "Jobs in the store by status.", labels=["status"])
        for status, n in self.counts().items():
            g.add_metric([status], n)
        yield g
        yield GaugeMetricFamily("offload_jobs_running_attempts", "Attempts this worker is running now.", value=self.running())


class WorkerMetrics:
    def __init__(self, counts: Callable[[], dict[str, int]], running: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.submitted = Counter("offload_jobs_submitted_total", "Jobs submitted.", ["kind"], registry=r)
        self.finished = Counter("offload_jobs_attempts_finished_total", "Attempts that ended, by status and reason.",
                                ["status", "reason"], registry=r)
        self.requests = Counter("offload_jobs_http_requests_total", "HTTP requests served.", ["method", "code"], registry=r)
        self.latency = Histogram("offload_jobs_http_request_duration_seconds", "HTTP request latency.", ["route"],
                                 buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5), registry=r)
        self.queue_wait = Histogram("offload_jobs_queue_wait_seconds", "Submit to first start of a job.",
                                    buckets=(0.05, 0.1, 0.25, 0.5, 1, 5, 30, 60, 300, 1800, 3600), registry=r)
        self.duration = Histogram("offload_jobs_job_duration_seconds", "Start to end of finished jobs.",
                                  buckets=(0.1, 1, 10, 60, 300, 1800, 3600, 4 * 3600, 12 * 3600), registry=r)
        r.register(_StoreCollector(counts, running))

    def on_finish(self, job: dict[str, Any]) -> None:
        status = job["status"] if job["status"] != JobState.PENDING else "RETRYING"
        self.finished.labels(status, job.get("reason") or "").inc()
        if job["status"] != JobState.PENDING and job.get("started_at") and job.get("finished_at"):
            self.duration.observe(max(0.0, job["finished_at"] - job["started_at"]))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class TimingMiddleware:
    """Counts requests and times them by route template (pure ASGI: no body buffering)."""

    def __init__(self, app: Any, metrics: WorkerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        code = [500]

        async def send_wrapper(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                code[0] = message["status"]
                route = scope.get("route")
                self.metrics.latency.labels(getattr(route, "path", "other")).observe(time.perf_counter() - t0)
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            self.metrics.requests.labels(scope.get("method", ""), str(code[0])).inc()
