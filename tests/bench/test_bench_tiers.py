"""python -m bench --link-gbps: our variants at emulated link tiers, each row against its tier's floor.

On the CPU the pacer counts instead of slowing (there is no link): this checks the plumbing (one
block per tier, the option reaching the engine, per-tier floors, the markdown table) and that
results stay bitwise equal to resident at every tier. No timing is asserted.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.tiers import derive_tiers, parse_link_gbps, tier_row

ROOT = Path(__file__).resolve().parents[2]
WORKLOADS = ("p1", "p2")  # inference and training: what pacing touches (p3 adds CPU time, not a case)
GB = 1e9


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str, str]:
    d = tmp_path_factory.mktemp("tiers")
    cmd = [sys.executable, "-m", "bench", "--tiny", "--device", "cpu", "--link-gbps", "13,real", "--only", "resident,ours",
           "--workloads", ",".join(WORKLOADS),
           "--json", str(d / "out.json"), "--md", str(d / "out.md")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((d / "out.json").read_text()), proc.stdout, (d / "out.md").read_text()


def test_one_block_per_tier_with_every_workload(run: tuple[dict, str, str]) -> None:
    result, stdout, _ = run
    assert [t["tier"] for t in result["tiers"]] == ["13 GB/s", "real"]
    table = stdout[stdout.index("tier     workload"):]
    blocks = [b for b in table.split("\n\n") if b.strip()]
    assert len(blocks) == 2, table  # separated by a blank line: one per tier
    for block, tier in zip(blocks, ("13 GB/s", "real")):
        body = [line for line in block.splitlines() if line.startswith(tier)]
        for wl in WORKLOADS:
            assert sum(f" {wl} " in line for line in body) == 2, (tier, wl, block)  # resident and ours


def test_ours_is_paced_at_the_emulated_tier_and_bitwise_at_both(run: tuple[dict, str, str]) -> None:
    result, _, _ = run
    for r in (r for r in result["rows"] if r["variant"] == "ours"):
        assert r["status"] == "ok", r.get("reason")
        assert r["bitwise_equal"] is True, (r["tier"], r["workload"], r.get("max_abs_diff"))
        st = r["stats"]
        if r["tier"] == "13 GB/s":
            assert r["config"]["debug_link_gbps"] == 13.0 and st["link_gbps"] == 13.0
            assert st["link_paced_bytes"] == st["h2d_bytes"] > 0  # every copy went through the pacer
        else:
            assert "debug_link_gbps" not in r["config"] and "link_gbps" not in st


def test_resident_runs_once_and_stands_in_every_tier(run: tuple[dict, str, str]) -> None:
    result, _, _ = run
    for wl in WORKLOADS:
        res = [r for r in result["rows"] if r["workload"] == wl and r["variant"] == "resident"]
        assert [r["tier"] for r in res] == ["13 GB/s", "real"]
        assert res[0]["times_ms"] == res[1]["times_ms"]


def test_each_tier_has_its_own_floor(run: tuple[dict, str, str]) -> None:
    result, stdout, _ = run
    t13, real = result["tiers"]
    assert t13["floor_h2d_gbps"] >= 13.0 and "asked" in t13["floor_rate"]
    assert "floors at" in stdout and "emulated, 13 GB/s asked" in stdout
    for r in result["rows"]:
        tier = t13 if r["tier"] == "13 GB/s" else real
        meta = tier["workloads"][r["workload"]]
        assert r["floor_ms"] >= meta["resident_ms"]
        assert r["x_floor"] == pytest.approx(r["time_ms"] / r["floor_ms"])
    assert t13["workloads"]["p1"]["bytes_ms"] == pytest.approx(
        t13["workloads"]["p1"]["must_cross_bytes"] / (t13["floor_h2d_gbps"] * 1e9) * 1e3)


def test_markdown_opens_with_the_tier_table(run: tuple[dict, str, str]) -> None:
    _, _, md = run
    lines = md.splitlines()
    head = lines.index("| tier | workload | variant | time ms | floor ms | x floor | target | H2D GB/s | plan | exact |")
    rows = []
    for line in lines[head + 2:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    assert len(rows) == 8 and rows[0].startswith("| 13 GB/s | p1 | resident |") and rows[-1].startswith("| real | p2 | ours |")
    assert "depth " in rows[1] and " slots, " in rows[1]  # what the planner chose


def test_parse_link_gbps() -> None:
    assert parse_link_gbps("13, 25,50,real") == [13.0, 25.0, 50.0, None]
    for bad, why in (("13,fast", "neither a rate"), ("0", "above 0"), ("13,13", "twice"), (",", "no tier")):
        with pytest.raises(ValueError, match=f"^--link-gbps: .*{why}"):
            parse_link_gbps(bad)


def test_a_bad_tier_is_one_line_and_exit_2() -> None:
    proc = subprocess.run([sys.executable, "-m", "bench", "--tiny", "--device", "cpu", "--link-gbps", "13,-4"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: --link-gbps: '-4' must be a rate in GB/s above 0", proc.stderr


def test_a_tier_floor_never_flatters() -> None:
    """The asked rate sets the floor, unless the paced copies ran faster: then theirs does."""
    def case(paced_gbps: float) -> tuple[dict, dict]:
        metas = {"p1": {"must_cross_bytes": 5 * GB, "streamed_bytes": 5 * GB, "h2d_crossings": 1, "d2h_crossings": 0,
                        "weight_bytes": 5 * GB}}
        rows = [tier_row({"workload": "p1", "variant": "resident", "family": "resident", "status": "ok", "time_ms": 40.0}, g)
                for g in (13.0, None)]
        rows += [tier_row({"workload": "p1", "variant": "ours", "family": "ours", "status": "ok", "time_ms": t, "config": {},
                           "stats": {"streamed_bytes": 5 * GB, "h2d_gbps": rate}}, g)
                 for g, t, rate in ((13.0, 410.0, paced_gbps), (None, 94.0, 54.7))]
        tiers = derive_tiers(rows, metas, {"h2d_gbps": 55.0}, [13.0, None])
        return {r["tier"]: r for r in rows if r["variant"] == "ours"}, {t["tier"]: t for t in tiers}

    ours, tiers = case(12.8)
    assert tiers["13 GB/s"]["floor_h2d_gbps"] == 13.0 and tiers["real"]["floor_h2d_gbps"] == 55.0
    assert ours["13 GB/s"]["floor_ms"] == pytest.approx(5 / 13 * 1e3)
    assert ours["13 GB/s"]["target_x_floor"] == 1.05 and ours["13 GB/s"]["meets_target"] is False  # 410 / 384.6
    assert ours["real"]["x_floor"] == pytest.approx(94.0 / (5 / 55.0 * 1e3))
    ours, tiers = case(13.5)  # paced faster than asked: the floor follows the copies
    assert tiers["13 GB/s"]["floor_h2d_gbps"] == 13.5 and "faster" in tiers["13 GB/s"]["floor_rate"]
