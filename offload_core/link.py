"""LinkPacer: a slower host-to-device link, emulated on a fast one (``debug_link_gbps``, bench only).

A consumer card sits behind a slower PCIe link than the H200 we measure on: Gen4 x8 about 13 GB/s
(4060 Ti), Gen4 x16 about 25 (3090/4090), Gen5 x16 about 50 (5090), against 55 here. To measure
the engine at those rates on one machine, every H2D weight copy the engine enqueues is followed,
on the same stream, by a spin kernel (``torch.cuda._sleep``) for the time the slower link would
have needed on top of the real copy::

    hold = nbytes / asked_rate - nbytes / real_rate

``real_rate`` is this device's pinned H2D rate at the copies' size (the fastest of eight 64 MiB
copies, measured once per process; for a bounce ring's chunks, copies of a chunk's size: a 16 MiB
copy runs slower than a 64 MiB one, and reckoned from the 64 MiB rate the ring's link ran at 23.2
where 25 GB/s was asked, on the H200), and the spin's clock rate (cycles per microsecond) is calibrated once too, after a
warm-up spin has raised the clock. Both are the fastest readings, so a copy that runs slower than
that, or a clock that drops under load, makes the link slower than asked, never faster: the
achieved rate is in ``stats()["h2d_gbps"]`` beside the asked one.

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


class LinkPacer:
    """Holds the current stream after each H2D copy for the extra time a ``gbps`` link would take.

    ``copy(dst, src)`` is the paced copy (the engine binds it in place of a plain one at setup, so
    an engine without the option runs no pacing code); ``hold(nbytes)`` paces a copy already queued.
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
        if self.is_cuda:
            self.real_gbps = pinned_h2d_gbps(device)
            self.cycles_per_us = spin_cycles_per_us(device)
            self._cycles_per_byte = self.cycles_per_byte(self.real_gbps)

    def cycles_per_byte(self, real_gbps: float) -> float:
        """Spin cycles per byte copied at ``real_gbps`` for the copy to take as long as on the asked link."""
        extra_us_per_byte = max(0.0, 1.0 / self.gbps - 1.0 / real_gbps) / 1e3  # (s/GB) / 1e9 B * 1e6 us
        return extra_us_per_byte * (self.cycles_per_us or 0.0)

    def hold(self, nbytes: int) -> None:
        """After a copy of ``nbytes`` queued on the current stream: spin there for the slower link's extra time."""
        self._spin(nbytes, self._cycles_per_byte)

    def _spin(self, nbytes: int, cycles_per_byte: float) -> None:
        self.paced_bytes += nbytes
        self.paced_copies += 1
        cycles = int(nbytes * cycles_per_byte)
        if cycles > 0:
            torch.cuda._sleep(cycles)

    def chunk_hold(self, chunk_bytes: int) -> Callable[[int], None]:
        """``hold`` for copies of at most ``chunk_bytes`` (a bounce ring's): their extra time reckoned
        from the real rate of copies that size, so the ring's link is the asked one too."""
        if not self.is_cuda or chunk_bytes >= _PROBE_BYTES:
            return self.hold
        self.chunk_real_gbps = pinned_h2d_gbps(self.device, chunk_bytes)
        per_byte = self.cycles_per_byte(self.chunk_real_gbps)
        return lambda nbytes: self._spin(nbytes, per_byte)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)`` on the current stream (asynchronous on a card), then the hold."""
        dst.copy_(src, non_blocking=self.is_cuda)
        self.hold(src.numel() * src.element_size())

    def stats(self) -> dict[str, Any]:
        return {
            "link_gbps": self.gbps,
            "link_real_gbps": self.real_gbps,
            "link_chunk_real_gbps": self.chunk_real_gbps,
            "link_paced": self._cycles_per_byte > 0,  # False: the real link is no faster than asked (or the CPU)
            "link_paced_bytes": self.paced_bytes,
            "link_paced_copies": self.paced_copies,
        }
