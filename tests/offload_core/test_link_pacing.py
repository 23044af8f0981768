"""debug_link_gbps (link.py): an emulated slower link, paced on every store's copies.

On the CPU there is no link to slow: the pacer counts the bytes it would have held the stream
for, which shows every H2D copy of every store (arena, bounce ring, disk cache) went through it,
and the results stay bitwise those of the unpaced run. The pacing itself is timed on a card
(test_gpu_link.py).
"""

from __future__ import annotations

import contextlib
import copy
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import pytest
import torch

import offload_core.bounce as bounce
from offload_core import OffloadConfig, OffloadConfigError, OffloadTrainingManager, enable_offload
from offload_core.disk.format import load_index
from offload_core.disk.integrate import max_memory_for
from offload_core.shard import shard_checkpoint
from offload_core_disk_helpers import flux_inputs, tiny_flux
from offload_core_test_models import CASES, assert_bitwise, assert_traces_equal, infer, make_optimizer, train

LINK_KEYS = {"link_gbps", "link_real_gbps", "link_chunk_real_gbps", "link_pacing", "link_pacing_note", "link_idle_holds", "link_paced", "link_paced_bytes", "link_paced_copies"}


@pytest.mark.parametrize("bad", [0, -13, math.nan, math.inf, "13", True, [13]])
def test_a_bad_rate_names_the_key(bad: object) -> None:
    with pytest.raises(OffloadConfigError, match=r"^debug_link_gbps: must be a link rate in GB/s"):
        OffloadConfig(debug_link_gbps=bad)  # type: ignore[arg-type]


def test_a_rate_is_taken_as_a_float_and_none_is_the_real_link() -> None:
    assert OffloadConfig(debug_link_gbps=13).debug_link_gbps == 13.0
    assert OffloadConfig().debug_link_gbps is None


def _paced_stats(st: dict) -> None:
    assert st["link_gbps"] == 13.0
    assert st["link_paced"] is False and st["link_real_gbps"] is None  # the CPU: counted, not slowed
    # every byte that crossed went through the pacer, one hold per copy (a bounce store: per chunk)
    assert st["link_paced_bytes"] == st["h2d_bytes"] > 0
    assert st["link_paced_copies"] >= st["h2d_count"]


@pytest.mark.parametrize("name", ["flux", "tied", "hetero"])
def test_arena_inference_is_paced_and_bitwise(name: str) -> None:
    case = CASES[name]
    a = case.build("frozen")
    b = copy.deepcopy(a)
    h_a = enable_offload(a, target_device="cpu", offload_granularity="block")
    want = infer(case, a)
    assert not LINK_KEYS & set(h_a.stats())  # no option, no keys
    h_b = enable_offload(b, target_device="cpu", offload_granularity="block", debug_link_gbps=13)
    got = infer(case, b)
    assert_bitwise(want, got, f"{name} output")
    st = h_b.stats()
    assert st["host_store"] == "arena"
    _paced_stats(st)
    h_a.remove()
    h_b.remove()


def test_bounce_inference_is_paced_per_chunk_and_bitwise(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bounce, "DEFAULT_CHUNK", 4096)
    monkeypatch.delenv(bounce.PINNED_LIMIT_ENV, raising=False)
    case = CASES["flux"]
    a = case.build("frozen")
    b = copy.deepcopy(a)
    want = infer(case, a)
    h = enable_offload(b, target_device="cpu", offload_granularity="block", pinned_limit="16KiB", num_copy_threads=2,
                       debug_link_gbps=13)
    got = infer(case, b)
    assert_bitwise(want, got, "flux output through the ring")
    st = h.stats()
    assert st["host_store"] == "bounce"
    _paced_stats(st)
    assert st["link_paced_copies"] > st["h2d_count"]  # units of several 4 KiB chunks: one hold a chunk
    h.remove()


def test_lora_training_is_paced_and_bitwise() -> None:
    case = CASES["flux"]
    a = case.build("adapter", checkpointing=True)
    b = copy.deepcopy(a)
    opt_a, opt_b = make_optimizer(a), make_optimizer(b)
    mgr_a = OffloadTrainingManager(a, target_device="cpu")
    mgr_b = OffloadTrainingManager(b, target_device="cpu", debug_link_gbps=13)
    want = train(case, a, opt_a, steps=3, after_backward=mgr_a.after_backward)
    got = train(case, b, opt_b, steps=3, after_backward=mgr_b.after_backward)
    assert_traces_equal(want, got)
    _paced_stats(mgr_b.stats())
    mgr_a.remove()
    mgr_b.remove()


def test_disk_store_is_paced_and_bitwise(tmp_path: Path) -> None:
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    ref = tiny_flux().requires_grad_(False)
    ref.save_pretrained(tmp_path / "src")
    shard_checkpoint(tmp_path / "src", tmp_path / "shards", progress=False)
    index = load_index(tmp_path / "shards")
    with torch.device("meta"):
        model = FluxTransformer2DModel.from_config(FluxTransformer2DModel.load_config(tmp_path / "src")).requires_grad_(False)
    h = enable_offload(model, target_device="cpu", lazy_load=True, shard_dir=str(tmp_path / "shards"),
                       max_memory=max_memory_for(index, index.units, 0.2, 2), offload_granularity="block",
                       debug_link_gbps=13)
    inputs = flux_inputs()
    with torch.no_grad():
        want = ref(**inputs, return_dict=False)[0]
        for _ in range(2):
            assert torch.equal(model(**inputs, return_dict=False)[0], want)
    st = h.stats()
    assert st["disk_reads"] > 0  # a disk store (its stats carry no host_store key yet)
    _paced_stats(st)
    h.remove()


def test_without_the_option_no_pacing_code_is_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decided once at setup: an engine without debug_link_gbps copies with the plain functions."""
    from offload_core.transfer import Transfer

    monkeypatch.delenv(bounce.PINNED_LIMIT_ENV, raising=False)
    for extra in ({}, {"pinned_limit": "16KiB"}):
        h = enable_offload(CASES["flux"].build("frozen"), target_device="cpu", offload_granularity="block", **extra)
        t = h.engine.transfer
        assert t.pacer is None and t._copy_in is Transfer._copy_in
        if extra:
            assert h.engine.store.ring.hold is bounce._no_hold
        else:
            assert t._h2d_copy.__func__ is Transfer._h2d_copy
        h.remove()


def test_a_bounce_rings_chunks_are_paced_from_the_real_rate_of_copies_their_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 16 MiB copy runs slower than the 64 MiB probe: reckoned from the probe's rate, the spin after
    each chunk made the ring's link slower than asked (23.2 of 25 GB/s on the H200). The chunks' holds
    come from the rate measured at their size; a unit's copy keeps the probe's."""
    from offload_core import link

    monkeypatch.setenv(link.PACING_ENV, "hold")
    rates = {64 << 20: 55.0, 16 << 20: 44.0}
    monkeypatch.setattr(link, "pinned_h2d_gbps", lambda device, nbytes=64 << 20: rates[nbytes])
    monkeypatch.setattr(link, "spin_cycles_per_us", lambda device: 1000.0)
    spins: list[int] = []
    monkeypatch.setattr(torch.cuda, "_sleep", spins.append)
    pacer = link.LinkPacer(25, torch.device("cuda"))
    chunk = pacer.chunk_hold(16 << 20)
    n = 16 << 20
    chunk(n)
    pacer.hold(n)

    def us(real: float) -> float:  # what the spin must add to a copy at `real` GB/s for it to last n / 25 GB/s
        return (n / 25e3) - (n / (real * 1e3))

    assert spins[0] == int(us(44.0) * 1000.0) and spins[1] == int(us(55.0) * 1000.0)
    assert pacer.stats()["link_chunk_real_gbps"] == 44.0 and pacer.stats()["link_paced_copies"] == 2
    other = link.LinkPacer(25, torch.device("cuda"))
    assert other.chunk_hold(64 << 20) == other.hold, "chunks as big as the probe: the probe's rate"


class _Launch:
    """Stands in for a Triton kernel's ``kernel[grid](*args)`` launch: records the arguments."""

    def __init__(self, calls: list, name: str) -> None:
        self.calls, self.name = calls, name

    def __getitem__(self, grid: tuple) -> object:
        def launch(*args: object, **kw: object) -> None:
            if self.name == "stamp":
                self.calls.append(("stamp", args[1:]))
                return
            src, slot, ns, trace, row = args[1:6]  # pace(slots, src, slot, ns, trace, row, TRACE=)
            if kw["TRACE"]:  # pace, recording its copy's times in row `row` of the trace
                self.calls.append(("pace-traced", (slot, ns, row)))
                if isinstance(trace, torch.Tensor) and row < trace.shape[0] and ns:
                    t0 = 1_000_000 * (row + 1) ** 2  # rows start 1, 4, 9 ms in; copied in 10 us, paced to 0.5 ms
                    trace[row] = torch.tensor([t0, t0 + 10_000, t0 + 500_000])
            elif src == slot:
                self.calls.append(("pace", (slot, ns)))
            else:  # started at the paced end of the copy in slot src
                self.calls.append(("pace-after", (src, slot, ns)))
        return launch


def _stand_in_card(monkeypatch: pytest.MonkeyPatch, calls: list, *, idle: Callable[[], bool] = lambda: False,
                   zeros: Callable[..., object] = lambda *a, **k: "slots",
                   synchronize: Callable[..., None] = lambda d=None: None,
                   sleep: Callable[[int], None] | None = None) -> Any:
    """A card for deadline pacing, with the kernels' launches recorded in ``calls`` (_Launch), a 55 GB/s
    probe, the current stream idle as ``idle()`` says, and each spin recorded as ("spin", cycles)."""
    from offload_core import link

    monkeypatch.delenv(link.PACING_ENV, raising=False)
    monkeypatch.setattr(link, "pinned_h2d_gbps", lambda device, nbytes=64 << 20: 55.0)
    monkeypatch.setattr(link, "_deadline_kernels", lambda: (_Launch(calls, "stamp"), _Launch(calls, "pace")))
    monkeypatch.setattr(link, "spin_cycles_per_us", lambda device: 1000.0)
    monkeypatch.setattr(torch, "zeros", zeros)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: SimpleNamespace(query=idle))
    monkeypatch.setattr(torch.cuda, "_sleep", sleep or (lambda cycles: calls.append(("spin", cycles))))
    return link


def test_deadline_pacing_stamps_each_copy_and_holds_until_the_stamp_plus_its_time_on_the_link(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The default form: a stamp before the copy, and a pace that waits for stamp + nbytes / rate, each
    copy with its own slot; nothing reckoned from a probe (the chunk size changes nothing)."""
    calls: list = []
    link = _stand_in_card(monkeypatch, calls, synchronize=lambda d=None: calls.append(("synchronize", ())),
                          sleep=lambda cycles: pytest.fail("a busy stream needs no spin"))
    pacer = link.LinkPacer(25, torch.device("cuda"))
    # both kernels compiled at setup, and waited for: not at the first paced copy, inside its timing
    assert calls == [("stamp", (0,)), ("pace", (0, 0)), ("synchronize", ())]
    calls.clear()
    assert pacer.stats()["link_pacing"] == "deadline" and pacer.stats()["link_paced"] is True
    hold = pacer.chunk_hold(16 << 20)
    assert hold == pacer.hold and pacer.stats()["link_chunk_real_gbps"] is None
    a, b = pacer.start(), pacer.start()
    hold(16 << 20, a)
    pacer.hold(50_000_000, b)
    assert calls == [("stamp", (a,)), ("stamp", (b,)), ("pace", (a, int((16 << 20) / 25))), ("pace", (b, 2_000_000))]
    assert a != b and pacer.stats()["link_paced_copies"] == 2
    pacer.hold(1 << 40, a)  # a wait past int32's nanoseconds is cut there (one compiled form)
    assert calls[-1] == ("pace", (a, link._MAX_NS))
    assert pacer.stats()["link_paced_bytes"] == (16 << 20) + 50_000_000 + (1 << 40)


def test_deadline_pacing_falls_back_to_the_first_form_without_triton_and_not_at_all_on_a_fast_enough_link(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from offload_core import link

    monkeypatch.delenv(link.PACING_ENV, raising=False)
    monkeypatch.setattr(link, "spin_cycles_per_us", lambda device: 1000.0)
    monkeypatch.setattr(link, "_deadline_kernels", lambda: None)  # Triton not importable
    monkeypatch.setattr(link, "pinned_h2d_gbps", lambda device, nbytes=64 << 20: 55.0)
    st = link.LinkPacer(25, torch.device("cuda")).stats()
    assert st["link_pacing"] == "hold" and st["link_paced"] is True
    assert st["link_pacing_note"] == "Triton cannot be imported: the first form"

    class Broken:  # Triton imports, but its kernel cannot be built for this device
        def __getitem__(self, grid: tuple) -> object:
            def launch(*args: object, **kw: object) -> None:
                raise RuntimeError("PTX .version 9.9 does not support .target sm_200")
            return launch

    monkeypatch.setattr(link, "_deadline_kernels", lambda: (Broken(), Broken()))
    monkeypatch.setattr(torch, "zeros", lambda *a, **k: "slots")
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    st = link.LinkPacer(25, torch.device("cuda")).stats()
    assert st["link_pacing"] == "hold" and st["link_paced"] is True
    assert st["link_pacing_note"].startswith("the deadline kernels failed (RuntimeError: PTX .version 9.9")
    monkeypatch.setattr(link, "pinned_h2d_gbps", lambda device, nbytes=64 << 20: 20.0)
    st = link.LinkPacer(25, torch.device("cuda")).stats()
    assert st["link_paced"] is False  # the real link is slower than asked: nothing to hold
    assert link.LinkPacer(25, torch.device("cpu")).stats()["link_pacing"] == "count"


@pytest.mark.parametrize("bad", ["spin", "1"])
def test_a_bad_pacing_switch_is_a_named_error(monkeypatch: pytest.MonkeyPatch, bad: str) -> None:
    from offload_core import link

    monkeypatch.setenv(link.PACING_ENV, bad)
    with pytest.raises(OffloadConfigError, match=r"^OFFLOAD_LINK_PACING='.*': expected deadline, stamp or hold"):
        link.LinkPacer(25, torch.device("cpu"))


def test_a_traced_pacer_keeps_its_copies_device_times_and_sums_the_copy_streams_idle(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """OFFLOAD_LINK_TRACE=N: the first N paced copies record (start, real end, paced end) on the device;
    stats() sums the copy stream's busy and idle time, its idle gaps by size."""
    from offload_core import link as link_mod

    monkeypatch.setenv(link_mod.TRACE_ENV, "3")
    calls: list = []
    real_zeros = torch.zeros
    link = _stand_in_card(monkeypatch, calls, zeros=lambda *a, **k: real_zeros(*a, dtype=k.get("dtype")))
    pacer = link.LinkPacer(25, torch.device("cuda"))
    assert calls[1:] == [("pace", (0, 0)), ("pace-traced", (0, 0, 0))]  # both forms compiled at setup
    assert int(pacer._trace.abs().sum()) == 0, "the setup's traced launch leaves no row behind"
    calls.clear()
    for _ in range(4):
        pacer.hold(25_000, pacer.start())  # 1 us each on the asked link
    assert [c[0] for c in calls if c[0] != "stamp"] == ["pace-traced"] * 3 + ["pace"]
    st = pacer.stats()
    # busy 3 x 0.5 ms; idle 3 - 0.5 = 2.5 and 5 - 0.5 = 4.5 ms
    assert st["link_trace_copies"] == 3.0
    assert st["link_trace_busy_ms"] == pytest.approx(1.5) and st["link_trace_idle_ms"] == pytest.approx(7.0)
    assert st["link_trace_span_ms"] == pytest.approx(8.5)
    assert st["link_trace_idle_ms_1_3"] == pytest.approx(2.5) and st["link_trace_idle_ms_3_10"] == pytest.approx(4.5)
    assert st["link_trace_idle_ms_10_up"] == 0.0
    assert st["link_trace_copies_over_deadline"] == 0.0
    assert st["link_trace_dropped"] == 1.0  # the fourth copy found no row left
    pacer._trace[2] = 0  # a row launched but not run yet (a ring's issuer queues past a synchronize)
    st = pacer.stats()
    assert st["link_trace_copies"] == 2.0 and st["link_trace_span_ms"] == pytest.approx(3.5)


def test_the_trace_summary_buckets_gaps_by_size_and_counts_copies_that_met_their_deadline() -> None:
    from offload_core.link import trace_summary

    ms = 1_000_000
    start = torch.tensor([0, 1 * ms, 3 * ms, 20 * ms], dtype=torch.int64)  # given out of order below
    end = start + ms // 2
    copied = end.clone()
    copied[0] = start[0] + ms // 4  # the others' real copies took the whole asked time: no pace left
    st = trace_summary(start.flip(0), copied.flip(0), end.flip(0))
    assert st["link_trace_idle_ms"] == pytest.approx(0.5 + 1.5 + 16.5)
    assert st["link_trace_idle_ms_0p2_1"] == pytest.approx(0.5)
    assert st["link_trace_idle_ms_1_3"] == pytest.approx(1.5)
    assert st["link_trace_idle_ms_10_up"] == pytest.approx(16.5)
    assert st["link_trace_copies_over_deadline"] == 3.0
    assert trace_summary(*(torch.zeros(0, dtype=torch.int64),) * 3) == {"link_trace_copies": 0.0}


@pytest.mark.parametrize("bad", ["many", "-1", "1.5"])
def test_a_bad_trace_count_is_a_named_error(monkeypatch: pytest.MonkeyPatch, bad: str) -> None:
    from offload_core import link

    monkeypatch.setenv(link.TRACE_ENV, bad)
    with pytest.raises(OffloadConfigError, match=r"^OFFLOAD_LINK_TRACE='.*': expected a number of copies"):
        link.LinkPacer(25, torch.device("cpu"))


def _pacer_on_a_stream(monkeypatch: pytest.MonkeyPatch, *, idle: bool) -> tuple[Any, Any, list, list[bool]]:
    """(link, a 25 GB/s pacer on the stand-in card, its recorded launches, the stream's idle flag to flip),
    no trace; the launches of the pacer's setup cleared."""
    from offload_core import link as link_mod

    monkeypatch.delenv(link_mod.TRACE_ENV, raising=False)
    calls: list = []
    flag = [idle]
    link = _stand_in_card(monkeypatch, calls, idle=lambda: flag[0])
    pacer = link.LinkPacer(25, torch.device("cuda"))
    calls.clear()
    return link, pacer, calls, flag


def test_on_an_idle_stream_the_stamp_waits_out_the_copys_submission(monkeypatch: pytest.MonkeyPatch) -> None:
    """An idle stream runs the stamp as soon as it is launched, while the host still submits the copy: the
    deadline would absorb that time (a link faster than asked). There a spin of 0.9 x the recent
    submission time (start() to hold(), its low quantile) goes first; a busy stream gets none."""
    link, pacer, calls, idle = _pacer_on_a_stream(monkeypatch, idle=True)
    pacer.hold(1 << 20, pacer.start())  # no submission time known yet: no spin
    assert [c[0] for c in calls] == ["stamp", "pace"]
    submit = pacer._submit_us
    assert submit is not None and submit > 0
    calls.clear()
    slot = pacer.start()
    assert calls[0] == ("spin", int(0.9 * submit * 1000.0)) and calls[1] == ("stamp", (slot,))
    pacer.hold(1 << 20, slot)
    idle[0] = False
    calls.clear()
    pacer.hold(1 << 20, pacer.start())
    assert [c[0] for c in calls] == ["stamp", "pace"]  # a busy stream: the stamp waits there anyway
    assert pacer.stats()["link_idle_holds"] == 1


def test_a_copy_queued_behind_a_running_one_starts_at_its_paced_end_and_runs_no_stamp(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """start(after=slot): a real link's queue runs a copy queued behind a running one back to back. While
    the stream is busy, the copy's deadline counts from the paced end of the copy before it (the pace
    reads that slot), with no stamp kernel; on an idle stream (a real gap) it is stamped as any other."""
    link, pacer, calls, idle = _pacer_on_a_stream(monkeypatch, idle=False)
    a = pacer.start()
    pacer.hold(25_000_000, a)
    b = pacer.start(after=a)  # the stream still runs a's copy: no stamp
    pacer.hold(25_000_000, b)
    assert calls == [("stamp", (a,)), ("pace", (a, 1_000_000)), ("pace-after", (a, b, 1_000_000))]
    idle[0] = True  # b's copy ended before c was queued: a real gap, stamped (after the idle spin)
    calls.clear()
    c = pacer.start(after=b)
    pacer.hold(25_000_000, c)
    assert [x[0] for x in calls] == ["spin", "stamp", "pace"] and calls[1] == ("stamp", (c,))
    assert pacer.stats()["link_chained_copies"] == 1
    monkeypatch.setenv(link.PACING_ENV, "stamp")  # the form before: every copy stamped
    pacer = link.LinkPacer(25, torch.device("cuda"))
    idle[0] = False
    calls.clear()
    pacer.hold(1, pacer.start(after=pacer.start()))
    assert calls[-2:] == [("stamp", (1,)), ("pace", (1, 0))] and pacer.stats()["link_pacing"] == "stamp"


def test_a_bounce_rings_chunks_of_one_unit_are_queued_each_behind_the_last() -> None:
    """The ring passes each chunk's copy the slot of the chunk before it in the same unit (the first of a
    unit follows the unit's waits: none)."""
    from offload_core.bounce import _Ring

    seen: list = []
    slots = iter(range(100))

    def start(after: object = None) -> int:
        seen.append(after)
        return next(slots)

    ring = _Ring(4 << 20, 1 << 20, 2, torch.device("cpu"), pin=False)
    try:
        ring.start, ring.hold = start, lambda n, slot=None: None
        want: list = []
        for _ in range(2):
            src = torch.arange(3 << 20, dtype=torch.uint8).view(-1)
            dst = torch.empty_like(src)
            job = ring.request(src)
            ring.copy(job, dst, None)
            assert torch.equal(dst, src)
            first = len(want)
            want += [None] + list(range(first, first + len(job.chunks) - 1))
    finally:
        ring.close()
    assert seen == want and len(want) > 6


def test_an_idle_rings_first_chunk_goes_in_growing_pieces_and_a_busy_rings_in_whole_chunks() -> None:
    """A request that finds the fill threads with nothing queued (the copy stream waits for its first
    bytes) splits its first chunk's worth in 1/16, 1/16, 1/8, 1/4, 1/2; a request queued behind others
    is cut in whole chunks. Bytes and order are the same either way."""
    from offload_core.bounce import _Ring

    chunk = 1 << 20
    ring = _Ring(4 * chunk, chunk, 2, torch.device("cpu"), pin=False)
    try:
        src = torch.arange(3 * chunk + 5, dtype=torch.uint8)
        idle = ring.request(src)
        sizes = [m for _, m in idle.chunks]
        assert sizes[:5] == [chunk // 16, chunk // 16, chunk // 8, chunk // 4, chunk // 2]
        assert sizes[5:] == [chunk, chunk, 5] and sum(sizes) == src.numel()
        assert [a for a, _ in idle.chunks] == [src.data_ptr() + sum(sizes[:i]) for i in range(len(sizes))]
        # 8 chunks queued for 2 threads and 4 buffers: at most 6 taken before the copies free a buffer
        other = (torch.arange(3 * chunk + 5, dtype=torch.int64) % 251).to(torch.uint8)
        busy = ring.request(other)
        assert [m for _, m in busy.chunks] == [chunk, chunk, chunk, 5]
        for job, want in ((idle, src), (busy, other)):
            dst = torch.empty_like(want)
            ring.copy(job, dst, None)
            assert torch.equal(dst, want)
        small = torch.arange(1000, dtype=torch.uint8)
        assert [m for _, m in ring.request(small).chunks] == [1000]  # smaller than a sixteenth: one piece
    finally:
        ring.close()
