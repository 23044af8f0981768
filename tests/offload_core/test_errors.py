"""Bad input gives a named exception with a clear message at setup, and leaves the model untouched."""

from __future__ import annotations

import copy

import pytest
import torch

from offload_core import OffloadTrainingManager, enable_offload
from offload_core.errors import (
    FrozenWeightError,
    DeviceUnavailableError,
    NotAModuleError,
    OffloadConfigError,
    OffloadError,
    OptimizerMismatchError,
)
from offload_core_test_models import CASES, assert_bitwise, assert_state_equal, hook_counts, infer, snapshot

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")


def _assert_untouched(model: torch.nn.Module, before: dict, hooks: dict) -> None:
    # A failed setup leaves no hooks and no placeholders behind, and the model still runs.
    assert hook_counts(model) == hooks, "a failed setup left hooks on the model"
    assert_state_equal(before, model, "weights after a failed setup")


@pytest.mark.parametrize("thing", ["not a module", None, 42, torch.zeros(3), [torch.nn.Linear(2, 2)]],
                         ids=["str", "None", "int", "tensor", "list"])
def test_not_a_module(thing: object) -> None:
    with pytest.raises(NotAModuleError) as info:
        enable_offload(thing, target_device="cpu")
    assert str(info.value).strip(), "empty message"
    assert isinstance(info.value, OffloadError)


def test_manager_not_a_module() -> None:
    with pytest.raises(NotAModuleError):
        OffloadTrainingManager("not a module", target_device="cpu")


def test_unknown_granularity_names_the_field() -> None:
    model = CASES["toy"].build("frozen")
    before, hooks = snapshot(model), hook_counts(model)
    with pytest.raises(OffloadConfigError, match="offload_granularity"):
        enable_offload(model, target_device="cpu", offload_granularity="diagonal")
    _assert_untouched(model, before, hooks)


def test_unknown_override_key_names_the_key() -> None:
    model = CASES["toy"].build("frozen")
    with pytest.raises(OffloadConfigError, match="offload_granularty"):
        enable_offload(model, target_device="cpu", offload_granularty="leaf")


@pytest.mark.parametrize("key,value", [("prefetch", -1), ("offload_ratio", 1.5), ("vram_budget", "lots"),
                                       ("stray_resident_fraction", 1.5), ("stray_resident_fraction", "lots")])
def test_bad_values_name_the_field(key: str, value: object) -> None:
    model = CASES["toy"].build("frozen")
    with pytest.raises(OffloadConfigError, match=key):
        enable_offload(model, target_device="cpu", **{key: value})


@NO_CUDA
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_missing_cuda_device(device: str) -> None:
    case = CASES["toy"]
    model = case.build("frozen")
    before, hooks = snapshot(model), hook_counts(model)
    with pytest.raises(DeviceUnavailableError) as info:
        enable_offload(model, target_device=device)
    assert "cuda" in str(info.value).lower()
    _assert_untouched(model, before, hooks)
    infer(case, model, seeds=(0,))


@NO_CUDA
def test_manager_missing_cuda_device() -> None:
    model = CASES["toy"].build("full")
    with pytest.raises(DeviceUnavailableError):
        OffloadTrainingManager(model, target_device="cuda")


def test_optimizer_missing_a_trainable_param_is_named() -> None:
    case = CASES["toy"]
    model = case.build("full")
    left_out = "layers.3.linear.weight"
    params = [p for n, p in model.named_parameters() if n != left_out]
    opt = torch.optim.AdamW(params, lr=1e-3)
    before, hooks = snapshot(model), hook_counts(model)
    with pytest.raises(OptimizerMismatchError) as info:
        OffloadTrainingManager(model, target_device="cpu", enable_optimizer_cpu_offload=True, optimizer=opt)
    assert left_out in str(info.value), f"message does not name the parameter: {info.value}"
    _assert_untouched(model, before, hooks)


def test_lora_optimizer_missing_adapter_param_is_named() -> None:
    case = CASES["flux"]
    model = case.build("adapter")
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    left_out = trainable[-1]
    opt = torch.optim.AdamW([p for n, p in model.named_parameters() if p.requires_grad and n != left_out], lr=1e-3)
    with pytest.raises(OptimizerMismatchError, match=left_out.replace(".", r"\.")):
        OffloadTrainingManager(model, target_device="cpu", enable_optimizer_cpu_offload=True, optimizer=opt)


def test_error_at_setup_leaves_a_working_model() -> None:
    # Same model, failed setup then a good one: results still bitwise equal to resident.
    case = CASES["flux"]
    ref_model = case.build("frozen")
    model = case.build("frozen")
    with pytest.raises(OffloadConfigError):
        enable_offload(model, target_device="cpu", offload_granularity="diagonal")
    handle = enable_offload(model, target_device="cpu", offload_granularity="leaf")
    assert_bitwise(infer(case, ref_model), infer(case, model), "output after a failed then a good setup")
    handle.remove()


@pytest.mark.parametrize("where", ["ring", "hooks", "masters"])
def test_a_failure_after_the_weights_moved_gives_the_model_back(monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """A setup that fails once the weights are packed (the ring's device memory, the hooks, the state_dict
    hooks): every tensor holds its value again, no hook is left, and a second setup streams bitwise."""
    from offload_core import engine as engine_mod

    case = CASES["flux"]
    ref_model = case.build("frozen")
    model = case.build("frozen")
    before, hooks = snapshot(model), hook_counts(model)
    target = {"ring": "SlotRing", "hooks": "Replanner", "masters": "Masters"}[where]
    real = getattr(engine_mod, target)  # "masters" comes after the forward hooks went on

    def broken(*a, **k):
        raise RuntimeError(f"CUDA out of memory ({where})")

    monkeypatch.setattr(engine_mod, target, broken)
    with pytest.raises(RuntimeError, match=f"out of memory \\({where}\\)"):
        enable_offload(model, target_device="cpu", offload_granularity="leaf")
    monkeypatch.setattr(engine_mod, target, real)
    assert_state_equal(before, model, "after a failed setup")
    assert hook_counts(model) == hooks
    handle = enable_offload(model, target_device="cpu", offload_granularity="leaf")
    assert_bitwise(infer(case, ref_model), infer(case, model), "output after a failed then a good setup")
    handle.remove()


def test_unfreezing_a_streamed_weight_after_offloading_raises_and_leaves_the_model_intact() -> None:
    # The engine streams weights frozen at setup as plain views, which get no gradient: a weight the
    # user unfreezes afterwards would silently not train. It raises, naming it, before any compute.
    import copy

    torch.manual_seed(0)
    ref = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(3)])
    ref[0].requires_grad_(False)  # frozen at setup; the rest train (resident)
    off = copy.deepcopy(ref)
    handle = enable_offload(off, target_device="cpu", offload_granularity="leaf")
    x = torch.randn(2, 16)
    off[0].weight.requires_grad_(True)
    with pytest.raises(FrozenWeightError, match=r"^0\.weight: .*remove\(\)"):
        off(x)
    assert off[0].weight.numel() == 0 and off[0].bias.numel() == 0  # placeholders again, nothing left bound
    off[0].weight.requires_grad_(False)
    assert_bitwise([ref(x)], [off(x)], "output after the error")
    handle.remove()
    assert_state_equal(snapshot(ref), off)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["no_ckpt", "ckpt"])
def test_training_a_model_taken_for_inference_raises_instead_of_leaving_its_weights_untrained(checkpointing: bool) -> None:
    # Every parameter requires grad (as from_pretrained leaves them), so enable_offload takes the model
    # for inference and streams its weights as frozen views. The embedders stay resident and still
    # require grad, so a loss has a graph and backward would run, silently training only them.
    case = CASES["flux"]
    ref = case.build("full", checkpointing=checkpointing)
    off = copy.deepcopy(ref)
    # the embedders resident, as at real size (the tiny model's are too big a share of it)
    handle = enable_offload(off, target_device="cpu", stray_resident_fraction=1.0)
    assert handle.engine.treat_as_inference
    out = case.forward(off, case.make_inputs(0))
    assert out.requires_grad  # the resident embedders: the silent case
    with pytest.raises(FrozenWeightError, match=r"^model: every parameter required grad .*OffloadTrainingManager"):
        case.loss(out, 0).backward()
    ref.eval()
    off.eval()
    with torch.no_grad():
        assert_bitwise(infer(case, ref), infer(case, off), "inference after the error")
    handle.remove()


def test_gradients_through_a_model_set_to_inference_on_purpose_still_flow() -> None:
    # treat_as_inference=True is a choice: gradients reach the resident tensors and the input
    case = CASES["flux"]
    ref = case.build("full")
    off = copy.deepcopy(ref)
    handle = enable_offload(off, target_device="cpu", treat_as_inference=True, stray_resident_fraction=1.0)
    inputs = case.make_inputs(0)
    case.loss(case.forward(off, inputs), 0).backward()
    grads = [p.grad for p in off.parameters() if p.grad is not None]
    assert grads and all(g.numel() for g in grads)
    handle.remove()


def test_weights_trained_through_optimizer_offload_outside_the_models_forward_raise() -> None:
    # encode()/decode() or a loop over the blocks never enters model.forward(), where each step's
    # bookkeeping (the optimizer's take-back, the saved-weight references) starts: the gradients came
    # out wrong and summed over the steps, silently. Through model() it is the tested path.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mgr = OffloadTrainingManager(model, "cpu", enable_optimizer_cpu_offload=True, offload_granularity="leaf")
    with pytest.raises(OffloadConfigError, match=r"^model: 0 was called outside model\.forward\(\)"):
        model[0](torch.randn(2, 8))
    model(torch.randn(2, 8)).pow(2).mean().backward()  # the model itself: fine
    mgr.after_backward()
    opt.step()
    mgr.remove()
