"""Train and infer jobs through a real worker, for Flux, Qwen-Image, Wan and SD3, on the tiny pipelines.

Each family: the train job SUCCEEDS and its loss falls; every step's metrics line is strict JSON
with the engine's stats; the LoRA file loads with diffusers' `load_lora_weights`, changes the
pipeline's output and gives exactly the trained transformer; an infer job with that LoRA (by the
train job's id) writes images, params.json and a contact sheet.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from runner_helpers import events, infer_spec, log, run_dir, run_job, step_records, strict_lines, train_spec
from safetensors import safe_open
from safetensors.torch import load_file

from jobs.runners.families import get_adapter
from jobs.runners.lora import inject_lora, load_trainable_state

STEP_FIELDS = {"step", "loss", "lr", "it_s", "eta_seconds", "host_rss_bytes", "vram_allocated_bytes",
               "vram_reserved_bytes", "vram_peak_bytes", "pinned_used_bytes", "pinned_capacity_bytes", "cache_hits",
               "cache_misses", "h2d_bytes", "h2d_gbps", "stall_ms"}
PIPE_KW = {"flux": {"max_sequence_length": 16, "guidance_scale": 3.5}, "qwen-image": {"max_sequence_length": 32},
           "wan": {"num_frames": 5, "max_sequence_length": 32}, "sd3": {"max_sequence_length": 16}}


def _pipeline_output(pipe, family: str) -> torch.Tensor:
    out = pipe("a red square on a blue background", num_inference_steps=2, height=32, width=32,
               generator=torch.Generator().manual_seed(0), output_type="pt", **PIPE_KW[family])
    return out.frames if family == "wan" else out.images


def _transformer_inputs(family: str, model) -> dict:
    g = torch.Generator().manual_seed(1)
    adapter = get_adapter(family)
    if family == "wan":
        x0 = torch.randn(1, 4, 2, 8, 8, generator=g)
        text = {"prompt_embeds": torch.randn(1, 7, 16, generator=g)}
    else:
        x0 = torch.randn(1, 4, 8, 8, generator=g)
        text = ({"prompt_embeds": torch.randn(1, 7, 32, generator=g), "pooled_prompt_embeds": torch.randn(1, 32, generator=g)}
                if family in ("flux", "sd3") else {"prompt_embeds": torch.randn(1, 7, 16, generator=g)})
    return adapter.model_inputs(model, x0, torch.tensor([0.6]), text, 3.5)


FAMILIES = ["flux", "qwen-image", "wan", "sd3"]


def _train_spec(tiny: dict[str, Path], family: str) -> dict:
    spec = train_spec(tiny, family, lora_rank=4, lora_alpha=8, sample_every=30,
                      sample_prompts=["a red square on a blue background --steps 3 --seed 1 --n blurry"])
    if family == "flux":
        spec["env"]["OFFLOAD_JOBS_HOST_MEMORY_WARN"] = "0.0"  # any use of RAM counts as "nearly full"
    return spec


@pytest.fixture(scope="module")
def train_jobs(worker, tiny: dict[str, Path]) -> dict[str, str]:
    """The four families' train jobs, submitted together (the worker runs them side by side)."""
    with worker.client() as c:
        return {f: c.submit(_train_spec(tiny, f))["id"] for f in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_train_then_infer(client, tiny: dict[str, Path], train_jobs: dict[str, str], family: str) -> None:
    job = client.wait(train_jobs[family], timeout=300)
    assert job["status"] == "SUCCEEDED", log(job)[-3000:]

    steps = step_records(job)
    assert [r["step"] for r in steps] == list(range(1, 31))
    assert STEP_FIELDS <= set(steps[-1]), STEP_FIELDS - set(steps[-1])
    losses = [r["loss"] for r in steps]
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last < 0.9 * first, f"{family}: the loss did not fall: {first:.4f} -> {last:.4f}"
    assert steps[-1]["h2d_bytes"] > steps[0]["h2d_bytes"] > 0  # the engine streamed the weights every step
    assert "train: 100%" in log(job)  # the progress bar, as whole lines
    assert "Traceback" not in log(job)
    assert events(job, "runner.gc_frozen")[0]["objects"] > 1000  # the loop's collections skip the setup's objects

    rd = run_dir(job)
    assert sorted(p.name for p in (rd / "checkpoints").iterdir()) == ["step-000020", "step-000030"]  # keep_last: 2
    sample = events(job, "runner.samples")[-1]
    assert sample["step"] == 30 and all(Path(p).is_file() for p in sample["paths"])
    if family == "flux":
        mem = events(job, "runner.host_memory")
        assert mem and "host memory nearly full" in mem[0]["message"]
        load = next(r for r in strict_lines(rd / "metrics.jsonl") if r.get("phase") == "load")
        assert load["weight_bytes"] > 0 and load["rss_peak_load_bytes"] >= load["rss_before_load"] > 0
        assert load["rss_peak_load_ratio"] == load["rss_peak_load_bytes"] / load["weight_bytes"]
        # the log words a tiny model's load as figures, not as an alarming ratio (test_load_memory_line.py)
        line = next(ln for ln in log(job).splitlines() if "host RAM while loading" in ln)
        assert re.search(r"flux transformer: [\d.]+ KB of weights", line), line
        assert "fixed overhead dominates at this size" in line, line
        assert "the weight bytes" not in log(job) and not re.search(r"\d+\.\d+x", line), line

    # The LoRA file: the family's key names, loadable by diffusers, exactly the trained adapter.
    lora = rd / "outputs" / "lora.safetensors"
    with safe_open(str(lora), framework="pt") as f:
        keys, meta = list(f.keys()), f.metadata()
    prefix = "transformer." if family in ("flux", "sd3") else "diffusion_model."
    assert keys and all(k.startswith(prefix) for k in keys) and not any(".alpha" in k for k in keys)
    assert (meta["lora_rank"], meta["lora_alpha"], meta["offload_jobs.family"]) == ("4", "8.0", family)

    adapter = get_adapter(family)
    pipe_cls, t_cls = adapter.classes()
    pipe = pipe_cls.from_pretrained(str(tiny[family]))
    pipe.set_progress_bar_config(disable=True)
    before = _pipeline_output(pipe, family)
    pipe.load_lora_weights(str(lora))
    assert sum(".lora_A." in n for n, _ in pipe.transformer.named_parameters()) == len(keys) // 2
    after = _pipeline_output(pipe, family)
    assert (after - before).abs().max() > 1e-4, "the LoRA did not change the pipeline's output"

    trained = t_cls.from_pretrained(str(tiny[family]), subfolder="transformer")
    inject_lora(trained, 4, 8.0, list(adapter.default_targets))
    load_trainable_state(trained, load_file(str(rd / "checkpoints" / "step-000030" / "trainable.safetensors")))
    with torch.no_grad():
        want = trained(**_transformer_inputs(family, trained))[0]
        got = pipe.transformer(**_transformer_inputs(family, pipe.transformer))[0]
    torch.testing.assert_close(got, want.to(got.dtype), rtol=1e-5, atol=1e-5)  # alpha/rank folded in, not lost

    # Inference with the LoRA, named by the train job's id.
    inf = run_job(client, infer_spec(tiny, family, lora=job["id"], num_images=2))
    assert inf["status"] == "SUCCEEDED", log(inf)[-3000:]
    out = run_dir(inf) / "outputs"
    params = json.loads((out / "params.json").read_text())
    assert params["lora"] == str(lora) and params["family"] == family and len(params["images"]) == 4
    assert [(i["prompt"], i["seed"], i["width"]) for i in params["images"]] == [
        ("a red square on a blue background", 0, 32), ("a red square on a blue background", 1, 32),
        ("a green circle", 7, 48), ("a green circle", 8, 48)]
    for rec in params["images"]:
        assert rec["negative"] == "blurry" and rec["steps"] == 3 and all(Path(f).is_file() for f in rec["files"])
    assert (out / "contact_sheet.png").is_file()
    if family == "wan":
        assert (out / "video_000" / "0004.png").is_file() and (out / "video_000.gif").is_file()
    else:
        from PIL import Image

        assert Image.open(out / "image_002.png").size == (48, 32)
