"""Bad data fails at setup with a reason in the job's events; a NaN loss stops with the step;
`signal save|sample|stop`, `outputs` and `show` on a running train job, through the real CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from runner_helpers import (FAMILY_DATA, copy_dataset, events, infer_spec, log, run_dir, step_records, train_spec,
                            wait_for)

from jobs.errors import InvalidTransition, SpecError

REPO = Path(__file__).resolve().parents[3]


def _bad_cases(tiny: dict[str, Path], tmp: Path) -> dict[str, tuple[dict, str]]:
    """name -> (spec, the words the failure must say)."""
    missing = copy_dataset(tiny["images"], tmp / "missing")
    with open(missing / "metadata.jsonl", "a") as f:
        f.write(json.dumps({"file_name": "not_there.png", "text": "a ghost"}) + "\n")
    no_column = tmp / "no_column"
    no_column.mkdir()
    (no_column / "img_00.png").write_bytes((tiny["images"] / "img_00.png").read_bytes())
    (no_column / "metadata.csv").write_text("file_name,caption\nimg_00.png,a red square\n")
    unreadable = tmp / "unreadable"
    unreadable.mkdir()
    (unreadable / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"not really a png" * 10)
    (unreadable / "broken.txt").write_text("a broken picture")
    empty = tmp / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("no images here")

    def with_data(folder: Path) -> dict:
        spec = train_spec(tiny, "flux")
        spec["train"]["dataset"] = str(folder)
        return spec

    wrong_family = train_spec(tiny, "flux")
    wrong_family["model"]["family"] = "wan"
    # a Flux LoRA file (as the Flux train job writes it) given to a Wan infer job
    flux_lora = tmp / "flux_lora.safetensors"
    header = {"__metadata__": {"offload_jobs.family": "flux"},
              "transformer.transformer_blocks.0.attn.to_q.lora_A.weight": {"dtype": "F32", "shape": [1, 1],
                                                                        "data_offsets": [0, 4]}}
    raw = json.dumps(header).encode()
    flux_lora.write_bytes(len(raw).to_bytes(8, "little") + raw + b"\x00" * 4)
    return {
        "missing image": (with_data(missing), "not_there.png: listed in the metadata but missing"),
        "no caption column": (with_data(no_column), "no `text` column"),
        "unreadable image": (with_data(unreadable), "broken.png: unreadable image"),
        "zero images": (with_data(empty), "has no images"),
        "wrong family": (wrong_family, "model.family: the spec says wan, but"),
        "foreign lora": (infer_spec(tiny, "wan", lora=str(flux_lora)), "is a flux LoRA; "),
    }


def test_bad_input_fails_at_setup_with_a_reason(client, tiny: dict[str, Path], tmp_path: Path) -> None:
    cases = _bad_cases(tiny, tmp_path)
    jobs = {name: client.submit(spec)["id"] for name, (spec, _) in cases.items()}  # all at once: each is quick
    for name, job_id in jobs.items():
        job = client.wait(job_id, timeout=120)
        words = cases[name][1]
        assert (job["status"], job["reason"]) == ("FAILED", "setup_failed"), f"{name}: {job['status']} {job['reason']}"
        assert words in (job.get("message") or ""), f"{name}: {job.get('message')!r}"
        finished = [e for e in events(job) if e.get("type") == "job.status" and e.get("status") == "FAILED"]
        assert finished and words in finished[-1]["message"], f"{name}: the reason is not in events.jsonl"
        assert "Traceback" not in log(job), f"{name}: a traceback in the log:\n{log(job)[-1500:]}"
        assert not (run_dir(job) / "checkpoints").exists()


def test_nonfinite_loss_stops_the_job_with_the_step(client, tiny: dict[str, Path]) -> None:
    job = client.wait(client.submit(train_spec(tiny, "flux", learning_rate=1e30, steps=10))["id"], timeout=180)
    assert job["status"] == "FAILED"
    assert job["reason"] == "nonfinite_loss"
    report = json.loads((run_dir(job) / "report.json").read_text())  # the runner's own report; exit.json is the launcher's
    assert report["reason"] == "nonfinite_loss"
    assert "at step 2" in report["message"] and "at step 2" in job["message"]
    assert [r["step"] for r in step_records(job)] == [1]  # the bad step is reported, not logged as a number
    assert "Traceback" not in log(job)


def _cli(worker, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OFFLOAD_JOBS_")}
    env.update(OFFLOAD_JOBS_URL=worker.url, OFFLOAD_JOBS_TOKEN=worker.token, OFFLOAD_JOBS_HOME=str(worker.home))
    return subprocess.run([sys.executable, "-m", "jobs.cli", *args], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=60)


def test_signals_outputs_and_show(worker, client, tiny: dict[str, Path], tmp_path: Path) -> None:
    spec = train_spec(tiny, "qwen-image", steps=5000, save_every=None, sample_every=None,
                      sample_prompts=["a red square --steps 2"])
    job_id = client.submit(spec)["id"]
    rd = Path(client.get(job_id)["run_dir"])
    with pytest.raises(SpecError, match="action"):
        client.signal(job_id, "explode")
    wait_for(lambda: (rd / "metrics.jsonl").exists() and '"loss"' in (rd / "metrics.jsonl").read_text(), timeout=180)

    res = _cli(worker, "signal", job_id, "save")
    assert res.returncode == 0, res.stderr
    ck = wait_for(lambda: events(client.get(job_id), "runner.checkpoint"), timeout=60)[0]
    assert Path(ck["path"]).is_dir() and (Path(ck["path"]) / "COMPLETE.json").is_file()

    client.signal(job_id, "sample")
    sample = wait_for(lambda: events(client.get(job_id), "runner.samples"), timeout=60)[0]
    assert sample["paths"] and all(Path(p).is_file() for p in sample["paths"])

    shown = json.loads(_cli(worker, "show", job_id, "--json").stdout)
    assert shown["run_state"]["checkpoints"]["latest_step"] == ck["step"]
    assert shown["run_state"]["last_samples"]["paths"] == sample["paths"]
    text = _cli(worker, "show", job_id).stdout
    assert f"latest step {ck['step']}" in text and Path(sample["paths"][0]).name in text

    res = _cli(worker, "signal", job_id, "stop", "--json")
    assert res.returncode == 0 and json.loads(res.stdout)["action"] == "stop"
    job = client.wait(job_id, timeout=120)
    assert job["status"] == "SUCCEEDED", log(job)[-2000:]
    stopped = events(job, "runner.stopped")[0]
    assert ck["step"] <= stopped["step"] < 5000
    assert events(job, "runner.checkpoint")[-1]["step"] == stopped["step"]  # stop = a checkpoint first

    with pytest.raises(InvalidTransition, match="SUCCEEDED"):
        client.signal(job_id, "save")
    res = _cli(worker, "signal", job_id, "save")
    assert res.returncode == 2 and res.stderr.startswith("error:") and "Traceback" not in res.stderr

    listed = json.loads(_cli(worker, "outputs", job_id, "--json").stdout)
    names = {f["path"] for f in listed["files"]}
    assert "lora.safetensors" in names and "train_summary.json" in names
    assert any(n.startswith("samples/") for n in names)
    dest = tmp_path / "copied"
    res = _cli(worker, "outputs", job_id, "--copy", str(dest))
    assert res.returncode == 0, res.stderr
    assert (dest / "lora.safetensors").read_bytes() == (rd / "outputs" / "lora.safetensors").read_bytes()
    assert "lora.safetensors" in _cli(worker, "outputs", job_id).stdout


def test_dataset_kinds(tiny: dict[str, Path], tmp_path: Path) -> None:
    """.txt captions, metadata.csv, and Wan clip folders scan to the same items (in-process)."""
    from jobs.runners.data import DatasetError, scan_dataset

    txt = tmp_path / "txt"
    txt.mkdir()
    rows = [json.loads(line) for line in (tiny["images"] / "metadata.jsonl").read_text().splitlines()]
    for r in rows:
        (txt / r["file_name"]).write_bytes((tiny["images"] / r["file_name"]).read_bytes())
        (txt / r["file_name"]).with_suffix(".txt").write_text(r["text"] + "\n")
    csvd = tmp_path / "csv"
    csvd.mkdir()
    for r in rows:
        (csvd / r["file_name"]).write_bytes((tiny["images"] / r["file_name"]).read_bytes())
    (csvd / "metadata.csv").write_text("file_name,text\n" + "".join(f'{r["file_name"]},"{r["text"]}"\n' for r in rows))
    a, b, c = (scan_dataset(d) for d in (tiny["images"], txt, csvd))
    assert [(i.name, i.caption, i.size, i.digest) for i in a] == [(i.name, i.caption, i.size, i.digest) for i in b] \
        == [(i.name, i.caption, i.size, i.digest) for i in c]
    clips = scan_dataset(tiny[FAMILY_DATA["wan"]], allow_clips=True)
    assert len(clips) == 3 and all(len(i.files) == 5 for i in clips)
    with pytest.raises(DatasetError, match="has no images"):
        scan_dataset(tiny["clips"])  # clip folders are for Wan only
