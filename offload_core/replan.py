"""Replanner: measure a running engine's cycles, ask the planner, and apply the plan it returns.

The first cycles run as set up, on the smallest ring. At the third cycle start the engine has one
traced cycle timed (each use's busy time, the copy rate) and the device's peak over the first two:

- with a ``vram_budget``, ``planner.plan_budget`` spends it (what the rest of the process peaked
  at is set aside first); a budget that cannot even hold the smallest ring raises at the second
  cycle start, as soon as one cycle has been measured;
- without one, on a card, with the prefetch depth not pinned, ``planner.plan_growth`` deepens the ring into the memory the card has free for this process. The
  growth stays if the measured stall of the next full cycle (the fourth) fell, or, for a growth the
  simulation chose, moved within one cycle's noise (``NOISE`` of its busy time); otherwise the ring
  goes back. Where torch's allocator had to free its cache to fit the activations next to the
  new slots, the ring gives back one slot and is judged again, down to where it started. A first
  decision that found no stall to take away, where there is room, looks again ``RETRY_AFTER``
  cycles on (twice at most): it read one cycle, and one slow cycle shows none.
  An inference ring grows into half the free memory only: a pipeline needs the rest for what runs
  after the transformer (the VAE decode, the next text encoder), which the ring cannot see coming.
  Its room may also keep units on the device (``plan_growth(keep_units=True)``: slots or sticky units,
  by simulated gain per byte), which ``release()`` gives back too.
  Narrow weights make it worth it: with fp8 storage a cycle is nearly copy-bound, and the slots
  past the smallest ring let the copies of the next call's first (widest) blocks run during this
  call's last (compute-heavy) ones. ``release()`` gives the grown slots back to torch's allocator
  (the jobs call it before a VAE decode); the next call takes them again.

The engine resets the device's peak-memory statistics once, when its first cycle starts, so the
peak it reads is this model's (activations and all). While it is deciding, it also reads the peak at
every use, and at the end of every backward pass that used a unit, and keeps the highest: a
training loop that resets the statistics each step cannot hide the activations from a decision,
nor the backward of the last unit used (which runs after its use).
"""

from __future__ import annotations

import torch

from . import device, planner
from .seams import ReplanHost

__all__ = ["Replanner"]


class Replanner:
    def __init__(self, e: ReplanHost) -> None:
        self.e = e
        cfg = e.config
        self.depth0 = e.schedule.depth
        self.slots0 = len(e.ring.slots)
        self.sticky0 = e.kept_units()  # units kept from the setup on: release() keeps them
        self.budget = cfg.vram_budget
        # a device with a memory limit to grow into (a card; None on the CPU)
        self.grow = (cfg.vram_budget is None and cfg.prefetch is None and e.timing is not None
                     and e.ring.slot_bytes > 1 and device.limit_bytes(e.device) is not None)
        self.active = e.timing is not None and (self.budget is not None or self.grow)
        self.training = True  # every cycle so far ran its forward with grad enabled
        self.before: planner.RingPlan | None = None  # the plan a growth replaced, to go back to
        self.grown_at = 0  # the cycle at whose start the last growth was applied
        self.retries_at_growth: int | None = None  # the allocator's retry count when it was applied
        self.judge_from = 0  # the cycle before the growth: its stall is what the growth must cut
        self.at_edge = False  # a growth made the allocator retry: the ring grows no further
        self.rounds = 0
        self.retries = 0  # first decisions that found no stall, tried again later (RETRY_AFTER)
        self.retry_at = 0  # the cycle at whose start the next retry is
        self.sampled_peak = 0  # the device's peak reading, taken at every use while deciding
        self._tail_task = -1  # the backward pass whose end is already queued to read the peak
        # (slots, depth, kept units) release() gave back, taken again at the next call
        self.restore: tuple[int, int, frozenset[int]] | None = None
        self.released = 0  # times release() gave slots back

    # ------------------------------------------------------------------ measuring
    def measure(self) -> planner.Measurements | None:
        """The traced cycle as the planner sees it: busy time per use, copy time per unit, device bytes."""
        e = self.e
        if e.timing is None or not e.schedule.trace:
            return None
        e.timing.resolve(block=True)
        h2d_ms = e.timing.timed_ms.get("h2d", 0.0)
        if h2d_ms <= 0 or e.counters.timed_h2d_bytes <= 0:
            return None
        per_ms = e.counters.timed_h2d_bytes / h2d_ms
        trace = tuple(e.schedule.trace)
        ring = e.ring
        fixed = e.resident_device_bytes()
        return planner.Measurements(
            trace=trace, spans=tuple(e.timing.last_ms.get(("span", ("pos", i)), 0.0) for i in range(len(trace))),
            copy_ms={u.uid: u.store_nbytes / per_ms for u in e.streamed}, nbytes={u.uid: u.nbytes for u in e.streamed},
            keep_bytes={u.uid: e.keep_cost(u.uid) for u in e.streamed},
            slot_bytes=ring.slot_bytes, slots=len(ring.slots), depth=e.schedule.depth, sticky=e.kept_units(),
            candidates=frozenset(u.uid for u in e.streamed if not u.trainable),
            forced=frozenset(uid for uid in ring.sticky if e.units[uid].nbytes > ring.slot_bytes),
            stale=frozenset(u.uid for u in e.streamed if u.trainable), fixed_bytes=fixed,
            engine_bytes=fixed + ring.capacity_bytes + ring.sticky_bytes + e.widener.kept_bytes,
            peak_bytes=self.peak(), limit_bytes=device.limit_bytes(e.device))

    def sample(self) -> None:
        """At a use, while plans are being decided: keep the highest peak reading seen. A training
        loop that resets the peak statistics every step (to log each step's peak) would otherwise
        leave a decision at a cycle start reading only what came after the reset, and the ring would
        grow into memory the activations need."""
        self._sample_peak()
        # In a backward pass, read it once more when the pass ends: after the last unit's use its
        # backward still runs (with checkpointing, the largest activations of the cycle).
        task = torch._C._current_graph_task_id()
        if task != -1 and task != self._tail_task:
            self._tail_task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._sample_peak)

    def _sample_peak(self) -> None:
        p = device.peak_bytes(self.e.device)
        if p is not None and p > self.sampled_peak:
            self.sampled_peak = p

    def peak(self) -> int | None:
        p = device.peak_bytes(self.e.device)
        return None if p is None else max(p, self.sampled_peak)

    def predict(self) -> float | None:
        m = self.measure()
        return None if m is None else planner.predict(m)

    # ------------------------------------------------------------------ applying
    def apply(self, plan: planner.RingPlan) -> None:
        """Make ``plan`` the one in force: sticky units, ring slots, prefetch depth."""
        e = self.e
        e.synchronize()  # no copy may still be landing in a buffer the new plan frees
        for uid in e.kept_units() - plan.sticky:
            e.unkeep_unit(uid)
        for uid in sorted(plan.sticky):
            e.keep_unit(uid)
        e.resize_ring(plan.slots, keep=e.bound_uids())
        e.schedule.depth = plan.depth
        moving = [u for u in e.streamed if u.uid not in e.ring.sticky]
        e.prediction.update(
            plan.info(), sticky_units=len(plan.sticky), streamed_units=len(moving),
            streamed_bytes=sum(u.nbytes for u in moving), sticky_bytes=sum(e.keep_cost(u) for u in plan.sticky),
            kept_narrow_units=len(e.widener.kept),
            extra_slots=len(e.ring.slots) - self.slots0, depth=plan.depth)
        e.refill()  # what the new plan no longer keeps: fetch the first units now

    # ------------------------------------------------------------------ when
    def release(self) -> int:
        """Between calls: the ring back to the slots the first cycles ran on, the grown ones freed to
        torch's allocator (cached, so what runs next in this process can take them), until the next
        call starts and takes them again. Returns the bytes given back (0: nothing had grown, or a
        call is running). A decision still being made ends with the plan in force."""
        e = self.e
        extra = len(e.ring.slots) - self.slots0
        kept = e.kept_units() - self.sticky0  # units the growth kept on the device (inference)
        if extra <= 0 and not kept or not self.grow or e.in_call():
            return 0
        if self.active:
            self.active = False
            self.before = None
            self.retry_at = 0
        self.restore = (len(e.ring.slots), e.schedule.depth, kept)
        e.synchronize()  # no copy may still be landing in a slot that is freed
        e.schedule.depth = self.depth0
        for uid in kept:
            e.unkeep_unit(uid)
        e.resize_ring(self.slots0, keep=set(e.schedule.upcoming(self.depth0 + 1)) | e.bound_uids())
        self.released += 1
        e.prediction["released"] = self.released
        return ((self.restore[0] - len(e.ring.slots)) * e.ring.slot_bytes
                + sum(e.keep_cost(uid) for uid in kept))

    def at_cycle_start(self) -> None:
        e, k = self.e, self.e.schedule.cycles
        if self.restore is not None:
            slots, depth, kept = self.restore
            self.restore = None
            for uid in sorted(kept):
                e.keep_unit(uid)  # loaded again at its first use
            e.resize_ring(slots)
            e.schedule.depth = depth  # the call's first prefetch (_prefetch_first) fills them
        if not self.active:
            return
        self.training &= torch.is_grad_enabled()
        if k == 1:
            device.reset_peak(e.device)  # from here on the peak is this model's: its activations and the ring
            self.sampled_peak = 0
            return
        # Stalls are kept per cycle, so only a decision point resolves (and so waits for the device):
        # a cycle that follows a host wait is not the one whose stall is read.
        if k == 2 and self.budget is not None:
            m = self.measure()
            if m is not None and m.peak_bytes is not None:
                planner.budget_room(m, self.budget)  # raises now if even the smallest ring cannot fit
        elif k == 3 and e.schedule.learned:
            m = self.measure()
            if m is None:
                self.active = False
            elif self.budget is not None:
                self.apply(planner.plan_budget(m, self.budget, grow_depth=e.config.prefetch is None))
                self.active = False
            else:
                self._grow(m, k)
        elif self.retry_at and k == self.retry_at:
            # the first decision read one cycle; one slow cycle (a host pause) can show no stall
            self.retry_at = 0
            m = self.measure()
            if m is None:
                self.active = False
            else:
                self._grow(m, k)  # it says whether to stay active (another retry, a growth to judge)
        elif self.before is not None and k == self.grown_at + 2:
            # cycle grown_at filled the new slots, the next one ran on them: keep the growth only if
            # that cycle's stall fell; while it did and the cycle still stalls, double the ring again
            e.timing.resolve(block=True)
            was, now = self.cycle_stall(self.judge_from), self.cycle_stall(k - 1)
            retries = device.alloc_retries(e.device)
            retried = 0 if retries is None or self.retries_at_growth is None else retries - self.retries_at_growth
            e.prediction.update(stall_before_growth_ms=was, stall_after_growth_ms=now, alloc_retries_after_growth=retried)
            if retried > 0 and len(e.ring.slots) - 1 > self.before.slots:
                # the new slots left the activations too little room: the allocator freed its cache and
                # retried (each time a device-wide wait). One slot fewer, judged again two cycles on.
                self.at_edge = True
                self._step_down(retried)
                self.grown_at = k
                self.retries_at_growth = device.alloc_retries(e.device)
            elif retried > 0:
                self.apply(self.before)
                e.prediction["chosen_by"] = ("smallest ring" if self.rounds == 1 else "free memory") + (
                    f" (growth made the allocator free its cache {retried} times)")
                self.before = None
                self.active = False
            elif now > was - max(0.5, 0.02 * was) and (
                    (now > was + max(0.5, self.NOISE * e.prediction.get("growth_busy_ms", 0.0))
                     and not self._cycle_held(self.judge_from, k - 1))
                    or e.prediction.get("chosen_by") not in self.SIMULATED):
                # The stall rose past one cycle's noise and the cycle took longer, or a growth the
                # simulation did not back (the measured-stall doubling) cut none of it: back to the ring
                # before. A stall that rose in a cycle that did not slow is a wait that moved: through a
                # bounce store a deeper ring queues further ahead of the engine's thread, which waits
                # less on the host and more on the device (on an H100 at an emulated 25 GB/s, Flux-dev
                # LoRA: stall 447 -> 519 ms, and sent back to 3 slots the step took 1969.8 ms against
                # 1938.9 on 5).
                self.apply(self.before)
                e.prediction["chosen_by"] = ("smallest ring (growth did not cut the measured stall)"
                                             if self.rounds == 1 else "free memory (the last growth bought nothing)")
                self.before = None
                self.active = False
            elif now > was - max(0.5, 0.02 * was):
                # A growth the simulation backed, judged on one cycle whose stall moved within the noise:
                # kept (the memory has no other use within the margin; the allocator's retries above
                # still send it back). Sent back, the H200's Flux-dev LoRA stayed on 3 slots in 2 of 5
                # runs (stall 136.3 -> 138.9 ms in a 1036 ms cycle): 1010.90 ms a step against 914.48 grown.
                rose = now > was + max(0.5, self.NOISE * e.prediction.get("growth_busy_ms", 0.0))
                e.prediction["growth_judged"] = ("kept: the stall rose, the cycle did not slow" if rose
                                                 else "kept: the stall moved within one cycle's noise")
                self.before = None
                self.active = False
            elif (not self.at_edge and self.rounds < self.MAX_ROUNDS
                  and e.prediction.get("chosen_by") == "free memory (measured stall)"):
                m = self.measure()
                if m is None or not self._grow(m, k):
                    self.before = None
                    self.active = False
            else:
                self.before = None
                self.active = False

    MAX_ROUNDS = 3  # growths tried one after the other while the measured stall keeps falling
    NOISE = 0.03  # of a cycle's busy time: how far one cycle's stall moves from the next with nothing changed
    SIMULATED = ("free memory", "free memory (slots and kept units)")  # growths the simulation chose
    MAX_RETRIES = 2  # a training ring that found no stall to take away, with room to grow, looks again
    RETRY_AFTER = 3  # cycles on (on the H200, at Flux-dev size under 8 GiB, one slow cycle showed
    #                  17.8 ms of stall where the others showed 161, and the ring stayed at 3 slots)

    def _grow(self, m: planner.Measurements, k: int) -> bool:
        """Try a deeper ring (evaluated two cycles on); False when there is nothing to try."""
        e = self.e
        stall = self.cycle_stall(k - 1)
        margin = self.margin(m)
        plan = planner.plan_growth(m, margin=margin, measured_stall_ms=stall, keep_units=not self.training)
        e.prediction.update(growth_room_slots=planner.growth_room(m, margin), growth_measured_stall_ms=stall,
                            growth_host_wait_ms=e.timing.cycle_ms.get(("host_wait", k - 1), 0.0),
                            growth_busy_ms=sum(m.spans), growth_margin_bytes=margin)
        if plan is None:
            if self.rounds == 0:
                e.prediction["growth"] = "none: no free memory, or no stall to take away"
                if self.retries < self.MAX_RETRIES and planner.growth_room(m, margin) > 0:
                    self.retries += 1
                    self.retry_at = k + self.RETRY_AFTER
                    e.prediction["growth_retries"] = self.retries
            self.active = self.retry_at != 0 or self.before is not None
            return False
        self.before = planner.RingPlan(m.sticky, m.slots, m.depth, plan.start_ms, plan.start_ms,
                                   "smallest ring" if self.rounds == 0 else "free memory")
        self.rounds += 1
        self.grown_at = k
        self.apply(plan)
        self.retries_at_growth = device.alloc_retries(e.device)
        self.judge_from = k - 1
        return True

    def _step_down(self, retried: int) -> None:
        """The grown ring less one slot (the sticky units kept), after the allocator retried ``retried`` times."""
        e = self.e
        slots = len(e.ring.slots) - 1
        p = e.prediction
        self.apply(planner.RingPlan(
            e.kept_units(), slots, max(self.before.depth, slots - 1), p.get("planned_step_ms", 0.0),
            p.get("unplanned_step_ms", 0.0), f"free memory (one slot fewer: the allocator freed its cache {retried} times)",
            p.get("measured_other_bytes", 0), p.get("planned_device_bytes", 0) - e.ring.slot_bytes))

    def cycle_time(self, cycle: int) -> float:
        """The device's ms from cycle ``cycle``'s start (after the replanner's own work there) to the
        next's (the engine's root-forward-to-root-forward pair; resolved timings only; 0: not read)."""
        return self.e.timing.cycle_ms.get(("cycle", cycle), 0.0)

    def _cycle_held(self, before: int, after: int) -> bool:
        """Cycle ``after`` took no longer than cycle ``before``, within one cycle's noise (False where
        either was not read)."""
        was, now = self.cycle_time(before), self.cycle_time(after)
        self.e.prediction.update(cycle_before_growth_ms=was, cycle_after_growth_ms=now)
        return was > 0 and now > 0 and now <= was + max(0.5, self.NOISE * was)

    def cycle_stall(self, cycle: int) -> float:
        """Measured stall ms of one cycle (resolved timings only): the device's wait for copies, or the
        engine's thread's wait for them to be queued where that is longer. Through a bounce store the
        thread blocks until the ring's issuer has queued a unit; when the device is still busy with
        earlier work, the device sees no wait, and the thread's lost lead shows up later as launch
        gaps inside the compute spans (Flux-dev LoRA at the H100's own link: 5.58 ms of device stall
        in a 1,663.72 ms cycle while the ring moved 32.5 GB/s; the ring never grew)."""
        cycle_ms = self.e.timing.cycle_ms
        return max(cycle_ms.get(("stall", cycle), 0.0), cycle_ms.get(("host_wait", cycle), 0.0))

    def margin(self, m: planner.Measurements) -> int:
        """Device memory growth leaves free: ``vram_margin`` where set; else 5% of the limit (512 MiB at
        least), and for inference half the room above the measured peak (what runs after the model)."""
        if self.e.config.vram_margin is not None:
            return int(self.e.config.vram_margin)
        base = max(512 << 20, int(0.05 * (m.limit_bytes or 0)))
        if self.training or m.limit_bytes is None or m.peak_bytes is None:
            return base
        return max(base, (m.limit_bytes - m.peak_bytes) // 2)
