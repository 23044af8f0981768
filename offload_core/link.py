"""LinkPacer: a slower host-to-device link, emulated on a fast one (``debug_link_gbps``, bench only).

A consumer card sits behind a slower PCIe link than the H200 we measure on: Gen4 x8 about 13 GB/s
(4060 Ti), Gen4 x16 about 25 (3090/4090), Gen5 x16 about 50 (5090), against 55 here. To measure
the engine at those rates on one machine, every H2D weight copy the engine enqueues is bracketed,
on its stream, by two one-thread kernels (Triton):

    stamp   writes the device's global timer (%globaltimer, ns) into a slot, just before the copy
    copy    the real copy, at the real link's rate
    pace    spins until the global timer reads  stamp + nbytes / asked_rate

so a copy, from the moment the stream reaches it, lasts ``nbytes / asked_rate`` or its real time
if that is longer (a copy the host slows, a copy waiting on the host's memory bus): never less
than the slower link would take, and not more either. Nothing is estimated: the deadline is read
off the device's clock at the copy's start. (On an idle stream the stamp would run while the host
still submits the copy; a short spin holds it back until the copy can begin: ``start``. A copy queued
right behind another while that one still runs, a bounce ring's next chunk, starts at the paced end
of the one before, with no stamp: a real link's queue runs them back to back, where a stamp kernel
waits for an SM.) (The first form held the stream after each copy for
``nbytes / asked - nbytes / real`` with ``real`` the fastest probe reading: every copy slower than
the probe made the link slower than asked; a bounce ring's 16 MiB chunks, ~2,500 a Flux step,
ran at 22.7-23.2 where 25 GB/s was asked.) Where Triton cannot be imported, or
``OFFLOAD_LINK_PACING=hold``, that first form is used (``stats()["link_pacing"]`` says which).

What the hold delays is what the slower link would delay: the unit's ``ready`` event (compute
waits for it), the next copy on that stream, the reuse of a bounce buffer the copy read from, and
the timing event that closes the copy, so the copy rate the planner reads (``h2d_gbps``) is the
paced one. Every store's copies are paced: the arena's and the disk cache's (one copy a unit) and
the bounce ring's (one copy a chunk, so each pinned buffer is held as long as the slower link
would hold it).

What it does not model: D2H copies (gradients under optimizer offload, write-back of buffers) run
at the real rate; the host side is unchanged (a slower link does not slow the bounce ring's fill
threads or the host's kernel launches); the spin occupies one thread of one SM while it waits; and
a real link's latency per transfer is not added. On the CPU (``target_device="cpu"``) there is no
link: copies are counted but not slowed.
"""

from __future__ import annotations

import itertools
import os
import time
from typing import Any, Callable

import torch

from .hostmem import HostBuffer

__all__ = ["LinkPacer", "spin_cycles_per_us", "pinned_h2d_gbps"]

_SPIN: dict[int, float] = {}  # device index -> spin cycles per microsecond
_REAL: dict[tuple[int, int], float] = {}  # (device index, copy bytes) -> pinned H2D GB/s
_PROBE_BYTES = 64 << 20


def spin_cycles_per_us(device: torch.device) -> float:
    """How many cycles ``torch.cuda._sleep`` counts per microsecond on ``device`` (measured once).

    A long spin first, so the reading is taken at the clock the device runs at under work; then
    the fastest of three readings (a hold sized from it never ends early at that clock)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    rate = _SPIN.get(index)
    if rate is None:
        with torch.cuda.device(index):
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                torch.cuda._sleep(20_000_000)  # ~10 ms at 2 GHz: out of the idle clock
                best = 0.0
                for _ in range(3):
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record(s)
                    torch.cuda._sleep(4_000_000)
                    b.record(s)
                    b.synchronize()
                    best = max(best, 4_000_000 / max(a.elapsed_time(b) * 1e3, 1e-3))
        rate = _SPIN[index] = best
    return rate


def pinned_h2d_gbps(device: torch.device, nbytes: int = _PROBE_BYTES) -> float:
    """This device's pinned H2D copy rate in GB/s for copies of ``nbytes``: the fastest of eight after
    at least 256 MiB of warm-up (measured once per size): a link that idles at a lower PCIe speed ramps
    up under the warm-up, and a rate read too low would make every paced copy run faster than asked."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    rate = _REAL.get((index, nbytes))
    if rate is None:
        with torch.cuda.device(index):
            host = HostBuffer(nbytes, pin=True)  # registered as the arena's buffers are
            src = host.tensor
            dst = torch.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", index))
            s = torch.cuda.Stream()
            best = 0.0
            with torch.cuda.stream(s):
                for _ in range(max(4, min(64, (256 << 20) // max(nbytes, 1)))):  # warm-up
                    dst.copy_(src, non_blocking=True)
                for _ in range(8):
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record(s)
                    dst.copy_(src, non_blocking=True)
                    b.record(s)
                    b.synchronize()
                    best = max(best, nbytes / 1e9 / max(a.elapsed_time(b) / 1e3, 1e-9))
            del src, dst
            host.close()
        rate = _REAL[(index, nbytes)] = best
    return rate


PACING_ENV = "OFFLOAD_LINK_PACING"  # "deadline" (the default where Triton imports), "stamp" (deadline pacing
# with every copy stamped, none started at the one before's end: the form before chaining) or "hold" (the first)
_MAX_NS = (1 << 31) - 1  # a pace's wait, at most (2.1 s): always an int32, so never a second compile
_SLOTS = 4096  # stamps in flight: a slot is reused 4,096 copies later, long after its copy's pace ran

_kernels: Any = None  # (stamp, pace) Triton kernels; False where Triton cannot be imported


def _deadline_kernels() -> Any:
    global _kernels
    if _kernels is None:
        try:
            _kernels = _build()
        except ImportError:
            _kernels = False
    return _kernels or None


def _build() -> Any:
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["slot"])
    def stamp(slots, slot):
        now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
        tl.store(slots + slot, now)

    @triton.jit(do_not_specialize=["src", "slot", "ns", "row"])
    def pace(slots, src, slot, ns, trace, row, TRACE: tl.constexpr):
        start = tl.load(slots + src)  # the copy's stamp (src == slot), or the paced end of the copy before it
        now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
        copied = now
        while now < start + ns:
            now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                            pack=1)
        tl.store(slots + slot, now)  # this copy's paced end: where a copy queued behind it starts (start(after=))
        if TRACE:  # the copy's start, when its real copy ended, when the slower link would have
            tl.store(trace + row * 3, start)
            tl.store(trace + row * 3 + 1, copied)
            tl.store(trace + row * 3 + 2, now)

    return stamp, pace


TRACE_ENV = "OFFLOAD_LINK_TRACE"  # copies to keep a device timeline of (deadline pacing; 0 or unset: none)


def trace_capacity() -> int:
    """``OFFLOAD_LINK_TRACE``: how many paced copies to trace (0: none); anything but a count is a named error."""
    from .errors import OffloadConfigError

    raw = os.environ.get(TRACE_ENV, "").strip()
    if not raw:
        return 0
    if not raw.isdigit():
        raise OffloadConfigError(f"{TRACE_ENV}={raw!r}: expected a number of copies (0: off)")
    return int(raw)


GAP_EDGES_MS = (0.2, 1.0, 3.0, 10.0)  # idle gaps on the copy stream, bucketed at these sizes


def trace_summary(start: torch.Tensor, copied: torch.Tensor, end: torch.Tensor) -> dict[str, float]:
    """The copy stream's timeline in numbers: traced copies' device times (ns), in any order. Idle is the
    time from the latest end so far to the next start; each gap goes to the bucket of its size."""
    order = torch.argsort(start)
    start, copied, end = start[order].double(), copied[order].double(), end[order].double()
    n = int(start.numel())
    out: dict[str, float] = {"link_trace_copies": float(n)}
    if n == 0:
        return out
    reach = torch.cummax(end, 0).values
    gaps = (start[1:] - reach[:-1]).clamp(min=0) / 1e6
    out["link_trace_span_ms"] = float((reach[-1] - start[0]) / 1e6)
    out["link_trace_busy_ms"] = float((end - start).sum() / 1e6)
    out["link_trace_idle_ms"] = float(gaps.sum())
    edges = (0.0,) + GAP_EDGES_MS + (float("inf"),)
    for lo, hi in zip(edges[:-1], edges[1:]):
        name = f"link_trace_idle_ms_{_ms(lo)}_{_ms(hi)}"
        out[name] = float(gaps[(gaps > lo) & (gaps <= hi)].sum())
    # copies whose real time reached the asked link's (the pace found its deadline passed)
    out["link_trace_copies_over_deadline"] = float(((end - copied) < 2_000).sum())  # under 2 us of pace
    return out


def _ms(x: float) -> str:
    return "up" if x == float("inf") else f"{x:g}".replace(".", "p")


def pacing_mode() -> str:
    """``OFFLOAD_LINK_PACING``: "deadline" (default), "stamp" or "hold"; anything else is a named error."""
    from .errors import OffloadConfigError

    raw = os.environ.get(PACING_ENV, "")
    value = raw.strip().lower() or "deadline"
    if value not in ("deadline", "stamp", "hold"):
        raise OffloadConfigError(f"{PACING_ENV}={raw!r}: expected deadline, stamp or hold")
    return value


class LinkPacer:
    """Paces each H2D copy the engine enqueues to the time a ``gbps`` link would take.

    ``copy(dst, src)`` is the paced copy (the engine binds it in place of a plain one at setup, so
    an engine without the option runs no pacing code); a store that queues its own copies calls
    ``slot = start()`` before one and ``hold(nbytes, slot)`` after it (``start(after=slot)`` for a
    copy queued right behind another on the same stream).
    """

    def __init__(self, gbps: float, device: torch.device) -> None:
        self.gbps = float(gbps)
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.chunk_real_gbps: float | None = None  # the real rate of a bounce ring's chunk copies (chunk_hold)
        self.paced_bytes = 0
        self.paced_copies = 0
        self.real_gbps: float | None = None
        self.cycles_per_us: float | None = None
        self._cycles_per_byte = 0.0
        self.mode = pacing_mode()
        capacity = trace_capacity()  # read (and checked) on every device; kept on a card's deadline pacing only
        self._kernels = None
        self._slots: torch.Tensor | None = None
        self._next = itertools.count()
        self._trace: torch.Tensor | None = None  # (copies, 3) device times under OFFLOAD_LINK_TRACE
        self._rows = itertools.count()  # the next traced copy's row (next() is atomic: two threads pace)
        self._traced = 0  # rows written so far
        self.note = ""  # why deadline pacing was not used, where it was asked for
        self._started = [0.0] * _SLOTS  # host time each slot's start() began (its submission time)
        self._submit_us: float | None = None  # a low quantile of start() to hold(): submitting a copy
        self.idle_holds = 0  # stamps held back on an idle stream until the copy could begin
        self._from = list(range(_SLOTS))  # per slot: where its copy's start is read (its stamp, or the copy before)
        self.chained = 0  # copies started at the paced end of the copy before them (start(after=))
        if self.is_cuda:
            self.real_gbps = pinned_h2d_gbps(device)
            if self.mode in ("deadline", "stamp") and self.real_gbps > self.gbps:
                self._kernels = _deadline_kernels()
                if self._kernels is None:
                    self.note = "Triton cannot be imported: the first form"
                else:
                    self._setup_deadline(capacity)
            if self._kernels is None:
                self.mode = "hold"
                self.cycles_per_us = spin_cycles_per_us(device)
                self._cycles_per_byte = self.cycles_per_byte(self.real_gbps)
        else:
            self.mode = "count"

    def _setup_deadline(self, capacity: int) -> None:
        """Deadline pacing's device state, and both kernels compiled now, at the engine's setup: compiled
        at the first paced copy, the second of compiling counted as that copy's time, and the copy rate
        the planner reads fell with it. A kernel that cannot be built or run here leaves the first form."""
        device = self.device
        try:
            self.cycles_per_us = spin_cycles_per_us(device)  # the idle stream's spin before a stamp (start)
            self._slots = torch.zeros(_SLOTS, dtype=torch.int64, device=device)
            self._ns_per_byte = 1.0 / self.gbps  # GB/s = bytes per ns
            if capacity:
                self._trace = torch.zeros((capacity, 3), dtype=torch.int64, device=device)
            with torch.cuda.device(device):
                self._kernels[0][(1,)](self._slots, 0, num_warps=1)
                for traced in (False, True) if capacity else (False,):  # an int32 wait, as every later one
                    self._kernels[1][(1,)](self._slots, 0, 0, 0, self._slots, 0, TRACE=traced, num_warps=1)
                torch.cuda.synchronize(device)
                if capacity:
                    self._trace.zero_()
        except Exception as exc:  # Triton present but unable to compile or launch for this device
            self._kernels, self._slots, self._trace = None, None, None
            self.note = f"the deadline kernels failed ({type(exc).__name__}: {str(exc)[:200]}): the first form"

    def cycles_per_byte(self, real_gbps: float) -> float:
        """Spin cycles per byte copied at ``real_gbps`` for the copy to take as long as on the asked link."""
        extra_us_per_byte = max(0.0, 1.0 / self.gbps - 1.0 / real_gbps) / 1e3  # (s/GB) / 1e9 B * 1e6 us
        return extra_us_per_byte * (self.cycles_per_us or 0.0)

    def start(self, after: int | None = None) -> int | None:
        """Before a copy on the current stream: its start stamped on the device (deadline pacing).

        ``after``: the slot of the paced copy queued just before this one on the same stream, with
        nothing queued between them (a bounce ring's next chunk of one unit). If the stream is still busy
        when this copy is queued, a real link would begin it as soon as that copy ended: it starts at
        that copy's paced end, and no stamp runs. (A stamp there is a kernel that must find an SM behind
        compute's blocks and be launched after the pace: 10-30 us a copy of idle link that a real
        link's queue of copies does not have, ~2,500 times a Flux-dev step through a 16 MiB ring.)
        The race this leaves: a stream that goes idle between the check and the copy's submission
        (tens of microseconds) has that gap counted as busy.

        On an idle stream the stamp would run as soon as it is launched, while the host still submits
        the copy (tens of microseconds), and the copy's deadline would absorb that: a link faster than
        asked. There a spin a little shorter than the recent submission time (launch to ``hold``, a low
        quantile) holds the stream first, so the stamp runs about when the copy can begin (as
        stats.CopyClock does for the copy's timing event)."""
        if self._kernels is None:
            return None
        t0 = time.perf_counter()
        idle = torch.cuda.current_stream(self.device).query()
        slot = next(self._next) % _SLOTS
        self._started[slot] = t0
        if after is not None and not idle and self.mode == "deadline":
            self._from[slot] = after
            self.chained += 1
            return slot
        if self._submit_us is not None and idle:
            torch.cuda._sleep(int(0.9 * self._submit_us * (self.cycles_per_us or 0.0)))
            self.idle_holds += 1
        self._from[slot] = slot
        self._kernels[0][(1,)](self._slots, slot, num_warps=1)
        return slot

    def hold(self, nbytes: int, slot: int | None = None) -> None:
        """After a copy of ``nbytes`` queued on the current stream: hold the stream until the slower
        link would be done (from ``slot``'s stamp), or for its extra time reckoned from the real rate."""
        if slot is not None and self._kernels is not None:
            us = (time.perf_counter() - self._started[slot]) * 1e6
            if self._submit_us is None or us < self._submit_us:
                self._submit_us = us
            else:  # rise slowly: one slow submission (a GIL switch) does not lengthen the spin
                self._submit_us += 0.05 * (us - self._submit_us)
            self.paced_bytes += nbytes
            self.paced_copies += 1
            ns = min(int(nbytes * self._ns_per_byte), _MAX_NS)
            trace = self._trace
            row = next(self._rows) if trace is not None else 0
            src = self._from[slot]
            if trace is not None and row < trace.shape[0]:
                self._traced = max(self._traced, row + 1)
                self._kernels[1][(1,)](self._slots, src, slot, ns, trace, row, TRACE=True, num_warps=1)
            else:
                self._kernels[1][(1,)](self._slots, src, slot, ns, self._slots, 0, TRACE=False, num_warps=1)
            return
        self._spin(nbytes, self._cycles_per_byte)

    def _spin(self, nbytes: int, cycles_per_byte: float) -> None:
        self.paced_bytes += nbytes
        self.paced_copies += 1
        cycles = int(nbytes * cycles_per_byte)
        if cycles > 0:
            torch.cuda._sleep(cycles)

    def chunk_hold(self, chunk_bytes: int) -> Callable[..., None]:
        """``hold`` for copies of at most ``chunk_bytes`` (a bounce ring's). Deadline pacing needs no
        rate; the first form reckons their extra time from the real rate of copies that size, so the
        ring's link is the asked one too."""
        if not self.is_cuda or chunk_bytes >= _PROBE_BYTES or self._kernels is not None:
            return self.hold
        self.chunk_real_gbps = pinned_h2d_gbps(self.device, chunk_bytes)
        per_byte = self.cycles_per_byte(self.chunk_real_gbps)
        return lambda nbytes, slot=None: self._spin(nbytes, per_byte)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)`` on the current stream (asynchronous on a card), paced."""
        slot = self.start()
        dst.copy_(src, non_blocking=self.is_cuda)
        self.hold(src.numel() * src.element_size(), slot)

    def timeline(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The traced copies' device times in ns (start, real copy's end, paced end), on the host; None
        without OFFLOAD_LINK_TRACE. Waits for the device."""
        if self._trace is None:
            return None
        torch.cuda.synchronize(self.device)
        t = self._trace[: self._traced].cpu()
        t = t[(t[:, 0] > 0) & (t[:, 2] > 0)]  # a row launched after the synchronize (a ring's issuer) is not written yet
        return t[:, 0], t[:, 1], t[:, 2]

    def stats(self) -> dict[str, Any]:
        traced = self.timeline()
        return {
            **(trace_summary(*traced) if traced is not None else {}),
            # paced copies past the trace's rows: its sums cover the first OFFLOAD_LINK_TRACE only
            **({"link_trace_dropped": float(max(self.paced_copies - self._trace.shape[0], 0))}
               if self._trace is not None else {}),
            "link_idle_holds": self.idle_holds,
            "link_chained_copies": self.chained,
            "link_gbps": self.gbps,
            "link_real_gbps": self.real_gbps,
            "link_chunk_real_gbps": self.chunk_real_gbps,
            "link_pacing": self.mode,  # deadline, stamp, hold (the first form), or count (the CPU: nothing slowed)
            "link_pacing_note": self.note,
            "link_paced": self._kernels is not None or self._cycles_per_byte > 0,  # False: real link no faster, or the CPU
            "link_paced_bytes": self.paced_bytes,
            "link_paced_copies": self.paced_copies,
        }
