"""state_dict() and load_state_dict() while the model is offloaded: the host masters, not placeholders.

Checkpoints are saved mid-training, without remove(): every value must be the resident model's,
bit for bit, running stats and optimizer-offloaded masters included.
"""

from __future__ import annotations

import copy

import pytest
import torch

from offload_core import OffloadTrainingManager, enable_offload
from offload_core_test_models import CASES, assert_bitwise, infer, make_optimizer, train

CKPT = [pytest.param(False, id="no_ckpt"), pytest.param(True, id="ckpt")]


def assert_state_dicts_equal(want: dict, got: dict, what: str) -> None:
    assert want.keys() == got.keys(), f"{what}: keys differ: {sorted(want.keys() ^ got.keys())}"
    for k, a in want.items():
        b = got[k]
        assert b.shape == a.shape, f"{what}: {k} has shape {tuple(b.shape)} (a placeholder?), expected {tuple(a.shape)}"
        assert b.dtype == a.dtype, f"{what}: {k} is {b.dtype}, expected {a.dtype}"
        assert torch.equal(a.cpu(), b.cpu()), f"{what}: {k} differs bitwise"


@pytest.mark.parametrize("granularity", ["block", "leaf"])
@pytest.mark.parametrize("checkpointing", CKPT)
def test_batchnorm_state_dict_after_4_steps_equals_resident(checkpointing: bool, granularity: str) -> None:
    # Running stats are written back from the device after each forward; state_dict waits for them.
    case = CASES["batchnorm"]
    ref = case.build("adapter", checkpointing=checkpointing)
    off = copy.deepcopy(ref)
    train(case, ref, make_optimizer(ref), steps=4)
    mgr = OffloadTrainingManager(off, "cpu", offload_granularity=granularity)
    train(case, off, make_optimizer(off), steps=4, after_backward=mgr.after_backward)
    got = off.state_dict()
    assert any(p.numel() == 0 for p in off.parameters()), "the model is not offloaded any more"
    assert_state_dicts_equal(ref.state_dict(), got, "offloaded state_dict")
    assert all(v.device.type == "cpu" for v in got.values())
    assert any("running_mean" in k for k in got)
    mgr.remove()


@pytest.mark.parametrize("name", ["batchnorm", "toy"])
def test_optimizer_offloaded_state_dict_mid_training_equals_resident(name: str) -> None:
    case = CASES[name]
    ref = case.build("full")
    off = copy.deepcopy(ref)
    opt_r = make_optimizer(ref)
    opt_o = make_optimizer(off)
    mgr = OffloadTrainingManager(off, "cpu", enable_optimizer_cpu_offload=True, fused_cpu_optimizer=False)
    for step in range(4):
        train(case, ref, opt_r, steps=1)
        train(case, off, opt_o, steps=1, after_backward=mgr.after_backward)
        assert_state_dicts_equal(ref.state_dict(), off.state_dict(), f"after step {step}")
    mgr.remove()


def test_torch_save_mid_training_round_trips(tmp_path) -> None:
    case = CASES["batchnorm"]
    ref = case.build("adapter", checkpointing=True)
    off = copy.deepcopy(ref)
    train(case, ref, make_optimizer(ref), steps=3)
    mgr = OffloadTrainingManager(off, "cpu", offload_granularity="block")
    train(case, off, make_optimizer(off), steps=3, after_backward=mgr.after_backward)
    path = tmp_path / "ckpt.pt"
    torch.save(off.state_dict(), path)
    assert_state_dicts_equal(ref.state_dict(), torch.load(path, weights_only=True), "torch.load of the checkpoint")
    fresh = case.build("adapter", checkpointing=True, seed=5)
    fresh.load_state_dict(torch.load(path, weights_only=True))
    assert_state_dicts_equal(ref.state_dict(), fresh.state_dict(), "a fresh model loaded from it")
    mgr.remove()


@pytest.mark.parametrize("optimizer_offload", [False, True], ids=["lora-resident", "lora-streamed"])
def test_peft_lora_state_dict_mid_training_equals_resident(optimizer_offload: bool) -> None:
    from peft import get_peft_model_state_dict

    case = CASES["flux"]
    ref = case.build("adapter", checkpointing=True)
    off = copy.deepcopy(ref)
    # optimizer offload steps streamed LoRA weights with the fused kernel: so does the reference
    train(case, ref, make_optimizer(ref, fused=optimizer_offload), steps=4)
    mgr = OffloadTrainingManager(off, "cpu", offload_granularity="block", enable_optimizer_cpu_offload=optimizer_offload)
    train(case, off, make_optimizer(off), steps=4, after_backward=mgr.after_backward)
    want = get_peft_model_state_dict(ref)
    got = get_peft_model_state_dict(off)
    assert want and any("lora_A" in k for k in want)
    assert_state_dicts_equal(want, got, "get_peft_model_state_dict")
    mgr.remove()


def test_diffusers_save_pretrained_mid_training(tmp_path) -> None:
    from diffusers import FluxTransformer2DModel

    case = CASES["flux"]
    ref = case.build("frozen")
    off = copy.deepcopy(ref)
    h = enable_offload(off, target_device="cpu", offload_granularity="block")
    infer(case, off, seeds=(0,))
    off.save_pretrained(tmp_path / "m")
    back = FluxTransformer2DModel.from_pretrained(tmp_path / "m")
    assert_state_dicts_equal(ref.state_dict(), back.state_dict(), "save_pretrained while offloaded, reloaded")
    h.remove()


def test_load_state_dict_while_offloaded_writes_the_masters() -> None:
    case = CASES["batchnorm"]
    ref = case.build("adapter", checkpointing=True)
    off = copy.deepcopy(ref)
    mgr = OffloadTrainingManager(off, "cpu", offload_granularity="block")
    train(case, off, make_optimizer(off), steps=2, after_backward=mgr.after_backward)  # device copies cached
    train(case, ref, make_optimizer(ref), steps=3)  # the checkpoint to resume from
    result = off.load_state_dict(ref.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    assert any(p.numel() == 0 for p in off.parameters()), "load_state_dict must not undo the offload"
    assert_state_dicts_equal(ref.state_dict(), off.state_dict(), "state_dict after load_state_dict")
    ref.eval()
    off.eval()
    assert_bitwise(infer(case, ref), infer(case, off), "output after load_state_dict")
    mgr.remove()
    assert_state_dicts_equal(ref.state_dict(), off.state_dict(), "after remove()")


def test_load_state_dict_reports_a_wrong_shape() -> None:
    case = CASES["toy"]
    model = case.build("frozen")
    h = enable_offload(model, target_device="cpu")
    sd = model.state_dict()
    sd["layers.3.linear.weight"] = torch.zeros(3, 3)
    with pytest.raises(RuntimeError, match=r"size mismatch for layers\.3\.linear\.weight"):
        model.load_state_dict(sd)
    del sd["layers.3.linear.weight"]
    with pytest.raises(RuntimeError, match=r"Missing key.*layers\.3\.linear\.weight"):
        model.load_state_dict(sd)
    h.remove()


def test_load_state_dict_with_fp8_storage_rounds_again() -> None:
    from offload_core.quant import fake_quantize

    case = CASES["toy"]
    src = case.build("frozen", seed=3)
    model = case.build("frozen")
    h = enable_offload(model, target_device="cpu", weight_dtype="float8_e4m3fn")
    infer(case, model, seeds=(0,))
    model.load_state_dict(src.state_dict())
    want = fake_quantize(copy.deepcopy(src), "float8_e4m3fn")
    assert_bitwise(infer(case, want), infer(case, model), "fp8 output after load_state_dict")
    with pytest.warns(UserWarning):
        h.remove()
