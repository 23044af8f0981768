"""Transfer: every copy between host and device, the streams it runs on and the events that order it.

- H2D: a unit's slab into its slot, on the copy stream (or, for a unit stored narrower, into a raw
  buffer, then widened into the slot on the convert stream). The compute stream waits on the
  slot's ``ready`` event; the copy waits for whatever the slot's last owner still had queued.
- D2H: one primitive, ``d2h``: after the compute stream's current point, on the D2H stream, with a
  ``done`` event. Gradients (optimizer offload) and write-back of in-place-updated buffers use it.
- Write-back: a unit's dirty buffers back into its host master; a later load of the unit waits
  for it, and reading the masters (state_dict) first calls ``flush``.
- An emulated slower link (``debug_link_gbps``, link.py): every H2D copy is followed on its stream
  by a hold for the time that link would need on top; bound at setup, like the bounce store's copies.

Without streams (the CPU, or ``use_streams=False``) the same calls copy synchronously.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any

import torch

from .slots import Slot
from .stats import CopyClock, Counters, TimingLog
from .quant import UnitWidener
from .units import Unit

if TYPE_CHECKING:
    from .bounce import BounceStore
    from .link import LinkPacer

__all__ = ["Transfer"]


def _set_stream(s: Any) -> None:
    torch._C._cuda_setStream(stream_id=s.stream_id, device_index=s.device_index, device_type=s.device_type)


class _On:
    """``with _On(s, back):`` ``s`` is the current stream inside, ``back`` after.

    What ``torch.cuda.stream(s)`` does, without its queries of the current stream and device (the
    hot path switches streams for every copy). Only when the engine's device is the current one:
    otherwise setting a stream of another device changes the current device, and
    ``torch.cuda.stream`` restores both.
    """

    __slots__ = ("to", "back", "ctx")

    def __init__(self, to: Any, back: Any) -> None:
        self.to, self.back = to, back
        self.ctx = None if torch._C._cuda_getDevice() == to.device_index else torch.cuda.stream(to)

    def __enter__(self) -> None:
        if self.ctx is None:
            _set_stream(self.to)
        else:
            self.ctx.__enter__()

    def __exit__(self, *exc: Any) -> None:
        if self.ctx is None:
            _set_stream(self.back)
        else:
            self.ctx.__exit__(*exc)


class Transfer:
    def __init__(self, device: torch.device, *, use_streams: bool, timing: TimingLog | None, counters: Counters,
                 widener: UnitWidener, bounce: BounceStore | None = None, pacer: LinkPacer | None = None) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.use_streams = bool(use_streams and self.is_cuda)
        self.timing = timing
        self.timed = timing is not None  # the engine turns it off for the cycles it does not time
        self.counters = counters
        self.widener = widener
        self._raw_free: dict[Any, Any] = {}  # raw buffer key -> the event after its last widening
        self._raw_turn = 0
        self._writeback: dict[int, Any] = {}  # uid -> event: its buffers are on their way to the host
        self.h2d_stream = self.d2h_stream = self.convert_stream = None
        self._index = device.index if device.index is not None else (torch.cuda.current_device() if self.is_cuda else 0)
        self._by_raw: dict[int, Any] = {}  # raw stream handle -> its Stream object (compute_stream)
        self._freed = None  # one event re-recorded per load: a wait takes the record made before it
        if self.use_streams:
            # Under an emulated link (debug_link_gbps) the pacer's one-thread kernels run on the copy
            # stream; at the default priority each waits for an SM until the compute kernel filling them
            # all drains (through a bounce ring, ~2,500 chunk copies a Flux-dev step, the copy stream stood
            # idle 1-3 ms 144 times in three steps; 27 times at high priority).
            # A high-priority stream's blocks go first as compute's blocks retire. Plain copies run
            # no kernel there: the priority changes nothing without the pacer.
            self.h2d_stream = torch.cuda.Stream(device, priority=-1 if pacer is not None else 0)
            self.d2h_stream = torch.cuda.Stream(device)
            self.convert_stream = torch.cuda.Stream(device) if widener.raw else None
            self._freed = torch.cuda.Event()
        # A bounce store (bounce.py) moves the bytes itself, through its pinned ring: chosen here,
        # once, so the hot path has no branch on the store.
        self.bounce = bounce
        self._late: collections.deque = collections.deque()  # timing pairs the issuer thread recorded
        # An emulated slower link (debug_link_gbps, link.py) paces every H2D copy: bound here too,
        # so an engine without it runs no pacing code.
        self.pacer = pacer
        if pacer is not None:
            self._copy_in = pacer.copy  # type: ignore[method-assign]
            self._h2d_copy = self._paced_copy  # type: ignore[method-assign]
        if bounce is not None:
            self._load_async = self._load_bounce  # type: ignore[method-assign]
            self._h2d_copy = self._bounce_copy  # type: ignore[method-assign]
            if pacer is not None:
                bounce.pace(pacer)  # the ring's chunk copies
        # times H2D copies (CUDA); the copy stream, or the compute stream when streams are off
        self.clock = None
        if self.is_cuda and timing is not None:
            self.clock = CopyClock(timing, self.h2d_stream if self.use_streams else torch.cuda.current_stream(device))

    @property
    def streams(self) -> tuple:
        return tuple(s for s in (self.h2d_stream, self.d2h_stream, self.convert_stream) if s is not None)

    def compute_stream(self) -> Any:
        """The calling thread's current stream on the device (the hot path asks for it at every use:
        the raw handle is one C call, the Stream object is kept per handle)."""
        raw = torch._C._cuda_getCurrentRawStream(self._index)
        s = self._by_raw.get(raw)
        if s is None:
            s = self._by_raw[raw] = torch.cuda.current_stream(self.device)
        return s

    def mark(self, stream: Any = None) -> Any:
        """A timing event recorded now on ``stream`` (default: the compute stream)."""
        ev = self.timing.event()
        if self.is_cuda:
            ev.record(stream if stream is not None else self.compute_stream())
        else:
            ev.record()
        return ev

    # ------------------------------------------------------------------ H2D
    def load(self, u: Unit, slot: Slot, src: torch.Tensor) -> Any:
        """Copy u's slab ``src`` into ``slot``. Returns the event after which the copy stream is done
        reading ``src`` (None when the copy was synchronous)."""
        if self.use_streams:
            read = self._load_async(u, slot, src)
        else:
            self._load_sync(u, slot, src)
            read = None
        self.counters.h2d_bytes += u.store_nbytes
        self.counters.h2d_count += 1
        if self.timed:
            self.counters.timed_h2d_bytes += u.store_nbytes
        return read

    def _load_async(self, u: Unit, slot: Slot, src: torch.Tensor) -> Any:
        h2d = self.h2d_stream
        compute = self.compute_stream()
        converted = u.converted
        freed = self._freed
        freed.record(compute)
        # Whatever overwrites the slot waits for the kernels queued against its old owner.
        writer = self.convert_stream if converted else h2d
        writer.wait_event(freed)
        for ev in slot.done:
            writer.wait_event(ev)
        slot.done = []
        wb = self._writeback.pop(u.uid, None)
        if wb is not None:
            h2d.wait_event(wb)
        if converted:
            b = self._raw_key(u)
            if self._raw_free.get(b) is not None:
                h2d.wait_event(self._raw_free[b])
            dst = self.widener.raw[b][: u.store_nbytes]
        else:
            dst = slot.buf[: u.nbytes]
        with _On(h2d, compute):
            clock = self.clock if self.timed else None
            a = clock.start(h2d) if clock is not None else None
            self._copy_in(dst, src)
            if a is not None:
                clock.submitted()
                self.timing.add("h2d", u.uid, a, self.mark(h2d))
            read = ready = torch.cuda.Event()
            ready.record(h2d)
        if converted:
            conv = self.convert_stream
            conv.wait_event(ready)
            with _On(conv, compute):
                self.widener.widen(u, b, slot.buf)
                ready = torch.cuda.Event()
                ready.record(conv)
            self._raw_free[b] = ready
        slot.ready = ready
        return read

    def _load_bounce(self, u: Unit, slot: Slot, src: torch.Tensor) -> Any:
        """_load_async for a bounce store: the same waits, copies and widening, queued in the same
        order by the store's issuer thread as the ring's chunks are filled. What must be read now
        (the compute stream's position, the slot's last users, the raw buffer's turn) is read here."""
        store = self.bounce
        compute = self.compute_stream()
        converted = u.converted
        freed = torch.cuda.Event()  # a fresh one: the issuer waits on it later
        freed.record(compute)
        done, slot.done = slot.done, []
        wb = self._writeback.pop(u.uid, None)
        b, raw_free = 0, None
        if converted:
            b = self._raw_key(u)
            raw_free = self._raw_free.get(b)
            dst = self.widener.raw[b][: u.store_nbytes]
        else:
            dst = slot.buf[: u.nbytes]
        while self._late:
            self.timing.add(*self._late.popleft())
        times = (self.timing.event(), self.timing.event()) if self.timed and self.timing is not None else None
        job = store.request(src)
        pending = store.pending()
        h2d, conv, widener, late = self.h2d_stream, self.convert_stream, self.widener, self._late

        def issue() -> None:
            writer = conv if converted else h2d
            writer.wait_event(freed)
            for ev in done:
                writer.wait_event(ev)
            if wb is not None:
                h2d.wait_event(wb)
            if raw_free is not None:
                h2d.wait_event(raw_free)
            with torch.cuda.stream(h2d):
                if times is not None:
                    times[0].record(h2d)
                store.copy(job, dst, h2d)
                if times is not None:
                    times[1].record(h2d)
                    late.append(("h2d", u.uid, times[0], times[1]))
                ready = torch.cuda.Event()
                ready.record(h2d)
            if converted:
                conv.wait_event(ready)
                with torch.cuda.stream(conv):
                    widener.widen(u, b, slot.buf)
                    ready = torch.cuda.Event()
                    ready.record(conv)
            pending.set(ready)

        store.post(issue)
        if converted:
            self._raw_free[b] = pending
        slot.ready = pending
        return None

    @staticmethod
    def _copy_in(dst: torch.Tensor, src: torch.Tensor) -> None:
        """The copy of _load_async, on the current (copy) stream; a LinkPacer's paced copy in its place."""
        dst.copy_(src, non_blocking=True)

    def _h2d_copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        dst.copy_(src, non_blocking=stream is not None)

    def _paced_copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        self.pacer.copy(dst, src)  # on the current stream (a card's: asynchronous, as stream is not None there)

    def _bounce_copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        self.bounce.copy(self.bounce.request(src), dst, stream)

    def _load_sync(self, u: Unit, slot: Slot, src: torch.Tensor) -> None:
        # Serial on purpose (streams off): the host waits for each copy before going on.
        clock = self.clock if self.timed else None
        stream = self.compute_stream() if self.is_cuda else None
        if clock is not None:
            a = clock.start(stream)
        else:
            a = self.mark() if self.timed else None
        converted = u.converted
        b = self._raw_key(u) if converted else 0
        dst = self.widener.raw[b][: u.store_nbytes] if converted else slot.buf[: u.nbytes]
        self._h2d_copy(dst, src, stream)
        if clock is not None:
            clock.submitted()
        if a is not None:
            self.timing.add("h2d", u.uid, a, self.mark())
        if stream is not None:
            stream.synchronize()
        if converted:
            self.widener.widen(u, b, slot.buf)
        slot.ready = None

    def _raw_key(self, u: Unit) -> Any:
        """The raw buffer u's stored bytes are copied into: its own (kept narrow, filled by this copy),
        else the pair's next turn."""
        key = self.widener.key(u.uid)
        if key is not None:
            self.widener.kept[u.uid] = True  # the copy is queued: later loads widen from it alone
            return key
        b = self._raw_turn
        self._raw_turn ^= 1
        return b

    # ------------------------------------------------------------------ units kept narrow
    def widen_kept(self, u: Unit, slot: Slot) -> None:
        """Load a unit kept narrow whose raw buffer holds its bytes: no copy, only its widening into
        ``slot`` (on the convert stream, after the slot's last users; through a bounce store's issuer,
        so it lands after the loads queued before it)."""
        key = ("kept", u.uid)
        widener = self.widener
        if not self.use_streams:
            widener.widen(u, key, slot.buf)
            slot.ready = None
            return
        compute = self.compute_stream()
        freed = torch.cuda.Event()
        freed.record(compute)
        done, slot.done = slot.done, []
        conv = self.convert_stream

        def issue() -> Any:
            conv.wait_event(freed)
            for ev in done:
                conv.wait_event(ev)
            with torch.cuda.stream(conv):  # (on the issuer thread too: not _On, which sets the caller's stream back)
                widener.widen(u, key, slot.buf)
                ready = torch.cuda.Event()
                ready.record(conv)
            return ready

        if self.bounce is None:
            slot.ready = self._raw_free[key] = issue()
            return
        pending = self.bounce.pending()
        self.bounce.post(lambda: pending.set(issue()))
        slot.ready = self._raw_free[key] = pending

    # ------------------------------------------------------------------ D2H
    def d2h(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        """Copy device tensor ``src`` into host ``dst`` once the compute stream has produced it.

        Returns the event that marks the copy done (None when it was synchronous). ``src`` is kept
        alive for the copy stream (``record_stream``), so the caller may drop it at once.
        """
        n = src.numel() * src.element_size()
        self.counters.d2h_bytes += n
        self.counters.d2h_count += 1
        if not self.use_streams:
            dst.copy_(src)
            return None
        compute, d2h = self.compute_stream(), self.d2h_stream
        # A fresh event: d2h() is also called from autograd's thread (gradient hooks) while the
        # main thread may be recording the load event.
        ev = torch.cuda.Event()
        ev.record(compute)
        d2h.wait_event(ev)
        with _On(d2h, compute):
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(d2h)
        src.record_stream(d2h)
        return done

    def write_back(self, u: Unit, dirty: list, master: torch.Tensor, slot: Slot | None) -> None:
        """Copy in-place-updated buffers (running stats, counters) back into the unit's host master."""
        done = None
        for ts, view in dirty:
            done = self.d2h(master[ts.store_offset: ts.store_offset + ts.nbytes], view.reshape(-1).view(torch.uint8))
        if done is not None:
            self._writeback[u.uid] = done
            if u.uid in self.widener.kept:
                self.widener.kept[u.uid] = False  # its own raw buffer is stale: the next load copies again
            if slot is not None:
                slot.done.append(done)  # nothing overwrites the slot before its bytes are out

    def flush(self) -> None:
        """Wait until every write-back has landed in the host masters."""
        for ev in list(self._writeback.values()):
            ev.synchronize()

    def synchronize(self) -> None:
        """Wait for every copy this engine queued (the streams and the compute stream)."""
        if self.bounce is not None:
            self.bounce.drain()  # copies a bounce store has yet to queue
        if self.is_cuda:
            torch.cuda.synchronize(self.device)
