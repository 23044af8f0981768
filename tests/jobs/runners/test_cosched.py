"""Co-scheduled inference through a real worker (issue 32): queued infer jobs with the same model,
LoRA and settings run as one batch in one child; each keeps its own state, outputs and exit.

One worker for the module, with one CPU slot: a gate job (a command waiting for a file) holds it
while a test queues its infer jobs, so what shares a batch is decided by the rules, not by timing.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import torch
from PIL import Image
from runner_helpers import infer_spec, log, run_dir, strict_lines, wait_for

from _helpers.jobs_helpers import WorkerProcess
from jobs.contract import JobState, Metric, Reason
from jobs.spec import parse_spec
from jobs.worker.cosched import batch_key


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    w = WorkerProcess(tmp_path_factory.mktemp("cosched") / "home", "--max-cpu-jobs", "1").start()
    yield w
    w.stop()


class Gate:
    """A command job that holds the worker's only CPU slot until `open()`."""

    def __init__(self, client: Any, folder: Path) -> None:
        self.file = folder / "gate-open"
        self.client = client
        self.job = client.submit({"kind": "command", "name": "gate", "resources": {"gpus": 0},
                                  "command": f"while [ ! -e {self.file} ]; do sleep 0.05; done"})
        wait_for(lambda: client.get(self.job["id"])["status"] == JobState.RUNNING, timeout=30)

    def open(self) -> None:
        self.file.touch()
        self.client.wait(self.job["id"], timeout=30)


def _spec(tiny: dict[str, Path], prompt: str, **infer: Any) -> dict[str, Any]:
    infer.setdefault("negative_prompt", None)
    return infer_spec(tiny, "flux", prompt=prompt, **infer)


def _metrics(job: dict[str, Any]) -> dict[str, Any]:
    """The job's last image row (its step rows carry the batch fields)."""
    rows = [r for r in strict_lines(run_dir(job) / "metrics.jsonl") if r.get(Metric.step) is not None]
    return rows[-1] if rows else {}


def _png(path: Path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB"))


def _direct_batch(tiny: dict[str, Path], prompts: list[str], seeds: list[int], steps: int, size: int) -> list[np.ndarray]:
    """The same pipeline run on the same batch in this process: the tiny FluxPipeline, resident, the
    prompts encoded one by one (as the runner's cache does), one generator per row."""
    from diffusers import FluxPipeline

    from jobs.runners.families import get_adapter
    from jobs.runners.render import to_pil

    pipe = FluxPipeline.from_pretrained(str(tiny["flux"]), dtype=torch.float32)
    family = get_adapter("flux")
    with torch.no_grad():
        enc = [pipe.encode_prompt(p, p, device="cpu", max_sequence_length=32)[:2] for p in prompts]
        out = pipe(prompt_embeds=torch.cat([e[0] for e in enc]), pooled_prompt_embeds=torch.cat([e[1] for e in enc]),
                   height=size, width=size, num_inference_steps=steps, output_type="latent", return_dict=False,
                   generator=[torch.Generator("cpu").manual_seed(s) for s in seeds])[0]
        f = family.spatial_factor(pipe.vae)
        lat = family.latents_from_pipeline(out, size // f, size // f)
        return [np.asarray(to_pil(family.decode_latents(pipe.vae, lat[b:b + 1]))[0]) for b in range(len(prompts))]


def _show(worker: WorkerProcess, job_id: str) -> str:
    env = {"OFFLOAD_JOBS_URL": worker.url, "OFFLOAD_JOBS_TOKEN": worker.token, "OFFLOAD_JOBS_HOME": str(worker.home),
           "PATH": "/usr/bin:/bin", "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "jobs", "show", job_id], capture_output=True, text=True, env=env,
                          timeout=60).stdout


def test_batch_key_rules(tiny: dict[str, Path]) -> None:
    """Different model, LoRA, size, steps, guidance, engine or environment never share; prompts,
    seeds, image counts, names and priorities may; share_stream: false and other kinds run alone."""
    base = _spec(tiny, "a red square", seed=1)
    key = batch_key(parse_spec(base))
    assert key is not None

    def with_(**changes: Any) -> str | None:
        spec = json.loads(json.dumps(base))
        for dotted, value in changes.items():
            node = spec
            *path, last = dotted.split("__")
            for p in path:
                node = node.setdefault(p, {})
            node[last] = value
        return batch_key(parse_spec(spec))

    for same in ({"infer__prompt": "a blue circle"}, {"infer__seed": 9}, {"infer__num_images": 3},
                 {"name": "other"}, {"priority": 5}, {"infer__seeds": [4, 5]}):
        assert with_(**same) == key, same
    for apart in ({"model__path": str(tiny["qwen-image"])}, {"infer__lora": "/some/lora.safetensors"},
                  {"infer__lora_scale": 0.5}, {"infer__width": 48}, {"infer__steps": 4}, {"infer__guidance": 2.0},
                  {"offload__offload_granularity": "leaf"}, {"env__OFFLOAD_JOBS_VRAM_CAP": "1GiB"},
                  {"infer__max_sequence_length": 16}, {"model__dtype": "bfloat16"}):
        assert with_(**apart) not in (key, None), apart
    assert with_(infer__share_stream=False) is None
    assert batch_key(parse_spec({"kind": "command", "command": "true"})) is None


def _lora_file(tiny: dict[str, Path], path: Path) -> Path:
    from jobs.runners.families import get_adapter
    from jobs.runners.lora import export_lora, inject_lora

    adapter = get_adapter("flux")
    model = adapter.classes()[1].from_pretrained(str(tiny["flux"]), subfolder="transformer")
    torch.manual_seed(0)
    inject_lora(model, 4, 4.0, list(adapter.default_targets))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.normal_(0, 0.05)
    export_lora(model, adapter, path, rank=4, alpha=4.0, fmt="diffusers")
    return path


def test_a_batch_shares_one_child_bitwise_and_a_bad_input_fails_alone(worker: WorkerProcess, client: Any,
                                                                        tiny: dict[str, Path], tmp_path: Path) -> None:
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("a yellow star\n")
    lora = _lora_file(tiny, tmp_path / "lora.safetensors")
    gate = Gate(client, tmp_path)
    a = client.submit(_spec(tiny, "a red square on a blue background", seed=1))
    b = client.submit(_spec(tiny, "a green circle", seed=5, num_images=2))
    bad = client.submit(_spec(tiny, "", prompt_file=str(prompts_file), seed=3))  # its file goes before it runs
    other_lora = client.submit(_spec(tiny, "a red square on a blue background", seed=1, lora=str(lora)))
    alone = client.submit(_spec(tiny, "a red square on a blue background", seed=1, share_stream=False))
    other_size = client.submit(_spec(tiny, "a red square on a blue background", seed=1, width=48))
    other_model = client.submit({**_spec(tiny, "a red square on a blue background", seed=1),
                                 "model": {"path": str(tiny["sd3"])}})
    prompts_file.unlink()
    gate.open()
    done = {k: client.wait(j["id"], timeout=300) for k, j in
            dict(a=a, b=b, bad=bad, other_lora=other_lora, alone=alone, other_size=other_size,
                 other_model=other_model).items()}

    batch = [a["id"], b["id"], bad["id"]]
    for k in ("a", "b"):
        assert done[k]["status"] == JobState.SUCCEEDED, (k, done[k], log(done[k]))
        m = done[k]["last_metrics"]
        assert m[Metric.batch_of] == a["id"] and m[Metric.batch_with] == batch and m[Metric.image_seconds] > 0
    assert done["bad"]["status"] == JobState.FAILED and done["bad"]["reason"] == Reason.SETUP_FAILED
    assert "infer.prompt_file" in done["bad"]["message"] and "no such file" in done["bad"]["message"]
    assert not list((run_dir(done["bad"]) / "outputs").glob("*.png"))
    for k in ("other_lora", "alone", "other_size", "other_model"):  # ran alone: the plain runner, no batch fields
        assert done[k]["status"] == JobState.SUCCEEDED, (k, log(done[k]))
        assert Metric.batch_of not in _metrics(done[k]) and "co-scheduled" not in log(done[k])
    # each job's own run dir: its images, params and log lines
    assert sorted(p.name for p in (run_dir(done["b"]) / "outputs").glob("image_*.png")) == ["image_000.png", "image_001.png"]
    assert json.loads((run_dir(done["b"]) / "outputs" / "params.json").read_text())[Metric.batch_of] == a["id"]
    assert "rendered by the child of job " + a["id"] in log(done["b"]) and "[2/2] 'a green circle' seed 6" in log(done["b"])
    assert "[1/1] 'a red square on a blue background' seed 1" in log(done["a"])

    # bitwise: the batch's images are the same pipeline's on the same batch, run here
    want = _direct_batch(tiny, ["a red square on a blue background", "a green circle", "a green circle"], [1, 5, 6],
                         steps=3, size=32)
    got = [_png(run_dir(done["a"]) / "outputs" / "image_000.png"), _png(run_dir(done["b"]) / "outputs" / "image_000.png"),
           _png(run_dir(done["b"]) / "outputs" / "image_001.png")]
    for g, w in zip(got, want):
        assert np.array_equal(g, w)
    # ... and the same job alone made the same image as in the batch (float32 on the CPU)
    assert np.array_equal(_png(run_dir(done["alone"]) / "outputs" / "image_000.png"), got[0])
    assert not np.array_equal(_png(run_dir(done["other_lora"]) / "outputs" / "image_000.png"), got[0])

    shown = _show(worker, b["id"])
    assert f"in the batch of {a['id']} (3 jobs: {', '.join(batch)})" in shown and "s an image" in shown


def test_cancel_one_job_of_a_running_batch_and_late_joiners_take_the_next(worker: WorkerProcess, client: Any,
                                                                          tiny: dict[str, Path], tmp_path: Path) -> None:
    gate = Gate(client, tmp_path)
    slow = dict(steps=120)
    x = client.submit(_spec(tiny, "a red square", seed=1, **slow))
    y = client.submit(_spec(tiny, "a green circle", seed=2, **slow))
    z = client.submit(_spec(tiny, "a blue star", seed=3, **slow))
    gate.open()
    batch_event = run_dir(client.get(x["id"])) / "events.jsonl"
    wait_for(lambda: batch_event.exists() and "runner.batch" in batch_event.read_text(), timeout=120, poll=0.05)
    late = [client.submit(_spec(tiny, f"a late prompt {n}", seed=10 + n, **slow)) for n in range(2)]
    client.cancel(y["id"])
    y_end = client.wait(y["id"], timeout=60)
    assert y_end["status"] == JobState.CANCELLED
    assert client.get(x["id"])["status"] == JobState.RUNNING  # cancelled while its batch still renders
    done = {j["id"]: client.wait(j["id"], timeout=300) for j in (x, z)}
    for j in (x, z):
        assert done[j["id"]]["status"] == JobState.SUCCEEDED, log(done[j["id"]])
        assert (run_dir(done[j["id"]]) / "outputs" / "image_000.png").is_file()
        assert done[j["id"]]["last_metrics"][Metric.batch_with] == [x["id"], y["id"], z["id"]]
    assert not list((run_dir(y_end) / "outputs").glob("*.png"))  # its rows were discarded

    # submitted while the batch ran: they share the next one; its leader is cancelled mid-pass
    lead, other = late
    lead_events = run_dir(client.get(lead["id"])) / "events.jsonl"
    wait_for(lambda: lead_events.exists() and "runner.batch" in lead_events.read_text(), timeout=120, poll=0.05)
    assert client.get(lead["id"])["started_at"] >= done[x["id"]]["finished_at"] - 1.0
    client.cancel(lead["id"])
    lead_end, other_end = client.wait(lead["id"], timeout=300), client.wait(other["id"], timeout=300)
    assert other_end["status"] == JobState.SUCCEEDED, log(other_end)
    assert other_end["last_metrics"][Metric.batch_with] == [lead["id"], other["id"]]
    assert (run_dir(other_end) / "outputs" / "image_000.png").is_file()
    assert lead_end["status"] == JobState.CANCELLED and lead_end["reason"] == Reason.CANCELLED
    assert not list((run_dir(lead_end) / "outputs").glob("*.png"))
    assert "left out of its batch" in log(lead_end)


def test_a_lost_leader_child_fails_its_members_worker_lost_and_they_run_again(client: Any, tiny: dict[str, Path],
                                                                               tmp_path: Path) -> None:
    import os
    import signal

    gate = Gate(client, tmp_path)
    jobs = [client.submit(_spec(tiny, f"prompt {n}", seed=n, steps=120)) for n in range(3)]
    gate.open()
    leader_file = run_dir(client.get(jobs[0]["id"])) / "batch" / "leader.json"
    events = run_dir(client.get(jobs[0]["id"])) / "events.jsonl"
    wait_for(lambda: events.exists() and "runner.batch" in events.read_text(), timeout=120, poll=0.05)
    os.kill(json.loads(leader_file.read_text())["pid"], signal.SIGKILL)  # the shared child crashes mid-pass
    first, *members = [client.wait(j["id"], timeout=300) for j in jobs]
    assert first["status"] == JobState.FAILED and first["reason"] == Reason.KILLED  # its own child: as today
    for m in members:  # lost with the child that rendered them: queued again (retry.on: worker_lost), then done
        assert m["status"] == JobState.SUCCEEDED and m["attempt"] == 2, log(m)
        assert "attempt 1 ended: FAILED (worker_lost)" in log(m)
        assert m["last_metrics"][Metric.batch_with] == [j["id"] for j in jobs[1:]]
        assert (run_dir(m) / "outputs" / "image_000.png").is_file()


@pytest.mark.parametrize("family", ["qwen-image", "wan"])
def test_render_batch_rows_are_each_prompt_alone(tiny: dict[str, Path], family: str) -> None:
    """A batched pass of the other families (Qwen-Image: prompts of different lengths, masked, and true
    CFG with a negative per row; Wan: clips) gives each row the image it gets alone, up to float32
    batching noise (at most 1 of 255 on the CPU)."""
    from jobs.runners import render as rnd
    from jobs.runners.families import get_adapter

    adapter = get_adapter(family)
    pipe = adapter.classes()[0].from_pretrained(str(tiny[family]))
    pipe.set_progress_bar_config(disable=True)
    cpu = torch.device("cpu")
    texts = [adapter.encode_text(pipe, p, cpu, 32) for p in ("a red square", "a green circle on a white background")]
    neg = adapter.encode_text(pipe, "blurry", cpu, 32) if adapter.uses_negative else None
    spec = rnd.PromptSpec(prompt="", width=32, height=32, steps=3, guidance=adapter.default_guidance,
                          negative="blurry", frames=5 if adapter.is_video else 1)
    rows = rnd.render_batch(adapter, pipe, pipe.vae, texts, [neg, neg] if neg is not None else None, spec, [1, 2], cpu,
                            torch.float32)
    assert [len(r) for r in rows] == [spec.frames] * 2
    for b in range(2):
        spec.seed = b + 1
        alone = rnd.render(adapter, pipe, pipe.vae, texts[b], neg, spec, cpu, torch.float32)
        diff = max(int(np.abs(np.asarray(x, dtype=np.int16) - np.asarray(y, dtype=np.int16)).max())
                   for x, y in zip(rows[b], alone))
        assert diff <= 1, (family, b, diff)


def test_a_batch_survives_a_worker_kill9_and_finishes_once(worker_factory, tiny: dict[str, Path], tmp_path: Path) -> None:
    """Every child of a batch is adopted by the restarted worker (the batch is in each attempt's
    handle), or its end read from its run dir when it ended meanwhile: each job finishes in its first
    attempt, once."""
    home = tmp_path / "home"
    w = worker_factory("--max-cpu-jobs", "1", home=home)
    c = w.client()
    gate = Gate(c, tmp_path)
    jobs = [c.submit(_spec(tiny, f"prompt {n}", seed=n, steps=400)) for n in range(3)]  # a pass of ~10 s
    gate.open()
    events = run_dir(c.get(jobs[0]["id"])) / "events.jsonl"
    wait_for(lambda: events.exists() and "runner.batch" in events.read_text(), timeout=120, poll=0.05)
    c.close()
    w.kill9()
    w2 = worker_factory("--max-cpu-jobs", "1", home=home)
    c2 = w2.client()
    ids = [j["id"] for j in jobs]
    for j in jobs:
        done = c2.wait(j["id"], timeout=300)
        assert done["status"] == JobState.SUCCEEDED and done["attempt"] == 1, log(done)
        assert [a["status"] for a in done["attempts"]] == [JobState.SUCCEEDED]
        assert _metrics(done)[Metric.batch_with] == ids  # (rows written while no worker watched skip last_metrics)
        assert re.search(r"worker restarted; attempt 1( is still running and was adopted|: it ended while no worker "
                         r"watched: SUCCEEDED)", log(done)), log(done)  # adopted, or its end read from exit.json
        assert (run_dir(done) / "outputs" / "image_000.png").is_file()
    c2.close()


def test_images_per_pass_is_what_the_cap_leaves_for_activations() -> None:
    from jobs.runners.cosched import ACTIVATION_FACTOR, MAX_DEFAULT_ROWS, images_per_pass

    tokens = 1024 * 1024 // 256 + 512  # Flux-dev at 1024x1024 with 512 text tokens
    per_image = ACTIVATION_FACTOR * tokens * 3072 * 2
    cap, held = 8 * 2**30, int(2.5 * 2**30)
    assert images_per_pass(cap, held, tokens, 3072, 2) == int((cap * 0.9 - held) // per_image) == 7
    assert images_per_pass(cap, cap, tokens, 3072, 2) == 1  # nothing left: still one image a pass
    assert images_per_pass(None, 0, tokens, 3072, 2) == MAX_DEFAULT_ROWS  # no cap (the CPU)
