"""OffloadEngine: one engine behind both enable_offload (inference) and the training manager.

Life of a streamed unit:

1. Its tensors are packed into the host store (hoststore.py; a PinnedArena slab) and the module keeps
   0-element placeholders.
2. When its anchor module is entered (or autograd needs one of its saved weights back), the slab is
   copied into a SlotRing slot (transfer.py): one H2D copy on the copy stream, then a ``ready``
   event the compute stream waits on. No host synchronization happens per unit.
3. While the anchor runs, the module's frozen tensors are plain views into the slot (binding.py; the
   Parameter objects stay registered elsewhere with placeholder data). Autograd and checkpoint recomputes
   that save those views keep the slot's storage alive, so the slot is not reused until they let go.
4. Without checkpointing, ``saved_tensors_hooks`` replace saved weight views with references, which
   backward re-fetches: weights do not stay on the device between forward and backward.
5. The schedule learns the order of uses and prefetches the next units into free slots; after the
   first cycles the planner (planner.py) sizes the ring from what was measured, and the engine
   applies its plan.
6. ``state_dict()`` reads the host masters (masters.py); ``remove()`` gives every tensor its data
   back. Dropped without ``remove()``, the engine's finalizer waits for its copies, and the host
   buffers' own finalizers unregister them before their memory goes.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
import warnings
import weakref
from collections.abc import Iterable
from typing import Any, Callable

import torch
from torch import nn

from . import planner, registry
from .arena import PinnedArena
from .bounce import BOUNCE_RING, PINNED_LIMIT_ENV, BounceStore, check_switches, pinned_limit
from .parking import Parking
from .binding import Binder, set_data
from .compiled import BlockCompiler, refuse_patched
from .config import OffloadConfig
from .device import resolve_device
from .errors import FrozenWeightError, LossyStorageWarning, NotAModuleError, OffloadConfigError
from .hostmem import trim_host_heap
from .link import LinkPacer
from .lockstep import Lockstep
from .masters import Masters
from .quant import (UnitWidener, adopt_native_fp8, assign_storage, compute_dtype_of, pack_into, stored_value,
                    widen_resident_fp8)
from .replan import Replanner
from .schedule import Schedule
from .slots import Slot, SlotRing
from .stats import Counters, EngineStats, TimingLog
from .hoststore import HostStore
from .transfer import Transfer
from .units import Unit, discover_units
from .weights import meta_tensor_names

log = logging.getLogger(__name__)
__all__ = ["OffloadEngine", "resolve_device"]

def _quiesce(streams: tuple) -> None:
    """The finalizer of a dropped engine: let its queued copies finish before its buffers are freed."""
    for s in streams:
        try:
            s.synchronize()
        except Exception:
            pass


class OffloadEngine:
    # What setup makes (host buffers, slots, placeholders) outlives the call: never inference tensors.
    @torch.inference_mode(False)
    def __init__(self, model: nn.Module, config: OffloadConfig, *, stream_trainable: bool = False) -> None:
        if not isinstance(model, nn.Module):
            raise NotAModuleError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
        registry.refuse_if_offloaded(model)
        check_switches()  # a misspelt OFFLOAD_BOUNCE_MODE or _CORES is named before the model is touched
        if config.weights is None and not config.lazy_load:
            on_meta = meta_tensor_names(model)
            if on_meta:
                raise OffloadConfigError(
                    f"weights: the model has tensors on the meta device ({', '.join(on_meta)}, ...); give them values: "
                    "weights=PATH (a checkpoint) or lazy_load=True with shard_dir (its shards)")
        t0 = time.perf_counter()
        self.model = model
        self.config = config
        self.device = resolve_device(config.target_device)
        self.is_cuda = self.device.type == "cuda"
        self.timing = TimingLog(host=not self.is_cuda) if config.record_timings else None
        self.counters = Counters()
        self.lock = threading.RLock()
        self._tick = 0
        self._root_depth = 0
        self._saved_hooks: Any = None
        self._handles: list[Any] = []
        self._cycle_callbacks: list[Callable[[], None]] = []
        self._cycle_start: Any = None  # a timed cycle's start event
        self._last_timed = 0  # the last timed cycle
        self._span_from: tuple | None = None  # (trace position, event, cycle, uid) of the last use's start
        self._removed = False
        self.lockstep: Lockstep | None = None  # while a layer-major group's forwards run (lockstep.py)
        # park_saved_tensors: large saved activations in host memory until the backward (parking.py)
        self.parking = Parking(self.device, self.counters) if config.park_saved_tensors else None
        self._group_depth = 0
        self.binder = Binder(self)  # views into the slots while a module runs (binding.py)

        split = None if config.split_threshold_mb is None else int(config.split_threshold_mb * 1024 * 1024)
        all_frozen = config.treat_as_inference
        if all_frozen is None:
            all_frozen = not stream_trainable and not any(not p.requires_grad for p in model.parameters())
        self.treat_as_inference = bool(all_frozen)
        # taken for inference because every parameter required grad: a backward through it is a mistake
        self._auto_inference = self.treat_as_inference and config.treat_as_inference is None
        self.layout = discover_units(model, config.offload_granularity, split, stream_trainable=stream_trainable,
                                   all_frozen=self.treat_as_inference)
        self.units: list[Unit] = self.layout.units
        blocks = self._blocks_to_compile() if config.compile else []
        depth = planner.initial_depth(config.prefetch, config.vram_budget)
        residency = planner.plan_residency(
            self.units, cpu_offload=config.cpu_offload, stray_resident_fraction=config.stray_resident_fraction,
            offload_ratio=config.offload_ratio, vram_budget=config.vram_budget, depth=depth)
        for uid in residency.resident:
            self.units[uid].streamed = False
        self.prediction: dict[str, Any] = dict(residency.info, granularity=self.layout.granularity)
        self.streamed: list[Unit] = [u for u in self.units if u.streamed]
        # weights the model holds in fp8 already (ComfyUI checkpoints) stream as they are, then weight_dtype
        compute = compute_dtype_of(model)
        adopt_native_fp8(self.streamed, compute)
        self.lossy = assign_storage(self.streamed, config.weight_dtype, config.resolved_fp8_scaling)

        self._resident_moved: list[tuple[nn.Module, str, bool, torch.device]] = []
        self.compiler: BlockCompiler | None = None
        try:
            self._build(model, residency, depth, blocks, compute)
        except BaseException:
            self._undo_setup()  # the model as it was given, then the failure
            raise
        self.setup_seconds = time.perf_counter() - t0

    # ------------------------------------------------------------------ setup
    def _build(self, model: nn.Module, residency: Any, depth: int, blocks: list[nn.Module], compute: Any) -> None:
        """Setup from the host store on: the weights move (packed, or read from a checkpoint), the ring,
        the hooks. Whatever fails in here, ``_undo_setup`` gives the model back as it was."""
        config = self.config
        # The host store of the streamed units; it may give meta tensors their values (weights,
        # lazy_load) and turn units the shards lack resident.
        self.store: HostStore = self._make_store()
        self.streamed = [u for u in self.units if u.streamed]
        # weights that train are streamed (optimizer offload): a step's bookkeeping starts in model.forward()
        self._trains_streamed = any(u.trainable for u in self.streamed)

        # Resident tensors: moved once. Streamed ones: packed (unless the store holds them already),
        # then placeholders.
        for m, attr, is_param in self.layout.resident:
            self._move_resident(m, attr, is_param)
        for u in self.units:
            if not u.streamed:
                for t in u.tensors:
                    self._move_resident(t.module, t.attr, t.is_param)
        widen_resident_fp8(model, self.streamed, compute)  # what no unit widens as it streams
        if getattr(self.store, "filled", False):
            for u in self.streamed:
                for ts in u.tensors:
                    set_data(ts, self.binder.placeholder_for(ts))
        else:
            self._pack()
        trim_host_heap()
        if hasattr(self.store, "pin"):
            self.store = self._pin_or_bounce(self.store)

        # Sticky units (a buffer of their own) are the ring's to know from here on: ring.sticky.
        moving = [u for u in self.streamed if u.uid not in residency.sticky]
        slot_bytes = max((u.nbytes for u in moving), default=0)
        self.ring = SlotRing(slot_bytes, planner.ring_slots(depth, len(moving)), self.device)
        for u in self.streamed:
            if u.uid in residency.sticky:
                self.ring.add_sticky(u.uid, u.nbytes)
        self.schedule = Schedule(depth)
        # Units stored in another dtype land in a raw buffer and are widened into their slot.
        self.widener = UnitWidener(self.streamed, self.device)
        # debug_link_gbps: a slower link, emulated by holding the copy stream after each H2D copy (link.py)
        self.pacer = LinkPacer(config.debug_link_gbps, self.device) if config.debug_link_gbps is not None else None
        if self.parking is not None:
            self.parking.pacer = self.pacer  # the activations' copies back cross the same (emulated) link
        self.transfer = Transfer(self.device, use_streams=config.use_streams, timing=self.timing,
                                 counters=self.counters, widener=self.widener,
                                 bounce=self.store if isinstance(self.store, BounceStore) else None, pacer=self.pacer)
        self.use_streams = self.transfer.use_streams
        self.replanner = Replanner(self)
        self._install_hooks()
        # after the hooks (they stay on the blocks' __call__, outside what is compiled)
        self.compiler = BlockCompiler(blocks, cycle=lambda: self.schedule.cycles) if blocks else None
        for u in self.streamed:
            self.binder._spec(u)  # each tensor's binding, and the tensor object it was given (binding.py)
        self.masters = Masters(self)  # state_dict() and load_state_dict() read and write the host masters
        self._handles += self.masters.handles
        registry.note(model, self)
        self._finalizer = weakref.finalize(self, _quiesce, self.transfer.streams)
        self._finalizer.atexit = False

    def _undo_setup(self) -> None:
        """Setup failed part way: each streamed tensor that already holds a placeholder gets its value
        back on the host (from the host store; a model given on the meta device gets meta tensors
        again), the tensors moved to the device go back, and hooks and host memory are released."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self.compiler is not None:
            self.compiler.remove()
        store = getattr(self, "store", None)
        filled = bool(getattr(store, "filled", False))
        held = {ph.data_ptr() for ph in self.binder._placeholders.values()}
        for u in self.streamed:
            for i, ts in enumerate(u.tensors):
                obj = ts.tensor()
                if obj is None or obj.device.type == "meta" or obj.data_ptr() not in held:
                    continue
                if store is None or filled:
                    value = torch.empty(ts.shape, dtype=ts.dtype, device="meta")
                    table = ts.module._parameters if ts.is_param else ts.module._buffers
                    table[ts.attr] = (nn.Parameter(value, requires_grad=obj.requires_grad)
                                      if isinstance(obj, nn.Parameter) else value)
                else:
                    obj.data = stored_value(store, u, i).clone().reshape(ts.shape)
        for m, attr, is_param, dev in self._resident_moved:
            t = (m._parameters if is_param else m._buffers)[attr]
            if t is not None:
                t.data = t.data.to(dev)
        self._resident_moved.clear()
        if store is not None:
            try:
                store.close()
            except Exception:  # the first failure is the one to see
                pass

    def _make_store(self) -> HostStore:
        """The host store of the streamed units (setup only; the hot path sees the HostStore calls).

        - lazy_load / offload_to_disk: a DiskStore over the shards in shard_dir (disk/integrate.py)
        - weights: a PinnedArena filled straight from the checkpoint (weights.py), the resident
          tensors read onto the device
        - otherwise a PinnedArena the model's tensors are packed into
        """
        cfg = self.config
        pin = self.is_cuda and cfg.cpu_offload
        if cfg.lazy_load or cfg.offload_to_disk:
            from .disk.integrate import open_disk_store

            inference = self.treat_as_inference or not any(p.requires_grad for p in self.model.parameters())
            return open_disk_store(self.model, self.units, self.layout.block_lists, cfg, pin=pin, inference=inference)
        arena = PinnedArena(self.streamed, pin=pin)
        if cfg.weights is not None:
            from .weights import fill_from_checkpoint

            try:
                placed = fill_from_checkpoint(self.model, self.streamed, arena, cfg.weights, self.device)
            except BaseException:
                arena.close()
                raise
            # Read onto the device from the files; remove() leaves them on the host, as from_pretrained would.
            self._resident_moved += [(m, attr, is_param, torch.device("cpu")) for m, attr, is_param in placed]
        return arena

    def _blocks_to_compile(self) -> list[nn.Module]:
        """The blocks compile=True compiles (compiled.py): every item of the block lists, each of
        which must be one unit anchored on the block itself, or its hooks would be inside the graph."""
        blocks = [b for name in self.layout.block_lists for b in self.model.get_submodule(name).children()]
        if not blocks:
            raise OffloadConfigError(f"compile: {type(self.model).__name__} has no block list (a ModuleList of at "
                                     "least two blocks) to compile; leave compile off for this model")
        anchors = {id(u.anchor): u.name for u in self.units}
        for block in blocks:
            inner = next((anchors[id(m)] for n, m in block.named_modules() if n and id(m) in anchors), None)
            if inner is not None:
                raise OffloadConfigError(f"compile: {inner} is a unit of its own inside its block, so the engine's "
                                         "hooks would be inside the compiled graph; compiled blocks need each block "
                                         "streamed whole (offload_granularity block, no split_threshold_mb)")
        refuse_patched(blocks)
        return blocks

    def _pin_or_bounce(self, arena: PinnedArena) -> HostStore:
        """The arena pinned whole, or, where the box will not pin that much, the same pageable
        arena behind a pinned bounce ring (bounce.py): a host that caps pinning (WSL2, Docker
        Desktop) is never left on plain pageable copies, 7-10x slower. Said once, with the reason."""
        cfg = self.config
        limit = pinned_limit(cfg.pinned_limit)
        want = arena.capacity_bytes
        arena.pinned_limit_bytes = limit
        if not arena.pin_requested:
            arena.host_store_reason = "no CUDA device, or cpu_offload is off: nothing to pin"
            if self.device.type == "cpu" and want > limit:
                # the CPU path runs the same ring (synchronous copies): tests reach it this way
                return BounceStore(arena, limit=limit, device=self.device, threads=cfg.num_copy_threads,
                                   reason=f"the streamed weights ({_gib(want)}) exceed pinned_limit ({_gib(limit)})")
            return arena
        if want > limit:
            reason = f"the streamed weights ({_gib(want)}) exceed the pinned limit ({_gib(limit)})"
        elif arena.pin():
            arena.host_store_reason = f"every streamed byte pinned ({_gib(want)}, limit {_gib(limit)})"
            return arena
        else:
            arena.unpin()
            reason = f"registering {_gib(want)} of host memory failed (the host caps pinned memory)"
            warnings.warn(f"offload: {reason}; streaming from pageable RAM through a pinned bounce ring of "
                          f"{_gib(min(limit, BOUNCE_RING))} instead of plain pageable copies (set pinned_limit, "
                          f"or {PINNED_LIMIT_ENV}, to choose the ring's size)", stacklevel=4)
        store = BounceStore(arena, limit=min(limit, BOUNCE_RING), device=self.device, threads=cfg.num_copy_threads,
                            reason=reason)
        log.info("offload: host store bounce: %s", reason)
        return store

    def _move_resident(self, m: nn.Module, attr: str, is_param: bool) -> None:
        t = (m._parameters if is_param else m._buffers)[attr]
        if t is None or t.device == self.device:
            return
        self._resident_moved.append((m, attr, is_param, t.device))
        t.data = t.data.to(self.device)

    def _pack(self) -> None:
        for u in self.streamed:
            for i, ts in enumerate(u.tensors):
                obj = ts.tensor()
                with torch.no_grad():
                    pack_into(self.store, u, i, obj.data)
                set_data(ts, self.binder.placeholder_for(ts))

    def _install_hooks(self) -> None:
        anchors: dict[int, tuple[nn.Module, list[Unit]]] = {}
        for u in self.streamed:
            anchors.setdefault(id(u.anchor), (u.anchor, []))[1].append(u)
        root = self.model
        root_last: list[int] = []
        for module, units in anchors.values():
            post = module.register_forward_hook(self.binder.make_post(units), always_call=True)
            # first, so the module's other pre-hooks (legacy weight_norm, the user's) see its weights;
            # its post-hook kept last (on the root, followed by the root's own post-hook)
            last = root_last if module is root else []
            last.insert(0, post.id)
            make = self.binder.make_pre(units, last)
            self._handles.append(module.register_forward_pre_hook(make, prepend=True))
            self._handles.append(post)
        # the root's cycle hooks go around everything, its anchor's included
        self._handles.append(root.register_forward_pre_hook(self._root_pre, prepend=True))
        root_post = root.register_forward_hook(self._root_post, always_call=True)
        root_last.append(root_post.id)
        self._handles.append(root_post)

    # ------------------------------------------------------------------ seams for optimizer offload and state_dict
    def add_cycle_callback(self, cb: Callable[[], None]) -> None:
        """``cb()`` runs when the root module's forward begins (a training step's start)."""
        self._cycle_callbacks.append(cb)

    def remove_cycle_callback(self, cb: Callable[[], None]) -> None:
        if cb in self._cycle_callbacks:
            self._cycle_callbacks.remove(cb)

    def in_use(self, uid: int) -> bool:
        """Whether the unit's tensors are bound (its module is running)."""
        return uid in self.binder.bound

    def invalidate(self, uid: int) -> None:
        """Forget the device copy of a unit whose host master changed: its next use loads it again.

        A slot something still references (a retained graph) is not reused meanwhile (it is not
        free), but it no longer counts as holding the unit, so the stale bytes are never bound.
        """
        if uid not in self.binder.bound:
            self.ring.forget(uid)

    # ------------------------------------------------------------------ root hooks
    def begin_group(self, lockstep: Lockstep) -> None:
        """Layer-major accumulation (lockstep.py): K forwards of the root run as one cycle, their
        workers switching at every streamed unit's entry; their own root hooks nest inside this one."""
        self._group_depth = self._root_depth
        self._root_pre(self.model, ())
        if self._saved_hooks is not None:  # thread-local: each worker enters its own (saved_weight_refs)
            hooks, self._saved_hooks = self._saved_hooks, None
            hooks.__exit__(None, None, None)
        self.counters.accumulation_groups += 1
        self.lockstep = lockstep

    def end_group(self) -> None:
        self.lockstep = None
        self._root_depth = self._group_depth  # a worker that failed may have left its root forward early

    def saved_weight_refs(self) -> Any:
        """The saved-tensor hooks that turn saved weight views into references (entered per thread)."""
        if torch.is_grad_enabled() and self.streamed:
            return torch.autograd.graph.saved_tensors_hooks(self.binder.pack_saved, self.binder.unpack_saved)
        return contextlib.nullcontext()

    def _root_pre(self, module: nn.Module, args: Any) -> None:
        self._root_depth += 1
        if self._root_depth > 1:
            return
        if self.timing is not None and self._cycle_start is not None:
            # the last cycle was timed: root forward to root forward (each pair owns its two events);
            # kept per cycle too, for the replanner's judging of a growth
            self.timing.add("cycle", -1, self._cycle_start, self.transfer.mark(), cycle=self.schedule.cycles)
            self._cycle_start = None
        with self.lock:
            self.counters.steps += 1
            relearned = self.schedule.relearned
            had_trace = self.schedule.learned
            self.schedule.start_cycle()
            if self.schedule.learned and (not had_trace or self.schedule.relearned != relearned):
                self.store.follow_trace(list(self.schedule.trace))
            for cb in self._cycle_callbacks:
                cb()
            try:
                self.replanner.at_cycle_start()  # may raise VramBudgetError; _root_post still runs
            finally:
                self._time_this_cycle()
            self._prefetch_first()
        if torch.is_grad_enabled() and self.streamed:
            self._saved_hooks = self.saved_weight_refs()
            self._saved_hooks.__enter__()

    TIMED_FIRST = 3  # the first cycles are always timed, so stats() has readings from the start

    def _time_this_cycle(self) -> None:
        """Whether this cycle's uses and copies are timed: every one while the planner decides (it
        reads them), then one in ``timing_every`` (on a host-bound step the events are ~1% of it)."""
        k = self.schedule.cycles
        timed = self.timing is not None and (
            self.replanner.active or k <= self.TIMED_FIRST or k % self.config.timing_every == 0)
        self.transfer.timed = timed
        if not timed:
            self._span_from = None  # no span reaches across an untimed cycle
            return
        self.counters.timed_steps += 1
        self.timing.weight = max(k - self._last_timed, 1)  # this cycle and the untimed ones since the last timed
        self._last_timed = k
        self._cycle_start = self.transfer.mark()

    def _root_post(self, module: nn.Module, args: Any, output: Any) -> None:
        self._root_depth = max(self._root_depth - 1, 0)
        if self._root_depth == 0 and self._saved_hooks is not None:
            hooks, self._saved_hooks = self._saved_hooks, None
            hooks.__exit__(None, None, None)
        if self.timing is not None and len(self.timing.pending) > 1024:
            self.timing.resolve(block=False)

    # ------------------------------------------------------------------ loading
    def delay(self) -> None:
        if self.config.debug_host_delay_ms > 0:
            time.sleep(random.random() * self.config.debug_host_delay_ms / 1000.0)

    def _keep(self, current: int) -> set[int]:
        """Units no load may evict: the one in use and the next ``depth + 1`` the trace expects."""
        return set(self.schedule.upcoming(self.schedule.depth + 1)) | {current}

    def use(self, u: Unit, backward: bool = False) -> Slot:
        """Make u's bytes available to the compute stream and return its slot."""
        if self._trains_streamed and self._root_depth == 0 and torch._C._current_graph_task_id() == -1:
            raise OffloadConfigError(
                f"model: {u.name} was called outside model.forward() (encode()/decode(), or a loop over the blocks), "
                "but its weights train through optimizer offload, whose step starts in model.forward(): call the model "
                "itself, or offload the module whose forward you call")
        if self._auto_inference and torch._C._current_graph_task_id() != -1:
            raise FrozenWeightError(
                "model: every parameter required grad when offloading began, so enable_offload took it for inference "
                "and streams its weights without gradients: this backward pass would leave them untrained. To train it, "
                "use OffloadTrainingManager; for gradients with the weights frozen, call model.requires_grad_(False) "
                "before enable_offload")
        self.delay()
        with self.lock:
            self._tick += 1
            if self.replanner.active:
                self.replanner.sample()
            new_use = self.schedule.observe_new(u.uid)
            timed = self.transfer.timed and new_use
            arrive = self.transfer.mark() if timed else None
            slot = self.ring.lookup(u.uid)
            if slot is None:
                slot = self._load(u, self._keep(u.uid), urgent=True)
                self.counters.cache_misses += 1
                if backward:
                    self.counters.refetches += 1
                if self.schedule.learned and self.schedule.cycles > 1:
                    self.counters.prefetch_misses += 1
            elif new_use:
                self.counters.cache_hits += 1
            slot.last_use, slot.unused = self._tick, False
            if self.use_streams and slot.ready is not None:
                if timed:  # a bounce store's unit not yet queued blocks this thread here (bounce.Pending)
                    t0 = time.perf_counter()
                    self.transfer.compute_stream().wait_event(slot.ready)
                    self.timing.host_wait(self.schedule.cycles, (time.perf_counter() - t0) * 1e3)
                else:
                    self.transfer.compute_stream().wait_event(slot.ready)
            if timed:
                # span: busy from the last use's start to this arrival; stall: waiting here for this
                # unit's bytes. Two events a use: the arrival ends the span and starts the stall,
                # whose end starts the next span (the pair that starts with an event pools it).
                ready = self.transfer.mark()
                if self._span_from is not None:
                    # within a cycle a span is the last unit's compute; across cycles it is not
                    pos, ev, cycle, uid = self._span_from
                    self.timing.add("span", ("pos", pos), ev, arrive, own_end=False,
                                    compute=uid if cycle == self.schedule.cycles else None)
                self.timing.add("stall", u.uid, arrive, ready, cycle=self.schedule.cycles, own_end=False)
                self._span_from = (self.schedule.position, ready, self.schedule.cycles, u.uid)
            self._prefetch(u.uid)
            return slot

    def _prefetch_first(self) -> None:
        """At a call's start, the trace's (depth + 1)-th unit into the slot the last call's last unit
        left, so the copy engine has work while the host runs up to the first unit (the last call
        already queued the first ``depth``; queued at its end, the caller's sync would wait for it)."""
        self._prefetch(-1, ahead=self.schedule.depth + 1)

    def _prefetch(self, current: int, ahead: int | None = None) -> None:
        if self.schedule.depth <= 0 or not self.schedule.learned:
            return
        keep = self._keep(current)
        for uid in self.schedule.upcoming(ahead):
            u = self.units[uid]
            if not u.streamed or self.ring.lookup(uid) is not None:
                continue
            if self._load(u, keep, urgent=False) is None:
                break
            self.counters.prefetch_issued += 1

    def _load(self, u: Unit, keep: set[int], urgent: bool) -> Slot | None:
        # The slot first: a store counts every acquire as a use (and a disk store reads for it).
        slot = self.ring.sticky.get(u.uid)
        if slot is None:
            slot = self.ring.pick_victim(keep)
        if slot is None and not urgent:
            return None
        if self.widener.kept.get(u.uid):  # kept narrow, its bytes on the device already: widened only
            if slot is None:
                slot = self._take_slot(u.uid)
            if self.ring.assign(slot, u.uid) is not None:
                self.counters.cache_evictions += 1
            slot.unused = False  # not the store's: nothing to redo there
            self.transfer.widen_kept(u, slot)
            self.counters.kept_widens += 1
            return slot
        src = self.store.acquire(u.uid, block=urgent)
        if src is None:
            return None  # a store still fetching the bytes: prefetch it later
        if slot is None:
            slot = self._take_slot(u.uid)
        if self.ring.assign(slot, u.uid) is not None:
            self.counters.cache_evictions += 1
        slot.unused = True
        self.store.release(u.uid, self.transfer.load(u, slot, src))
        return slot

    def resize_ring(self, n: int, keep: Iterable[int] = ()) -> None:
        """The ring to n slots (replans); a prefetch dropped with its slot is acquired again for the same
        use, and the store hears so."""
        for uid in self.ring.resize(n, keep):
            self.store.unuse(uid)

    def _take_slot(self, uid: int) -> Slot:
        """The farthest free slot (else a new one). A prefetch there not used since its load is acquired
        again for the same use: the store hears so (a unit kept across a turn was used: its next acquire
        is its next use)."""
        slot = self._farthest_free(uid)
        if slot is None:
            return self.ring.grow()
        if slot.unused and slot.owner is not None:
            self.store.unuse(slot.owner)
        return slot

    def _farthest_free(self, uid: int) -> Slot | None:
        """For a unit needed now that no free slot outside the lookahead can take: the free slot of
        the unit the trace needs last (its prefetch is redone later), so the ring keeps the size its
        plan gave it. A disk store that could not serve a prefetch in time leaves later units in
        every slot; growing a slot then took memory the plan had given the activations."""
        for ahead in reversed(self.schedule.upcoming(self.schedule.depth + 1)):
            slot = self.ring.lookup(ahead)
            if ahead != uid and slot is not None and slot.index >= 0 and slot.is_free():
                return slot
        return None

    # ------------------------------------------------------------------ units kept on the device
    def kept_units(self) -> frozenset[int]:
        """Streamed units a plan keeps on the device: in a buffer of their own (``ring.sticky``,
        widened), or as their stored bytes, widened at each use (``widener.kept``)."""
        return frozenset(self.ring.sticky) | frozenset(self.widener.kept)

    def _narrow(self, uid: int) -> bool:
        u = self.units[uid]  # (a unit bigger than a slot cannot pass through the ring: kept widened)
        return self.config.keep_narrow and u.converted and not u.trainable and u.nbytes <= self.ring.slot_bytes

    def keep_cost(self, uid: int) -> int:
        """Device bytes keeping uid takes: its stored bytes where it is kept narrow."""
        u = self.units[uid]
        return u.store_nbytes if self._narrow(uid) else u.nbytes

    def keep_unit(self, uid: int) -> None:
        if uid in self.ring.sticky or uid in self.widener.kept:
            return
        if self._narrow(uid):
            self.widener.keep(self.units[uid])  # filled by its next load, which copies as before
        else:
            self.ring.add_sticky(uid, self.units[uid].nbytes)

    def unkeep_unit(self, uid: int) -> None:
        """uid streams through the ring from the host again (the caller has synchronized)."""
        self.ring.drop_sticky(uid)
        self.widener.unkeep(uid)

    # ------------------------------------------------------------------ planning (replan.py)
    def predict(self) -> float | None:
        """The planner's simulated cycle for the plan in force, from measured times (ms)."""
        return self.replanner.predict()

    def refill(self) -> None:
        """Prefetch along the trace now (after a new plan freed or added slots)."""
        with self.lock:
            self._prefetch(-1)

    def in_call(self) -> bool:
        """A forward of the model, or a backward pass, is running."""
        return self._root_depth > 0 or torch._C._current_graph_task_id() != -1

    def release_growth(self) -> int:
        """The ring's slots past its first plan, back to torch's allocator until the next call (Replanner.release)."""
        with self.lock:
            return self.replanner.release()

    def bound_uids(self) -> set[int]:
        return set(self.binder.bound)

    def resident_device_bytes(self) -> int:
        """Device bytes of the tensors this engine moved there for good (residents, strays, staging)."""
        return self.widener.staging_bytes + sum(
            (m._parameters if p else m._buffers)[a].nbytes for m, a, p, _ in self._resident_moved
            if (m._parameters if p else m._buffers).get(a) is not None)

    # ------------------------------------------------------------------ stats
    def stats(self) -> EngineStats:
        """What the engine counted and measured so far (``handle.stats()`` is its ``as_dict()``)."""
        c = self.counters
        if self.is_cuda:
            dev = self.device
            vram = (torch.cuda.memory_allocated(dev), torch.cuda.memory_reserved(dev), torch.cuda.max_memory_allocated(dev))
        else:
            vram = (0, 0, 0)
        sticky_uids = self.ring.sticky
        streamed = sum(u.nbytes for u in self.streamed if u.uid not in sticky_uids)
        sticky = sum(u.nbytes for u in self.streamed if u.uid in sticky_uids)
        resident = sticky + sum(t.nbytes for u in self.units if not u.streamed for t in u.tensors)
        narrow = self.widener.kept  # kept as their stored bytes: streamed through the ring, from the device
        resident += sum(
            (m._parameters if p else m._buffers)[a].numel() * (m._parameters if p else m._buffers)[a].element_size()
            for m, a, p in self.layout.resident
            if (m._parameters if p else m._buffers).get(a) is not None
        )
        units = [{"name": u.name, "bytes": u.nbytes, "streamed": u.streamed and u.uid not in sticky_uids,
                  "sticky": u.uid in sticky_uids, "stray": u.stray} for u in self.units]
        store_stats = self.store.stats()
        h2d_ms = stall_ms = compute_ms = timed_h2d_ms = 0.0
        measured = predicted = None
        # Once the plan is settled one step in timing_every is timed, its readings weighted by the
        # steps they stand for (stats.TimingLog): the totals are estimates over every step up to the
        # last timed one, and the copy rate is the timed bytes over the timed copies' ms.
        if self.timing is not None:
            self.timing.resolve(block=True)
            timed_h2d_ms = self.timing.timed_ms.get("h2d", 0.0)
            h2d_ms = self.timing.total_ms.get("h2d", 0.0)
            stall_ms = self.timing.total_ms.get("stall", 0.0)
            # compute: the spans within a cycle (a use to the next), each counted for the unit used first
            compute_ms = self.timing.total_ms.get("compute", 0.0)
            for info, u in zip(units, self.units):
                info.update({f"{k}_ms": v for k, v in self.timing.per_unit_ms.get(u.uid, {}).items()})
        if self.timing is not None and self.timing.counts.get("cycle"):
            # A cycle is root forward to root forward: a training step, or one inference call.
            measured = self.timing.total_ms["cycle"] / self.timing.counts["cycle"]
            predicted = self.predict()
        return EngineStats(
            vram_allocated_bytes=vram[0], vram_reserved_bytes=vram[1], vram_peak_bytes=vram[2],
            pinned=self.store.pinned,
            pinned_capacity_bytes=self.store.capacity_bytes,
            pinned_used_bytes=self.store.used_bytes,
            weight_bytes=streamed + resident,
            streamed_bytes=streamed,
            resident_bytes=resident,
            sticky_bytes=sticky + self.widener.kept_bytes,
            sticky_units=len(sticky_uids) + len(narrow),
            kept_narrow_units=len(narrow),
            slot_count=len(self.ring.slots),
            slot_bytes=self.ring.slot_bytes,
            slot_grows=self.ring.grows,
            prefetch_depth=self.schedule.depth,
            staging_bytes=self.widener.staging_bytes,
            **c.reported(),
            planning=self.replanner.active,
            trace_length=len(self.schedule.trace),
            trace_relearned=self.schedule.relearned,
            setup_seconds=self.setup_seconds,
            num_units=len(self.units),
            units=units,
            plan=dict(self.prediction),
            store_stats=store_stats,
            measured_step_ms=measured,
            predicted_step_ms=predicted,
            h2d_ms=h2d_ms,
            timed_h2d_ms=timed_h2d_ms,
            stall_ms=stall_ms,
            compute_ms=compute_ms,
            h2d_gbps=(c.timed_h2d_bytes / 1e9) / (timed_h2d_ms / 1e3) if timed_h2d_ms > 0 else 0.0,
            link_stats=self.pacer.stats() if self.pacer is not None else {},
            h2d_bytes_per_optimizer_step=c.accumulate_h2d_bytes / c.accumulate_calls if c.accumulate_calls else 0.0,
            compile_stats=self.compiler.stats() if self.compiler is not None else {},
        )

    def reset_stats(self) -> None:
        """Counters, timings and the device's peak start again from zero."""
        self.counters.__init__()
        if self.timing is not None:
            self.timing.resolve(block=True)
            self.timing.reset()
        if self.is_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    # ------------------------------------------------------------------ teardown
    def synchronize(self) -> None:
        self.transfer.synchronize()

    def remove(self) -> None:
        """Take the hooks off and give every tensor its full data back on the host."""
        if self._removed:
            return
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self.compiler is not None:
            self.compiler.remove()
        self.synchronize()
        for uid in list(self.binder.bound):
            self.binder.unbind(self.units[uid])
        self.synchronize()
        for u in self.streamed:
            self.binder.adopt(u, lost="warn")  # `p.data = new` since the last use; a lost in-place edit warns
        self.masters.flush()
        for u in self.streamed:
            for i, ts in enumerate(u.tensors):
                # a weight given in fp8 goes back as its fp8 bytes; the rest as the model computes with it
                value = self.store.view(u, i) if ts.native_dtype is not None else self.masters.value(u, i)
                # into the tensor object the engine was given (a replacement the user put in its place stays)
                own = self.binder.own(u, i)
                own.data = value.clone() if ts.store_dtype is None or ts.native_dtype is not None else value
        for m, attr, is_param, dev in self._resident_moved:
            t = (m._parameters if is_param else m._buffers)[attr]
            if t is not None:
                t.data = t.data.to(dev)
        self._resident_moved.clear()
        self.ring.clear()
        self.store.close()
        registry.forget(self.model)
        self._removed = True
        if self.lossy:
            dtype = self.config.weight_dtype
            warnings.warn(
                f"weight_dtype={dtype}: remove() leaves the model holding its weights as stored, rounded to "
                f"{dtype} and widened back to their dtype; reload the checkpoint for the original values",
                LossyStorageWarning, stacklevel=3)


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"
