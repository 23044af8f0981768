"""fp8 shards with row scales from the CLI and from a `kind: shard` job, and jobs streaming them.

`offload-jobs shard SRC DST --dtype float8_e4m3fn --fp8-scaling row` writes the engine's fp8 slabs
(the fp8 bytes, then their fp32 row scales) at about half the bf16 shards' bytes; through the real
worker a shard job writes the same layout, an infer job streaming it (lazy_load with its shard_dir)
renders the image the same job renders from RAM with fp8 row storage, byte for byte, and a train job
streaming it trains.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from runner_helpers import events, infer_spec, log, run_dir, run_job, step_records, train_spec
from typer.testing import CliRunner

from jobs.cli import app
from jobs.spec import SpecError, parse_spec

FP8 = "float8_e4m3fn"


def _index(dst: Path) -> dict:
    return json.loads((dst / "index.json").read_text())


def _slab_bytes(dst: Path) -> int:
    return sum(e["nbytes"] for e in _index(dst)["units"].values())


def test_the_shard_verb_writes_row_scales_at_half_the_bf16_bytes(tiny: dict[str, Path], tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OFFLOAD_JOBS_HOME", str(tmp_path / "home"))
    src = tiny["flux"] / "transformer"
    runner = CliRunner()
    for dtype, extra in (("bfloat16", []), (FP8, ["--fp8-scaling", "row"])):
        res = runner.invoke(app, ["shard", str(src), str(tmp_path / dtype), "--dtype", dtype, *extra])
        assert res.exit_code == 0, res.output
    index = _index(tmp_path / FP8)
    assert (index["format_version"], index["dtype"], index["fp8_scaling"]) == (3, FP8, "row")
    fp8 = [t for e in index["units"].values() for t in e["tensors"].values() if t["dtype"] == FP8]
    assert fp8 and all(t["scale_shape"] == [t["shape"][0]] for t in fp8)  # a scale a row
    # the matrices take one byte an element where bf16 takes two; norms and biases keep the source's
    # dtype (fp32 in this tiny model) and the row scales add 4 bytes a row: 0.13% at Flux-dev's
    # 3072-wide rows, 12% at this tiny model's 32, so its slabs are a little over half
    bf16_tensors = {n: t for e in _index(tmp_path / "bfloat16")["units"].values() for n, t in e["tensors"].items()}
    fp8_tensors = {n: t for e in index["units"].values() for n, t in e["tensors"].items() if t["dtype"] == FP8}
    assert all(2 * t["nbytes"] == bf16_tensors[n]["nbytes"] for n, t in fp8_tensors.items())
    bf16, got = _slab_bytes(tmp_path / "bfloat16"), _slab_bytes(tmp_path / FP8)
    assert got < 0.6 * bf16, (got, bf16)


@pytest.mark.parametrize("args, line", [
    (["--dtype", FP8, "--fp8-scaling", "channel"], "--fp8-scaling: 'channel' is not one of tensor, row, block"),
    (["--fp8-scaling", "row"], "--fp8-scaling: applies to --dtype float8_e4m3fn only"),
])
def test_a_bad_fp8_scaling_flag_is_one_line(tmp_path: Path, args: list[str], line: str) -> None:
    res = CliRunner().invoke(app, ["shard", str(tmp_path), str(tmp_path / "out"), *args])
    assert res.exit_code == 2, (res.output, res.exception)
    assert res.stderr.strip().splitlines() == [f"error: {line}"], res.stderr
    assert not (tmp_path / "out").exists()


def test_shard_fp8_scaling_without_fp8_is_refused_at_submit() -> None:
    with pytest.raises(SpecError, match=r"^shard\.fp8_scaling: applies to shard\.dtype: float8_e4m3fn"):
        parse_spec({"kind": "shard", "shard": {"src": "/a", "dst": "/b", "fp8_scaling": "row"}})
    ok = parse_spec({"kind": "shard", "shard": {"src": "/a", "dst": "/b", "dtype": FP8, "fp8_scaling": "block"}})
    assert ok.shard.fp8_scaling == "block"


@pytest.fixture(scope="module")
def fp8_jobs(worker, tiny: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict:
    dst = tmp_path_factory.mktemp("fp8jobs") / "shards"
    with worker.client() as c:
        shard = run_job(c, {"kind": "shard", "name": "test-fp8-shard", "resources": {"gpus": 0},
                            "shard": {"src": str(tiny["flux"] / "transformer"), "dst": str(dst), "dtype": FP8,
                                      "fp8_scaling": "row"}, "limits": {"max_duration": "5m"}})
        assert shard["status"] == "SUCCEEDED", log(shard)[-3000:]
        disk_spec = infer_spec(tiny, "flux", prompt="a red square", steps=2)
        disk_spec["offload"].update(lazy_load=True, shard_dir=str(dst), max_memory=0)
        disk = run_job(c, disk_spec)
        ram_spec = infer_spec(tiny, "flux", prompt="a red square", steps=2)
        ram_spec["offload"].update(weight_dtype=FP8, fp8_scaling="row", lazy_load=False)
        ram = run_job(c, ram_spec)
        train = train_spec(tiny, "flux", steps=2, save_every=None)
        train["offload"].update(lazy_load=True, shard_dir=str(dst))
        trained = run_job(c, train)
    return {"dst": dst, "disk": disk, "ram": ram, "train": trained}


def test_jobs_stream_row_scaled_fp8_shards_bitwise_the_ram_engine(fp8_jobs: dict) -> None:
    assert _index(fp8_jobs["dst"])["fp8_scaling"] == "row"
    for key in ("disk", "ram", "train"):
        assert fp8_jobs[key]["status"] == "SUCCEEDED", (key, log(fp8_jobs[key])[-3000:])
    tier = events(fp8_jobs["disk"], "runner.host_store")[-1]
    assert tier["host_store"] == "disk" and tier["shard_dir"] == str(fp8_jobs["dst"])
    image = lambda job: (run_dir(job) / "outputs" / "image_000.png").read_bytes()  # noqa: E731
    assert image(fp8_jobs["disk"]) == image(fp8_jobs["ram"])
    rows = step_records(fp8_jobs["train"])
    assert len(rows) == 2 and all(r["host_store"] == "disk" and math.isfinite(r["loss"]) for r in rows)
