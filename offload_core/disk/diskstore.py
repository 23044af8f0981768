"""DiskStore: the engine's host store when the weights live on disk (``lazy_load``, ``offload_to_disk``).

It has the HostStore interface the engine uses for the PinnedArena (plan, acquire, release,
master, view, stats, close), on top of:

- a SlabCache of ``cache_bytes`` (Belady by default): the units it keeps stay in pinned memory
  across uses;
- a few staging slots (``stream_slots``, default ``num_disk_workers + 2``, each the largest unit)
  that the other units stream through, on top of the cache (the engine's ``max_memory`` counts
  both: integrate.py splits it);
- ``num_disk_workers`` threads that read whole unit slabs (UnitReader: O_DIRECT into the pinned
  slab) in the traced order, as far ahead as the staging slots allow, so disk reads overlap the
  engine's H2D copies and compute.

A use is ``acquire`` (the slab, once its bytes are in memory), then ``release(after=event)`` once the
engine's copy out of it is queued; the slab is reused only after that event completes. A read that
fails (a deleted or truncated file, an I/O error, a checksum) is raised by the next ``acquire``,
from whichever thread: nothing waits forever on a read that will not come.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from ..quant import scale_view
from ..units import Unit
from .cache import NextUse, SlabCache
from .errors import ShardError, ShardReadError
from .format import ShardIndex, SlabEntry
from .pool import HostPool
from .read import UnitReader

log = logging.getLogger(__name__)

__all__ = ["DiskStore"]

_POLL_S = 0.002  # how often a waiting acquire re-checks copy events that free memory


@dataclass
class _Unit:
    unit: Unit
    entry: SlabEntry
    pool: HostPool | None = None  # where its bytes are (None: not in memory)
    offset: int = 0
    where: str = ""  # "cache", "stream", "kept" (an own buffer) or "" (absent)
    reading: bool = False
    fresh: bool = False  # read from disk and not used yet
    holds: int = 0
    events: list = field(default_factory=list)  # copies out of the slab still in flight
    for_pos: int = -1  # the trace position the read was made for
    used_at: int = -1  # the trace position of its latest use
    move_from: int = -1  # staging-slot offset of bytes being copied into its cache slab (-1: none)
    learn: bool = False  # read ahead once the position was known: an unused read teaches a skip
    kept: bool = False

    @property
    def ready(self) -> bool:
        return self.pool is not None and not self.reading


class _Core:
    """The store's state, shared with its worker threads (which hold no reference to the DiskStore)."""

    def __init__(self, units: Sequence[Unit], entries: dict[int, SlabEntry], index: ShardIndex, *, cache_bytes: int,
                 num_disk_workers: int, stream_slots: int | None, policy: str, pin: bool, verify: bool,
                 direct: bool | None) -> None:
        self.reader = UnitReader(index, direct=direct, verify=verify)
        self.units = {u.uid: _Unit(u, entries[u.uid]) for u in units}
        streamed = sum(entries[u.uid].read_nbytes for u in units)
        self.cache = SlabCache(min(cache_bytes, streamed), policy, pin=pin)  # never more than the model needs
        self.cache.sizes = {u.uid: entries[u.uid].read_nbytes for u in units}
        largest = max((e.read_nbytes for e in entries.values()), default=0)
        self.n_stream = stream_slots if stream_slots is not None else num_disk_workers + 2
        self.stream = HostPool(max(self.n_stream, 1) * largest, pin=pin)
        self.own: dict[int, HostPool] = {}  # kept units that did not fit in the cache
        self.cond = threading.Condition()
        self.queue: collections.deque[int] = collections.deque()
        self.moves: collections.deque[int] = collections.deque()  # staging slots to copy into the cache
        self.error: ShardError | None = None
        self.closed = False
        self.pos = -1  # absolute trace position of the latest use
        self.synced = False
        self.trace = NextUse([])
        self.skip: set[int] = set()  # trace positions that no acquire comes for (the engine had the unit)
        self.raw = NextUse([])  # the trace with no position skipped
        self.seen: set[int] = set()  # absolute positions acquired, not judged yet
        self.judged = -1  # positions up to here were judged: acquired, or skipped
        self.lookahead = max(2 * num_disk_workers, self.n_stream)
        self.pinned = self.stream.pinned and (self.cache.capacity_bytes == 0 or self.cache.pool.pinned)
        # counters
        self.hits = self.misses = self.hit_bytes = self.miss_bytes = 0
        self.disk_bytes = self.disk_reads = self.direct_reads = self.wasted_reads = self.emergency = 0
        self.moved = self.moved_bytes = 0
        self.move_errors = 0  # moves whose copy raised (the unit read again instead)
        self.stall_s = 0.0
        self.busy_s = 0.0
        self._inflight = 0
        self._busy_since = 0.0
        # worker 0 also watches the staging slots whose copies are still in flight: a copy that completes
        # frees its slot with no call from the engine, and the next read must not wait for one
        self.workers = [threading.Thread(target=self._work, args=(i == 0,), name=f"disk-worker-{i}", daemon=True)
                        for i in range(max(num_disk_workers, 1))]
        # A unit's first-read check (xxh3) runs here, so the worker that read it goes on to its next read
        # and the disk stays busy while the bytes are hashed; the unit is ready only once it passed.
        self.checks: queue.SimpleQueue = queue.SimpleQueue()
        self.checker = threading.Thread(target=self._check_work, name="disk-checker", daemon=True)
        self.checker.start()
        for w in self.workers:
            w.start()

    # ------------------------------------------------------------------ memory
    def _idle(self, u: _Unit) -> bool:
        if u.reading or u.holds:
            return False
        u.events = [ev for ev in u.events if not ev.query()]
        return not u.events

    def _busy(self) -> set[int]:
        # read ahead and not used yet counts as busy too: the policies replace, they do not undo read-ahead
        return {uid for uid, u in self.units.items() if u.where == "cache" and (u.fresh or not self._idle(u))}

    def _drop(self, u: _Unit) -> None:
        if u.where == "stream":
            self.stream.free(u.offset, u.entry.read_nbytes)
        elif u.where == "cache":
            self.cache.remove(u.unit.uid)
        elif u.where == "temp":
            pass  # its own buffer goes with it
        u.pool, u.where, u.fresh, u.events = None, "", False, []

    def _reap(self) -> None:
        """Let staging slots go once their copies are done: used, or passed by without a use."""
        for u in self.units.values():
            if u.where not in ("stream", "temp") or not self._idle(u):
                continue
            if not u.fresh:
                if not (u.where == "stream" and self._move_to_cache(u)):
                    self._drop(u)
            elif u.for_pos < self.pos - self.lookahead:  # read ahead for a use that did not come
                self.wasted_reads += 1
                if self.trace.length and u.learn:
                    self.skip.add(u.for_pos % self.trace.length)
                    self._skips_changed()
                self._drop(u)

    def _move_to_cache(self, u: _Unit) -> bool:
        """Offer a used unit in a staging slot to the cache, as if read now for the use it just had.

        Read-ahead decides at read time, when the cache is full of units read for uses before this
        one: a read made far ahead (the units between were cached) went to a staging slot and was let
        go after its use, though by then the policy would keep it. A forward then a backward in reverse
        read the blocks at each turn twice that way. Its bytes are copied (by a worker, off the lock)
        into the cache instead of read from disk again."""
        if self.cache.policy != "belady" or not self.trace.length or u.used_at < 0:
            return False
        off, evicted = self.cache.admit(u.unit.uid, u.entry.read_nbytes, self.pos, u.used_at, self._busy())
        for v in evicted:
            vu = self.units[v]
            vu.pool, vu.where, vu.fresh = None, "", False
        if off is None:
            return False
        u.move_from, u.pool, u.offset, u.where, u.reading = u.offset, self.cache.pool, off, "cache", True
        self.moves.append(u.unit.uid)
        self.cond.notify_all()
        return True

    def _moved(self, u: _Unit) -> None:
        self.stream.free(u.move_from, u.entry.read_nbytes)
        u.move_from, u.reading = -1, False
        self.moved += 1
        self.moved_bytes += u.entry.nbytes

    @staticmethod
    def _move_copy(dest: torch.Tensor, src: torch.Tensor) -> None:
        dest.copy_(src)

    def _move_failed(self, u: _Unit, exc: Exception) -> None:
        """A move's copy raised: its staging slot and its cache slab go; the next acquire reads it from disk."""
        self.stream.free(u.move_from, u.entry.read_nbytes)
        u.move_from, u.reading = -1, False
        self._drop(u)
        self.move_errors += 1
        if self.move_errors == 1:
            log.warning("disk store: copying unit %s into the RAM cache failed (%s: %s); it is read from disk "
                        "again at its next use", u.entry.name, type(exc).__name__, exc)

    def _place(self, u: _Unit, use_at: int, urgent: bool) -> bool:
        """Find memory for u's read: the cache if the policy admits it, else a staging slot."""
        off, evicted = self.cache.admit(u.unit.uid, u.entry.read_nbytes, self.pos, use_at, self._busy())
        for v in evicted:
            vu = self.units[v]
            vu.pool, vu.where, vu.fresh = None, "", False
        if off is not None:
            u.pool, u.offset, u.where = self.cache.pool, off, "cache"
            return True
        off = self.stream.alloc(u.entry.read_nbytes)
        if off is None and urgent:
            # Out of order: give up the read-ahead unit needed last, rather than wait behind it.
            ahead = [x for x in self.units.values() if x.where == "stream" and x.fresh and self._idle(x)]
            if ahead:
                self.wasted_reads += 1
                self._drop(max(ahead, key=lambda x: x.for_pos))
                off = self.stream.alloc(u.entry.read_nbytes)
            elif not any(x.where == "stream" and (x.events or x.reading) for x in self.units.values()):
                # every slot is held by the engine and none will free itself: one buffer of its own
                self.emergency += 1
                pool = HostPool(u.entry.read_nbytes, pin=self.stream.pinned)
                u.pool, u.offset, u.where = pool, 0, "temp"
                return True
        if off is None:
            return False
        u.pool, u.offset, u.where = self.stream, off, "stream"
        return True

    def _schedule(self, u: _Unit, use_at: int, urgent: bool = False) -> bool:
        if u.pool is not None:
            return True
        if not self._place(u, use_at, urgent):
            return False
        u.reading, u.fresh, u.for_pos, u.learn = True, False, use_at, self.synced
        if urgent:
            self.queue.appendleft(u.unit.uid)
        else:
            self.queue.append(u.unit.uid)
        self.cond.notify_all()
        return True

    def _fill(self) -> None:
        """Queue reads for the next units in the trace, in order, as far as memory and lookahead allow."""
        self._reap()
        n = self.trace.length
        if not n or self.closed or self.error is not None:
            return
        ahead = sum(1 for u in self.units.values() if u.reading or (u.fresh and u.where != "cache"))
        for k in range(1, n + 1):
            if ahead >= self.lookahead:
                break
            q = self.pos + k
            if q % n in self.skip:
                continue
            u = self.units.get(self.trace.trace[q % n])
            if u is None or u.pool is not None:
                continue
            if not self._schedule(u, q):
                break
            ahead += 1

    def _count_read(self, nbytes: int, direct: bool) -> None:
        self.disk_bytes += nbytes
        self.disk_reads += 1
        if direct:
            self.direct_reads += 1

    # ------------------------------------------------------------------ workers
    def _copies_pending(self) -> bool:
        """A staging slot waits only for the engine's copy out of it (then _reap lets it go)."""
        return any(u.events for u in self.units.values() if u.where in ("stream", "temp") and not u.holds)

    def _work(self, watch: bool) -> None:
        while True:
            with self.cond:
                while not self.queue and not self.moves and not self.closed:
                    if watch and self.trace.length and self._copies_pending():
                        self.cond.wait(_POLL_S)
                        self._fill()
                    else:
                        self.cond.wait()
                if self.closed:
                    return
                if self.moves:
                    u = self.units[self.moves.popleft()]
                    src = self.stream.slab(u.move_from, u.entry.read_nbytes)
                    dest = u.pool.slab(u.offset, u.entry.read_nbytes)
                else:
                    src = None
                    u = self.units[self.queue.popleft()]
                    dest = u.pool.slab(u.offset, u.entry.read_nbytes)
                    if self._inflight == 0:
                        self._busy_since = time.perf_counter()
                    self._inflight += 1
            if src is not None:  # a used unit's bytes from its staging slot into the cache: no disk read
                failed: Exception | None = None
                try:
                    self._move_copy(dest, src)
                except Exception as exc:  # the worker must live: the unit is read from disk again at its next use
                    failed = exc
                del src, dest
                with self.cond:
                    if failed is None:
                        self._moved(u)
                    else:
                        self._move_failed(u, failed)
                    self._fill()
                    self.cond.notify_all()
                continue
            err: ShardError | None = None
            n, direct, first = 0, False, None
            try:
                n, direct, first = self.reader.read_unchecked(u.entry, dest)
            except ShardError as exc:
                err = exc
            except Exception as exc:  # anything the reader did not name: still the file's error, never a dead worker
                why = str(exc) if isinstance(exc, OSError) else f"{type(exc).__name__}: {exc}"
                err = ShardReadError(f"{self.reader.root / u.entry.file}: cannot read unit {u.entry.name}: {why}")
            with self.cond:
                self._inflight -= 1
                if self._inflight == 0:
                    self.busy_s += time.perf_counter() - self._busy_since
                if first is not None and err is None:
                    self._fill()  # the next read need not wait for this one's check
            if first is not None:
                self.checks.put((u, dest, first, n, direct))
            else:
                self._done(u, err, n, direct)
            del dest

    def _check_work(self) -> None:
        while True:
            item = self.checks.get()
            if item is None:
                return
            u, dest, st, n, direct = item
            err: ShardError | None = None
            try:
                self.reader.check_first_read(u.entry, dest, st)
            except ShardError as exc:
                err = exc
            except Exception as exc:  # the checker thread must live: the error goes to the unit's next acquire
                err = ShardReadError(f"{self.reader.root / u.entry.file}: cannot check unit {u.entry.name}: "
                                     f"{type(exc).__name__}: {exc}")
            del dest, item
            self._done(u, err, n, direct)

    def _done(self, u: _Unit, err: ShardError | None, n: int, direct: bool) -> None:
        """A read (and its check) finished: the unit is ready, or the error waits for the next acquire."""
        with self.cond:
            u.reading = False
            if err is not None:
                self._drop(u)
                if self.error is None:
                    self.error = err
            else:
                u.fresh = True
                self._count_read(n, direct)
                self._fill()
            self.cond.notify_all()

    # ------------------------------------------------------------------ the engine's calls
    def raise_error(self) -> None:
        if self.error is not None:
            raise type(self.error)(str(self.error))

    def follow_trace(self, trace: Sequence[int]) -> None:
        with self.cond:
            self.skip = set()
            self.trace = self.raw = NextUse([uid for uid in trace])
            self.cache.next_use = self.trace
            self.pos = -1
            self.seen, self.judged = set(), -1
            self.synced = False  # until the first use, the position is a guess (the engine may start mid-trace)
            for u in self.units.values():
                # A read made under the old order teaches nothing about this one (no skip is learned from
                # it); one still unused is kept for its first use in the new order, not counted wasted.
                u.learn, u.used_at = False, -1
                if u.fresh or u.reading:
                    q = self.trace.after(u.unit.uid, -1)
                    u.for_pos = int(q) if q != float("inf") else -1
                else:
                    u.for_pos = min(u.for_pos, -1)
            self._fill()

    def _advance(self, uid: int) -> int:
        """Move the trace position to this use of uid: its first occurrence after a short window behind
        the position (the engine may take a prefetch a little out of order), never backwards.
        Returns the use's position (-1 without a trace)."""
        if not self.trace.length:
            return -1
        start = max(self.pos - self.lookahead, -1)
        q = self._unseen(uid, start)
        if q is None:
            q = self.raw.after(uid, start)  # every use near enough was matched already: the first, as before
        if q != float("inf") and int(q) % self.trace.length in self.skip:
            self.skip.discard(int(q) % self.trace.length)  # a use at a position learned as skipped: it is not
            self._skips_changed()
        if q == float("inf"):
            return -1
        if q > self.pos:
            if not self.synced:
                self.judged = int(q) - 1  # the positions before the first use were not passed by
            self.pos = int(q)
            self.synced = True
        self.seen.add(int(q))
        self._judge()
        return int(q)

    def _unseen(self, uid: int, start: int) -> float | None:
        """uid's first use after ``start`` (skipped or not) that no acquire matched yet, where it is near
        enough; None when there is none.

        A unit used on both sides of a turn (the forward's last blocks, the backward's first) is acquired
        at its second use while its first is still in the window behind the position: matched to that
        one again, the second use looked like one the engine served itself, was learned as skipped and
        read again all the same, every step. A later use is taken when it lies within the lookahead
        past the position, not counting positions learned as skipped. (An acquire the engine makes again
        for the same use, its first copy dropped before the use, is not a later use: ``unuse``.)"""
        nu = self.raw
        q = nu.after(uid, start)
        while q != float("inf") and int(q) in self.seen:
            q = nu.after(uid, int(q))
        if q == float("inf"):
            return None
        gap = int(q) - self.pos
        if gap <= 0:
            return q  # the first use, in the window behind: as before
        if gap >= nu.length:
            return None
        skipped = sum(1 for x in range(self.pos + 1, int(q)) if x % nu.length in self.skip)
        return q if gap <= self.lookahead + skipped else None

    def unuse(self, uid: int) -> None:
        """The engine dropped uid's copy before its use (the slot went to a unit needed now); it acquires
        uid again for the same use, which must match that use, not the unit's next one."""
        with self.cond:
            u = self.units.get(uid)
            if u is not None and u.used_at >= 0:
                self.seen.discard(u.used_at)

    def _judge(self) -> None:
        """Positions an acquire can no longer match (a lookahead behind) that none did are skipped.

        The engine serves some traced uses itself: the units still on the device at the turn of a
        forward into the backward's recompute and back. Unlearned, the cache kept room for those uses
        and let go of units that were then read again. (Reads made for such a use teach it too, in _reap.)"""
        limit = self.pos - self.lookahead - 1
        if limit <= self.judged:
            return
        n, changed = self.trace.length, False
        for p in range(max(self.judged + 1, limit - n + 1), limit + 1):
            if p not in self.seen and p % n not in self.skip:
                self.skip.add(p % n)
                changed = True
        self.judged = limit
        self.seen = {p for p in self.seen if p > limit}
        if changed:
            self._skips_changed()

    def _skips_changed(self) -> None:
        self.trace = self.cache.next_use = NextUse(self.trace.trace, self.skip)

    def acquire(self, uid: int, block: bool) -> torch.Tensor | None:
        with self.cond:
            self.raise_error()
            u = self.units[uid]
            if not u.ready:
                use_at = int(min(self.trace.after(uid, self.pos), 2**62)) if self.trace.length else self.pos + 1
                if not u.reading and not self._schedule(u, use_at, urgent=True) and not block:
                    return None
                if not block:
                    return None
                t0 = time.perf_counter()
                while not u.ready:
                    self.raise_error()
                    if self.closed:
                        raise ShardError(f"{self.reader.root}: the disk store was closed")
                    if not u.reading:
                        self._reap()
                        self._schedule(u, use_at, urgent=True)
                    self._fill()  # slots whose copies finished meanwhile take the next reads
                    self.cond.wait(_POLL_S)
                self.stall_s += time.perf_counter() - t0
            if u.fresh:
                self.misses += 1
                self.miss_bytes += u.entry.nbytes
                u.fresh = False
            else:
                self.hits += 1
                self.hit_bytes += u.entry.nbytes
            if u.where == "cache":
                self.cache.touch(uid)
            u.holds += 1
            u.used_at = self._advance(uid)
            self._fill()
            return u.pool.slab(u.offset, u.entry.nbytes)[: u.entry.nbytes]

    def release(self, uid: int, after: Any) -> None:
        with self.cond:
            u = self.units[uid]
            u.holds = max(u.holds - 1, 0)
            if after is not None:
                u.events.append(after)
            self._fill()
            self.cond.notify_all()

    def master(self, uid: int) -> torch.Tensor:
        with self.cond:
            u = self.units[uid]
            if not u.kept:
                while u.reading:
                    self.raise_error()
                    self.cond.wait(_POLL_S)
                self.raise_error()
                old = u.pool.slab(u.offset, u.entry.nbytes)[: u.entry.nbytes] if u.pool is not None else None
                if u.where == "cache":
                    self.cache.keep(uid, u.entry.read_nbytes, set())
                    new_pool, new_off = u.pool, u.offset
                else:
                    off, evicted = self.cache.keep(uid, u.entry.read_nbytes, self._busy())
                    for v in evicted:
                        vu = self.units[v]
                        vu.pool, vu.where, vu.fresh = None, "", False
                    if off is None:
                        new_pool, new_off = self.own.setdefault(uid, HostPool(u.entry.read_nbytes, pin=self.stream.pinned)), 0
                    else:
                        new_pool, new_off = self.cache.pool, off
                    dest = new_pool.slab(new_off, u.entry.read_nbytes)
                    deadline = time.monotonic() + 30
                    while u.holds and old is not None:  # the engine is copying out of the staging slot
                        if time.monotonic() > deadline:
                            raise RuntimeError(f"master({uid}): the unit is acquired and never released")
                        self.cond.wait(_POLL_S)
                    if old is not None:
                        dest[: u.entry.nbytes].copy_(old)
                        for ev in u.events:
                            ev.synchronize()
                        self._drop(u)
                    else:
                        self._count_read(*self.reader.read_into(u.entry, dest))  # setup time: a plain read
                u.pool, u.offset = new_pool, new_off
                u.where = "cache" if new_pool is self.cache.pool else "kept"
                u.kept, u.fresh = True, False
            return u.pool.slab(u.offset, u.entry.nbytes)[: u.entry.nbytes]

    def view(self, unit: Unit, index: int) -> torch.Tensor:
        t = unit.tensors[index]
        with self.cond:
            u = self.units[unit.uid]
            if u.ready:
                raw = u.pool.slab(u.offset, u.entry.nbytes)[t.store_offset: t.store_offset + t.store_nbytes]
                typed = raw.view(t.store_dtype or t.dtype).view(t.shape)
                return typed if u.kept else typed.clone()
        return self.reader.read_tensor(u.entry, u.entry.tensors[index])

    def scales(self, unit: Unit, index: int) -> torch.Tensor:
        t = unit.tensors[index]
        with self.cond:
            u = self.units[unit.uid]
            if u.ready:
                return scale_view(u.pool.slab(u.offset, u.entry.nbytes)[: u.entry.nbytes], t).clone()
        return self.reader.read_scales(u.entry, u.entry.tensors[index])

    def used_bytes(self) -> int:
        return sum(u.entry.nbytes for u in self.units.values() if u.pool is not None)

    def capacity_bytes(self) -> int:
        return self.cache.capacity_bytes + self.stream.capacity_bytes + sum(p.capacity_bytes for p in self.own.values())

    def stats(self) -> dict[str, Any]:
        with self.cond:
            busy = self.busy_s + (time.perf_counter() - self._busy_since if self._inflight else 0.0)
            uses = self.hits + self.misses
            return {
                "disk_bytes": self.disk_bytes,
                "disk_reads": self.disk_reads,
                "disk_read_s": busy,
                "disk_gbps": self.disk_bytes / 1e9 / busy if busy > 0 else 0.0,
                "disk_stall_ms": self.stall_s * 1e3,
                "disk_direct_reads": self.direct_reads,  # O_DIRECT; the others read buffered, then fadvise(DONTNEED)
                "disk_wasted_reads": self.wasted_reads,
                "disk_ahead_units": sum(1 for u in self.units.values() if u.fresh or u.reading),  # read, not used yet
                "disk_reads_in_flight": sum(1 for u in self.units.values() if u.reading),
                "disk_workers": len(self.workers),
                "disk_cache_policy": self.cache.policy,
                "disk_cache_hits": self.hits,
                "disk_cache_misses": self.misses,
                "disk_cache_hit_rate": self.hits / uses if uses else 0.0,
                "disk_cache_hit_bytes": self.hit_bytes,
                "disk_cache_miss_bytes": self.miss_bytes,
                "disk_cache_evictions": self.cache.evictions,
                "disk_cache_moves": self.moved,  # used units copied from a staging slot into the cache, not re-read
                "disk_cache_moved_bytes": self.moved_bytes,
                "disk_cache_capacity_bytes": self.cache.capacity_bytes,
                # admissions placed where the plan (a replay of the trace's cycle) put them / decided at the read
                "disk_cache_planned": self.cache.planned,
                "disk_cache_unplanned": self.cache.unplanned,
                # the plan in force: a fixed set ("static") or Belady's turning one ("belady"); its reads a cycle
                "disk_cache_plan": self.cache.plan_kind,
                "disk_cache_plan_bytes": self.cache.plan_bytes,
                "disk_cache_used_bytes": self.cache.pool.used_bytes,
                "disk_cache_units": sum(1 for u in self.units.values() if u.where == "cache" and not u.reading),
                "disk_kept_bytes": sum(u.entry.nbytes for u in self.units.values() if u.kept),
                "disk_stream_slots": self.n_stream,
                "disk_stream_bytes": self.stream.capacity_bytes,
                "disk_emergency_buffers": self.emergency,
                "disk_first_read_checks": self.reader.first_checks,  # units checked on their first read here
                "disk_sha256_checks": self.reader.full_checks,  # disk_verify: every read
            }

    def close(self) -> None:
        with self.cond:
            if self.closed:
                return
            self.closed = True
            self.queue.clear()
            self.moves.clear()
            self.cond.notify_all()
        for w in self.workers:
            if w is not threading.current_thread():
                w.join(timeout=30)
        self.checks.put(None)  # after the workers: nothing is queued behind it
        if self.checker is not threading.current_thread():
            self.checker.join(timeout=30)
        with self.cond:
            for u in self.units.values():
                for ev in u.events:
                    ev.synchronize()  # the engine's copies out of these slabs must finish before they go
                u.pool, u.where, u.events = None, "", []
            self.cache.close()
            self.stream.close()
            for p in self.own.values():
                p.close()
            self.own.clear()


class DiskStore:
    """The HostStore of a model whose weights stream from a shard directory.

    units: the engine's streamed units, already bound to the index (``bind_units`` gives
    ``entries``: uid -> slab entry). cache_bytes: bytes of cache (the staging slots come on top).
    policy: "belady" (default), "fifo" or "lru". verify: check each read's sha256 (costs CPU).
    direct: O_DIRECT on (True), off (False) or where it works (None).
    """

    filled = True  # the shards hold every unit's bytes: the engine packs nothing into this store

    def __init__(self, units: Sequence[Unit], index: ShardIndex, entries: dict[int, SlabEntry], *,
                 cache_bytes: int = 0, num_disk_workers: int = 2, stream_slots: int | None = None,
                 policy: str = "belady", pin: bool = False, verify: bool = False, direct: bool | None = None,
                 reason: str = "") -> None:
        self.index = index
        self.reason = reason  # why the engine streams from disk (stats()["host_store_reason"])
        self._core = _Core(units, entries, index, cache_bytes=int(cache_bytes or 0), num_disk_workers=num_disk_workers,
                           stream_slots=stream_slots, policy=policy, pin=pin, verify=verify, direct=direct)
        self._finalizer = weakref.finalize(self, _Core.close, self._core)
        self._finalizer.atexit = False  # at exit the process's memory, threads and registrations end with it

    @property
    def pinned(self) -> bool:
        return self._core.pinned

    @property
    def capacity_bytes(self) -> int:
        return self._core.capacity_bytes()

    @property
    def used_bytes(self) -> int:
        return self._core.used_bytes()

    def follow_trace(self, trace: Sequence[int]) -> None:
        """The traced order of unit uses (one cycle, repeating): what to read ahead and what to keep."""
        self._core.follow_trace(trace)

    def acquire(self, uid: int, *, block: bool = True) -> torch.Tensor | None:
        """The unit's slab (uint8, store_nbytes long), valid until release(); None (block=False) while it is
        not in memory yet. Raises the read error of any unit that failed since the last call."""
        return self._core.acquire(uid, block)

    def release(self, uid: int, after: Any = None) -> None:
        """The engine is done with the slab once ``after`` (a CUDA event, or None: now) completes."""
        self._core.release(uid, after)

    def unuse(self, uid: int) -> None:
        """The engine dropped uid's copy before its use and acquires it again for that use."""
        self._core.unuse(uid)

    def master(self, uid: int) -> torch.Tensor:
        """A writable slab that the store keeps from now on (write-back buffers, optimizer masters)."""
        return self._core.master(uid)

    def view(self, unit: Unit, index: int) -> torch.Tensor:
        """One tensor's host value, typed and shaped: a view into the slab of a kept unit (``master``
        first, to write), else a copy (the cache may let the slab go), read from disk when not in memory."""
        return self._core.view(unit, index)

    def scales(self, unit: Unit, index: int) -> torch.Tensor:
        """Tensor ``index``'s fp8 row/block scales, a copy (from the cache, else read from disk): what
        ``state_dict`` widens with, without keeping the unit as ``master`` would."""
        return self._core.scales(unit, index)

    def stats(self) -> dict[str, Any]:
        return {"host_store": "disk", "host_store_reason": self.reason, **self._core.stats()}

    def close(self) -> None:
        self._finalizer()
