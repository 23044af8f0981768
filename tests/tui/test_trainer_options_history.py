"""The trainer options' series and the host store line, on rows shaped as the runners write them
(the real train and infer jobs of tests/jobs/test_contract_jobs.py cover the whole path)."""

from __future__ import annotations

import math

from jobs.contract import Metric
from tui.fmt import fmt_host_store
from tui.history import CHARTS, MetricHistory


def test_a_sparse_val_loss_survives_thinning_and_ema_shows_its_chart() -> None:
    h = MetricHistory(capacity=8)  # thinned to one row in two, then four, ...
    for step in range(1, 101):
        row = {Metric.step: step, Metric.loss: 1.0 / step, Metric.ema_distance: 0.01 * step}
        if step % 10 == 0:  # train.validation.every: 10
            row[Metric.val_loss] = 2.0 / step
        h.add(row)
    val = h.get(Metric.val_loss)
    assert val.stride > 1 and val.last() in {2.0 / s for s in range(10, 101, 10)}
    assert all(math.isfinite(y) for y in val.ys[len(val.ys) // 2:])  # held between validations: no gaps
    ema_chart = next(c for c in CHARTS if c.key == Metric.ema_distance)
    assert ema_chart.optional and h.draws(ema_chart) and not MetricHistory().draws(ema_chart)


def test_the_host_store_line() -> None:
    bounce = {Metric.host_store: "bounce", Metric.host_store_reason: "the streamed weights exceed pinned_limit",
              Metric.pinned_limit_bytes: 256 << 20, Metric.pinned_used_bytes: 256 << 20, Metric.bounce_fill_gbps: 33.14}
    assert fmt_host_store(bounce) == ("host store bounce: pinned 256 MiB / limit 256 MiB, fill 33.1 GB/s"
                                      " — the streamed weights exceed pinned_limit")
    arena = {Metric.host_store: "arena", Metric.pinned_limit_bytes: 1 << 62, Metric.pinned_used_bytes: 1 << 30}
    assert fmt_host_store(arena) == "host store arena: pinned 1.0 GiB / limit none"
    arena[Metric.host_store_reason] = "every streamed byte pinned (1.00 GiB, limit 64.00 GiB)"
    assert fmt_host_store(arena) == "host store arena: every streamed byte pinned (1.00 GiB, limit 64.00 GiB)"
    assert fmt_host_store({Metric.loss: 1.0}) is None
