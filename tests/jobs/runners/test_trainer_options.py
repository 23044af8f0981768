"""The trainer options (issue 28), each through a real worker on the tiny Flux pipeline, on the CPU:
trigger_word, default_caption, caption_dropout, optimizer, ema, validation, log_to and init_lora."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from runner_helpers import events, log, run_dir, step_records, strict_lines, train_spec
from safetensors.torch import load_file

from jobs.errors import SpecError


def _wait_all(client, specs: list[dict]) -> list[dict]:
    """Submit all, then wait for all (the worker runs them side by side)."""
    ids = [client.submit(s)["id"] for s in specs]
    return [client.wait(i, timeout=300) for i in ids]


def _uncaptioned(tiny: dict[str, Path], tmp_path: Path) -> Path:
    """The tiny images with .txt captions for all but img_00 (no metadata file)."""
    data = tmp_path / "uncaptioned"
    data.mkdir()
    for i, img in enumerate(sorted(tiny["images"].glob("*.png"))):
        shutil.copy(img, data / img.name)
        if i:
            (data / img.with_suffix(".txt").name).write_text(f"a tiny square number {i}")
    return data


def test_captions_trigger_word_default_caption_and_dropout(client, tiny: dict[str, Path], tmp_path: Path) -> None:
    data = str(_uncaptioned(tiny, tmp_path))
    strict = train_spec(tiny, "flux", dataset=data, steps=2, save_every=None)
    defaulted = train_spec(tiny, "flux", dataset=data, steps=2, save_every=None, default_caption="a tiny square",
                           trigger_word="sks")
    dropout = train_spec(tiny, "flux", steps=6, save_every=None, caption_dropout=0.5, trigger_word="sks")
    all_dropped = train_spec(tiny, "flux", steps=2, save_every=None, caption_dropout=1.0)
    failed, ok, dropped, every = _wait_all(client, [strict, defaulted, dropout, all_dropped])

    assert failed["status"] == "FAILED" and failed["reason"] == "setup_failed"
    assert "img_00.png: no caption" in failed["message"] and "train.default_caption" in failed["message"]

    assert ok["status"] == "SUCCEEDED", log(ok)[-2000:]
    dataset = events(ok, "runner.dataset")[-1]
    assert dataset["default_captions"] == 1 and dataset["items"] == 6
    assert dataset["example_caption"] == "sks, a tiny square"  # img_00: the default caption, the trigger in front

    assert dropped["status"] == every["status"] == "SUCCEEDED", log(dropped)[-2000:]
    counts = [r["captions_dropped"] for r in step_records(dropped)]
    assert len(counts) == 6 and 0 < sum(counts) < 6  # batch 1: some steps dropped, some not
    assert [r["captions_dropped"] for r in step_records(every)] == [1, 1]
    assert "captions_dropped" not in step_records(ok)[0]  # off: not drawn, not written


def test_adamw8bit_ema_validation_and_tensorboard(client, tiny: dict[str, Path]) -> None:
    pytest.importorskip("bitsandbytes")
    pytest.importorskip("tensorboard")
    spec = train_spec(tiny, "flux", steps=5, save_every=5, optimizer="adamw8bit", ema=0.9,
                      validation={"items": 2, "every": 2, "timesteps": [0.3, 0.7]}, log_to="tensorboard")
    (job,) = _wait_all(client, [spec])
    assert job["status"] == "SUCCEEDED", log(job)[-2000:]
    rd = run_dir(job)
    records = step_records(job)
    load = next(r for r in strict_lines(rd / "metrics.jsonl") if r.get("phase") == "load")
    assert load["optimizer"] == "adamw8bit"
    # bitsandbytes' optimizer state (state1/state2), not torch's AdamW (exp_avg)
    state = torch.load(rd / "checkpoints" / "step-000005" / "optimizer.pt", weights_only=True)["optimizer"]["state"]
    assert state and all("state1" in str(list(s.get("__bnb_optimizer_quant_state__", s))) and "exp_avg" not in s
                         for s in state.values())

    # validation: 2 held-out items, a loss at steps 2, 4 and after the last step
    assert events(job, "runner.dataset")[-1]["held_out"] == 2
    assert [r["step"] for r in records if "val_loss" in r] == [2, 4, 5]
    assert all(r["val_loss"] > 0 for r in records if "val_loss" in r)

    # EMA: a distance every step; its LoRA beside the raw one, different from it, with the decay in its header
    assert all(r["ema_distance"] > 0 for r in records)
    outputs = Path(job["run_dir"]) / "outputs"
    raw, ema = load_file(outputs / "lora.safetensors"), load_file(outputs / "lora_ema.safetensors")
    assert raw.keys() == ema.keys() and any(not torch.equal(raw[k], ema[k]) for k in raw)
    assert (rd / "checkpoints" / "step-000005" / "ema.safetensors").is_file()  # a retry resumes the EMA too

    # tensorboard: event files that hold the same losses as metrics.jsonl
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = list((rd / "tensorboard").glob("events.out.tfevents.*"))
    assert files
    acc = EventAccumulator(str(rd / "tensorboard"))
    acc.Reload()
    losses = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert [s for s, _ in losses] == [r["step"] for r in records]
    assert [v for _, v in losses] == pytest.approx([r["loss"] for r in records], rel=1e-6)
    assert [e.step for e in acc.Scalars("train/val_loss")] == [2, 4, 5]


def test_init_lora_continues_from_a_lora_file(client, tiny: dict[str, Path], tmp_path: Path) -> None:
    (first,) = _wait_all(client, [train_spec(tiny, "flux", steps=4, save_every=None)])
    assert first["status"] == "SUCCEEDED", log(first)[-2000:]
    lora = Path(first["run_dir"]) / "outputs" / "lora.safetensors"
    # a learning rate too small to move anything: the second job's LoRA is the file it started from
    same = train_spec(tiny, "flux", steps=1, save_every=None, init_lora=str(lora), learning_rate=1e-30)
    wrong_rank = train_spec(tiny, "flux", steps=1, save_every=None, init_lora=str(lora), lora_rank=8)
    fresh = train_spec(tiny, "flux", steps=1, save_every=None, learning_rate=1e-30)
    cont, bad, base = _wait_all(client, [same, wrong_rank, fresh])
    assert cont["status"] == "SUCCEEDED", log(cont)[-2000:]
    assert events(cont, "runner.init_lora")[-1]["tensors"] > 0
    want = load_file(lora)
    got = load_file(Path(cont["run_dir"]) / "outputs" / "lora.safetensors")
    assert got.keys() == want.keys()
    assert all(torch.allclose(got[k], want[k], rtol=1e-5, atol=1e-7) for k in want)
    assert step_records(cont)[0]["loss"] != step_records(base)[0]["loss"]  # it trained from the file, not afresh
    assert bad["status"] == "FAILED" and bad["reason"] == "setup_failed"
    assert "train.init_lora" in bad["message"] and "rank 4" in bad["message"]


def test_a_missing_library_is_refused_at_submit_naming_the_extra(client, tiny: dict[str, Path], monkeypatch) -> None:
    import importlib.util

    if importlib.util.find_spec("wandb") is None:  # through the real worker: wandb is not installed here
        with pytest.raises(SpecError) as e:
            client.submit(train_spec(tiny, "flux", log_to="wandb"))
        assert e.value.field == "train.log_to" and "offload-jobs[wandb]" in str(e.value)
    # each optimizer's library, missing: the refusal names its extra
    from jobs.spec import parse_spec

    real = importlib.util.find_spec
    for name, module in (("adamw8bit", "bitsandbytes"), ("prodigy", "prodigyopt")):
        monkeypatch.setattr(importlib.util, "find_spec", lambda m, *a, _m=module: None if m == _m else real(m, *a))
        with pytest.raises(SpecError) as e:
            parse_spec(train_spec(tiny, "flux", optimizer=name))
        assert e.value.field == "train.optimizer" and f"offload-jobs[{name}]" in str(e.value)


def test_adafactor_and_prodigy_train(client, tiny: dict[str, Path]) -> None:
    pytest.importorskip("prodigyopt")
    specs = [train_spec(tiny, "flux", steps=2, save_every=2, optimizer=name, learning_rate=1e-3 if name == "adafactor"
                        else 1.0) for name in ("adafactor", "prodigy")]
    adafactor, prodigy = _wait_all(client, specs)
    for job in (adafactor, prodigy):
        assert job["status"] == "SUCCEEDED", log(job)[-2000:]
    def saved(job: dict) -> dict:
        return torch.load(run_dir(job) / "checkpoints" / "step-000002" / "optimizer.pt", weights_only=True)["optimizer"]

    # each optimizer's own state: Adafactor's factored second moment, Prodigy's step size estimate d
    assert any("exp_avg_sq_row" in s or "exp_avg_sq" in s for s in saved(adafactor)["state"].values())
    assert all("d" in g for g in saved(prodigy)["param_groups"])
