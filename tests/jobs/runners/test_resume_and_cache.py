"""Exact resume after kill -9, torn checkpoints skipped, and the content-keyed cache, through a real worker."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import torch
from runner_helpers import (copy_dataset, events, log, run_dir, run_job, step_records, train_spec, wait_for,
                            written_lines)
from safetensors.torch import load_file


def _losses_by_step(job: dict) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    for r in step_records(job):
        out.setdefault(r["step"], []).append(r["loss"])
    return out


def test_kill9_then_retry_resumes_bitwise_and_skips_a_torn_checkpoint(client, tiny: dict[str, Path]) -> None:
    spec = train_spec(tiny, "flux", steps=60, save_every=4, keep_last=3)
    victim = client.submit(spec)  # started first: the reference runs beside it on the other core
    reference = client.submit(spec)

    # kill -9 the victim's whole process group once it is past two checkpoints
    rd = Path(client.get(victim["id"])["run_dir"])
    wait_for(lambda: any(row.get("step", 0) >= 14 for row in written_lines(rd / "metrics.jsonl")), timeout=180)
    pgid = client.get(victim["id"])["attempts"][-1]["pgid"]
    os.killpg(pgid, signal.SIGKILL)
    killed = client.wait(victim["id"], timeout=60)
    assert killed["status"] == "FAILED"
    steps_before = max(_losses_by_step(killed))
    assert steps_before < 60, "the job finished before the kill; nothing was tested"

    # the newest checkpoint cut off mid-write: its optimizer state half there, its marker kept
    ckpts = sorted((rd / "checkpoints").glob("step-*"))
    newest = ckpts[-1]
    opt = newest / "optimizer.pt"
    opt.write_bytes(opt.read_bytes()[: opt.stat().st_size // 2])
    (rd / "checkpoints" / ".step-999999.tmp-12345").mkdir()  # and a temp folder a dead attempt left

    client.retry(victim["id"])
    resumed = client.wait(victim["id"], timeout=240)
    ref = client.wait(reference["id"], timeout=240)
    assert ref["status"] == "SUCCEEDED", log(ref)[-2000:]
    assert resumed["status"] == "SUCCEEDED", log(resumed)[-2000:]

    skipped = events(resumed, "runner.checkpoint_skipped")
    assert skipped and newest.name in skipped[0]["reason"] and "truncated" in skipped[0]["reason"]
    previous = int(ckpts[-2].name.split("-")[1])
    assert events(resumed, "runner.resumed")[-1]["step"] == previous

    want = {s: v[0] for s, v in _losses_by_step(ref).items()}
    got = _losses_by_step(resumed)
    assert sorted(got) == list(range(1, 61))
    assert any(len(v) > 1 for v in got.values())  # steps after the resumed checkpoint ran twice
    for step, values in got.items():
        assert all(v == want[step] for v in values), f"step {step}: {values} != {want[step]} (bitwise)"
    a = load_file(str(run_dir(ref) / "outputs" / "lora.safetensors"))
    b = load_file(str(rd / "outputs" / "lora.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_changed_caption_recomputes_one_text_embedding_and_no_latent(client, tiny: dict[str, Path],
                                                                       tmp_path: Path) -> None:
    data = copy_dataset(tiny["images"], tmp_path / "data")
    cache = tmp_path / "cache"
    spec = train_spec(tiny, "flux", steps=2, save_every=None, cache_dir=str(cache))
    spec["train"]["dataset"] = str(data)

    first = run_job(client, spec)
    assert first["status"] == "SUCCEEDED", log(first)[-2000:]
    assert {k: events(first, "runner.cache")[-1][k] for k in ("latents_computed", "text_computed")} == {
        "latents_computed": 6, "text_computed": 6}

    meta = data / "metadata.jsonl"
    rows = [json.loads(line) for line in meta.read_text().splitlines()]
    rows[2]["text"] = "a purple stripe in the snow"
    meta.write_text("".join(json.dumps(r) + "\n" for r in rows))
    second = run_job(client, spec)
    assert second["status"] == "SUCCEEDED", log(second)[-2000:]
    counts = events(second, "runner.cache")[-1]
    assert (counts["text_computed"], counts["text_cached"], counts["latents_computed"], counts["latents_cached"]) == (
        1, 5, 0, 6)

    spec["train"]["max_pixels"] = 576  # 24x24 buckets: every latent is new, no caption is
    third = run_job(client, spec)
    assert third["status"] == "SUCCEEDED", log(third)[-2000:]
    counts = events(third, "runner.cache")[-1]
    assert (counts["latents_computed"], counts["text_computed"]) == (6, 0)


def test_cancel_saves_then_retry_resumes_with_optimizer_offload(client, tiny: dict[str, Path]) -> None:
    """SIGTERM (cancel) checkpoints at the step boundary; the retry continues bitwise, with the optimizer
    on the CPU (offload.enable_optimizer_cpu_offload) and gradient accumulation."""
    spec = train_spec(tiny, "flux", steps=16, save_every=None, gradient_accumulation_steps=2)
    spec["offload"]["enable_optimizer_cpu_offload"] = True
    victim = client.submit(spec)
    reference = client.submit(spec)
    rd = Path(client.get(victim["id"])["run_dir"])
    wait_for(lambda: (rd / "metrics.jsonl").exists() and '"step":3,' in (rd / "metrics.jsonl").read_text(), timeout=180)
    client.cancel(victim["id"])
    cancelled = client.wait(victim["id"], timeout=60)
    assert cancelled["status"] == "CANCELLED"
    stopped = events(cancelled, "runner.stopped")
    assert stopped, "the runner did not stop cleanly on SIGTERM:\n" + log(cancelled)[-2000:]
    at = stopped[0]["step"]
    assert at < 16 and events(cancelled, "runner.checkpoint")[-1]["step"] == at

    client.retry(victim["id"])
    resumed = client.wait(victim["id"], timeout=240)
    ref = client.wait(reference["id"], timeout=240)
    assert resumed["status"] == ref["status"] == "SUCCEEDED", log(resumed)[-2000:]
    assert events(resumed, "runner.resumed")[-1]["step"] == at
    want = {s: v[0] for s, v in _losses_by_step(ref).items()}
    got = _losses_by_step(resumed)
    assert sorted(got) == list(range(1, 17))
    assert all(v == want[s] for s, vs in got.items() for v in vs)
