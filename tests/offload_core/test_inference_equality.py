"""Inference with the engine is bitwise the same as inference with the model resident."""

from __future__ import annotations

import copy

import pytest
import torch

from offload_core import OffloadConfig, enable_offload
from offload_core_test_models import CASES, assert_bitwise, assert_state_equal, infer, snapshot

MODELS = ["toy", "flux", "sd3", "wan", "qwen", "vae"]


def _compare(name: str, mode: str = "frozen", **overrides: object) -> None:
    case = CASES[name]
    a = case.build(mode)
    b = copy.deepcopy(a)
    before = snapshot(b)
    ref = infer(case, a)
    handle = enable_offload(b, target_device="cpu", **overrides)
    got = infer(case, b)
    assert_bitwise(ref, got, f"{name} output")
    handle.remove()
    assert_state_equal(before, b, "weights after remove()")


@pytest.mark.parametrize("granularity", ["block", "leaf", "phase", "auto"])
@pytest.mark.parametrize("name", MODELS)
def test_matches_resident(name: str, granularity: str) -> None:
    _compare(name, offload_granularity=granularity)


@pytest.mark.parametrize("prefetch", [0, 1, 4])
@pytest.mark.parametrize("name", ["flux", "wan"])
def test_prefetch_depths(name: str, prefetch: int) -> None:
    _compare(name, offload_granularity="block", prefetch=prefetch)


@pytest.mark.parametrize("granularity", ["block", "leaf"])
@pytest.mark.parametrize("name", ["flux", "sd3", "wan", "qwen", "vae"])
def test_split_threshold(name: str, granularity: str) -> None:
    # 0.01 MB is below every block of these tiny models, so non-leaf units get split.
    _compare(name, offload_granularity=granularity, split_threshold_mb=0.01)


@pytest.mark.parametrize("name", ["flux", "qwen"])
def test_with_lora_adapter(name: str) -> None:
    # Frozen base streamed, LoRA weights resident, under no_grad.
    _compare(name, mode="adapter", offload_granularity="leaf")


def test_config_object_and_serial_path() -> None:
    config = OffloadConfig(target_device="cpu", offload_granularity="block", use_streams=False)
    case = CASES["flux"]
    a = case.build("frozen")
    b = copy.deepcopy(a)
    ref = infer(case, a)
    handle = enable_offload(b, config)
    assert_bitwise(ref, infer(case, b), "flux output")
    handle.remove()


@pytest.mark.parametrize("granularity", ["block", "leaf"])
def test_inference_mode_matches_resident(granularity: str) -> None:
    # Many users run under torch.inference_mode() rather than no_grad.
    case = CASES["flux"]
    a = case.build("frozen")
    b = copy.deepcopy(a)
    with torch.inference_mode():
        ref = [case.forward(a, case.make_inputs(s)).clone() for s in (0, 1, 2)]
    handle = enable_offload(b, target_device="cpu", offload_granularity=granularity)
    with torch.inference_mode():
        got = [case.forward(b, case.make_inputs(s)).clone() for s in (0, 1, 2)]
    assert_bitwise(ref, got, "flux output under inference_mode")
    handle.remove()


def test_recovers_after_a_failing_forward() -> None:
    # An exception raised by the model mid-forward must not leave units bound or the schedule stuck.
    case = CASES["flux"]
    a = case.build("frozen")
    b = copy.deepcopy(a)
    ref = infer(case, a)
    handle = enable_offload(b, target_device="cpu", offload_granularity="block")
    infer(case, b, seeds=(0,))
    bad = case.make_inputs(0)
    bad["encoder_hidden_states"] = torch.randn(1, 12, 31)  # wrong width: fails inside context_embedder
    with pytest.raises(RuntimeError):
        case.forward(b, bad)
    assert_bitwise(ref, infer(case, b), "flux output after a failed forward")
    for name, p in b.named_parameters():
        assert p.data.numel() == 0, f"{name} left bound after the failed forward"
    handle.remove()
