"""bench.disk_paced on the CPU: the fixed set reads the floor's bytes where the read-time rank reads more."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import disk_paced


def test_the_static_plan_reads_the_floor_and_the_rank_more(tmp_path: Path) -> None:
    out = tmp_path / "paced.json"
    assert disk_paced.main(["--rate", "1e9", "--steps", "8", "--plans", "static,rank", "--json", str(out)]) == 0
    rows = {r["plan"]: r for r in json.loads(out.read_text())}
    assert rows["static"]["x_floor_bytes"] <= 1.01  # measured 1.001x
    assert rows["rank"]["disk_bytes"] > rows["static"]["disk_bytes"]  # measured 1.065x the floor


def test_an_unknown_plan_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert disk_paced.main(["--plans", "static,belady"]) == 2
    assert capsys.readouterr().err.strip() == "--plans: belady is not one of static, replay, rank"
