"""train.accumulation_order through a real worker: layer-major accumulation trains the same LoRA as the
plain micro-batch loop, bitwise, while the weights cross once per optimizer step instead of once per
micro-batch; a bad value or a combination it cannot run is named at submit."""

from __future__ import annotations

from pathlib import Path

import pytest
from runner_helpers import log, run_dir, step_records, train_spec
from safetensors.torch import load_file

from jobs.contract import Metric
from jobs.errors import SpecError
from jobs.spec import parse_spec


def test_layer_order_trains_the_same_lora_with_a_third_of_the_copies(client, tiny: dict[str, Path]) -> None:
    jobs = {}
    for order in ("micro", "layer"):
        spec = train_spec(tiny, "flux", steps=3, save_every=None, gradient_accumulation_steps=3,
                          accumulation_order=order, gradient_checkpointing=True)
        jobs[order] = client.submit(spec)
    done = {order: client.wait(job["id"], timeout=300) for order, job in jobs.items()}
    for order, job in done.items():
        assert job["status"] == "SUCCEEDED", f"{order}: " + log(job)[-2000:]
    micro, layer = (step_records(done[o]) for o in ("micro", "layer"))
    assert [r[Metric.loss] for r in layer] == [r[Metric.loss] for r in micro]
    assert [r[Metric.grad_norm] for r in layer] == [r[Metric.grad_norm] for r in micro]
    lora = {o: load_file(str(next((run_dir(done[o]) / "outputs").glob("*.safetensors")))) for o in done}
    assert lora["layer"].keys() == lora["micro"].keys() and lora["layer"]
    for key, value in lora["micro"].items():
        assert value.equal(lora["layer"][key]), key
    per_step = {o: r[-1][Metric.h2d_bytes_per_optimizer_step] for o, r in (("micro", micro), ("layer", layer))}
    assert 0 < per_step["layer"] <= 0.5 * per_step["micro"], per_step


def _spec(**train: object) -> dict:
    return {"kind": "train", "model": {"path": "/models/flux"}, "train": {"dataset": "/data", **train}}


def test_a_bad_accumulation_order_is_named() -> None:
    with pytest.raises(SpecError) as bad:
        parse_spec(_spec(accumulation_order="lyer"))
    assert bad.value.field == "train.accumulation_order"
    spec = _spec(accumulation_order="layer", gradient_accumulation_steps=4)
    spec["offload"] = {"enable_optimizer_cpu_offload": True}
    with pytest.raises(SpecError, match="optimizer offload|enable_optimizer_cpu_offload") as both:
        parse_spec(spec)
    assert both.value.field == "train.accumulation_order"
    assert parse_spec(_spec(accumulation_order="layer")).train.accumulation_order == "layer"
