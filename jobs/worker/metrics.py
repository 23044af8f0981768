"""Prometheus metrics (`offload_jobs_*`, base units, `_total` counters) on a private registry.

Besides the worker's own counters it exports, for each job this worker runs, the newest metrics row
the job wrote (`offload_jobs_job_*{job,kind}`): the names come from jobs/contract.py, as the
dashboard's do, converted to base units (GB/s to bytes a second, ms to seconds)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from jobs.contract import JobState, Metric
from jobs.worker.asgi import HttpMiddleware

__all__ = ["WorkerMetrics", "TimingMiddleware", "JOB_GAUGES", "job_gauges", "live_jobs", "base_unit_factor"]


# A contract name's unit suffix -> the factor to Prometheus's base units (GB/s to bytes a second,
# ms to seconds); the other names are counts, bytes or seconds already.
BASE_UNIT_FACTORS: dict[str, float] = {"_gbps": 1e9, "_ms": 1e-3}


def base_unit_factor(name: str) -> float:
    return next((f for suffix, f in BASE_UNIT_FACTORS.items() if name.endswith(suffix)), 1.0)


# Metric name -> (exported name, help); JOB_GAUGES adds each one's factor to base units.
_EXPORTED: dict[str, tuple[str, str]] = {
    Metric.step: ("offload_jobs_job_step", "The job's step (a train step, an infer image)."),
    Metric.total_steps: ("offload_jobs_job_total_steps", "The steps the job will take."),
    Metric.loss: ("offload_jobs_job_loss", "Training loss of the last step."),
    Metric.it_s: ("offload_jobs_job_steps_per_second", "Steps a second since the attempt started."),
    Metric.eta_seconds: ("offload_jobs_job_eta_seconds", "Seconds until the last step, at the current rate."),
    Metric.host_rss_bytes: ("offload_jobs_job_host_rss_bytes", "Resident memory of the job's process."),
    Metric.vram_allocated_bytes: ("offload_jobs_job_vram_allocated_bytes", "GPU memory allocated by torch."),
    Metric.vram_peak_bytes: ("offload_jobs_job_vram_peak_bytes", "Peak GPU memory allocated by torch."),
    Metric.pinned_used_bytes: ("offload_jobs_job_pinned_used_bytes", "Pinned host memory the engine holds."),
    Metric.cache_hits: ("offload_jobs_job_cache_hits", "Weight-cache hits this attempt (cumulative)."),
    Metric.cache_misses: ("offload_jobs_job_cache_misses", "Weight-cache misses this attempt (cumulative)."),
    Metric.h2d_gbps: ("offload_jobs_job_h2d_bytes_per_second", "Host-to-device copy rate."),
    Metric.disk_gbps: ("offload_jobs_job_disk_read_bytes_per_second", "Disk read rate (disk-backed weights)."),
    Metric.stall_ms: ("offload_jobs_job_stall_seconds", "Time compute waited for weights (cumulative)."),
}
# Metric name -> (exported name, help, factor to base units).
JOB_GAUGES: dict[str, tuple[str, str, float]] = {
    name: (exported, help_text, base_unit_factor(name)) for name, (exported, help_text) in _EXPORTED.items()}


def job_gauges(jobs: list[Mapping[str, Any]]) -> Iterator[GaugeMetricFamily]:
    """One gauge family per exported metric, a sample per job whose last row carries it."""
    for name, (exported, help_text, factor) in JOB_GAUGES.items():
        g = GaugeMetricFamily(exported, help_text, labels=["job", "kind"])
        for job in jobs:
            row = job.get("last_metrics")
            value = row.get(name) if isinstance(row, dict) else None
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                g.add_metric([str(job.get("id")), str(job.get("kind") or "")], float(value) * factor)
        yield g


def live_jobs(store: Any, job_ids: list[str]) -> list[dict[str, Any]]:
    """The jobs this worker runs, with their last metrics row (a job gone meanwhile is skipped)."""
    from jobs.errors import JobsError

    out = []
    for job_id in job_ids:
        try:
            out.append(store.get_job(job_id))
        except JobsError:
            continue
    return out


class _StoreCollector:
    def __init__(self, counts: Callable[[], dict[str, int]], running: Callable[[], int],
                 live: Callable[[], list[dict[str, Any]]] | None = None) -> None:
        self.counts = counts
        self.running = running
        self.live = live

    def collect(self) -> Iterator[Any]:
        g = GaugeMetricFamily("offload_jobs_jobs", "Jobs in the store by status.", labels=["status"])
        for status, n in self.counts().items():
            g.add_metric([status], n)
        yield g
        yield GaugeMetricFamily("offload_jobs_running_attempts", "Attempts this worker is running now.", value=self.running())
        if self.live is not None:
            yield from job_gauges(self.live())


class WorkerMetrics:
    def __init__(self, counts: Callable[[], dict[str, int]], running: Callable[[], int],
                 live: Callable[[], list[dict[str, Any]]] | None = None) -> None:
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
        r.register(_StoreCollector(counts, running, live))

    def on_finish(self, job: dict[str, Any]) -> None:
        status = job["status"] if job["status"] != JobState.PENDING else "RETRYING"
        self.finished.labels(status, job.get("reason") or "").inc()
        if job["status"] != JobState.PENDING and job.get("started_at") and job.get("finished_at"):
            self.duration.observe(max(0.0, job["finished_at"] - job["started_at"]))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class TimingMiddleware(HttpMiddleware):
    """Counts requests and times them by route template (pure ASGI: no body buffering)."""

    def __init__(self, app: Any, metrics: WorkerMetrics) -> None:
        super().__init__(app)
        self.metrics = metrics

    async def handle(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
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
