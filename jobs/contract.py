"""The contract between the wings: job states, failure reasons, kinds, executors, and the names of
the metrics a job writes and the dashboard, the report, `show` and the Prometheus exporter read.

Stdlib only and import-free (no pydantic, no torch), so the store, the client, the CLI, the spec,
the runners and `tui/` all read the same names, and `offload-jobs ps` pays nothing for them. Every
one of these names is spelled here and only here: elsewhere code says `JobState.FAILED`,
`Reason.TIMEOUT` or `Metric.eta_seconds` (tests/jobs/test_contract_names.py greps for strays).

    PENDING -> STARTING -> RUNNING -> SUCCEEDED | FAILED | CANCELLED
                    \\          \\-> CANCELLING -> CANCELLED
                     \\-> (cancel while STARTING) CANCELLING

The enums are `str` subclasses: a member equals, hashes and JSON-encodes as its value, so rows read
back from SQLite or Postgres (plain strings) compare equal to them.
"""

from __future__ import annotations

import sys
from enum import Enum
from typing import Any, Mapping, TypedDict

if sys.version_info >= (3, 11):
    from enum import StrEnum
else:  # pragma: no cover - Python 3.10

    class StrEnum(str, Enum):
        """enum.StrEnum for 3.10: str() and format() give the value, as 3.11's does."""

        __str__ = str.__str__
        __format__ = str.__format__


__all__ = [
    "StrEnum", "JobState", "Reason", "Kind", "Executor",
    "STATES", "TERMINAL", "ACTIVE", "LIVE", "REASONS", "RETRYABLE", "RETRYABLE_REASONS", "KINDS", "EXECUTORS",
    "RUNNER_ENV_OPTIONS", "RUNNER_ENV_SIZES", "StepMetrics", "EngineStats", "Metric", "METRIC_NAMES", "ENGINE_STATS", "engine_stats",
]


class JobState(StrEnum):
    PENDING = "PENDING"
    STARTING = "STARTING"
    RUNNING = "RUNNING"
    CANCELLING = "CANCELLING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"


class Reason(StrEnum):
    """Why an attempt ended other than with exit code 0."""

    EXIT_NONZERO = "exit_nonzero"  # the job exited non-zero, or died by a signal it raised itself
    SETUP_FAILED = "setup_failed"  # it could not start: bad spec, missing binary, image or path
    CUDA_OOM = "cuda_oom"  # the job reported CUDA out of memory (its exit report)
    HOST_OOM = "host_oom"  # the kernel's OOM killer ended it
    TIMEOUT = "timeout"  # it ran past limits.max_duration
    CANCELLED = "cancelled"  # a user cancelled it
    WORKER_LOST = "worker_lost"  # the worker died and the attempt could not be recovered
    KILLED = "killed"  # a SIGKILL that neither the worker nor the OOM killer sent
    NONFINITE_LOSS = "nonfinite_loss"  # the train runner's guard stopped a diverging run
    NO_CUDA = "no_cuda"  # the job asked for a CUDA device that the worker's torch cannot use (a CPU build)
    PERMISSION_DENIED = "permission_denied"  # a model or data file the job's uid cannot read (file and uid named)


class Kind(StrEnum):
    TRAIN = "train"
    INFER = "infer"
    SHARD = "shard"
    COMMAND = "command"


class Executor(StrEnum):
    PROCESS = "process"
    DOCKER = "docker"
    SLURM = "slurm"


# Plain-str tuples (pydantic's Literal and SQL want values, not members), in the order shown to users.
STATES: tuple[str, ...] = tuple(s.value for s in JobState)
REASONS: tuple[str, ...] = tuple(r.value for r in Reason)
KINDS: tuple[str, ...] = tuple(k.value for k in Kind)
EXECUTORS: tuple[str, ...] = tuple(e.value for e in Executor)

TERMINAL = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})
ACTIVE = frozenset({JobState.PENDING, JobState.STARTING, JobState.RUNNING, JobState.CANCELLING})
LIVE = frozenset({JobState.STARTING, JobState.RUNNING, JobState.CANCELLING})  # an attempt exists (or is being made)
RETRYABLE = frozenset(r for r in Reason if r is not Reason.CANCELLED)
RETRYABLE_REASONS: tuple[str, ...] = tuple(r.value for r in Reason if r in RETRYABLE)

# OFFLOAD_JOBS_* variables a spec's `env` may set: options the runners read. Every other
# OFFLOAD_JOBS_* name is the worker's own (run dir, metrics file, outputs, exit report).
#   OFFLOAD_JOBS_VRAM_CAP           emulate a smaller card (torch.cuda.set_per_process_memory_fraction)
#   OFFLOAD_JOBS_HOST_MEMORY_WARN   the host-RAM fraction at which the train runner warns
#   OFFLOAD_JOBS_RAM_BUDGET         the job's host RAM (as resources.ram): past it the weights stream from disk
RUNNER_ENV_OPTIONS = frozenset({"OFFLOAD_JOBS_VRAM_CAP", "OFFLOAD_JOBS_HOST_MEMORY_WARN", "OFFLOAD_JOBS_RAM_BUDGET"})
RUNNER_ENV_SIZES = frozenset({"OFFLOAD_JOBS_VRAM_CAP", "OFFLOAD_JOBS_RAM_BUDGET"})  # bytes or a size: checked at submit


class StepMetrics(TypedDict, total=False):
    """One row of metrics.jsonl per step (a train step, an infer image, a shard file).

    Any field may be missing or null (strict JSON writes NaN as null); readers take what is there.
    Runners build it with keywords (`StepMetrics(step=..., loss=...)`), readers use `Metric.<name>`.
    """

    step: int
    total_steps: int
    progress: float  # fraction done, when the job knows it better than step / total_steps
    loss: float | None
    lr: float
    grad_norm: float | None
    epoch: int
    it_s: float  # steps a second, since this attempt started
    step_seconds: float  # wall time of this step
    seconds: float  # wall time of this item (an infer image)
    eta_seconds: float | None  # until total_steps at it_s
    host_rss_bytes: int  # this process's resident memory now
    host_total_bytes: int  # the box's RAM (the ceiling of host_rss_bytes)
    val_loss: float | None  # mean loss on train.validation's held-out items, every N steps
    ema_distance: float  # L2 distance between the EMA LoRA (train.ema) and the raw one
    captions_dropped: int  # samples of the step trained with the empty caption (train.caption_dropout)
    batch_of: str  # co-scheduled inference: the job whose child ran this job's images (itself when it led)
    batch_with: list[str]  # every job of that batch, in queue order, this one included
    image_seconds: float  # a batched pass's wall time over the images it made (the per-image time)


class EngineStats(TypedDict, total=False):
    """The engine's `handle.stats()` keys a runner forwards into each step row (the ones charted,
    summarised or exported; `units` and the other per-unit detail stay out of metrics.jsonl)."""

    vram_allocated_bytes: int
    vram_reserved_bytes: int
    vram_peak_bytes: int
    pinned_capacity_bytes: int
    pinned_used_bytes: int
    cache_hits: int  # cumulative: rates are taken between rows
    cache_misses: int
    cache_evictions: int
    h2d_bytes: int
    h2d_bytes_per_optimizer_step: float  # over the steps so far: the weights' crossings each step (train.accumulation_order)
    h2d_gbps: float
    disk_gbps: float  # a disk-backed store only (lazy_load, offload_to_disk)
    disk_bytes: int  # a disk-backed store only, cumulative: the bytes read from the shards
    disk_stall_ms: float  # a disk-backed store only, cumulative: the engine waiting on a read
    disk_cache_hit_rate: float  # a disk-backed store only: uses served from its RAM cache
    disk_cache_capacity_bytes: int  # a disk-backed store only: that cache's size (max_memory)
    # a disk-backed store only, cumulative: the bytes of the uses that reached the store, from its RAM cache
    # and not (the uses the engine serves from the device at a turn never reach it): the disk floor's bytes
    disk_cache_hit_bytes: int
    disk_cache_miss_bytes: int
    disk_read_s: float  # a disk-backed store only, cumulative: wall time with a read in flight (the disk's busy time)
    disk_cache_planned: int  # a disk-backed store only, cumulative: reads placed where the cache's plan put them
    disk_cache_plan_bytes: int  # a disk-backed store only: the bytes its plan reads a cycle of the trace (0: no plan)
    stall_ms: float  # cumulative
    prefetch_misses: int
    planning: bool  # the engine is still measuring its first steps and choosing its ring: not its own speed yet
    weight_bytes: int
    streamed_bytes: int
    resident_bytes: int
    measured_step_ms: float
    predicted_step_ms: float | None
    plan: dict[str, Any]  # the planner's prediction (the report's plan table)
    host_store: str  # where the streamed bytes live: arena (all pinned), bounce (pageable + a pinned ring), disk
    host_store_reason: str
    pinned_limit_bytes: int  # the bounce store's limit on pinned bytes
    bounce_fill_gbps: float  # the bounce ring's fill threads, each thread's own memcpy rate
    # offload.compile only (offload_core/compiled.py): graphs compiled, those after the first step, and
    # the seconds spent compiling (cumulative; the first step pays nearly all of it)
    compile_graphs: int
    recompiles: int
    compile_seconds: float
    compile_cache_hits: int  # inductor's FX-graph cache: graphs found compiled (by an earlier job), and not
    compile_cache_misses: int


class _Names:
    """Attribute access to the field names of typed records: `Metric.loss == "loss"`.

    The records' annotations are the one source; an unknown name is an AttributeError, not a
    silently missing key."""

    def __init__(self, *records: type) -> None:
        names: list[str] = []
        for record in records:
            for name in record.__annotations__:
                if name not in names:
                    names.append(name)
        self._names = tuple(names)
        for name in names:
            object.__setattr__(self, name, name)

    def __getattr__(self, name: str) -> str:  # only reached for a name that is not a field
        raise AttributeError(f"no metric named {name!r} in jobs.contract")

    def __iter__(self) -> Any:
        return iter(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._names


Metric = _Names(StepMetrics, EngineStats)
METRIC_NAMES: tuple[str, ...] = tuple(Metric)
ENGINE_STATS: tuple[str, ...] = tuple(EngineStats.__annotations__)


def engine_stats(stats: Mapping[str, Any]) -> EngineStats:
    """The forwarded part of `handle.stats()` (what every runner writes into its step rows)."""
    return EngineStats(**{k: stats[k] for k in ENGINE_STATS if k in stats})  # type: ignore[typeddict-item]
