"""bench.disk runs end to end on the CPU at a tiny size (its figures are the GPU machine's to make)."""

from __future__ import annotations

import json
from pathlib import Path

from bench import disk


def test_bench_disk_runs_on_the_cpu(tmp_path: Path, capsys: object) -> None:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls on a shared 2-core machine: threads only spin at barriers
    try:
        _run(tmp_path, capsys)
    finally:
        torch.set_num_threads(threads)


def _run(tmp_path: Path, capsys: object) -> None:
    out = tmp_path / "disk.json"
    code = disk.main(["--device", "cpu", "--size-gb", "0.01", "--dim", "128", "--tokens", "8", "--passes", "2",
                      "--workers", "2", "--fractions", "0.25,0.5", "--no-peer", "--keep-page-cache", "--json", str(out)])
    assert code == 0
    r = json.loads(out.read_text())
    assert r["raw_gbps"] > 0 and r["bytes"] > 0 and r["blocks"] >= 4
    rows = {(row["policy"], row["f"]): row for row in r["rows"]}
    assert set(rows) == {("belady", 0.25), ("belady", 0.5), ("fifo", 0.5), ("lru", 0.5)}
    n = r["blocks"]
    for f in (0.25, 0.5):  # the cached subset: whole blocks that fit in f of the bytes
        assert abs(rows[("belady", f)]["hit_rate"] - int(f * n) / n) <= 1.01 / n
    assert rows[("fifo", 0.5)]["hit_rate"] == 0.0 and rows[("lru", 0.5)]["hit_rate"] == 0.0
    assert all(row["floor_s"] > 0 and row["warm_s"] > 0 for row in r["rows"])
    printed = capsys.readouterr().out  # type: ignore[attr-defined]
    assert "raw O_DIRECT" in printed and "steady state <= 1.10x floor" in printed


def test_bench_disk_without_cuda_says_so(capsys: object) -> None:
    import torch

    if torch.cuda.is_available():
        return
    assert disk.main(["--device", "cuda"]) == 2
    assert "no CUDA device" in capsys.readouterr().err  # type: ignore[attr-defined]
