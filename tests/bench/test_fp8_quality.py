"""bench.fp8_quality runs end to end in tiny mode and measures something: finite, nonzero errors per
scaling, where per-tensor scaling loses on outlier channels, and a loss curve per storage."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench import fp8_quality


def test_tiny_quality_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "q.json"
    assert fp8_quality.main(["--tiny", "--steps", "3", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| weights | fp8_scaling | output rel. error | LoRA grad rel. error |" in printed
    assert "| final / fp32 |" in printed
    got = json.loads(out.read_text())
    rows = {(r["init"], r["scaling"]): r for r in got["widths"]}
    assert set(rows) == {(i, s) for i in ("normal", "outliers") for s in ("tensor", "row", "block")}
    for r in rows.values():
        assert 0 < r["out_rel"] < 1 and 0 < r["grad_rel"] and math.isfinite(r["grad_rel"])
    # one scale a tensor is what outlier channels hurt: a scale per row keeps the rest apart
    assert rows[("outliers", "row")]["out_rel"] < rows[("outliers", "tensor")]["out_rel"]
    assert list(got["curves"]) == ["fp32", "fp8 tensor", "fp8 row", "fp8 block"]
    for curve in got["curves"].values():
        assert len(curve) == 3 and all(math.isfinite(x) and x > 0 for x in curve)
    # fp8 storage really changed the run (the engine stored fp8), but not by much
    assert got["curves"]["fp8 row"] != got["curves"]["fp32"]
    assert abs(got["curves"]["fp8 row"][-1] / got["curves"]["fp32"][-1] - 1) < 0.1
