"""What a job's metrics rows mean over time: bounded series for charts, and the latest values.

A job appends JSON rows to metrics.jsonl; any key may be missing, null, NaN or unknown. The engine's
counters (cache hits and misses, stall ms) are cumulative, so rates are taken between rows; a
counter that goes down (a new attempt, a new engine) starts over. Every series keeps at most
`capacity` points: when full it drops every other point and keeps one row in two from then on, so
a replayed 100,000-step job and a live one both fit, with the whole run in view.

Pure Python (no Textual, no torch): the dashboard's charts and `offload-jobs report` share it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable

from jobs.contract import Metric
from tui.fmt import num

__all__ = ["Series", "MetricHistory", "budget_of", "progress_of", "hit_rate_of", "CHARTS", "ChartSpec"]

EMA_ALPHA = 0.1


class Series:
    """(x, y) points, at most `capacity`; y may be NaN (drawn as a gap).

    It keeps its finite range and last finite value as points arrive, and caches its squeezed
    columns (`columns`), so a chart redrawn after a few new rows does work for those rows only.
    """

    __slots__ = ("xs", "ys", "capacity", "stride", "_pending", "_lo", "_hi", "_last", "_cols")

    def __init__(self, capacity: int = 2048) -> None:
        self.xs: list[float] = []
        self.ys: list[float] = []
        self.capacity = max(8, capacity)
        self.stride = 1
        self._pending = 0
        self._lo = self._hi = self._last = None
        self._cols: tuple[int, int, list[float]] | None = None

    def append(self, x: float, y: float | None) -> None:
        self._pending += 1
        if self._pending < self.stride:
            return
        self._pending = 0
        y = math.nan if y is None else y
        self.xs.append(x)
        self.ys.append(y)
        if y == y:  # not NaN
            self._last = y
            self._lo = y if self._lo is None else min(self._lo, y)
            self._hi = y if self._hi is None else max(self._hi, y)
        if len(self.xs) >= self.capacity:
            self.xs = self.xs[::2]
            self.ys = self.ys[::2]
            self.stride *= 2
            self._rescan()

    def _rescan(self) -> None:
        kept = self.finite()
        self._lo, self._hi = (min(kept), max(kept)) if kept else (None, None)
        self._last = kept[-1] if kept else None
        self._cols = None

    def __len__(self) -> int:
        return len(self.xs)

    def finite(self) -> list[float]:
        return [y for y in self.ys if math.isfinite(y)]

    def last(self) -> float | None:
        return self._last

    def range(self) -> tuple[float, float] | None:
        """(min, max) of the finite values, or None when there are none."""
        return None if self._lo is None else (self._lo, self._hi)

    def columns(self, n: int) -> list[float]:
        """At most `n` values: all of them if they fit, else the max of each run of ceil(len / n)
        (NaN where a run has none). Cached: after a few appends only the last runs are redone."""
        ys = self.ys
        m = len(ys)
        if m <= n:
            return list(ys)
        k = -(-m // n)
        cached = self._cols
        if cached is not None and cached[0] == n and cached[1] == k:
            out = cached[2]
            del out[max(0, len(out) - 1):]  # the last run may have grown
        else:
            out = []
        nan = math.nan
        for start in range(len(out) * k, m, k):
            out.append(max((y for y in ys[start:start + k] if y == y), default=nan))
        self._cols = (n, k, out)
        return out


@dataclass(frozen=True)
class ChartSpec:
    """One chart: its title, the series it draws (name, label), the unit, and a limit line."""

    key: str
    title: str
    series: tuple[tuple[str, str], ...]
    unit: str  # bytes, pct, gbps, ms, plain
    limit: str | None = None  # a series drawn as the chart's ceiling (budget, capacity)
    optional: bool = False  # a trainer option's chart: shown only once the job writes its series


CHARTS: tuple[ChartSpec, ...] = (
    ChartSpec("vram", "VRAM", (("vram_allocated", "allocated"), ("vram_reserved", "reserved")), "bytes", "vram_budget"),
    ChartSpec("pinned", "pinned pool", (("pinned_used", "used"),), "bytes", "pinned_capacity"),
    ChartSpec("hit", "cache hit rate", (("hit_rate", "hit rate"),), "pct"),
    ChartSpec("gbps", "H2D / disk GB/s", ((Metric.h2d_gbps, "H2D"), (Metric.disk_gbps, "disk")), "gbps"),
    ChartSpec("stall", "stall ms/step", (("stall_per_step", "stall"),), "ms"),
    ChartSpec(Metric.loss, Metric.loss,
              ((Metric.loss, Metric.loss), ("loss_ema", "smoothed"), (Metric.val_loss, "validation")), "plain"),
    ChartSpec(Metric.ema_distance, "EMA distance", ((Metric.ema_distance, "EMA to raw LoRA"),), "plain", optional=True),
)


def budget_of(spec: Any) -> int | None:
    """The VRAM budget a job's spec sets (offload.vram_budget, else resources.vram_budget), in bytes."""
    if not isinstance(spec, dict):
        return None
    for section in ("offload", "resources"):
        sub = spec.get(section)
        value = sub.get("vram_budget") if isinstance(sub, dict) else None
        if value is None:
            continue
        b = num(value)
        if b is None and isinstance(value, str):
            try:
                from jobs.spec import parse_bytes  # pydantic-free helper, only for a raw string budget

                b = num(parse_bytes(value))
            except (ValueError, ImportError):
                b = None
        if b is not None and b > 0:
            return int(b)
    return None


def progress_of(metrics: Any, spec: Any = None) -> tuple[float | None, str]:
    """(fraction done, 'step/total') from a metrics row (step, total_steps or progress) and the spec."""
    m = metrics if isinstance(metrics, dict) else {}
    step = num(m.get(Metric.step))
    total = num(m.get(Metric.total_steps))
    if total is None and isinstance(spec, dict):
        kind = spec.get("kind")
        section = spec.get(kind) if kind in ("train", "infer") else None
        total = num(section.get("steps")) if isinstance(section, dict) else None
    frac = num(m.get(Metric.progress))
    if frac is None and step is not None and total:
        frac = step / total
    if frac is not None:
        frac = min(1.0, max(0.0, frac))
    text = f"{int(step)}/{int(total)}" if step is not None and total else (f"{int(step)}" if step is not None else "")
    return frac, text


def hit_rate_of(metrics: Any) -> float | None:
    """Cumulative weight-cache hit rate of a metrics row."""
    m = metrics if isinstance(metrics, dict) else {}
    hits, misses = num(m.get(Metric.cache_hits)), num(m.get(Metric.cache_misses))
    if hits is None or misses is None or hits + misses <= 0:
        return None
    return hits / (hits + misses)


@dataclass
class MetricHistory:
    """Series for every chart, fed one metrics row at a time; `latest` keeps the newest value of each key."""

    budget: int | None = None
    capacity: int = 2048
    series: dict[str, Series] = field(default_factory=dict)
    latest: dict[str, Any] = field(default_factory=dict)
    rows: int = 0
    _prev: dict[str, float] = field(default_factory=dict)
    _ema: float | None = None
    _val_loss: float | None = None

    def _put(self, name: str, y: float | None) -> None:
        s = self.series.get(name)
        if s is None:
            s = self.series[name] = Series(self.capacity)
        s.append(float(self.rows), y)

    def _delta(self, key: str, value: float | None) -> float | None:
        """value - previous value of a cumulative counter (None at the start or after a reset)."""
        prev = self._prev.get(key)
        if value is None:
            return None
        self._prev[key] = value
        if prev is None or value < prev:
            return None
        return value - prev

    def extend(self, rows: Iterable[Any]) -> int:
        n = 0
        for row in rows:
            if isinstance(row, dict):
                self.add(row)
                n += 1
        return n

    def add(self, row: dict[str, Any]) -> None:
        self.rows += 1
        for k, v in row.items():
            if v is not None:
                self.latest[k] = v
            elif isinstance(self.latest.get(k), (int, float)) and not isinstance(self.latest.get(k), bool):
                # the worker's strict JSON writes a non-finite number as null: a number gone NaN/inf
                self.latest[k] = math.nan
        g = row.get
        self._put("vram_allocated", num(g(Metric.vram_allocated_bytes)))
        self._put("vram_reserved", num(g(Metric.vram_reserved_bytes)))
        self._put("vram_budget", float(self.budget) if self.budget else None)
        self._put("pinned_used", num(g(Metric.pinned_used_bytes)))
        self._put("pinned_capacity", num(g(Metric.pinned_capacity_bytes)))
        hits, misses = num(g(Metric.cache_hits)), num(g(Metric.cache_misses))
        dh, dm = self._delta(Metric.cache_hits, hits), self._delta(Metric.cache_misses, misses)
        rate = dh / (dh + dm) if dh is not None and dm is not None and dh + dm > 0 else None
        self._put("hit_rate", rate)
        if rate is not None:
            self.latest["_hit_rate_interval"] = rate
        self._put(Metric.h2d_gbps, num(g(Metric.h2d_gbps)))
        self._put(Metric.disk_gbps, num(g(Metric.disk_gbps)))
        stall, step = num(g(Metric.stall_ms)), num(g(Metric.step))
        d_stall, d_step = self._delta(Metric.stall_ms, stall), self._delta(Metric.step, step)
        per_step = None
        if d_stall is not None:
            per_step = d_stall / d_step if d_step else d_stall
        elif stall is not None and step and step <= 1:
            per_step = stall / step
        self._put("stall_per_step", per_step)
        if per_step is not None:
            self.latest["_stall_per_step"] = per_step
        loss = num(g(Metric.loss))
        self._put(Metric.loss, loss if loss is not None else (math.nan if Metric.loss in row else None))
        if loss is not None:
            self._ema = loss if self._ema is None else self._ema + EMA_ALPHA * (loss - self._ema)
        self._put("loss_ema", self._ema)
        # val_loss comes one row in train.validation.every: held until the next one, so the line reads
        # "the latest validation loss" and thinning the series (one row in two) never drops it.
        if Metric.val_loss in row:
            val = num(row[Metric.val_loss])
            self._val_loss = val if val is not None else math.nan
        self._put(Metric.val_loss, self._val_loss)
        self._put(Metric.ema_distance, num(g(Metric.ema_distance)))
        self._put(Metric.measured_step_ms, num(g(Metric.measured_step_ms)))
        self._put(Metric.predicted_step_ms, num(g(Metric.predicted_step_ms)))

    def get(self, name: str) -> Series:
        return self.series.get(name) or Series(self.capacity)

    def draws(self, chart: ChartSpec) -> bool:
        """Whether any series of `chart` has a finite value yet."""
        return any(self.get(name).last() is not None for name, _ in chart.series)

    @property
    def plan(self) -> dict[str, Any] | None:
        plan = self.latest.get(Metric.plan)
        return plan if isinstance(plan, dict) else None
