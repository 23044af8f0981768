"""What users do to an offloaded model besides calling it: inference mode first, their own hooks,
legacy weight_norm, writing through state_dict(), re-tying a weight, deep-copying a block, editing
weights between calls (``p.data = w``, in place), a buffer the forward assigns anew.

Each either gives the resident model's results bit for bit or raises a named error; none may give a
silently different result (a review of the engine found each of these doing so, or failing obscurely).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from torch import nn

from offload_core import OffloadedCopyError, OffloadedEditError, OffloadTrainingManager, enable_offload
from offload_core_test_models import CASES, assert_bitwise, assert_traces_equal, make_optimizer, reference, train


class Stack(nn.Module):
    def __init__(self, n: int = 3, d: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = torch.tanh(b(x))
        return x


def _pair(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    a = Stack().requires_grad_(False)
    return a, copy.deepcopy(a)


# ---------------------------------------------------------------- inference mode, then training
def test_training_after_a_first_call_in_inference_mode_is_bitwise() -> None:
    # A validation sample under torch.inference_mode() before LoRA training: the slot views the
    # engine keeps were made in that first call, and used to be inference tensors for good.
    case = CASES["flux"]
    a = case.build("adapter", checkpointing=True)
    b = copy.deepcopy(a)
    with torch.inference_mode():
        case.forward(a, case.make_inputs(0))
    ref, _ = reference(case, a, mode="adapter", checkpointing=True, steps=3)
    h = enable_offload(b, target_device="cpu")
    with torch.inference_mode():
        case.forward(b, case.make_inputs(0))
    got = train(case, b, make_optimizer(b), steps=3)
    assert_traces_equal(ref, got)
    assert not any(t.is_inference() for s in h.engine.ring.slots for t in s._typed.values())
    h.remove()


class Counting(nn.Module):
    """A buffer updated in place at every call (a step counter, running statistics)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.lin(x) * self.calls


def test_a_buffer_updated_in_eval_under_inference_mode_is_kept() -> None:
    torch.manual_seed(0)
    a = nn.Sequential(Counting(), Counting()).eval().requires_grad_(False)
    b = copy.deepcopy(a)
    h = enable_offload(b, target_device="cpu", offload_granularity="leaf")
    x = torch.randn(2, 8)
    with torch.inference_mode():
        for _ in range(3):
            assert_bitwise([a(x)], [b(x)], "output")
    assert b.state_dict()["0.calls"].item() == 3.0
    h.remove()
    assert b[0].calls.item() == a[0].calls.item() == 3.0


# ---------------------------------------------------------------- hooks
def test_user_hooks_see_the_weights_whenever_they_were_registered() -> None:
    a, b = _pair()
    pre = lambda mod, args: (args[0] + mod.weight.sum(),)  # noqa: E731
    post = lambda mod, args, out: out * mod.weight.abs().mean()  # noqa: E731
    for m in (a, b):
        m.blocks[1].register_forward_pre_hook(pre)  # before enable_offload
    h = enable_offload(b, target_device="cpu", offload_granularity="block")
    for m in (a, b):
        m.blocks[2].register_forward_hook(post)  # after it
    x = torch.randn(2, 8)
    assert_bitwise([a(x), a(x)], [b(x), b(x)], "output with user hooks")
    h.remove()


def test_a_forward_hook_on_a_root_module_that_owns_weights_sees_them() -> None:
    # the root module is itself a unit's anchor (a bare Linear, leaf granularity): its unbinding and
    # the engine's cycle end are kept after a forward hook the user adds later
    torch.manual_seed(0)
    a = nn.Linear(8, 8).requires_grad_(False)
    b = copy.deepcopy(a)
    h = enable_offload(b, target_device="cpu")
    post = lambda mod, args, out: out * mod.weight.abs().mean()  # noqa: E731
    for m in (a, b):
        m.register_forward_hook(post)
    x = torch.randn(2, 8)
    assert_bitwise([a(x), a(x)], [b(x), b(x)], "output with a root forward hook")
    h.remove()


def test_legacy_weight_norm_computes_from_its_streamed_parameters() -> None:
    # torch.nn.utils.weight_norm's pre-hook builds the weight from weight_g and weight_v: it ran before
    # the engine's and saw empty placeholders (the process died of SIGFPE in the convolution)
    def build() -> nn.Module:  # twice from one seed: a weight_norm module cannot be deep-copied
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # weight_norm is deprecated
            return nn.Sequential(nn.utils.weight_norm(nn.Conv1d(8, 8, 3, padding=1)), nn.GELU(),
                                 nn.utils.weight_norm(nn.Conv1d(8, 8, 3, padding=1))).requires_grad_(False)

    a, b = build(), build()
    h = enable_offload(b, target_device="cpu", offload_granularity="leaf")
    x = torch.randn(2, 8, 16)
    with torch.no_grad():
        assert_bitwise([a(x), a(x)], [b(x), b(x)], "weight_norm output")
    h.remove()


# ---------------------------------------------------------------- writing through state_dict()
def test_a_write_into_a_state_dict_tensor_reaches_the_next_call() -> None:
    a, b = _pair()
    h = enable_offload(b, target_device="cpu", offload_granularity="block")
    x = torch.randn(2, 8)
    for _ in range(2):
        assert_bitwise([a(x)], [b(x)], "before the write")  # the ring now holds blocks' copies
    for m in (a, b):
        m.state_dict()["blocks.1.weight"].mul_(0.5)  # in place
    assert_bitwise([a(x), a(x)], [b(x), b(x)], "after writing through state_dict()")
    h.remove()
    assert torch.equal(a.blocks[1].weight, b.blocks[1].weight)


# ---------------------------------------------------------------- replacing, copying
def test_a_weight_re_tied_after_offloading_is_refused_and_remove_leaves_it_alone() -> None:
    a, b = _pair()
    h = enable_offload(b, target_device="cpu", offload_granularity="block")
    new = nn.Parameter(torch.full((8, 8), 0.25), requires_grad=False)
    b.blocks[2].weight = new  # what a re-tie after loading does (head.weight = embed.weight)
    with pytest.raises(OffloadedCopyError, match=r"^blocks\.2\.weight: this parameter was replaced after enable_offload"):
        b(torch.randn(2, 8))
    h.remove()
    assert b.blocks[2].weight is new and torch.equal(new, torch.full((8, 8), 0.25)), "remove() wrote into the replacement"
    assert torch.equal(b.blocks[1].weight, a.blocks[1].weight) and torch.equal(b.blocks[0].bias, a.blocks[0].bias)


def test_a_deep_copied_block_cannot_read_or_write_the_original() -> None:
    a, b = _pair()
    h = enable_offload(b, target_device="cpu", offload_granularity="block")
    ema = copy.deepcopy(b.blocks[0])  # carries the engine's hooks along
    with pytest.raises(OffloadedCopyError, match="copy"):
        ema.load_state_dict({"weight": torch.zeros(8, 8), "bias": torch.zeros(8)})
    with pytest.raises(OffloadedCopyError, match="copy"):
        ema(torch.randn(2, 8))
    x = torch.randn(2, 8)
    assert_bitwise([a(x)], [b(x)], "the original after its copy was used")
    h.remove()


# ---------------------------------------------------------------- editing weights between calls
@pytest.mark.parametrize("granularity", ["leaf", "block"])
def test_new_data_given_between_calls_is_what_the_next_call_uses(granularity: str) -> None:
    # `p.data = w` between calls: the resident model computes with w, and so must the offloaded one
    # (the engine used to override it with its host copy, and remove() brought the old values back)
    a, b = _pair()
    h = enable_offload(b, target_device="cpu", offload_granularity=granularity)
    x = torch.randn(2, 8)
    b(x)
    for m in (a, b):
        m.blocks[1].weight.data = torch.full((8, 8), 0.25)
        m.blocks[2].bias.data = a.blocks[0].bias.detach().clone() * 2
    assert torch.equal(b.state_dict()["blocks.1.weight"], a.blocks[1].weight)  # state_dict() before any call sees it
    assert torch.equal(a(x), b(x))
    assert torch.equal(a(x), b(x))
    h.remove()
    assert torch.equal(b.blocks[1].weight, a.blocks[1].weight) and torch.equal(b.blocks[2].bias, a.blocks[2].bias)


def test_an_in_place_edit_between_calls_raises_instead_of_being_lost() -> None:
    # model.apply(init) / mul_ after enable_offload acted on the empty placeholder: no effect, no error
    a, b = _pair()
    h = enable_offload(b, target_device="cpu")
    x = torch.randn(2, 8)
    with torch.no_grad():
        b.blocks[1].weight.mul_(0.5)
    with pytest.raises(OffloadedEditError, match=r"blocks\.1\.weight: edited in place"):
        b(x)
    with pytest.raises(OffloadedEditError, match=r"blocks\.1\.weight"):
        b.state_dict()
    # loading new values is the way out, and the model then computes with them
    with torch.no_grad():
        a.blocks[1].weight.mul_(0.5)
    b.load_state_dict(a.state_dict())
    assert torch.equal(a(x), b(x))
    with torch.no_grad():
        nn.init.zeros_(b.blocks[0].weight)
    with pytest.warns(UserWarning, match=r"blocks\.0\.weight: edited in place"):
        h.remove()  # remove() still gives the model back, and says what was lost
    assert torch.equal(b.blocks[0].weight, a.blocks[0].weight)


def test_new_data_of_another_shape_is_refused() -> None:
    a, b = _pair()
    enable_offload(b, target_device="cpu")
    b.blocks[0].weight.data = torch.zeros(4, 8)
    with pytest.raises(OffloadedEditError, match=r"blocks\.0\.weight: its \.data was set to a float32 tensor of shape \(4, 8\)"):
        b(torch.randn(2, 8))


class Caching(nn.Module):
    """A module whose forward assigns its buffer anew (`self.state = new`): a running cache."""

    def __init__(self, grow: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.grow = grow
        self.register_buffer("state", torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x) + self.state
        self.state = torch.cat([self.state, self.state]) if self.grow else y.detach().mean(0)
        return y


@pytest.mark.parametrize("granularity", ["leaf", "block"])
def test_a_buffer_the_forward_assigns_anew_is_kept(granularity: str) -> None:
    torch.manual_seed(0)
    a = nn.Sequential(Caching(), Caching(), Caching()).requires_grad_(False)
    b = copy.deepcopy(a)
    h = enable_offload(b, target_device="cpu", offload_granularity=granularity)
    x = torch.randn(4, 8)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(a(x), b(x))  # the second call used to read the stale state
    assert torch.equal(b.state_dict()["1.state"], a[1].state)
    h.remove()
    assert all(torch.equal(p.state, q.state) for p, q in zip(a, b))


def test_a_buffer_the_forward_gives_another_shape_is_refused() -> None:
    b = nn.Sequential(Caching(grow=True), Caching()).requires_grad_(False)
    enable_offload(b, target_device="cpu")
    with pytest.raises(OffloadedEditError, match=r"0\.state: the module's forward set this buffer to a float32 tensor of shape \(16,\)"):
        b(torch.randn(4, 8))


def _optimizer_offload_pair(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    ref = nn.Sequential(*[nn.Linear(16, 16) for _ in range(3)])
    return ref, copy.deepcopy(ref)


def _steps(model: nn.Module, mgr: OffloadTrainingManager, opt: torch.optim.Optimizer, x: torch.Tensor, n: int) -> None:
    """n training steps of an offloaded model in the documented order."""
    for _ in range(n):
        model(x).float().pow(2).mean().backward()
        mgr.after_backward()
        opt.step()
        opt.zero_grad()


def _step_both(ref: nn.Module, off: nn.Module, opts: tuple, mgr: OffloadTrainingManager, x: torch.Tensor, *,
               before_step: Any = None, after_step: Any = None) -> None:
    """One step of resident ``ref``, then of offloaded ``off`` (after_backward() before its step);
    ``before_step(model)`` / ``after_step(model)``: what the user does to each model there."""
    for model, opt in zip((ref, off), opts):
        model(x).float().pow(2).mean().backward()
        if model is off:
            mgr.after_backward()
        if before_step is not None:
            before_step(model)
        opt.step()
        opt.zero_grad()
        if after_step is not None:
            after_step(model)


def _clamp(bound: float) -> Any:
    def clamp(model: nn.Module) -> None:
        for p in model.parameters():
            p.data = p.data.clamp(-bound, bound)
    return clamp


def test_optimizer_offload_keeps_new_data_given_after_the_step() -> None:
    # WGAN-style clipping written as `p.data = p.data.clamp(...)`, SAM's restore: resident keeps it
    ref, off = _optimizer_offload_pair()
    opt_r = torch.optim.RMSprop(ref.parameters(), lr=5e-3)
    opt_o = torch.optim.RMSprop(off.parameters(), lr=5e-3)
    mgr = OffloadTrainingManager(off, "cpu", enable_optimizer_cpu_offload=True, fused_cpu_optimizer=False)
    for step in range(3):
        x = torch.randn(4, 16)
        _step_both(ref, off, (opt_r, opt_o), mgr, x, after_step=_clamp(0.05))
        with torch.no_grad():
            assert torch.equal(ref(x), off(x)), step
    sd = off.state_dict()
    assert all(torch.equal(sd[k], v) for k, v in ref.state_dict().items())
    mgr.remove()
    assert all(torch.equal(p, q) for p, q in zip(ref.parameters(), off.parameters()))


def test_a_trained_weight_read_outside_its_forward_reads_nan_not_zero() -> None:
    # Optimizer offload streams trained weights too: outside its module's forward a parameter holds a
    # placeholder. A weight penalty (or a head reusing an embedding's weight) read there used to see
    # zeros and train on silently without it; NaN makes the mistake show.
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(3)])
    mgr = OffloadTrainingManager(model, "cpu", enable_optimizer_cpu_offload=True)
    model(torch.randn(2, 8))
    penalty = sum(p.pow(2).sum() for p in model.parameters())
    assert torch.isnan(penalty)
    mgr.remove()
    assert torch.isfinite(sum(p.pow(2).sum() for p in model.parameters()))


def test_new_data_computed_from_the_placeholder_or_a_cast_raises() -> None:
    # `p.data = p.data * 2` and `model.half()` read the empty placeholder: the result was ignored, silently
    a, b = _pair()
    enable_offload(b, target_device="cpu")
    b.blocks[0].weight.data = b.blocks[0].weight.data * 2
    with pytest.raises(OffloadedEditError, match=r"blocks\.0\.weight: its \.data was set to a tensor computed from"):
        b(torch.randn(2, 8))
    c = copy.deepcopy(a)
    enable_offload(c, target_device="cpu")
    c.half()
    with pytest.raises(OffloadedEditError, match="computed from its empty placeholder"):
        c(torch.randn(2, 8).half())


def test_a_model_built_under_inference_mode_can_be_offloaded() -> None:
    # its tensors keep no version counter; reading one at setup crashed
    with torch.inference_mode():
        torch.manual_seed(0)
        a = Stack()
    b = copy.deepcopy(a)
    h = enable_offload(b, target_device="cpu")
    x = torch.randn(2, 8)
    with torch.inference_mode():
        assert torch.equal(a(x), b(x))
    h.remove()


def test_state_dict_of_a_replaced_tensor_is_the_replacement() -> None:
    # the next call refuses the replacement (OffloadedCopyError); until then state_dict and
    # load_state_dict see the object the module holds, as torch does, not the old master
    a, b = _pair()
    enable_offload(b, target_device="cpu")
    w = torch.full((8, 8), 0.5)
    b.blocks[1].weight = nn.Parameter(w.clone(), requires_grad=False)
    assert torch.equal(b.state_dict()["blocks.1.weight"], w)
    sd = a.state_dict()
    b.load_state_dict(sd)
    assert torch.equal(b.blocks[1].weight, a.blocks[1].weight)


def test_optimizer_offload_new_data_before_the_first_call_and_after_an_eval_call() -> None:
    ref, off = _optimizer_offload_pair()
    mgr = OffloadTrainingManager(off, "cpu", enable_optimizer_cpu_offload=True)
    x = torch.randn(4, 16)
    for m in (ref, off):
        m[0].weight.data = torch.full((16, 16), 0.01)  # before any forward: the parameter holds its placeholder
    with torch.no_grad():
        assert torch.equal(ref(x), off(x))
    for m in (ref, off):
        m[1].weight.data = torch.full((16, 16), -0.02)  # after an eval forward
    with torch.no_grad():
        assert torch.equal(ref(x), off(x))
    assert torch.equal(off.state_dict()["1.weight"], ref[1].weight)
    mgr.remove()
    assert all(torch.equal(p, q) for p, q in zip(ref.parameters(), off.parameters()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_optimizer_offload_new_data_between_after_backward_and_step_is_stepped_on(dtype: torch.dtype) -> None:
    # SAM's restore writes p.data = old before step(): the step runs on the new values (it used to run
    # on the master, and the new values then overwrote the stepped ones)
    ref, off = _optimizer_offload_pair()
    ref, off = ref.to(dtype), off.to(dtype)
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt_o = torch.optim.SGD(off.parameters(), lr=0.1)
    mgr = OffloadTrainingManager(off, "cpu", enable_optimizer_cpu_offload=True, overlap_optimizer_step=False)
    for step in range(3):
        x = torch.randn(4, 16).to(dtype)
        _step_both(ref, off, (opt_r, opt_o), mgr, x, before_step=_clamp(0.2))
        if dtype == torch.float32:
            with torch.no_grad():
                assert torch.equal(ref(x), off(x)), step
    if dtype == torch.float32:
        mgr.remove()
        assert all(torch.equal(p, q) for p, q in zip(ref.parameters(), off.parameters()))
    else:  # fp32 masters (see README): within bf16 rounding of resident
        mgr.remove()
        assert all((p.float() - q.float()).abs().max() < 2e-2 for p, q in zip(ref.parameters(), off.parameters()))


def test_optimizer_offload_new_data_after_a_step_that_ran_during_backward_raises() -> None:
    from offload_core import OptimizerOverlapError
    ref, off = _optimizer_offload_pair()
    opt = torch.optim.AdamW(off.parameters(), lr=1e-3)
    mgr = OffloadTrainingManager(off, "cpu", enable_optimizer_cpu_offload=True)
    with pytest.raises(OptimizerOverlapError, match=r"\.data was replaced between after_backward\(\) and optimizer\.step\(\)"):
        for _ in range(5):
            off(torch.randn(4, 16)).pow(2).mean().backward()
            mgr.after_backward()
            if mgr.stats()["optimizer_steps_overlapped"]:
                off[0].weight.data = off[0].weight.data.clamp(-0.1, 0.1)
            opt.step()
            opt.zero_grad()


def test_optimizer_offload_load_state_dict_wins_over_new_data() -> None:
    ref, off = _optimizer_offload_pair()
    ckpt = copy.deepcopy(ref.state_dict())
    opt = torch.optim.SGD(off.parameters(), lr=0.1)
    mgr = OffloadTrainingManager(off, "cpu", enable_optimizer_cpu_offload=True)
    _steps(off, mgr, opt, torch.randn(4, 16), 1)
    for p in off.parameters():
        p.data = p.data.clamp(-0.01, 0.01)
    off.load_state_dict(ckpt)
    x = torch.randn(4, 16)
    with torch.no_grad():
        assert torch.equal(ref(x), off(x))
    mgr.remove()


def test_optimizer_offload_an_in_place_edit_between_calls_raises_and_spares_the_others() -> None:
    ref, off = _optimizer_offload_pair()
    mgr = OffloadTrainingManager(off, "cpu", enable_optimizer_cpu_offload=True)
    off(torch.randn(4, 16))
    with torch.no_grad():
        nn.init.zeros_(off[1].weight)  # acted on the placeholder; it no longer reads NaN, the others still do
    assert torch.isnan(off[0].weight).all() and torch.isnan(off[2].weight).all()
    with pytest.raises(OffloadedEditError, match=r"1\.weight: edited in place"):
        off(torch.randn(4, 16))
    mgr.remove()


# ---------------------------------------------------------------- bf16 masters: what state_dict(), resume and remove() see
@pytest.mark.parametrize("fused", [True, False])
def test_bf16_state_dict_after_each_step_is_that_steps_weights(fused: bool) -> None:
    # torch.save(model.state_dict()) every step: the fp32 masters go into the store once per state_dict();
    # a flush skipped on unchanged version counters returned the previous step's weights (fused AdamW bumps none)
    _, off = _optimizer_offload_pair()
    off = off.to(torch.bfloat16)
    mgr = OffloadTrainingManager(off, "cpu", enable_optimizer_cpu_offload=True, fused_cpu_optimizer=fused)
    opt = torch.optim.AdamW(off.parameters(), lr=1e-2)
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    for _ in range(3):
        _steps(off, mgr, opt, x, 1)
        sd = off.state_dict()
        masters = [p.data.to(torch.bfloat16) for p in off.parameters()]  # on the host after the step: the fp32 masters
        assert all(torch.equal(v, m) for v, m in zip(sd.values(), masters))
        with torch.no_grad():
            off[0].weight.data.clamp_(-0.01, 0.01)  # an in-place write through .data, after a state_dict()
        assert off.state_dict()["0.weight"].abs().max() <= 0.01
    mgr.remove()


def test_bf16_resume_with_optimizer_load_state_dict_before_the_first_call() -> None:
    # optimizer.load_state_dict casts the state to the parameter's dtype: bf16 (its placeholder) before the
    # first forward; the fp32 masters' step then failed on the mixed dtypes
    _, off = _optimizer_offload_pair()
    off = off.to(torch.bfloat16)
    opt = torch.optim.AdamW(off.parameters(), lr=1e-2)
    mgr = OffloadTrainingManager(off, "cpu", enable_optimizer_cpu_offload=True)
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    _steps(off, mgr, opt, x, 1)
    ckpt = (copy.deepcopy(off.state_dict()), copy.deepcopy(opt.state_dict()))
    mgr.remove()
    _, fresh = _optimizer_offload_pair(1)
    fresh = fresh.to(torch.bfloat16)
    opt2 = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    mgr2 = OffloadTrainingManager(fresh, "cpu", enable_optimizer_cpu_offload=True)
    fresh.load_state_dict(ckpt[0])
    opt2.load_state_dict(ckpt[1])
    _steps(fresh, mgr2, opt2, x, 2)
    assert all(torch.isfinite(v).all() for v in fresh.state_dict().values())
    mgr2.remove()


def test_remove_between_after_backward_and_step_does_not_step_twice() -> None:
    # with the overlap on, the step already ran during backward: the gradient handed back would make the
    # now-resident optimizer.step() apply it a second time
    ref, off = _optimizer_offload_pair()
    opt_r = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt_o = torch.optim.AdamW(off.parameters(), lr=1e-2)
    mgr = OffloadTrainingManager(off, "cpu", enable_optimizer_cpu_offload=True, fused_cpu_optimizer=False)
    def remove_before_the_last_step(model: nn.Module) -> None:
        if model is off and step == 4:
            assert mgr.stats()["optimizer_steps_overlapped"]
            with pytest.warns(UserWarning, match="not handed back"):
                mgr.remove()

    for step in range(5):
        _step_both(ref, off, (opt_r, opt_o), mgr, torch.randn(4, 16), before_step=remove_before_the_last_step)
    assert all(torch.equal(p, q) for p, q in zip(ref.parameters(), off.parameters()))


def test_bf16_training_goes_on_resident_after_remove() -> None:
    _, off = _optimizer_offload_pair()
    off = off.to(torch.bfloat16)
    opt = torch.optim.AdamW(off.parameters(), lr=1e-2)
    mgr = OffloadTrainingManager(off, "cpu", enable_optimizer_cpu_offload=True)
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    _steps(off, mgr, opt, x, 2)
    mgr.remove()
    off(x).float().pow(2).mean().backward()
    opt.step()  # the optimizer state was fp32 (the masters'), which bf16 parameters refuse
    assert all(torch.isfinite(p).all() for p in off.parameters())
