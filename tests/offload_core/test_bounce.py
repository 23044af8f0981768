"""The bounce store (bounce.py): pageable masters copied through a small pinned ring by threads.

On the CPU the same ring, threads and chunk order run with synchronous copies: results are
compared bitwise with resident runs on the tricky trees, with a ring of a few 4 KiB buffers so
every unit is several chunks and every buffer is reused many times per pass. Every test runs
with both rings: the Python one and the native one (``OFFLOAD_BOUNCE_RING=native``: the chunk
loop in pthreads, native/bounce_ring.c), where a C compiler builds it.
"""

from __future__ import annotations

import copy
import gc
import os
import threading

import pytest
import torch
from torch import nn

import offload_core.bounce as bounce
from offload_core import OffloadConfigError, enable_offload
from offload_core.bounce import BounceError
from offload_core_test_models import CASES, TREES, assert_bitwise, assert_traces_equal, infer, make_optimizer, reference, train

pytestmark = pytest.mark.usefixtures("ring_kind")  # every test with both rings (conftest.py)

LIMIT = "16KiB"  # 4 buffers of 4 KiB (the chunk below): smaller than every test model


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bounce, "DEFAULT_CHUNK", 4096)
    monkeypatch.delenv(bounce.PINNED_LIMIT_ENV, raising=False)


def _bounce_threads() -> list[str]:
    """The rings' threads alive in this process: Python's by name, the native ring's from /proc."""
    names = [t.name for t in threading.enumerate() if t.name.startswith("bounce-")]
    return names + list(bounce.native_fill_threads().values())


def _mlp(n: int = 6) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)) for _ in range(n)])


@pytest.mark.parametrize("name", TREES + ["mha"])
def test_inference_through_the_ring_matches_resident(name: str) -> None:
    case = CASES[name]
    a = case.build("frozen")
    b = copy.deepcopy(a)
    ref = infer(case, a)
    h = enable_offload(b, target_device="cpu", offload_granularity="block", pinned_limit=LIMIT, num_copy_threads=3)
    st = h.stats()
    assert st["host_store"] == "bounce", st["host_store"]
    native = os.environ[bounce.BOUNCE_RING_ENV] == "native"
    assert isinstance(h.engine.store.ring, bounce._NativeRing) == native
    assert st["bounce_fill_copy"] == ("stream, native ring" if native else "stream")
    got = infer(case, b)
    assert_bitwise(ref, got, f"{name} output")
    st = h.stats()
    assert st["bounce_fill_bytes"] >= st["h2d_bytes"] > 0
    h.remove()


@pytest.mark.parametrize("checkpointing", [False, True], ids=["no_ckpt", "ckpt"])
@pytest.mark.parametrize("name", ["toy", "tied", "batchnorm", "hetero"])
def test_training_through_the_ring_matches_resident(name: str, checkpointing: bool) -> None:
    case = CASES[name]
    a = case.build("adapter", checkpointing=checkpointing)
    b = copy.deepcopy(a)
    ref, _ = reference(case, a, mode="adapter", checkpointing=checkpointing, steps=6)
    opt = make_optimizer(b)
    h = enable_offload(b, target_device="cpu", offload_granularity="leaf", pinned_limit=LIMIT, num_copy_threads=2)
    assert h.stats()["host_store"] == "bounce"
    got = train(case, b, opt, steps=6)
    assert_traces_equal(ref, got)
    h.remove()


def _mlp_through_the_ring(passes: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor, object]:
    """An MLP on a ring of 4 KiB chunks, run ``passes`` times, each output bitwise the resident one."""
    m = _mlp()
    x = torch.randn(3, 64)
    ref = m(x)
    h = enable_offload(m, target_device="cpu", offload_granularity="block", pinned_limit=LIMIT)
    for _ in range(passes):
        assert torch.equal(m(x), ref)
    return m, x, ref, h


def test_units_span_many_chunks_and_buffers_are_reused() -> None:
    m, x, ref, h = _mlp_through_the_ring(3)
    st = h.stats()
    unit_bytes = (64 * 128 + 128 + 128 * 64 + 64) * 4
    assert st["bounce_chunk_bytes"] == 4096 and unit_bytes > 8 * 4096  # each unit: many chunks
    assert st["bounce_fill_bytes"] > 4 * st["bounce_ring_bytes"]  # the ring went round many times
    h.remove()
    assert torch.equal(m(x), ref)


def test_the_arena_is_kept_when_it_fits_under_the_limit() -> None:
    m = _mlp(2)
    h = enable_offload(m, target_device="cpu", pinned_limit="64MiB")
    assert h.stats()["host_store"] == "arena"
    h.remove()


def test_the_environment_caps_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(bounce.PINNED_LIMIT_ENV, "16KiB")
    m = _mlp(2)
    x = torch.randn(2, 64)
    ref = m(x)
    h = enable_offload(m, target_device="cpu", pinned_limit="64MiB")
    st = h.stats()
    assert st["host_store"] == "bounce" and st["pinned_limit_bytes"] == 16 << 10
    assert "pinned_limit" in st["host_store_reason"]
    assert torch.equal(m(x), ref)
    h.remove()


def test_threads_end_on_remove_and_when_the_engine_is_dropped() -> None:
    before = len(_bounce_threads())
    m = _mlp()
    x = torch.randn(2, 64)
    h = enable_offload(m, target_device="cpu", pinned_limit=LIMIT, num_copy_threads=4)
    m(x)
    assert len(_bounce_threads()) == before + 5  # 4 fill threads and the issuer
    h.remove()
    assert len(_bounce_threads()) == before
    # dropped without remove(): the model and the engine go, and so do the threads
    m2 = _mlp()
    enable_offload(m2, target_device="cpu", pinned_limit=LIMIT, num_copy_threads=4)
    m2(x)
    assert len(_bounce_threads()) == before + 5
    del m2
    gc.collect()
    for t in [t for t in threading.enumerate() if t.name.startswith("bounce-")]:
        t.join(timeout=5)
    assert len(_bounce_threads()) == before


def test_a_failing_fill_thread_is_a_named_error_at_the_next_use(ring_kind: str) -> None:
    m = _mlp()
    x = torch.randn(2, 64)
    h = enable_offload(m, target_device="cpu", offload_granularity="block", pinned_limit=LIMIT)
    m(x)
    ring = h.engine.store.ring

    def broken(dst: int, src: int, n: int) -> None:
        raise OSError("the copy failed")

    if ring_kind == "native":  # a pthread: its failure is injected in the C loop, and named the same way
        ring.fail_next_fill()
        match = "fill thread failed: an injected failure"
    else:
        ring.memmove = broken
        match = "fill thread bounce-fill-.*OSError: the copy failed"
    with pytest.raises(BounceError, match=match):
        for _ in range(4):  # within a pass: every unit is loaded anew each pass
            m(x)
    with pytest.raises(BounceError):
        m(x)  # and stays failed, never a hang
    h.remove()


@pytest.mark.parametrize("value, match", [("lots", "pinned_limit"), ("1KiB", "at least 16KiB"), (-1, "pinned_limit")])
def test_a_bad_pinned_limit_is_named(value: object, match: str) -> None:
    with pytest.raises(OffloadConfigError, match=match):
        enable_offload(_mlp(1), target_device="cpu", pinned_limit=value)


def test_a_bad_thread_count_is_named() -> None:
    with pytest.raises(OffloadConfigError, match="num_copy_threads"):
        enable_offload(_mlp(1), target_device="cpu", pinned_limit=LIMIT, num_copy_threads=0)


# ---- register mode (OFFLOAD_BOUNCE_MODE=register, an experiment): windows of the masters locked in place --


@pytest.mark.parametrize("checkpointing", [False, True], ids=["no_ckpt", "ckpt"])
def test_register_mode_trains_as_resident_through_reused_windows(monkeypatch: pytest.MonkeyPatch,
                                                                 checkpointing: bool) -> None:
    """On the CPU a window is used without registering: the same pieces, windows, waits and evictions,
    with a budget of 4 windows of 4 KiB, so every unit is several pieces and windows come and go."""
    monkeypatch.setenv(bounce.BOUNCE_MODE_ENV, "register")
    case = CASES["toy"]
    a = case.build("adapter", checkpointing=checkpointing)
    b = copy.deepcopy(a)
    ref, _ = reference(case, a, mode="adapter", checkpointing=checkpointing, steps=6)
    h = enable_offload(b, target_device="cpu", offload_granularity="leaf", pinned_limit=LIMIT, num_copy_threads=3)
    ring = h.engine.store.ring
    assert isinstance(ring, bounce._RegisterRing)
    assert [t.name for t in ring.threads] == [f"bounce-register-{i}" for i in range(3)] + ["bounce-issue"]
    got = train(case, b, make_optimizer(b), steps=6)
    assert_traces_equal(ref, got)
    assert ring.registrations > ring.nbuf and len(ring.windows) <= ring.nbuf  # windows came and went
    h.remove()
    assert not any(t.is_alive() for t in ring.threads) and not ring.windows


def test_register_mode_inference_and_a_failing_registration(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(bounce.BOUNCE_MODE_ENV, "register")
    m, x, _, h = _mlp_through_the_ring(2)
    ring = h.engine.store.ring

    def broken(w: object, rt: object) -> None:
        raise OSError("cannot lock")

    ring._lock = broken
    with pytest.raises(BounceError, match="register thread bounce-register-.*OSError: cannot lock"):
        for _ in range(4):
            m(x)
    h.remove()


@pytest.mark.parametrize("name, value, allowed", [(bounce.BOUNCE_MODE_ENV, "regster", "copy or register"),
                                                  (bounce.BOUNCE_CORES_ENV, "spar", "all or spare")])
def test_a_misspelt_experiment_switch_is_named(monkeypatch: pytest.MonkeyPatch, name: str, value: str,
                                                allowed: str) -> None:
    monkeypatch.setenv(name, value)
    m, x = _mlp(1), torch.randn(2, 64)
    want = m(x)
    with pytest.raises(OffloadConfigError, match=f"{name}='{value}': expected {allowed}"):
        enable_offload(m, target_device="cpu", pinned_limit=LIMIT)
    assert torch.equal(m(x), want), "the model is left as it was"


# ---- OFFLOAD_BOUNCE_CORES=spare (an experiment): the copy threads keep off the engine thread's core --


def test_spare_cores_leave_out_the_calling_threads_core_and_its_siblings(monkeypatch: pytest.MonkeyPatch) -> None:
    files = {"/proc/thread-self/stat": "4242 (python3 (x)) R " + " ".join(["0"] * 35) + " 3 0 0",
             "/sys/devices/system/cpu/cpu3/topology/thread_siblings_list": "3,11\n"}
    monkeypatch.setattr(bounce, "_read", lambda path: files.get(path, ""))
    monkeypatch.setattr(bounce.os, "sched_getaffinity", lambda pid: set(range(16)))
    assert bounce._spare_cpus() is None, "off unless asked for"
    monkeypatch.setenv(bounce.BOUNCE_CORES_ENV, "spare")
    assert bounce._spare_cpus() == set(range(16)) - {3, 11}
    assert bounce._cpu_list("0-2,5,7-8") == {0, 1, 2, 5, 7, 8}
    monkeypatch.setattr(bounce.os, "sched_getaffinity", lambda pid: {3, 11, 4})
    assert bounce._spare_cpus() is None, "fewer than two CPUs left: any CPU"


def test_the_copy_threads_run_on_the_spare_cpus(monkeypatch: pytest.MonkeyPatch, ring_kind: str) -> None:
    cpus = {max(os.sched_getaffinity(0))}
    monkeypatch.setattr(bounce, "_spare_cpus", lambda: cpus)
    before = set(bounce.native_fill_threads())
    m, x, _, h = _mlp_through_the_ring(2)  # bitwise through the ring
    ring = h.engine.store.ring
    ids = [t.native_id for t in ring.threads]
    if ring_kind == "native":
        ids += [tid for tid in bounce.native_fill_threads() if tid not in before]
    assert len(ids) == 2 and all(os.sched_getaffinity(tid) == cpus for tid in ids)
    h.remove()


def test_a_closed_native_ring_is_a_named_error_never_a_crash(ring_kind: str) -> None:
    """After close() (an engine's remove(), or a finalizer) a copy or request names the misuse; the
    native ring never hands C a freed handle."""
    if ring_kind != "native":
        pytest.skip("the native ring's handle")
    m, x, _, h = _mlp_through_the_ring(2)
    ring = h.engine.store.ring
    src = torch.zeros(10_000, dtype=torch.uint8)
    job = ring.request(src)
    ring.copy(job, torch.empty_like(src), None)
    h.remove()
    with pytest.raises(BounceError, match="used after close"):
        ring.request(src)
    with pytest.raises(BounceError, match="used after close"):
        ring.copy(job, torch.empty_like(src), None)
