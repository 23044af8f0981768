"""bench.floor.derive: the copy rate behind the floors never flatters our rows."""

from __future__ import annotations

import pytest

from bench.floor import derive

GB = 1e9


def _case(probe_gbps: float, engine_gbps: float) -> tuple[list[dict], dict, dict]:
    metas = {"p1": {"must_cross_bytes": 5 * GB, "streamed_bytes": 5 * GB, "h2d_crossings": 1, "d2h_crossings": 0,
                    "weight_bytes": 5 * GB}}
    rows = [
        {"workload": "p1", "variant": "resident", "family": "resident", "status": "ok", "time_ms": 40.0},
        {"workload": "p1", "variant": "ours", "family": "ours", "status": "ok", "time_ms": 94.0,
         "stats": {"streamed_bytes": 5 * GB, "h2d_gbps": engine_gbps}, "config": {}},
    ]
    ceiling = {"h2d_gbps": probe_gbps}
    derive(rows, metas, ceiling)
    return rows, metas, ceiling


def test_a_probe_that_read_low_does_not_lift_the_floor() -> None:
    # the probe read 49.3 GB/s while the engine copied at 54.7: the floor is the bytes at 54.7
    rows, metas, ceiling = _case(49.3, 54.7)
    assert ceiling["floor_h2d_gbps"] == 54.7 and ceiling["probe_h2d_gbps"] == 49.3
    assert metas["p1"]["bytes_ms"] == pytest.approx(5 / 54.7 * 1e3)
    assert rows[1]["x_floor"] == pytest.approx(94.0 / (5 / 54.7 * 1e3))  # 1.028, not the 0.93 the probe gave
    assert "engine" in ceiling["floor_rate"]


def test_a_slower_engine_does_not_lower_the_bar() -> None:
    rows, metas, ceiling = _case(55.4, 50.0)
    assert ceiling["floor_h2d_gbps"] == 55.4 and ceiling["floor_rate"] == "the probe"
    assert rows[1]["x_floor"] == pytest.approx(94.0 / (5 / 55.4 * 1e3))


def test_derive_twice_keeps_the_probe() -> None:
    rows, metas, ceiling = _case(49.3, 54.7)
    derive(rows, metas, ceiling)  # the bench derives again after every workload
    assert ceiling["probe_h2d_gbps"] == 49.3 and ceiling["h2d_gbps"] == 49.3 and ceiling["floor_h2d_gbps"] == 54.7


def test_the_failed_registration_row_is_offered_with_the_bounce_rows_and_needs_cuda() -> None:
    # issue 29: "a registration made to fail on purpose ... a step time within 1.15x of the arena's";
    # the row registers the arena's buffer ahead of the engine, which only CUDA can do
    import torch
    from torch import nn

    from bench.peers import NotApplicable, variants_for
    from bench.workloads import get_workload

    for name in ("p1", "flux-dev-lora-8g", "flux-dev-infer-8g"):
        wl = get_workload(name, tiny=True)
        names = [v.name for v in variants_for(wl)]
        assert names.index("ours-regfail") == names.index("ours-bounce-t8") + 1, names
    row = next(v for v in variants_for(wl) if v.name == "ours-regfail")
    assert row.family == "ours" and row.config == {"registration": "made to fail"}
    from bench.tiers import at_tier

    for tier in (None, 25.0):  # paced at an emulated link it is still a host whose registration fails
        paced = at_tier(row, tier)
        assert paced.config.get("registration") == "made to fail", paced.config
        with pytest.raises(NotApplicable, match="CUDA"):
            paced.setup(nn.Linear(2, 2), wl, torch.device("cpu"))
