"""Host memory lifecycle and a second engine on the same modules.

On a machine without CUDA, the registration calls are recorded by a stand-in for torch's cudart
bindings (the same two functions the engine calls), so the bookkeeping is tested for real: a
registered buffer is unregistered exactly once, while its memory is still alive, whether the
engine was removed or only dropped. The GPU half (real registrations, 8 models dropped in one
process, a registration made to fail) is in test_gpu_lifecycle.py.
"""

from __future__ import annotations

import copy
import gc
import logging
import subprocess
import sys
import weakref

import pytest
import torch

from offload_core import AlreadyOffloadedError, OffloadTrainingManager, enable_offload
from offload_core import hostmem
from offload_core_test_models import CASES, assert_bitwise, hook_counts, infer, make_optimizer, snapshot, train


class FakeCudart:
    """Records cudaHostRegister / cudaHostUnregister; a registered range may not be registered again."""

    def __init__(self) -> None:
        self.registered: dict[int, int] = {}
        self.calls: list[tuple[str, int]] = []
        self.alive_at_unregister: list[bool] = []
        self.watch: dict[int, weakref.ref] = {}  # ptr -> weakref to the allocation that holds it

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:
        self.calls.append(("register", ptr))
        if ptr in self.registered:
            return 712  # cudaErrorHostMemoryAlreadyRegistered
        self.registered[ptr] = nbytes
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        self.calls.append(("unregister", ptr))
        ref = self.watch.get(ptr)
        self.alive_at_unregister.append(ref is not None and ref() is not None)
        return 0 if self.registered.pop(ptr, None) is not None else 713


@pytest.fixture
def cudart(monkeypatch: pytest.MonkeyPatch) -> FakeCudart:
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    cleared: list = []
    monkeypatch.setattr(hostmem, "clear_cuda_error", lambda device=None: cleared.append(device))
    fake.cleared = cleared  # type: ignore[attr-defined]
    real = hostmem.host_buffer

    def watched(nbytes: int):
        buf, raw = real(nbytes)
        fake.watch[buf.data_ptr()] = weakref.ref(raw)
        return buf, raw

    monkeypatch.setattr(hostmem, "host_buffer", watched)
    return fake


def _pin_everything(handle) -> list[int]:
    """Register the engine's host buffers (the CPU path never asks to) through the fake cudart."""
    store = handle.engine.store
    store.pin_requested = True
    assert store.pin() and store.pinned
    bufs = list(store._buffers)
    if handle.trainer is not None:
        assert handle.trainer._staging.pin()
        bufs.append(handle.trainer._staging)
    return [b.tensor.data_ptr() for b in bufs]


def test_host_buffer_unregisters_on_close_and_once(cudart: FakeCudart) -> None:
    buf = hostmem.HostBuffer(3 << 20, pin=True)
    ptr = buf.tensor.data_ptr()
    assert buf.pinned and cudart.registered == {ptr: 3 << 20}
    buf.close()
    buf.close()
    assert cudart.calls == [("register", ptr), ("unregister", ptr)]
    assert cudart.alive_at_unregister == [True]


def test_dropped_host_buffer_unregisters_before_its_memory_goes(cudart: FakeCudart) -> None:
    buf = hostmem.HostBuffer(1 << 20, pin=True)
    ptr = buf.tensor.data_ptr()
    ref = weakref.ref(buf)
    del buf  # no cycle: freed at once, and the finalizer does not keep it alive
    assert ref() is None
    assert cudart.calls[-1] == ("unregister", ptr) and cudart.alive_at_unregister == [True]
    assert not cudart.registered


@pytest.mark.parametrize("optimizer_offload", [False, True], ids=["lora", "optimizer-offload"])
def test_engine_dropped_without_remove_unregisters_everything(cudart: FakeCudart, optimizer_offload: bool) -> None:
    case = CASES["flux"]
    model = case.build("adapter", checkpointing=True)
    opt = make_optimizer(model)
    mgr = OffloadTrainingManager(model, "cpu", offload_granularity="block",
                                 enable_optimizer_cpu_offload=optimizer_offload)
    ptrs = _pin_everything(mgr.handle)
    assert len(ptrs) >= (2 if optimizer_offload else 1)
    train(case, model, opt, steps=2, after_backward=mgr.after_backward)
    assert set(cudart.registered) == set(ptrs)
    engine = weakref.ref(mgr.engine)
    del mgr, model, opt  # the hooks hold the engine in a cycle with the model: gc collects it
    gc.collect()
    assert engine() is None, "the engine outlived its model"
    assert not cudart.registered, f"{len(cudart.registered)} host buffers still registered after the engine died"
    assert sorted(p for k, p in cudart.calls if k == "unregister") == sorted(ptrs)
    assert all(cudart.alive_at_unregister), "a buffer was unregistered after its memory was freed"


def test_remove_unregisters_at_once(cudart: FakeCudart) -> None:
    model = CASES["toy"].build("frozen")
    h = enable_offload(model, target_device="cpu")
    ptrs = _pin_everything(h)
    h.remove()
    assert not cudart.registered and sorted(p for k, p in cudart.calls if k == "unregister") == sorted(ptrs)


def test_a_failed_registration_is_cleared_logged_by_name_and_falls_back(cudart: FakeCudart,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    case = CASES["toy"]
    ref = case.build("frozen")
    model = copy.deepcopy(ref)
    h = enable_offload(model, target_device="cpu")
    store = h.engine.store
    for b in store._buffers:  # someone registered the range first
        cudart.registered[b.tensor.data_ptr()] = b.nbytes
    store.pin_requested = True
    with caplog.at_level(logging.WARNING, logger="offload_core.hostmem"):
        assert store.pin() is False
    assert "cudaErrorHostMemoryAlreadyRegistered" in caplog.text
    assert cudart.cleared, "the failed call's error was left for torch's next launch check"
    assert h.stats()["pinned"] is False
    assert_bitwise(infer(case, ref), infer(case, model), "output from pageable memory")
    outside = set(cudart.registered)
    h.remove()
    assert set(cudart.registered) == outside, "remove() unregistered a range it never registered"


def test_interpreter_exit_with_a_registered_buffer_is_quiet(tmp_path) -> None:
    # A buffer still registered at exit: the finalizer stands down (the process's memory goes with it).
    script = tmp_path / "exit.py"
    script.write_text(
        "import torch\n"
        "from offload_core import hostmem\n"
        "class C:\n"
        "    def cudaHostRegister(self, p, n, f): return 0\n"
        "    def cudaHostUnregister(self, p): raise SystemExit('unregister ran at exit')\n"
        "torch.cuda.is_available = lambda: True\n"
        "torch.cuda.cudart = lambda: C()\n"
        "torch.cuda.current_device = lambda: 0\n"
        "keep = hostmem.HostBuffer(1 << 20, pin=True)\n"
        "assert keep.pinned\n"
        "print('ok')\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    assert "Exception" not in out.stderr, out.stderr


# ---------------------------------------------------------------- a second engine
def test_enable_offload_twice_is_refused_and_leaves_the_model_alone() -> None:
    case = CASES["flux"]
    ref = case.build("frozen")
    model = copy.deepcopy(ref)
    h = enable_offload(model, target_device="cpu", offload_granularity="block")
    hooks = hook_counts(model)
    with pytest.raises(AlreadyOffloadedError, match="remove"):
        enable_offload(model, target_device="cpu")
    with pytest.raises(AlreadyOffloadedError, match="transformer_blocks"):
        enable_offload(model.transformer_blocks[0], target_device="cpu")  # a part of it
    with pytest.raises(AlreadyOffloadedError):
        OffloadTrainingManager(model, "cpu")
    assert hook_counts(model) == hooks
    assert_bitwise(infer(case, ref), infer(case, model), "output after the refused second engine")
    h.remove()
    h2 = enable_offload(model, target_device="cpu")  # after remove() it is allowed again
    assert_bitwise(infer(case, ref), infer(case, model), "output with the engine installed again")
    h2.remove()


def test_enabling_a_model_whose_submodule_is_offloaded_is_refused() -> None:
    case = CASES["flux"]
    model = case.build("frozen")
    before = snapshot(model)
    h = enable_offload(model.transformer_blocks[1], target_device="cpu")
    with pytest.raises(AlreadyOffloadedError, match="transformer_blocks.1"):
        enable_offload(model, target_device="cpu")
    h.remove()
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


# ---------------------------------------------------------------- the host-store seam
class SlowStore:
    """A HostStore over a PinnedArena whose non-blocking acquires miss every other time, as a disk
    store's would while a read is still in flight; it records what the engine asks."""

    def __init__(self, arena) -> None:
        self.arena = arena
        self.calls: list[tuple] = []
        self.held: set[int] = set()
        self.traces: list[list[int]] = []
        self._flip = False

    pinned = property(lambda self: self.arena.pinned)
    capacity_bytes = property(lambda self: self.arena.capacity_bytes)
    used_bytes = property(lambda self: self.arena.used_bytes)

    def follow_trace(self, trace) -> None:
        self.traces.append(list(trace))

    def acquire(self, uid: int, *, block: bool = True):
        self._flip = not self._flip
        if not block and self._flip:
            self.calls.append(("miss", uid))
            return None
        assert uid not in self.held, "acquired twice without a release"
        self.held.add(uid)
        self.calls.append(("acquire", uid))
        return self.arena.acquire(uid)

    def release(self, uid: int, after=None) -> None:
        self.held.discard(uid)
        self.calls.append(("release", uid))

    def unuse(self, uid: int) -> None:
        self.calls.append(("unuse", uid))

    def master(self, uid: int):
        return self.arena.master(uid)

    def view(self, unit, index: int):
        return self.arena.view(unit, index)

    def stats(self) -> dict:
        return {"store_misses": sum(1 for c in self.calls if c[0] == "miss")}

    def close(self) -> None:
        self.arena.close()


def test_a_second_host_store_plugs_in_without_engine_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    from offload_core.engine import OffloadEngine
    from offload_core.hoststore import HostStore

    made: list[SlowStore] = []
    original = OffloadEngine._make_store

    def make(self):
        made.append(SlowStore(original(self)))
        return made[-1]

    monkeypatch.setattr(OffloadEngine, "_make_store", make)
    case = CASES["batchnorm"]  # running stats: write-back goes through master()
    ref = case.build("adapter", checkpointing=True)
    off = copy.deepcopy(ref)
    mgr = OffloadTrainingManager(off, "cpu", offload_granularity="block")
    store = made[0]
    assert isinstance(store, HostStore)
    want = train(case, ref, make_optimizer(ref), steps=4)
    got = train(case, off, make_optimizer(off), steps=4, after_backward=mgr.after_backward)
    from offload_core_test_models import assert_traces_equal

    assert_traces_equal(want, got)
    kinds = {c[0] for c in store.calls}
    assert {"acquire", "release", "miss"} <= kinds, kinds
    assert not store.held, "a slab was never released"
    assert store.traces and store.traces[0] == list(mgr.engine.schedule.trace)
    assert mgr.stats()["store_misses"] > 0  # the store's stats() reach handle.stats()
    for k, v in ref.state_dict().items():
        assert torch.equal(v, off.state_dict()[k]), k
    mgr.remove()
