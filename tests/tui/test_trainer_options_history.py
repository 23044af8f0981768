"""The trainer options' series, on rows shaped as the runners write them
(the real train and infer jobs of tests/jobs/test_contract_jobs.py cover the whole path)."""

from __future__ import annotations

import math

from jobs.contract import Metric
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
