"""The compiled variants are declared where the issue's acceptance runs them, and their row says
what the first step cost (the run itself is the GPU's: bench/RESULTS.md)."""

from __future__ import annotations

import pytest

from bench.__main__ import ALL_VARIANTS
from bench.peers import variants_for
from bench.report import _short_note
from bench.workloads import get_workload

COMPILED = ("resident-compile", "ours-compile", "ours-fp8-compile")


@pytest.mark.parametrize("workload", ["flux-dev-lora-8g", "p1"])
def test_compiled_variants_are_declared_with_compile_on(workload: str) -> None:
    variants = {v.name: v for v in variants_for(get_workload(workload, True))}
    for name in COMPILED:
        assert name in ALL_VARIANTS and variants[name].config.get("compile") is True, name
    assert variants["ours-fp8-compile"].config["weight_dtype"] == "float8_e4m3fn"
    assert variants["resident-compile"].family == "resident"


def test_a_compiled_row_reports_its_first_step() -> None:
    row = {"family": "ours", "config": {"compile": True}, "first_step_s": 41.25,
           "inductor_cache": {"hit": 3, "miss": 11},
           "stats": {"compile_seconds": 39.5, "compile_graphs": 4, "recompiles": 0, "prefetch_depth": 2}}
    note = _short_note(row)
    assert "compiled: first step 41.2 s (39.5 s compiling, 4 graphs, 0 recompiles; inductor cache 3 hit / 11 miss)" in note
    assert _short_note({**row, "family": "resident"}).startswith("compiled: first step 41.2 s")
    assert "compiled" not in _short_note({**row, "config": {}})
