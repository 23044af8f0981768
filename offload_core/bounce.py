"""BounceStore: weights in pageable RAM, copied to the device through a small pinned bounce ring.

Where the box will not pin the whole model (WSL2 and Docker Desktop stop near 0.5-1 GiB; native
Windows at about half the RAM), a copy straight from pageable memory runs at 7-10x less than a
pinned one. This store keeps the host masters in an unregistered PinnedArena and moves a unit in
chunks through ``pinned_limit`` bytes of pinned buffers:

- ``num_copy_threads`` fill threads copy the chunks of each requested unit into the ring, in the
  order the engine asked for them, with streaming (non-temporal) stores where streamcopy.py's helper
  builds, else libc's memmove (both through ctypes, which releases the GIL);
- one issuer thread, in that same order, waits for each chunk to be filled and queues its H2D copy
  on the copy stream, then records the unit's ``ready`` event; a chunk's buffer is filled again once
  the event after its copy has completed.

The engine asks for a unit at prefetch time and goes on at once: the fills, the copies and the
compute overlap. Its slot's ``ready`` is a ``Pending`` event, which a stream waits on as on a CUDA
event (``stream.wait_event(pending)``); the host blocks there only if the unit's copies have not all
been queued yet, which means the copies are behind anyway. The device never waits on the host, so
a fill that fails cannot hang a stream: the error is raised by the next wait, as ``BounceError``.

Measured on the H200 host (bench/bounce_probe.py): 48.6 GB/s through a 256 MiB ring of 16 MiB
chunks with 16 threads, against 55.3 pinned and 7.5 pageable; on an H100 host, streaming stores took
the ring from 45.7 to 49.2 GB/s and its Flux-dev LoRA step from 1.20x the arena's to 1.02x.
"""

from __future__ import annotations

import ctypes
import os
import queue
import threading
import time
import weakref
from typing import Any, Callable, Sequence

import torch

from . import streamcopy
from .arena import PinnedArena
from .errors import OffloadConfigError, OffloadError
from .hostmem import HostBuffer
from .units import Unit

__all__ = ["BounceStore", "BounceError", "Pending", "DEFAULT_CHUNK", "BOUNCE_RING", "PINNED_LIMIT_ENV", "pinned_limit"]

DEFAULT_CHUNK = 16 << 20  # 16 MiB: the probe's best on the H200 host (8 MiB close behind)
BOUNCE_RING = 256 << 20  # the ring's size when the limit allows more (48.6 GB/s at 256 MiB on the H200 host)
PINNED_LIMIT_ENV = "OFFLOAD_PINNED_LIMIT"  # a hard cap on pinned bytes, over any config
_MIN_BUFFERS = 4
_RAMP = (16, 16, 8, 4, 2)  # an idle ring's first chunk, in these fractions of a chunk (request)
_NO_LIMIT = 1 << 62


def pinned_limit(configured: int | str | None) -> int:
    """The pinned bytes the engine may ask for: ``pinned_limit`` from the config and the
    ``OFFLOAD_PINNED_LIMIT`` environment cap, the smaller; neither set: no limit (the arena tries
    to pin everything, and a failed registration falls back to the ring)."""
    from .config import parse_bytes

    limit = _NO_LIMIT
    for value, key in ((configured, "pinned_limit"), (os.environ.get(PINNED_LIMIT_ENV), PINNED_LIMIT_ENV)):
        n = parse_bytes(value, key=key) if value not in (None, "") else None
        if n is not None:
            limit = min(limit, n)
    return limit


class BounceError(OffloadError, RuntimeError):
    """A fill or copy thread of the bounce store failed; the message says which and why."""


class Pending:
    """A unit's ``ready`` event before the issuer thread has recorded it.

    ``wait(stream)`` is what ``stream.wait_event(pending)`` calls: the host waits until the unit's
    copies are queued (raising the ring's error if a thread failed), then the stream waits on the
    recorded CUDA event, as for any other slot.
    """

    __slots__ = ("_done", "event", "_ring")

    def __init__(self, ring: "_Ring") -> None:
        self._done = threading.Event()
        self.event: Any = None
        self._ring = ring

    def set(self, event: Any) -> None:
        self.event = event
        self._done.set()

    def resolve(self) -> Any:
        while not self._done.wait(0.05):
            self._ring.check()
        self._ring.check()
        return self.event

    def wait(self, stream: Any = None) -> None:
        ev = self.resolve()
        if ev is not None:
            stream.wait_event(ev)

    def query(self) -> bool:
        return self._done.is_set() and (self.event is None or self.event.query())

    def synchronize(self) -> None:
        ev = self.resolve()
        if ev is not None:
            ev.synchronize()


class _Job:
    """One unit's bytes on their way through the ring: chunk sequence numbers first..first+n."""

    __slots__ = ("first", "chunks")

    def __init__(self, first: int, chunks: list[tuple[int, int]]) -> None:
        self.first = first
        self.chunks = chunks  # (source address, bytes), in order


class _Ring:
    """The pinned buffers, the fill threads and the issuer thread (none of them hold the store).

    Each buffer has its own condition, so a fill or a copy wakes only the (at most two) threads
    waiting on that buffer: one shared condition woke all of them at every chunk, and their GIL
    churn slowed the engine's own kernel launches. Work reaches the threads through SimpleQueues.
    """

    def __init__(self, limit: int, chunk: int, threads: int, device: torch.device, pin: bool) -> None:
        self._pinned_buffers(limit, chunk, device, pin)
        nbuf, chunk = self.nbuf, self.chunk
        self.bufs = [self.host.tensor[i * chunk: (i + 1) * chunk] for i in range(nbuf)]
        self.ptrs = [b.data_ptr() for b in self.bufs]
        self.conds = [threading.Condition(threading.Lock()) for _ in range(nbuf)]
        self.filled = [-1] * nbuf  # per buffer: the sequence number whose bytes it holds
        self.consumed = [-1] * nbuf  # per buffer: the sequence number whose copy out of it is queued
        self.events: list[Any] = [None] * nbuf  # the event after that copy
        self.seq = 0  # the next sequence number to hand out (requests come from one thread at a time)
        self.memmove, self.fill_kind = _fill_copy()
        self._start(self._fill_loop, "bounce-fill", threads)

    def _pinned_buffers(self, limit: int, chunk: int, device: torch.device, pin: bool) -> None:
        """At least four buffers of at most ``chunk`` bytes (page multiples) in ``limit``, in one pinned block."""
        nbuf = max(limit // chunk, _MIN_BUFFERS)
        chunk = max(min(chunk, limit // nbuf) // 4096 * 4096, 4096)
        self._common(nbuf, chunk, device)
        self.host = HostBuffer(nbuf * chunk)
        self.pinned = self.host.pin() if pin else False

    def _common(self, nbuf: int, chunk: int, device: torch.device) -> None:
        self.nbuf, self.chunk = nbuf, chunk
        self.is_cuda = device.type == "cuda"
        self.tasks: queue.SimpleQueue = queue.SimpleQueue()  # the fill threads' work, or None: stop
        self.issue: queue.SimpleQueue = queue.SimpleQueue()  # functions, or None: stop
        self.idle = threading.Condition(threading.Lock())
        self.posted = 0  # functions posted to the issuer, and finished by it
        self.finished = 0
        self.error: BaseException | None = None
        self.closed = False
        self.fill_bytes = 0
        self.fill_s = 0.0
        self.wait_s = 0.0  # the issuer waiting for a fill
        # a LinkPacer's start and hold under debug_link_gbps (link.py): before and after each chunk's copy
        self.start: Callable[[], Any] = _no_start
        self.hold: Callable[..., None] = _no_hold
        self.cpus = _spare_cpus()  # OFFLOAD_BOUNCE_CORES=spare: the CPUs the threads keep to (None: any)

    def _start(self, loop: Callable[[], None], name: str, n: int) -> None:
        """``n`` threads running ``loop`` (named name-0, name-1, ...), and the issuer."""
        self.fillers = [threading.Thread(target=self._on_cpus(loop), name=f"{name}-{i}", daemon=True)
                        for i in range(max(n, 1))]
        self.threads = self.fillers + [threading.Thread(target=self._on_cpus(self._issue_loop), name="bounce-issue",
                                                        daemon=True)]
        for t in self.threads:
            t.start()

    def _on_cpus(self, loop: Callable[[], None]) -> Callable[[], None]:
        if self.cpus is None:
            return loop

        def run() -> None:
            try:
                os.sched_setaffinity(0, self.cpus)  # this thread only (Linux: pid 0 is the calling thread)
            except OSError:
                pass
            loop()
        return run

    # ------------------------------------------------------------------ errors and shutdown
    def check(self) -> None:
        if self.error is not None:
            raise BounceError(f"bounce store: {self.error}") from self.error
        if self.closed:
            raise BounceError("bounce store: used after close()")

    def _wake_all(self) -> None:
        for c in self.conds:
            with c:
                c.notify_all()
        with self.idle:
            self.idle.notify_all()

    def _fail(self, exc: BaseException, where: str) -> None:
        if self.error is None:
            self.error = RuntimeError(f"{where} failed: {type(exc).__name__}: {exc}")
        self._wake_all()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for _ in self.fillers:
            self.tasks.put(None)
        self.issue.put(None)
        self._wake_all()
        me = threading.current_thread()
        for t in self.threads:
            if t is not me:
                t.join(timeout=5.0)
        self._release()

    def _release(self) -> None:
        self.host.close()

    # ------------------------------------------------------------------ requests
    def request(self, src: torch.Tensor) -> _Job:
        """Queue the fills of ``src`` (a pageable host slab); its chunks follow every earlier request's."""
        self.check()
        base, n = src.data_ptr(), src.numel() * src.element_size()
        chunks: list[tuple[int, int]] = []
        o = 0
        if self.tasks.empty():
            # Nothing queued for the fill threads: the copy stream waits for this unit's first chunk (the
            # next forward's first streamed unit, after a step). Its first chunk's worth goes in pieces of
            # 1/16, 1/16, 1/8, 1/4 and 1/2 of a chunk, filled side by side: the first copy can begin after
            # a sixteenth of one thread's memcpy of a chunk (16 MiB: ~5 ms on the H100 host).
            for part in _RAMP:
                m = min(self.chunk // part, n - o)
                if m <= 0:
                    break
                chunks.append((base + o, m))
                o += m
        chunks += [(base + p, min(self.chunk, n - p)) for p in range(o, n, self.chunk)]
        job = _Job(self.seq, chunks)
        for i, (a, m) in enumerate(chunks):
            self.tasks.put((self.seq + i, a, m))
        self.seq += len(chunks)
        return job

    def post(self, fn: Callable[[], None]) -> None:
        """Run fn on the issuer thread, after everything posted before it."""
        self.check()
        with self.idle:
            self.posted += 1
        self.issue.put(fn)

    # ------------------------------------------------------------------ fill threads
    def _fill_loop(self) -> None:
        try:
            while True:
                task = self.tasks.get()
                if task is None or self.closed or self.error is not None:
                    return
                seq, src, n = task
                b = seq % self.nbuf
                c = self.conds[b]
                with c:  # the buffer's last occupant must have had its copy queued ...
                    while self.consumed[b] < seq - self.nbuf and not self.closed and self.error is None:
                        c.wait()
                    ev = self.events[b]
                if self.closed or self.error is not None:
                    return
                if ev is not None:  # ... and finished (the wait releases the GIL)
                    ev.synchronize()
                t0 = time.perf_counter()
                self.memmove(self.ptrs[b], src, n)
                dt = time.perf_counter() - t0
                with c:
                    self.filled[b] = seq
                    c.notify_all()
                self.fill_bytes += n  # statistics only: a lost update under a race is harmless
                self.fill_s += dt
        except BaseException as exc:  # surfaced by the next wait, never a hang
            self._fail(exc, f"fill thread {threading.current_thread().name}")

    # ------------------------------------------------------------------ consuming
    def copy(self, job: _Job, dst: torch.Tensor, stream: Any) -> None:
        """Copy job's chunks into ``dst`` (device bytes) as they are filled: queued on ``stream``,
        the current stream (CUDA; each buffer reused once its copy's event completes), or
        synchronously (no stream)."""
        off = 0
        slot = None
        for i, (_, n) in enumerate(job.chunks):
            seq = job.first + i
            b = seq % self.nbuf
            c = self.conds[b]
            with c:
                if self.filled[b] != seq:
                    t0 = time.perf_counter()
                    while self.filled[b] != seq and self.error is None and not self.closed:
                        c.wait()
                    self.wait_s += time.perf_counter() - t0
            self.check()
            slot = self.start(slot)  # right behind the chunk before, on the same stream (link.py)
            dst[off: off + n].copy_(self.bufs[b][:n], non_blocking=stream is not None)
            self.hold(n, slot)  # an emulated slower link holds the buffer as long as that link would
            ev = None
            if stream is not None:
                # blocking: a fill thread waiting on it sleeps; the default event spins, and 16 spinning
                # threads took the cores the memcpys and the engine's own thread need
                ev = torch.cuda.Event(blocking=True)
                ev.record(stream)
            off += n
            with c:
                self.events[b] = ev
                self.consumed[b] = seq
                c.notify_all()

    def counters(self) -> tuple[int, float, float]:
        """Fill bytes, the fill threads' copy seconds (summed), the issuer's seconds waiting for fills."""
        return self.fill_bytes, self.fill_s, self.wait_s

    def _issue_loop(self) -> None:
        try:
            while True:
                fn = self.issue.get()
                if fn is None or self.closed:
                    return
                try:
                    fn()
                finally:
                    with self.idle:
                        self.finished += 1
                        self.idle.notify_all()
        except BaseException as exc:
            self._fail(exc, "issuer thread")

    def drain(self) -> None:
        """Wait until every posted unit's copies are queued (before a device sync means 'all done').
        After a failure there is nothing more to wait for: the error is the next use's to raise, and
        remove() still restores the model from the masters."""
        with self.idle:
            while self.finished < self.posted and self.error is None and not self.closed:
                self.idle.wait(0.05)


class _Window:
    """A page-aligned part of an arena buffer, registered (page-locked) in place while copies read it."""

    __slots__ = ("ptr", "nbytes", "tensor", "refs", "event", "ready")

    def __init__(self, ptr: int, nbytes: int, tensor: torch.Tensor) -> None:
        self.ptr, self.nbytes, self.tensor = ptr, nbytes, tensor
        self.refs = 0  # pieces given this window whose copies are not queued yet
        self.event: Any = None  # after the latest copy out of it
        self.ready = threading.Event()  # registered


class _Piece:
    """One copy of a request: ``nbytes`` at ``offset`` of a window, to ``dst_offset`` of the unit; ``ready``
    once its window is registered (and counts this piece in its refs)."""

    __slots__ = ("seq", "key", "offset", "nbytes", "dst_offset", "ready", "window")

    def __init__(self, seq: int, key: tuple[int, int], offset: int, nbytes: int, dst_offset: int) -> None:
        self.seq, self.key, self.offset, self.nbytes, self.dst_offset = seq, key, offset, nbytes, dst_offset
        self.ready = threading.Event()
        self.window: _Window | None = None


class _RegisterRing(_Ring):
    """Bounce mode "register" (``OFFLOAD_BOUNCE_MODE=register``, an experiment): no bounce buffers and no
    host memcpy. The pageable masters' buffers are cut into page-aligned windows of ``chunk`` bytes;
    ``threads`` registrar threads page-lock the windows the requests need in place (cudaHostRegister;
    the masters are on transparent huge pages, so that pins few pages), at most ``limit`` bytes at a
    time. Room is taken in request order (a piece's turn), so a window is never held by a later piece
    while an earlier one waits for room: the oldest idle window is unlocked, once its last copy
    completed, and the locking itself runs in parallel. The issuer copies each piece straight from
    its window. A byte is read once, by the DMA, where the copy mode reads, writes and reads it again."""

    def __init__(self, limit: int, chunk: int, threads: int, buffers: list[torch.Tensor], device: torch.device,
                 pin: bool) -> None:
        chunk = max(chunk // 4096 * 4096, 4096)
        self._common(max(limit // chunk, _MIN_BUFFERS), chunk, device)
        self.pin = pin and self.is_cuda
        self.pinned = self.pin
        self.buffers = sorted((b.data_ptr(), b.numel() * b.element_size(), b) for b in buffers)
        self.starts = [b[0] for b in self.buffers]
        self.cond = threading.Condition(threading.Lock())
        self.windows: dict[tuple[int, int], _Window] = {}  # registered or being registered, oldest first
        self.unlocking = 0  # windows taken out of the dict, not unregistered yet (they still count)
        self.seq = 0  # the next piece's number (requests come from one thread at a time)
        self.turn = 0  # the piece whose room is taken next
        self.registrations = 0
        self._start(self._register_loop, "bounce-register", threads)

    def _wake_all(self) -> None:
        with self.cond:
            self.cond.notify_all()
        with self.idle:
            self.idle.notify_all()

    def request(self, src: torch.Tensor) -> Any:
        """The pieces of ``src`` (a slab of one of the buffers), cut at window edges, queued for registration."""
        import bisect

        self.check()
        a, n = src.data_ptr(), src.numel() * src.element_size()
        i = bisect.bisect_right(self.starts, a) - 1
        if i < 0 or a + n > self.buffers[i][0] + self.buffers[i][1]:
            raise BounceError(f"bounce store: a {n}-byte slab outside the masters' buffers")
        base = self.buffers[i][0]
        pieces, off = [], 0
        while off < n:
            k, within = divmod(a + off - base, self.chunk)
            m = min(self.chunk - within, n - off)
            piece = _Piece(self.seq, (i, k), within, m, off)
            self.seq += 1
            pieces.append(piece)
            self.tasks.put(piece)
            off += m
        return pieces

    def _stopping(self) -> bool:
        return self.closed or self.error is not None

    def _register_loop(self) -> None:
        rt = torch.cuda.cudart() if self.pin else None
        try:
            while True:
                piece = self.tasks.get()
                if piece is None or self._stopping():
                    return
                t0 = time.perf_counter()
                w, mine = self._reserve(piece, rt)
                if w is None:
                    return
                if mine:
                    self._lock(w, rt)
                else:
                    while not w.ready.wait(0.05):
                        if self._stopping():
                            return
                piece.window = w
                piece.ready.set()
                self.fill_s += time.perf_counter() - t0
        except BaseException as exc:  # surfaced by the next wait, never a hang
            self._fail(exc, f"register thread {threading.current_thread().name}")

    def _reserve(self, piece: _Piece, rt: Any) -> tuple[_Window | None, bool]:
        """In the piece's turn: its window counted for it (already there, or new, after unlocking the oldest
        idle one if the budget is full)."""
        key = piece.key
        with self.cond:
            while self.turn != piece.seq:
                if self._stopping():
                    return None, False
                self.cond.wait(0.05)
        while True:
            with self.cond:
                w = self.windows.get(key)
                if w is not None or len(self.windows) + self.unlocking < self.nbuf:
                    mine = w is None
                    if mine:
                        base, size, buf = self.buffers[key[0]]
                        start = key[1] * self.chunk
                        nbytes = min(self.chunk, size - start)
                        w = self.windows[key] = _Window(base + start, nbytes, buf[start: start + nbytes])
                    w.refs += 1
                    self.turn += 1
                    self.cond.notify_all()
                    return w, mine
                idle = next((k for k, x in self.windows.items() if x.refs == 0 and x.ready.is_set()), None)
                if idle is None:
                    if self._stopping():
                        return None, False
                    self.cond.wait(0.05)
                    continue
                old = self.windows.pop(idle)
                self.unlocking += 1
            try:
                self._unregister(old, rt)
            finally:
                with self.cond:
                    self.unlocking -= 1

    def _lock(self, w: _Window, rt: Any) -> None:
        if rt is not None:
            err = int(rt.cudaHostRegister(w.ptr, w.nbytes, 0))
            if err != 0:
                from .hostmem import clear_cuda_error, cuda_error_name

                clear_cuda_error()
                raise RuntimeError(f"cudaHostRegister of {w.nbytes} bytes failed: {cuda_error_name(err)}")
        self.registrations += 1
        self.fill_bytes += w.nbytes
        w.ready.set()

    @staticmethod
    def _unregister(w: _Window, rt: Any) -> None:
        if w.event is not None:
            w.event.synchronize()  # no copy still reads it
        if rt is not None:
            rt.cudaHostUnregister(w.ptr)

    def copy(self, job: Any, dst: torch.Tensor, stream: Any) -> None:
        slot = None
        for piece in job:
            if not piece.ready.is_set():
                t0 = time.perf_counter()
                while not piece.ready.wait(0.05):
                    self.check()
                self.wait_s += time.perf_counter() - t0
            self.check()
            w = piece.window
            out = dst[piece.dst_offset: piece.dst_offset + piece.nbytes]
            src = w.tensor[piece.offset: piece.offset + piece.nbytes]
            slot = self.start(slot)
            out.copy_(src, non_blocking=stream is not None)
            self.hold(piece.nbytes, slot)
            ev = None
            if stream is not None:
                before = w.event
                if before is not None:  # a copy out of this window on another stream: the new event covers it too
                    stream.wait_event(before)
                    slot = None  # a wait queued after it: the next copy is not right behind this one
                ev = torch.cuda.Event(blocking=True)
                ev.record(stream)
            with self.cond:
                w.event = ev
                w.refs -= 1
                self.cond.notify_all()

    def _release(self) -> None:
        rt = torch.cuda.cudart() if self.pin else None
        with self.cond:
            windows, self.windows = list(self.windows.values()), {}
        for w in windows:
            if w.ready.is_set():
                self._unregister(w, rt)


class _NativeJob:
    """A unit's chunks in the native ring: numbers first..first+count-1, nbytes in all."""

    __slots__ = ("first", "count", "nbytes")

    def __init__(self, first: int, count: int, nbytes: int) -> None:
        self.first, self.count, self.nbytes = first, count, nbytes


class _NativeRing(_Ring):
    """Bounce ring "native" (``OFFLOAD_BOUNCE_RING=native``): the same ring, order and chunk ramp, with the
    chunk loop in native threads (native/bounce_ring.c). The fill threads are pthreads that never take
    the GIL; the issuer thread stays Python for each unit's waits and widening, and hands the unit's
    chunks to one native call (queue each copy as its fill lands, record the buffer's event), made
    without the GIL. The Python ring takes the GIL several times a chunk in each thread, about 3,000
    chunks a second at 50 GB/s, beside the engine's thread, which takes it back after every op."""

    def __init__(self, limit: int, chunk: int, threads: int, device: torch.device, pin: bool, lib: Any,
                 host_bytes: int = 0, units: int = 0) -> None:
        self.lib = lib
        self.handle = None
        self.leaked = False
        self._pinned_buffers(limit, chunk, device, pin)
        nbuf, chunk = self.nbuf, self.chunk
        streaming = _switch(BOUNCE_FILL_ENV) == "stream"
        self.fill_kind = "stream, native ring" if streaming else f"libc ({BOUNCE_FILL_ENV}=libc), native ring"
        cpus = sorted(self.cpus or ())  # OFFLOAD_BOUNCE_CORES=spare: the fill threads keep to them too
        # chunks requested ahead of their copies, at most: every unit of the masters twice over (never reached)
        ntasks = max(1 << 16, 2 * (host_bytes // chunk + 6 * units) + 64)
        args = (nbuf, chunk, self.host.tensor.data_ptr(), max(threads, 1), int(self.is_cuda), int(streaming),
                (ctypes.c_int * max(len(cpus), 1))(*cpus), len(cpus), ntasks)
        if self.is_cuda:
            with torch.cuda.device(device):  # the ring's threads take the context current here: this device's
                torch.cuda.synchronize(device)
                handle = lib.oj_ring_new(*args)
        else:
            handle = lib.oj_ring_new(*args)
        if not handle:
            self.host.close()
            raise MemoryError("the native bounce ring could not be allocated")
        if lib.oj_ring_failed(handle):
            why = lib.oj_ring_error(handle).decode(errors="replace")
            lib.oj_ring_close(handle)
            self.host.close()
            raise _NativeUnavailable(why)
        self.handle = handle
        self.fillers = [None] * lib.oj_ring_threads(handle)  # native: counted, not Thread objects
        self.issuer = threading.Thread(target=self._on_cpus(self._issue_loop), name="bounce-issue", daemon=True)
        self.threads = [self.issuer]
        self.issuer.start()
        self._stats = (ctypes.c_double * 3)()

    def check(self) -> None:
        if self.error is None and self.handle is not None and self.lib.oj_ring_failed(self.handle):
            self.error = RuntimeError(self.lib.oj_ring_error(self.handle).decode(errors="replace"))
        super().check()

    def _live(self) -> Any:
        """The native handle; a BounceError once the ring is closed (never a NULL into C)."""
        self.check()
        if self.handle is None:
            raise BounceError("bounce store: used after close()")
        return self.handle

    def request(self, src: torch.Tensor) -> _NativeJob:
        handle = self._live()
        count = ctypes.c_int64()
        nbytes = src.numel() * src.element_size()
        first = self.lib.oj_ring_request(handle, src.data_ptr(), nbytes, ctypes.byref(count))
        if first < 0:
            self.check()
            raise BounceError("bounce store: the native ring refused a request")
        return _NativeJob(first, count.value, nbytes)

    def copy(self, job: _NativeJob, dst: torch.Tensor, stream: Any) -> None:
        handle = self._live()
        if not dst.is_contiguous() or dst.numel() * dst.element_size() < job.nbytes:
            raise BounceError(f"bounce store: a {job.nbytes}-byte unit into a destination of "
                              f"{dst.numel() * dst.element_size()} bytes")
        wait = stream is None and self.is_cuda  # streams off: a synchronous copy on the current stream
        if wait:
            stream = torch.cuda.current_stream(dst.device)
        raw = stream.cuda_stream if stream is not None else None
        if self.lib.oj_ring_copy(handle, job.first, job.count, dst.data_ptr(), raw) != 0:
            self.check()
            raise BounceError("bounce store: a native copy failed")
        if wait:
            stream.synchronize()

    def counters(self) -> tuple[int, float, float]:
        if self.handle is None:
            return 0, 0.0, 0.0
        self.lib.oj_ring_stats(self.handle, ctypes.byref(self._stats))
        fill_bytes, fill_s, wait_s = self._stats
        return int(fill_bytes), fill_s, wait_s

    def _wake_all(self) -> None:
        with self.idle:
            self.idle.notify_all()

    def fail_next_fill(self) -> None:
        """A test's injected failure: the fill of the next chunk requested fails."""
        self.lib.oj_ring_fail_at(self._live(), -1)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.issue.put(None)
        self.lib.oj_ring_stop(self.handle)  # a copy under way returns at once
        self._wake_all()
        if threading.current_thread() is not self.issuer:
            self.issuer.join(timeout=5.0)
        if self.issuer.is_alive():
            # still inside the ring (a stuck device call, or closing from the issuer itself): the fill
            # threads are joined, so nothing reads the masters, but the ring and its buffers are left
            # alive (freed under a thread, they would crash it), and so are the masters (BounceStore.close)
            self.lib.oj_ring_join(self.handle)
            self.leaked = True
            return
        self.lib.oj_ring_close(self.handle)  # joins the fill threads, waits for the buffers' last copies
        self.handle = None
        self._release()


class _NativeUnavailable(Exception):
    """The native ring could not start here (one line: why)."""


def native_fill_threads() -> dict[int, str]:
    """This process's native rings' fill threads (Linux): thread id -> name (oj-fill-N)."""
    out = {}
    try:
        for tid in os.listdir("/proc/self/task"):
            name = _read(f"/proc/self/task/{tid}/comm").strip()
            if name.startswith("oj-fill-"):
                out[int(tid)] = name
    except OSError:
        pass
    return out


BOUNCE_MODE_ENV = "OFFLOAD_BOUNCE_MODE"  # "copy" (the default) or "register" (_RegisterRing, an experiment)


BOUNCE_CORES_ENV = "OFFLOAD_BOUNCE_CORES"  # "all" (the default) or "spare" (an experiment: _spare_cpus)
# "stream" (the default: streaming stores, streamcopy.py, where they build) or "libc" (libc's memmove)
BOUNCE_FILL_ENV = "OFFLOAD_BOUNCE_FILL"
# "python" (the default: _Ring) or "native" (_NativeRing: the chunk loop in pthreads, where it builds)
BOUNCE_RING_ENV = "OFFLOAD_BOUNCE_RING"
_SWITCHES = {BOUNCE_MODE_ENV: ("copy", "register"), BOUNCE_CORES_ENV: ("all", "spare"),
             BOUNCE_FILL_ENV: ("stream", "libc"), BOUNCE_RING_ENV: ("python", "native")}  # the default first


def _switch(name: str) -> str:
    """An experiment's environment switch: its default when unset or empty; anything but its values is a
    named error (the engine reads them all before it touches the model: check_switches)."""
    raw = os.environ.get(name, "")
    value, allowed = raw.strip().lower() or _SWITCHES[name][0], _SWITCHES[name]
    if value not in allowed:
        raise OffloadConfigError(f"{name}={raw!r}: expected {' or '.join(allowed)}")
    return value


def bounce_mode() -> str:
    """``OFFLOAD_BOUNCE_MODE``: "copy" or "register" (_RegisterRing)."""
    return _switch(BOUNCE_MODE_ENV)


def check_switches() -> None:
    for name in _SWITCHES:
        _switch(name)


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _cpu_list(text: str) -> set[int]:
    """Linux's CPU list format ("0-3,8,10-11") -> the CPU numbers."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if "-" in part:
            a, b = part.split("-", 1)
            out.update(range(int(a), int(b) + 1))
        elif part.strip():
            out.add(int(part))
    return out


def _spare_cpus() -> set[int] | None:
    """The CPUs the copy threads may run on under ``OFFLOAD_BOUNCE_CORES=spare``: this process's, less
    the core the calling thread (the engine's, which launches the kernels) runs on now and that
    core's SMT siblings, so that no fill shares a core with it (a sibling's memcpy halves its
    instruction rate). None where that is unknown or would leave fewer than two CPUs (all of them)."""
    if _switch(BOUNCE_CORES_ENV) != "spare" or not hasattr(os, "sched_getaffinity"):
        return None
    stat = _read("/proc/thread-self/stat")
    try:
        cpu = int(stat.rsplit(")", 1)[1].split()[36])  # field 39, "processor"
    except (IndexError, ValueError):
        return None
    siblings = _cpu_list(_read(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")) or {cpu}
    rest = set(os.sched_getaffinity(0)) - siblings - {cpu}
    return rest if len(rest) >= 2 else None


def _fill_copy() -> tuple[Callable[[int, int, int], Any], str]:
    """The fill threads' copy, and its name for stats(): streaming stores unless switched off or not
    built here (then libc's memmove, and why)."""
    if _switch(BOUNCE_FILL_ENV) == "libc":
        return ctypes.memmove, f"libc ({BOUNCE_FILL_ENV}=libc)"
    fn, why = streamcopy.load()
    return (fn, why) if fn is not None else (ctypes.memmove, f"libc ({why})")


def _make_ring(limit: int, chunk: int, threads: int, device: torch.device, arena: PinnedArena) -> _Ring:
    """The copy mode's ring: native where switched on and it builds and starts here, else Python's
    (the reason in stats()["bounce_fill_copy"])."""
    pin = device.type == "cuda"
    why = ""
    if _switch(BOUNCE_RING_ENV) == "native":
        lib, why = streamcopy.load_ring()
        if lib is not None:
            try:
                return _NativeRing(limit, chunk, threads, device, pin, lib, host_bytes=arena.capacity_bytes,
                                   units=len(arena._slabs))
            except _NativeUnavailable as exc:
                why = str(exc)
    ring = _Ring(limit, chunk, threads, device, pin=pin)
    if why:
        ring.fill_kind += f" (the native ring: {why})"
    return ring


def _no_start(after: Any = None) -> None:
    """The real link: nothing to stamp before a chunk's copy."""


def _no_hold(nbytes: int, slot: Any = None) -> None:
    """The real link: nothing to add after a chunk's copy."""


def _default_threads() -> int:
    cpus = _spare_cpus()
    return max(1, min(16, len(cpus) if cpus else os.cpu_count() or 1))


class BounceStore:
    """A HostStore whose masters are pageable (an unregistered PinnedArena) and whose copies go
    through a pinned ring of ``limit`` bytes (see the module docstring)."""

    filled = False
    bounce = True  # the engine's Transfer hands this store its copies (transfer.py)

    def __init__(self, arena: PinnedArena, *, limit: int, device: torch.device, threads: int | None = None,
                 chunk: int | None = None, reason: str = "") -> None:
        self.arena = arena
        self.reason = reason
        self.limit = int(limit)
        if bounce_mode() == "register":
            self.ring = _RegisterRing(self.limit, chunk or DEFAULT_CHUNK, threads or _default_threads(), arena.buffers(),
                                      device, pin=device.type == "cuda")
        else:
            self.ring = _make_ring(self.limit, chunk or DEFAULT_CHUNK, threads or _default_threads(), device, arena)
        self._args = (chunk or DEFAULT_CHUNK, threads or _default_threads(), device)
        self._finalizer = weakref.finalize(self, self.ring.close)
        self._finalizer.atexit = False

    @property
    def pinned(self) -> bool:
        return self.ring.pinned

    # pinned bytes: the ring (the masters are pageable: stats()["host_arena_bytes"])
    @property
    def capacity_bytes(self) -> int:
        return self.ring.nbuf * self.ring.chunk

    @property
    def used_bytes(self) -> int:
        return self.ring.nbuf * self.ring.chunk

    # ------------------------------------------------------------------ HostStore
    def follow_trace(self, trace: Sequence[int]) -> None:
        """Fills follow the engine's requests, which follow the trace: nothing to schedule."""

    def acquire(self, uid: int, *, block: bool = True) -> torch.Tensor | None:
        return self.arena.slab(uid)

    def release(self, uid: int, after: Any = None) -> None:
        """The ring reuses its own buffers once their copies complete: nothing to give back."""

    def unuse(self, uid: int) -> None:
        """No trace followed: nothing to undo."""

    def master(self, uid: int) -> torch.Tensor:
        return self.arena.master(uid)

    def view(self, unit: Unit, index: int) -> torch.Tensor:
        return self.arena.view(unit, index)

    def stats(self) -> dict[str, Any]:
        r = self.ring
        fill_bytes, fill_s, wait_s = r.counters()
        return {
            **self.arena.stats(),
            "host_store": "bounce",
            "host_store_reason": self.reason,
            "pinned_limit_bytes": self.limit,
            "bounce_ring_bytes": r.nbuf * r.chunk,
            "bounce_chunk_bytes": r.chunk,
            "bounce_threads": len(r.fillers),
            "bounce_pinned": r.pinned,
            "bounce_fill_bytes": fill_bytes,
            "bounce_fill_copy": getattr(r, "fill_kind", "none (registered in place)"),
            # bytes per second of the threads' own memcpy time, summed over threads
            "bounce_fill_gbps": fill_bytes / fill_s / 1e9 if fill_s > 0 else 0.0,
            "bounce_wait_ms": wait_s * 1e3,
        }

    def close(self) -> None:
        self._finalizer()
        if not getattr(self.ring, "leaked", False):  # a native ring left alive may still copy out of them
            self.arena.close()

    # ------------------------------------------------------------------ the copies (transfer.py)
    def request(self, src: torch.Tensor) -> _Job:
        return self.ring.request(src)

    def copy(self, job: _Job, dst: torch.Tensor, stream: Any) -> None:
        self.ring.copy(job, dst, stream)

    def post(self, fn: Callable[[], None]) -> None:
        self.ring.post(fn)

    def pending(self) -> Pending:
        return Pending(self.ring)

    def drain(self) -> None:
        self.ring.drain()

    def pace(self, pacer: Any) -> None:
        """Pace each chunk's copy as an emulated slower link would (link.py). The pacer's holds are
        torch kernels queued per chunk: a native ring gives way to the Python one (before any use)."""
        if isinstance(self.ring, _NativeRing):
            self._finalizer.detach()
            self.ring.close()
            chunk, threads, device = self._args
            self.ring = _Ring(self.limit, chunk, threads, device, pin=device.type == "cuda")
            self.ring.fill_kind += " (a paced link: the Python ring)"
            self._finalizer = weakref.finalize(self, self.ring.close)
            self._finalizer.atexit = False
        self.ring.start = pacer.start
        self.ring.hold = pacer.chunk_hold(self.ring.chunk)
