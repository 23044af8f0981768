"""OffloadEngine: one engine behind both enable_offload (inference) and the training manager.

Life of a streamed unit:

1. Its tensors are packed into a PinnedArena slab and the module keeps 0-element placeholders.
2. When its anchor module is entered (or autograd needs one of its saved weights back), the slab is
   copied into a SlotRing slot: one H2D copy on the copy stream, then a ``ready`` event the compute
   stream waits on. No host synchronization happens per unit.
3. While the anchor runs, the module's frozen tensors are plain views into the slot (the Parameter
   objects stay registered elsewhere with placeholder data). Autograd and checkpoint recomputes
   that save those views keep the slot's storage alive, so the slot is not reused until they let go.
4. Without checkpointing, ``saved_tensors_hooks`` replace saved weight views with references, which
   backward re-fetches: weights do not stay on the device between forward and backward.
5. The schedule learns the order of uses and prefetches the next units into free slots.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from .arena import PinnedArena, trim_host_heap
from .config import OffloadConfig
from .errors import DeviceUnavailableError, NotAModuleError
from .planner import measured_prediction, plan_residency, replan_from_measurements, ring_slots
from .quant import UnitWidener, eligible, quantize, storage_dtype, widen
from .schedule import Schedule
from .slots import Slot, SlotRing
from .stats import CopyClock, Counters, TimingLog
from .units import Unit, discover_units

__all__ = ["OffloadEngine", "resolve_device"]


def resolve_device(target: str | torch.device) -> torch.device:
    try:
        dev = torch.device(target)
    except (RuntimeError, TypeError):
        raise DeviceUnavailableError(f"target_device: {target!r} is not a device name") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceUnavailableError(
                f"target_device: {target!r} asked for, but this machine has no CUDA device "
                "(use target_device='cpu' to run the same path on the CPU)"
            )
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise DeviceUnavailableError(f"target_device: {target!r} does not exist ({torch.cuda.device_count()} CUDA devices)")
        return torch.device("cuda", index)
    if dev.type != "cpu":
        raise DeviceUnavailableError(f"target_device: {target!r} is not supported (use 'cuda' or 'cpu')")
    return dev


@dataclass
class _SlotRef:
    """What autograd keeps instead of a streamed weight view."""

    uid: int
    offset: int
    size: tuple
    stride: tuple
    dtype: torch.dtype


class OffloadEngine:
    def __init__(self, model: nn.Module, config: OffloadConfig, *, stream_trainable: bool = False) -> None:
        if not isinstance(model, nn.Module):
            raise NotAModuleError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
        t0 = time.perf_counter()
        self.model = model
        self.config = config
        self.device = resolve_device(config.target_device)
        self.is_cuda = self.device.type == "cuda"
        self.use_streams = bool(config.use_streams and self.is_cuda)
        self.timing = TimingLog(host=not self.is_cuda) if config.record_timings else None
        self.counters = Counters()
        self._lock = threading.RLock()
        self._tick = 0
        self._root_depth = 0
        self._saved_hooks: Any = None
        self._cycle_callbacks: list[Callable[[], None]] = []
        self._handles: list[Any] = []
        self._placeholders: dict[torch.dtype, torch.Tensor] = {}
        self._cycle_start: Any = None
        self._compute_start: dict[int, Any] = {}  # uid -> event recorded when the unit was bound
        self._span_from: tuple[int, Any] | None = None  # (trace position, event) of the last use's start
        self._replanned = False

        split = None if config.split_threshold_mb is None else int(config.split_threshold_mb * 1024 * 1024)
        all_frozen = config.treat_as_inference
        if all_frozen is None:
            all_frozen = not stream_trainable and not any(not p.requires_grad for p in model.parameters())
        self.treat_as_inference = bool(all_frozen)
        self.plan = discover_units(model, config.offload_granularity, split, stream_trainable=stream_trainable,
                                   all_frozen=self.treat_as_inference)
        self.units: list[Unit] = self.plan.units
        self.prediction = plan_residency(self.units, config)
        self.streamed: list[Unit] = [u for u in self.units if u.streamed]
        store = storage_dtype(config.weight_dtype)
        if store is not None:
            for u in self.streamed:
                for ts in u.tensors:
                    # weights only: buffers (positional tables, running stats) keep their dtype
                    if ts.is_param and not ts.trainable and eligible(ts.tensor(), store):
                        ts.store_dtype = store
                u.layout()

        # Resident tensors: moved once. Streamed ones: packed, then placeholders.
        self._resident_moved: list[tuple[nn.Module, str, bool, torch.device]] = []
        for m, attr, is_param in self.plan.resident:
            self._move_resident(m, attr, is_param)
        for u in self.units:
            if not u.streamed:
                for t in u.tensors:
                    self._move_resident(t.module, t.attr, t.is_param)

        self.arena = PinnedArena(self.streamed, pin=self.is_cuda and config.cpu_offload)
        self._pack()
        trim_host_heap()
        self.arena.pin()
        self._bound: dict[int, list] = {}
        self._depth: dict[int, int] = {}
        self._writeback: dict[int, Any] = {}

        moving = [u for u in self.streamed if not u.sticky]
        slot_bytes = max((u.nbytes for u in moving), default=0)
        self.ring = SlotRing(slot_bytes, ring_slots(config) if moving else 0, self.device)
        for u in self.streamed:
            if u.sticky:
                self.ring.add_sticky(u.uid, u.nbytes)
        self.schedule = Schedule(config.prefetch)
        # Units stored in another dtype land in a raw buffer and are widened into their slot;
        # two raw buffers let the next copy overlap the current widening.
        self.widener = UnitWidener(self.streamed, self.device)
        self._raw_free: list[Any] = [None, None]
        self._raw_turn = 0
        if self.use_streams:
            self.h2d_stream = torch.cuda.Stream(self.device)
            self.d2h_stream = torch.cuda.Stream(self.device)
            self.convert_stream = torch.cuda.Stream(self.device) if self.widener.raw else None
        # times H2D copies (CUDA); the copy stream, or the compute stream when streams are off
        self.copy_clock = None
        if self.is_cuda and self.timing is not None:
            self.copy_clock = CopyClock(self.timing, self.h2d_stream if self.use_streams else torch.cuda.current_stream(self.device))
        self._install_hooks()
        self.setup_seconds = time.perf_counter() - t0

    # ------------------------------------------------------------------ setup
    def _move_resident(self, m: nn.Module, attr: str, is_param: bool) -> None:
        t = (m._parameters if is_param else m._buffers)[attr]
        if t is None or t.device == self.device:
            return
        self._resident_moved.append((m, attr, is_param, t.device))
        t.data = t.data.to(self.device)

    def _placeholder(self, dtype: torch.dtype) -> torch.Tensor:
        ph = self._placeholders.get(dtype)
        if ph is None:
            ph = self._placeholders[dtype] = torch.empty(0, dtype=dtype, device=self.device)
        return ph

    def _trainable_placeholder(self, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
        # AccumulateGrad shapes a new .grad after the leaf's current sizes, so a streamed trainable
        # parameter keeps its shape between uses: one element, expanded (stride 0).
        one = self._placeholders.get((dtype, 1))
        if one is None:
            one = self._placeholders[(dtype, 1)] = torch.zeros(1, dtype=dtype, device=self.device)
        return one.expand(shape)

    def placeholder_for(self, ts: Any, obj: torch.Tensor) -> torch.Tensor:
        if ts.trainable:
            return self._trainable_placeholder(ts.dtype, ts.shape)
        return self._placeholder(ts.dtype)

    def _pack(self) -> None:
        for u in self.streamed:
            for i, ts in enumerate(u.tensors):
                obj = ts.tensor()
                with torch.no_grad():
                    if ts.store_dtype is not None:
                        _, ts.scale = quantize(obj.data, ts.store_dtype, out=self.arena.view(u, i))
                    else:
                        self.arena.view(u, i).copy_(obj.data)
                obj.data = self.placeholder_for(ts, obj)

    def _install_hooks(self) -> None:
        anchors: dict[int, tuple[nn.Module, list[Unit]]] = {}
        for u in self.streamed:
            anchors.setdefault(id(u.anchor), (u.anchor, []))[1].append(u)
        root = self.model
        self._handles.append(root.register_forward_pre_hook(self._root_pre, prepend=True))
        for module, units in anchors.values():
            self._handles.append(module.register_forward_pre_hook(self._make_pre(units)))
            self._handles.append(module.register_forward_hook(self._make_post(units), always_call=True))
        self._handles.append(root.register_forward_hook(self._root_post, always_call=True))

    # ------------------------------------------------------------------ root hooks
    def _root_pre(self, module: nn.Module, args: Any) -> None:
        self._root_depth += 1
        if self._root_depth > 1:
            return
        if self.timing is not None:
            # Each pair owns its two events: the pool recycles events once a pair is resolved.
            if self._cycle_start is not None:
                self.timing.add("cycle", -1, self._cycle_start, self._mark())
            self._cycle_start = self._mark()
        with self._lock:
            self.counters.steps += 1
            self.schedule.start_cycle()
            for cb in self._cycle_callbacks:
                cb()
            if (self.config.vram_budget is not None and not self._replanned and self.timing is not None
                    and self.schedule.cycles >= 3 and self.schedule.learned):
                self._replanned = True
                if self.replan() is not None:
                    self._prefetch(-1)  # units the new plan no longer keeps: fetch the first ones now
        if torch.is_grad_enabled() and self.streamed:
            self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack_saved, self._unpack_saved)
            self._saved_hooks.__enter__()

    def _root_post(self, module: nn.Module, args: Any, output: Any) -> None:
        self._root_depth -= 1
        if self._root_depth == 0 and self._saved_hooks is not None:
            hooks, self._saved_hooks = self._saved_hooks, None
            hooks.__exit__(None, None, None)
        if self.timing is not None and len(self.timing.pending) > 1024:
            self.timing.resolve(block=False)

    # ------------------------------------------------------------------ unit hooks
    def _make_pre(self, units: list[Unit]) -> Callable:
        def pre(module: nn.Module, args: Any) -> None:
            for u in units:
                depth = self._depth.get(u.uid, 0)
                self._depth[u.uid] = depth + 1
                if depth == 0:
                    slot = self.use(u)
                    self._bind(u, slot)
        return pre

    def _make_post(self, units: list[Unit]) -> Callable:
        def post(module: nn.Module, args: Any, output: Any) -> None:
            for u in units:
                depth = self._depth.get(u.uid, 0) - 1
                self._depth[u.uid] = max(depth, 0)
                if depth <= 0:
                    self._unbind(u)
        return post

    def _bind(self, u: Unit, slot: Slot) -> None:
        bound = []
        for ts in u.tensors:
            view = slot.typed(ts.dtype).as_strided(ts.shape, ts.contiguous_stride, ts.offset // ts.dtype.itemsize)
            table = ts.module._parameters if ts.is_param else ts.module._buffers
            orig = table[ts.attr]
            if ts.trainable:
                # Trainable streamed params must stay the leaf autograd accumulates into.
                orig.data = view
                bound.append((ts, orig, None, 0))
            else:
                # Frozen: the module sees a plain view; the Parameter keeps its placeholder, so
                # nothing autograd or a checkpoint saves can be swapped out from under it.
                table[ts.attr] = view
                # Inference tensors keep no version counter: None means "ask the module".
                bound.append((ts, orig, view, None if view.is_inference() else view._version))
        self._bound[u.uid] = bound
        if self.timing is not None:
            self._compute_start[u.uid] = self._mark()

    def _unbind(self, u: Unit) -> None:
        bound = self._bound.pop(u.uid, None)
        if bound is None:
            return
        self._delay()
        dirty = []
        for ts, orig, view, version in bound:
            table = ts.module._parameters if ts.is_param else ts.module._buffers
            if view is None:
                orig.data = self._trainable_placeholder(ts.dtype, ts.shape)
            else:
                table[ts.attr] = orig
                if not ts.is_param:
                    changed = ts.module.training if version is None else view._version != version
                    if changed:
                        dirty.append((ts, view))
        if dirty:
            self._write_back(u, dirty)
        if self.timing is not None and u.uid in self._compute_start:
            self.timing.add("compute", u.uid, self._compute_start.pop(u.uid), self._mark())

    def _write_back(self, u: Unit, dirty: list) -> None:
        """Copy in-place-updated buffers (running stats, counters) back to the host master."""
        slab = self.arena.slab(u.uid)
        with self._lock:
            if self.use_streams:
                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(self.device))
                self.d2h_stream.wait_event(ev)
                with torch.cuda.stream(self.d2h_stream):
                    for ts, view in dirty:
                        slab[ts.store_offset: ts.store_offset + ts.nbytes].copy_(view.reshape(-1).view(torch.uint8), non_blocking=True)
                    done = torch.cuda.Event()
                    done.record(self.d2h_stream)
                self._writeback[u.uid] = done
                slot = self.ring.lookup(u.uid)
                if slot is not None:
                    slot.done.append(done)
            else:
                for ts, view in dirty:
                    slab[ts.store_offset: ts.store_offset + ts.nbytes].copy_(view.reshape(-1).view(torch.uint8))
            for ts, _ in dirty:
                self.counters.d2h_bytes += ts.nbytes
                self.counters.d2h_count += 1

    # ------------------------------------------------------------------ autograd saved tensors
    def _pack_saved(self, t: torch.Tensor) -> Any:
        if t.device != self.device or not t.numel():
            return t
        slot = self.ring.by_ptr.get(t.untyped_storage().data_ptr())
        if slot is None or slot.owner is None:
            return t
        self.counters.saved_refs += 1
        return _SlotRef(slot.owner, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)

    def _unpack_saved(self, ref: Any) -> torch.Tensor:
        if not isinstance(ref, _SlotRef):
            return ref
        slot = self.use(self.units[ref.uid], backward=True)
        return slot.buf.view(ref.dtype).as_strided(ref.size, ref.stride, ref.offset)

    # ------------------------------------------------------------------ loading
    def _delay(self) -> None:
        if self.config.debug_host_delay_ms > 0:
            time.sleep(random.random() * self.config.debug_host_delay_ms / 1000.0)

    def _mark(self, stream: Any = None) -> Any:
        """A timing event recorded now on ``stream`` (default: the compute stream)."""
        ev = self.timing.event()
        if self.is_cuda:
            ev.record(stream if stream is not None else torch.cuda.current_stream(self.device))
        else:
            ev.record()
        return ev

    def use(self, u: Unit, backward: bool = False) -> Slot:
        """Make u's bytes available to the compute stream and return its slot."""
        self._delay()
        with self._lock:
            self._tick += 1
            new_use = self.schedule.observe_new(u.uid)
            timed = self.timing is not None and new_use
            arrive = (self._mark(), self._mark()) if timed else None
            slot = self.ring.lookup(u.uid)
            if slot is None:
                keep = set(self.schedule.upcoming(self.config.prefetch + 1)) | {u.uid}
                slot = self._load(u, keep, urgent=True)
                self.counters.cache_misses += 1
                if backward:
                    self.counters.refetches += 1
                if self.schedule.learned and self.schedule.cycles > 1:
                    self.counters.prefetch_misses += 1
            elif new_use:
                self.counters.cache_hits += 1
            slot.last_use = self._tick
            if self.use_streams and slot.ready is not None:
                torch.cuda.current_stream(self.device).wait_event(slot.ready)
            if timed:
                # stall: waiting for this unit's bytes; span: busy from the last use's start to here.
                # Every pair owns its events (the log recycles an event once its pair resolves).
                self.timing.add("stall", u.uid, arrive[0], self._mark())
                if self._span_from is not None:
                    pos, ev = self._span_from
                    self.timing.add("span", ("pos", pos), ev, arrive[1])
                self._span_from = (self.schedule.position, self._mark())
            self._prefetch(u.uid)
            return slot

    def _prefetch(self, current: int) -> None:
        if self.config.prefetch <= 0 or not self.schedule.learned:
            return
        upcoming = self.schedule.upcoming()
        keep = set(self.schedule.upcoming(self.config.prefetch + 1)) | {current}
        for uid in upcoming:
            u = self.units[uid]
            if not u.streamed or self.ring.lookup(uid) is not None:
                continue
            if self._load(u, keep, urgent=False) is None:
                break
            self.counters.prefetch_issued += 1

    def _load(self, u: Unit, keep: set[int], urgent: bool) -> Slot | None:
        slot = self.ring.sticky.get(u.uid)
        if slot is None:
            slot = self.ring.pick_victim(keep)
        if slot is None:
            if not urgent:
                return None
            slot = self.ring.grow()
        if self.ring.assign(slot, u.uid) is not None:
            self.counters.cache_evictions += 1
        src = self.arena.slab(u.uid)
        if self.use_streams:
            h2d = self.h2d_stream
            freed = torch.cuda.Event()
            freed.record(torch.cuda.current_stream(self.device))
            # Whatever overwrites the slot waits for the kernels queued against its old owner.
            writer = self.convert_stream if u.converted else h2d
            writer.wait_event(freed)
            for ev in slot.done:
                writer.wait_event(ev)
            slot.done = []
            wb = self._writeback.pop(u.uid, None)
            if wb is not None:
                h2d.wait_event(wb)
            if u.converted:
                b = self._raw_turn
                self._raw_turn ^= 1
                if self._raw_free[b] is not None:
                    h2d.wait_event(self._raw_free[b])
                dst = self.widener.raw[b][: u.store_nbytes]
            else:
                dst = slot.buf[: u.nbytes]
            with torch.cuda.stream(h2d):
                clock = self.copy_clock
                a = clock.start(h2d) if clock is not None else None
                dst.copy_(src, non_blocking=True)
                if a is not None:
                    clock.submitted()
                    self.timing.add("h2d", u.uid, a, self._mark(h2d))
                ready = torch.cuda.Event()
                ready.record(h2d)
            if u.converted:
                conv = self.convert_stream
                conv.wait_event(ready)
                with torch.cuda.stream(conv):
                    self.widener.widen(u, b, slot.buf)
                    ready = torch.cuda.Event()
                    ready.record(conv)
                self._raw_free[b] = ready
            slot.ready = ready
        else:
            # Serial on purpose (streams off): the host waits for each copy before going on.
            clock = self.copy_clock
            stream = torch.cuda.current_stream(self.device) if self.is_cuda else None
            if clock is not None:
                a = clock.start(stream)
            else:
                a = self._mark() if self.timing is not None else None
            dst = self.widener.raw[0][: u.store_nbytes] if u.converted else slot.buf[: u.nbytes]
            dst.copy_(src, non_blocking=stream is not None)
            if clock is not None:
                clock.submitted()
            if a is not None:
                self.timing.add("h2d", u.uid, a, self._mark())
            if stream is not None:
                stream.synchronize()
            if u.converted:
                self.widener.widen(u, 0, slot.buf)
            slot.ready = None
        self.counters.h2d_bytes += u.store_nbytes
        self.counters.h2d_count += 1
        return slot

    # ------------------------------------------------------------------ planning from measurements
    def predict(self) -> float | None:
        """The planner's simulated cycle for the plan in force, from measured times (ms)."""
        return measured_prediction(self)

    def replan(self) -> dict | None:
        """vram_budget: choose sticky units and extra ring slots from the measured cycle."""
        return replan_from_measurements(self)

    # ------------------------------------------------------------------ teardown
    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def remove(self) -> None:
        """Take the hooks off and give every tensor its full data back on the host."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.synchronize()
        for uid in list(self._bound):
            self._unbind(self.units[uid])
        self.synchronize()
        for u in self.streamed:
            for i, ts in enumerate(u.tensors):
                stored = self.arena.view(u, i)
                # fp8-stored weights come back widened: the rounding is not undone.
                ts.tensor().data = stored.clone() if ts.store_dtype is None else widen(stored, ts.scale, ts.dtype)
        for m, attr, is_param, dev in self._resident_moved:
            t = (m._parameters if is_param else m._buffers)[attr]
            if t is not None:
                t.data = t.data.to(dev)
        self._resident_moved.clear()
        self.ring.clear()
        self.arena.release()
