"""Layer-major gradient accumulation (accumulation_order="layer", offload_core/lockstep.py).

The K micro-batches run through each streamed unit before the next, forward and backward, and the
gradients equal the plain loop's (K ``loss.backward()`` calls on a resident model) bitwise, while the
weights cross once per optimizer step instead of K times.
"""

from __future__ import annotations

import copy
import gc
import threading
import weakref

import pytest
import torch

from offload_core import OffloadTrainingManager, enable_offload
from offload_core.errors import OffloadConfigError
from offload_core_test_models import CASES, Case, assert_bitwise, make_optimizer, trainable_grads


def _batches(step: int, k: int) -> list[int]:
    return [1000 + 100 * step + micro for micro in range(k)]


def _loss_fn(case: Case, model: torch.nn.Module, k: int):
    def loss_fn(seed: int) -> torch.Tensor:
        out = case.forward(model, case.make_inputs(seed))
        return case.loss(out, seed) / k
    return loss_fn


def _plain_loop(case: Case, model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, k: int) -> list[dict]:
    grads = []
    for step in range(steps):
        fn = _loss_fn(case, model, k)
        for seed in _batches(step, k):
            fn(seed).backward()
        grads.append(trainable_grads(model))
        opt.step()
        opt.zero_grad()
    return grads


def _accumulated(case: Case, model: torch.nn.Module, opt: torch.optim.Optimizer, accumulate, steps: int,
                 k: int) -> tuple[list[dict], list[list[torch.Tensor]]]:
    grads, losses = [], []
    for step in range(steps):
        losses.append(accumulate(_batches(step, k), _loss_fn(case, model, k)))
        grads.append(trainable_grads(model))
        opt.step()
        opt.zero_grad()
    return grads, losses


def _assert_grads_equal(ref: list[dict], got: list[dict]) -> None:
    assert len(ref) == len(got)
    for step, (a, b) in enumerate(zip(ref, got)):
        assert a.keys() == b.keys()
        assert any(g is not None for g in a.values()), "nothing trained"
        for name, ga in a.items():
            gb = b[name]
            assert (ga is None) == (gb is None), f"step {step}: grad of {name}"
            if ga is not None:
                assert_bitwise([ga], [gb], f"step {step}: grad of {name}")


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["no_ckpt", "ckpt"])
@pytest.mark.parametrize("name", ["flux", "toy"])
def test_layer_major_gradients_equal_the_plain_loop(name: str, checkpointing: bool, k: int) -> None:
    # flux: peft LoRA on a diffusers transformer; toy: every other layer trainable (full weights).
    case = CASES[name]
    a = case.build("adapter", checkpointing=checkpointing)
    b = copy.deepcopy(a)
    ref = _plain_loop(case, a, make_optimizer(a), steps=2, k=k)

    opt = make_optimizer(b)
    own = {n: p for n, p in b.named_parameters()}
    handle = enable_offload(b, target_device="cpu", offload_granularity="block", accumulation_order="layer")
    got, losses = _accumulated(case, b, opt, handle.accumulate, steps=2, k=k)
    _assert_grads_equal(ref, got)
    assert all(len(step) == k and all(not l.requires_grad for l in step) for step in losses)
    s = handle.stats()
    assert s["accumulate_calls"] == 2
    if k > 1:
        assert s["accumulation_groups"] == 2 and s["lockstep_switches"] > 0
    assert all(p is own[n] for n, p in b.named_parameters()), "a worker's alias was left in the model"
    handle.remove()


def test_manager_accumulates_layer_major_at_leaf_granularity() -> None:
    # Leaf units: a switch at every leaf, several units a block; the DiffSynth-style entry point.
    case = CASES["flux"]
    a = case.build("adapter", checkpointing=True)
    b = copy.deepcopy(a)
    ref = _plain_loop(case, a, make_optimizer(a), steps=2, k=3)
    opt = make_optimizer(b)
    mgr = OffloadTrainingManager(b, target_device="cpu", offload_granularity="leaf", accumulation_order="layer")
    got, _ = _accumulated(case, b, opt, mgr.accumulate, steps=2, k=3)
    _assert_grads_equal(ref, got)
    mgr.remove()


def test_existing_gradients_are_added_to_in_order() -> None:
    # .grad left from an earlier backward: the K micro-batches add to it one by one, as backward() does.
    case = CASES["toy"]
    a = case.build("adapter", checkpointing=True)
    b = copy.deepcopy(a)
    for m in (a, b):
        _loss_fn(case, m, 1)(7).backward()
    fn = _loss_fn(case, a, 4)
    for seed in _batches(0, 4):
        fn(seed).backward()
    handle = enable_offload(b, target_device="cpu", accumulation_order="layer")
    handle.accumulate(_batches(0, 4), _loss_fn(case, b, 4))
    _assert_grads_equal([trainable_grads(a)], [trainable_grads(b)])
    handle.remove()


def _h2d_per_step(k: int, order: str, checkpointing: bool) -> tuple[float, int]:
    case = CASES["flux"]
    model = case.build("adapter", checkpointing=checkpointing)
    opt = make_optimizer(model)
    handle = enable_offload(model, target_device="cpu", offload_granularity="block", prefetch=1,
                            accumulation_order=order)
    _accumulated(case, model, opt, handle.accumulate, steps=1, k=k)  # traces the order of uses
    handle.reset_stats()
    _accumulated(case, model, opt, handle.accumulate, steps=2, k=k)
    s = handle.stats()
    handle.remove()
    return s["h2d_bytes_per_optimizer_step"], s["streamed_bytes"]


@pytest.mark.parametrize("checkpointing", [False, True], ids=["no_ckpt", "ckpt"])
def test_weights_cross_once_per_step_not_once_per_micro_batch(checkpointing: bool) -> None:
    one, streamed = _h2d_per_step(1, "layer", checkpointing)
    layer4, _ = _h2d_per_step(4, "layer", checkpointing)
    micro4, _ = _h2d_per_step(4, "micro", checkpointing)
    assert one >= streamed > 0
    assert layer4 <= 1.1 * one, f"K=4 layer-major copied {layer4 / one:.2f}x what K=1 does per step"
    assert micro4 >= 3.5 * one, f"K=4 micro-batch order copied only {micro4 / one:.2f}x K=1's"


def test_a_bad_order_is_named() -> None:
    model = CASES["toy"].build("adapter")
    with pytest.raises(OffloadConfigError, match=r"accumulation_order: unknown value 'lyer' \(choose micro or layer\)"):
        enable_offload(model, target_device="cpu", accumulation_order="lyer")
    with pytest.raises(OffloadConfigError, match="accumulation_order: layer needs the trainable parameters resident"):
        enable_offload(model, target_device="cpu", accumulation_order="layer", enable_optimizer_cpu_offload=True)
    handle = enable_offload(model, target_device="cpu")
    with pytest.raises(OffloadConfigError, match="accumulation_order: unknown value 'lyer'"):
        handle.accumulate([1, 2], lambda s: torch.zeros(()), order="lyer")
    handle.remove()


class _Boom(RuntimeError):
    pass


@pytest.mark.parametrize("where", ["head", "block", "tail"])
def test_a_failing_micro_batch_raises_and_the_next_step_is_right(where: str) -> None:
    # The failure (before the model, in a block, in the loss) comes out in the caller's thread; the
    # parked workers unwind; no gradient was accumulated; the engine is whole after.
    case = CASES["flux"]
    a = case.build("adapter", checkpointing=True)
    b = copy.deepcopy(a)
    opt = make_optimizer(b)
    handle = enable_offload(b, target_device="cpu", accumulation_order="layer")

    def bad(seed: int) -> torch.Tensor:
        if seed != 1001:
            return _loss_fn(case, b, 3)(seed)
        if where == "head":
            raise _Boom("micro-batch 1")
        if where == "tail":
            case.forward(b, case.make_inputs(seed))
            raise _Boom("micro-batch 1")
        hook = b.transformer_blocks[1].register_forward_pre_hook(lambda *_: (_ for _ in ()).throw(_Boom("micro-batch 1")))
        try:
            return _loss_fn(case, b, 3)(seed)
        finally:
            hook.remove()

    own = {n: p for n, p in b.named_parameters()}
    with pytest.raises(_Boom, match="micro-batch 1"):
        handle.accumulate(_batches(0, 3), bad)
    assert not [t for t in threading.enumerate() if t.name.startswith("offload-lockstep")]
    assert all(p.grad is None for p in b.parameters())
    assert all(p is own[n] for n, p in b.named_parameters()), "a worker's alias was left in the model"
    ref = _plain_loop(case, a, make_optimizer(a), steps=2, k=3)
    got, _ = _accumulated(case, b, opt, handle.accumulate, steps=2, k=3)
    _assert_grads_equal(ref, got)
    handle.remove()


def test_engine_dropped_without_remove_after_layer_major_steps() -> None:
    case = CASES["flux"]
    model = case.build("adapter", checkpointing=True)
    opt = make_optimizer(model)
    handle = enable_offload(model, target_device="cpu", accumulation_order="layer")
    _accumulated(case, model, opt, handle.accumulate, steps=2, k=2)
    engine = weakref.ref(handle.engine)
    del handle, model, opt
    gc.collect()
    assert engine() is None, "the engine outlived its model and handle"
    assert not [t for t in threading.enumerate() if t.name.startswith("offload-lockstep")]


def test_noise_drawn_before_the_model_keeps_the_plain_loops_draws() -> None:
    # A trainer draws each micro-batch's noise in loss_fn, before the model: layer-major order draws
    # them in the same order (micro-batch 1's, then 2's, ...), so the gradients stay the plain loop's.
    case = CASES["flux"]
    a = case.build("adapter", checkpointing=True)
    b = copy.deepcopy(a)

    def noisy(model: torch.nn.Module):
        def loss_fn(seed: int) -> torch.Tensor:
            inputs = case.make_inputs(seed)
            torch.manual_seed(0) if seed == 1000 else None  # one seed a step: later draws come from the stream
            inputs["hidden_states"] = inputs["hidden_states"] + torch.randn_like(inputs["hidden_states"])
            return case.loss(case.forward(model, inputs), seed) / 3
        return loss_fn

    fn = noisy(a)
    for seed in _batches(0, 3):
        fn(seed).backward()
    handle = enable_offload(b, target_device="cpu", accumulation_order="layer")
    handle.accumulate(_batches(0, 3), noisy(b))
    _assert_grads_equal([trainable_grads(a)], [trainable_grads(b)])
    handle.remove()


def test_dropout_inside_the_model_is_refused_before_any_gradient() -> None:
    # Checkpointed blocks replay their draws from where the generator stood at the block's entry; in
    # lockstep every micro-batch stood there at once, so the replay would not match: named, not silent.
    from offload_core import LayerOrderError

    case = CASES["toy"]
    model = case.build("adapter", checkpointing=True)
    model.layers[4].register_forward_hook(lambda m, args, out: torch.nn.functional.dropout(out, 0.1, training=True))
    handle = enable_offload(model, target_device="cpu", accumulation_order="layer")
    with pytest.raises(LayerOrderError, match="accumulation_order: layer: the model's forward draws random numbers"):
        handle.accumulate(_batches(0, 2), _loss_fn(case, model, 2))
    assert all(p.grad is None for p in model.parameters())
    handle.accumulate(_batches(0, 2), _loss_fn(case, model, 2), order="micro")  # the plain loop still runs
    assert any(p.grad is not None for p in model.parameters())
    handle.remove()


@pytest.mark.parametrize("checkpointing", [False, True], ids=["no_ckpt", "ckpt"])
def test_backward_finishes_each_micro_batch_in_a_unit_before_the_next(checkpointing: bool) -> None:
    # Micro-batch K's nodes of a unit's segment (from its entry to the next unit's) outnumber K-1's, ...:
    # the backward runs one micro-batch's part of a segment (one checkpoint recompute alive) before the
    # next's, and every micro-batch's part before the segment before it (layer-major), from the first
    # call on (a first call that interleaved them held K recomputes at once: out of memory at Flux-dev
    # dims under 8 GiB). Recorded: when the node that made each layer's output runs, for which micro-batch.
    case = CASES["toy"]
    model = case.build("adapter", checkpointing=checkpointing)
    log: list[tuple[int, int]] = []

    def watch(i: int):
        def hook(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
            if out.requires_grad and torch._C._current_graph_task_id() == -1:
                mb = int(threading.current_thread().name.rsplit("-", 1)[1])
                out.register_hook(lambda g: log.append((i, mb)))
        return hook

    for i, layer in enumerate(model.layers):
        layer.register_forward_hook(watch(i))
    handle = enable_offload(model, target_device="cpu", accumulation_order="layer")
    anchors = [i for i, layer in enumerate(model.layers) if any(u.anchor is layer for u in handle.engine.streamed)]
    assert len(anchors) == 5  # the frozen layers stream; the trainable ones stay resident

    def segment(i: int) -> int:
        return max(a for a in anchors if a <= i)

    for call in range(3):
        log.clear()
        handle.accumulate(_batches(call, 4), _loss_fn(case, model, 4))
        order = [(segment(i), mb) for i, mb in log]
        order = [x for k, x in enumerate(order) if k == 0 or order[k - 1] != x]
        segments = [a for a, _ in order]
        assert segments == sorted(segments, reverse=True), f"call {call}: not layer-major: {order}"
        assert order == [(a, mb) for a in reversed(anchors) for mb in reversed(range(4))], f"call {call}: {order}"
    assert handle.stats()["lockstep_pad_nodes"] > 0
    handle.remove()


@pytest.mark.parametrize("store", ["bounce", "disk"])
def test_layer_major_through_the_other_host_stores(store: str, tmp_path) -> None:
    # The same hand-overs in front of the bounce ring (pageable weights, copy threads) and the disk tier
    # (reader threads, a cache evicting by next use in the trace): gradients still the plain loop's.
    # (toy: offload_to_disk refuses a peft LoRA model at setup today, layer order or not: a ShardMismatchError
    # that names the same tensor on both sides)
    case = CASES["toy"]
    a = case.build("adapter", checkpointing=True)
    b = copy.deepcopy(a)
    ref = _plain_loop(case, a, make_optimizer(a), steps=2, k=3)
    opt = make_optimizer(b)
    extra = ({"pinned_limit": "16KiB", "num_copy_threads": 2} if store == "bounce"
             else {"offload_to_disk": True, "shard_dir": str(tmp_path / "shards"), "max_memory": 0})
    handle = enable_offload(b, target_device="cpu", offload_granularity="block", accumulation_order="layer", **extra)
    got, _ = _accumulated(case, b, opt, handle.accumulate, steps=2, k=3)
    _assert_grads_equal(ref, got)
    assert handle.stats()["host_store"] == {"bounce": "bounce", "disk": "disk"}[store]
    handle.remove()


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["no_ckpt", "ckpt"])
def test_parked_activations_give_the_plain_loops_gradients(monkeypatch: pytest.MonkeyPatch, checkpointing: bool,
                                                           k: int) -> None:
    """park_saved_tensors: the saved activations (with checkpointing, each block's inputs) go to host
    memory in the forward and come back in the backward; the gradients stay bitwise the plain loop's."""
    from offload_core import parking

    monkeypatch.setattr(parking, "PARK_MIN", 1024)  # the tiny model's activations: park them all
    case = CASES["flux"]
    a = case.build("adapter", checkpointing=checkpointing)
    b = copy.deepcopy(a)
    ref = _plain_loop(case, a, make_optimizer(a), steps=2, k=k)
    opt = make_optimizer(b)
    handle = enable_offload(b, target_device="cpu", offload_granularity="block", accumulation_order="layer",
                            park_saved_tensors=True)
    got, _ = _accumulated(case, b, opt, handle.accumulate, steps=2, k=k)
    _assert_grads_equal(ref, got)
    s = handle.stats()
    assert s["parked_tensors"] > 0 and s["parked_bytes"] >= 1024 * s["parked_tensors"], s
    handle.remove()


def test_park_saved_tensors_is_off_by_default_and_checked() -> None:
    case = CASES["flux"]
    model = case.build("adapter", checkpointing=True)
    opt = make_optimizer(model)
    handle = enable_offload(model, target_device="cpu", offload_granularity="block", accumulation_order="layer")
    _accumulated(case, model, opt, handle.accumulate, steps=1, k=2)
    assert handle.stats()["parked_tensors"] == 0
    handle.remove()
    with pytest.raises(OffloadConfigError, match=r"^park_saved_tensors: expected true or false"):
        enable_offload(case.build("adapter"), target_device="cpu", park_saved_tensors="yes")


def test_a_small_view_of_a_large_activation_is_parked(monkeypatch: pytest.MonkeyPatch) -> None:
    """A saved view keeps its whole storage alive: Flux's single blocks hand on their text tokens as a view
    of the joint output (3 MB holding 27 MB a block and micro-batch at Flux-dev dims, 3.9 GB for K=4: out
    of memory under 8 GiB). Parking goes by the storage too, so nothing left on the device after the
    forward holds a storage past the threshold, and the gradients stay the plain loop's bitwise."""
    from offload_core import parking

    case = CASES["flux"]
    a = case.build("adapter", checkpointing=True)
    b = copy.deepcopy(a)
    handle = enable_offload(b, target_device="cpu", offload_granularity="block", accumulation_order="layer",
                            park_saved_tensors=True)
    binder = handle.engine.binder
    pack = binder.pack_saved
    kept: list[tuple[int, int]] = []  # (view bytes, storage bytes) of what stayed on the device
    views = []  # parked tensors smaller than their storage

    def watched(t: torch.Tensor):
        out = pack(t)
        if isinstance(out, torch.Tensor) and out.numel():
            kept.append((out.numel() * out.element_size(), out.untyped_storage().nbytes()))
        elif isinstance(out, parking.Parked) and t.numel() * t.element_size() < t.untyped_storage().nbytes():
            views.append(t.numel() * t.element_size())
        return out

    monkeypatch.setattr(binder, "pack_saved", watched)
    # the threshold between a view's bytes and its storage's: only the storage rule parks those views
    monkeypatch.setattr(parking, "PARK_MIN", 4096)
    ref = _plain_loop(case, a, make_optimizer(a), steps=1, k=3)
    got, _ = _accumulated(case, b, make_optimizer(b), handle.accumulate, steps=1, k=3)
    _assert_grads_equal(ref, got)
    assert views and min(views) < 4096, "no small view of a large activation was parked"
    assert all(storage < 4096 for _, storage in kept), [k for k in kept if k[1] >= 4096]
    handle.remove()


def test_parked_tensors_come_back_ahead_in_the_backwards_order() -> None:
    """On a card each unpack starts the H2D copies of the tensors parked just before it (the backward
    unpacks in about the reverse order of the parking): which ones, and that a forward whose backward
    never ran does not leave the next one's bookkeeping wrong. The copies themselves need CUDA (the GPU
    test); the order is plain Python."""
    import gc

    from offload_core.parking import AHEAD, Parked, Parking
    from offload_core.stats import Counters

    parking = Parking(torch.device("cpu"), Counters())

    def parked(n: int) -> list[Parked]:
        return [parking._track(Parked(torch.zeros(1), None, torch.device("cpu"))) for _ in range(n)]

    ps = parked(10)
    assert [p.pos for p in ps] == list(range(10))
    want = ps[9 - AHEAD:9][::-1]  # the AHEAD parked just before the last one, nearest first
    got = parking._ahead(ps[9])
    assert got == want
    for q in got:
        q.back = torch.zeros(1)  # brought back: not asked for again
    assert parking._ahead(ps[8]) == [ps[8 - AHEAD]]
    assert parking._ahead(ps[9]) == []  # unpacked again (retain_graph): forgotten, nothing to bring back
    assert parking._ahead(ps[2]) == ps[:2][::-1] and len(parking._order) == 2
    # a forward whose backward never ran: its tensors went with the graph; the next forward starts anew
    del ps, got, want, q
    gc.collect()
    fresh = parked(3)
    assert [p.pos for p in fresh] == [0, 1, 2]
    assert parking._ahead(fresh[2]) == fresh[:2][::-1]
