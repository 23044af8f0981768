"""The bench times an engine only once it has chosen its plan, and still compares its trajectory.

On a card the engine spends its first cycles measuring and growing its ring (``planning``); steps
timed then measure the planner, not the plan. The card here is emulated (a 1 GiB limit and a peak
reading for the engine on the CPU, as in tests/offload_core/test_memory_plans.py), so the real
replanner runs its rounds.
"""

from __future__ import annotations

import pytest
import torch

from bench.peers import ours_variant, resident_variant
from bench.runner import MAX_SETTLE_STEPS, run_variant
from bench.workloads import get_workload
from offload_core import device as device_mod

MiB = 1 << 20


@pytest.fixture
def card(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device_mod, "limit_bytes", lambda d: 1024 * MiB)
    monkeypatch.setattr(device_mod, "peak_bytes", lambda d: 0)
    monkeypatch.setattr(device_mod, "reset_peak", lambda d: None)


def test_warmup_runs_until_the_plan_is_chosen_and_the_trajectory_is_still_compared(card: None) -> None:
    cpu = torch.device("cpu")
    wl = get_workload("p2", tiny=True)
    master = wl.build()
    inputs = wl.make_inputs(cpu)
    ref_row = run_variant(wl, master, inputs, resident_variant(), cpu, warmup=2, repeats=3, ref=None, profile=False)
    assert ref_row["warmup_steps"] == 2  # resident has no plan to wait for
    row = run_variant(wl, master, inputs, ours_variant("ours"), cpu, warmup=2, repeats=3, ref=ref_row["_reference"],
                      profile=False)
    # the replanner decides at the third cycle start and judges a growth two cycles on
    assert 2 < row["warmup_steps"] <= 2 + MAX_SETTLE_STEPS, row["warmup_steps"]
    assert row["stats"]["planning"] is False
    assert row["stats"]["steps"] == row["warmup_steps"] + 3
    # resident ran 5 steps, ours more: the 5 both ran are compared, bit for bit
    assert row["trajectory_steps_compared"] == 5
    assert row["trajectory_bitwise_equal"] is True and row["bitwise_equal"] is True
