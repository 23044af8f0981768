"""A `kind: shard` job through the real worker: a non-empty dst it did not write fails by name,
and `shard.overwrite: true` writes into it without touching the user's own files."""

from __future__ import annotations

from pathlib import Path

from runner_helpers import log


def _shard_spec(src: Path, dst: Path, **shard: object) -> dict:
    return {"kind": "shard", "name": "test-shard-guard", "shard": {"src": str(src), "dst": str(dst), **shard},
            "resources": {"gpus": 0}, "limits": {"max_duration": "5m"}}


def test_a_shard_job_refuses_a_folder_it_did_not_write(client, tiny: dict[str, Path], tmp_path: Path) -> None:
    dst = tmp_path / "album"
    dst.mkdir()
    (dst / "index.json").write_text('{"photos": 3}')
    (dst / "scan.tmp").write_text("the user's")
    src = tiny["flux"] / "transformer"
    job = client.wait(client.submit(_shard_spec(src, dst))["id"], timeout=180)
    assert (job["status"], job["reason"]) == ("FAILED", "setup_failed"), (job["status"], job.get("reason"))
    assert f"{dst}: not empty" in job["message"] and "Traceback" not in log(job)
    assert (dst / "index.json").read_text() == '{"photos": 3}' and (dst / "scan.tmp").read_text() == "the user's"
    job = client.wait(client.submit(_shard_spec(src, dst, overwrite=True))["id"], timeout=180)
    assert job["status"] == "SUCCEEDED", (job.get("reason"), job.get("message"))
    assert '"offload-jobs-shards"' in (dst / "index.json").read_text()
    assert (dst / "scan.tmp").read_text() == "the user's"
