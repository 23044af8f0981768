"""DiskStore on real shard files (CPU): the cache's hit rate, read-ahead, kept units, errors without hangs."""

from __future__ import annotations

import gc
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from offload_core.disk.errors import ShardChecksumError, ShardReadError
from offload_core.disk.read import UnitReader
from offload_core_disk_helpers import block_units, one_pass, open_store, sharded_stack, typed


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, Any]:
    return sharded_stack(tmp_path_factory.mktemp("stack"))


def _rate(store: Any, passes: int, units: list) -> tuple[float, int]:
    """The hit rate of these passes, and the unit reads they cost (read-ahead into the next pass excluded)."""
    s0 = store.stats()
    for _ in range(passes):
        one_pass(store, units)
    s = store.stats()
    hits, misses = s["disk_cache_hits"] - s0["disk_cache_hits"], s["disk_cache_misses"] - s0["disk_cache_misses"]
    assert hits + misses == passes * len(units)
    # every read is a miss, or read ahead and not used yet: nothing is read twice or for nothing
    assert s["disk_reads"] + s["disk_reads_in_flight"] == s["disk_cache_misses"] + s["disk_ahead_units"]
    return hits / (hits + misses), misses


# ------------------------------------------------------------------ the cache


@pytest.mark.parametrize("f", [0.25, 0.5, 0.75])
def test_hit_rate_is_the_cached_fraction(stack: tuple, f: float) -> None:
    """max_memory = f x the streamed bytes: over 20 passes in trace order, f of the uses are hits
    (the reads are counted: every miss is one read of one unit file, and nothing else is read)."""
    model, plan, index = stack
    units = block_units(plan)
    store = open_store(model, units, index, f, num_disk_workers=2)
    try:
        store.follow_trace([u.uid for u in units])
        cold, cold_reads = _rate(store, 1, units)  # the first pass reads everything: nothing is cached yet
        assert cold == 0.0 and cold_reads == len(units)
        rate, reads = _rate(store, 20, units)
        assert abs(rate - f) <= 0.02, rate
        assert reads == round((1 - rate) * 20 * len(units))
        s = store.stats()
        assert s["disk_cache_used_bytes"] <= s["disk_cache_capacity_bytes"] <= f * sum(
            index.units[u.name].read_nbytes for u in units) + 4096
        assert s["disk_cache_evictions"] == 0  # a fixed subset: nothing churns
        assert s["disk_wasted_reads"] == 0
    finally:
        store.close()


@pytest.mark.parametrize("policy", ["fifo", "lru"])
@pytest.mark.parametrize("f", [0.25, 0.75])
def test_fifo_and_lru_get_about_nothing_from_a_cycle(stack: tuple, policy: str, f: float) -> None:
    model, plan, index = stack
    units = block_units(plan)
    store = open_store(model, units, index, f, num_disk_workers=2, policy=policy)
    try:
        store.follow_trace([u.uid for u in units])
        one_pass(store, units)
        rate, reads = _rate(store, 20, units)
        assert rate <= 0.02 and reads >= 0.98 * 20 * len(units)
        assert store.stats()["disk_cache_evictions"] > 0 and store.stats()["disk_cache_policy"] == policy
    finally:
        store.close()


def test_a_cache_bigger_than_the_model_holds_just_the_model(stack: tuple) -> None:
    model, plan, index = stack
    units = block_units(plan)
    store = open_store(model, units, index, 4.0)
    try:
        assert store.stats()["disk_cache_capacity_bytes"] == sum(index.units[u.name].read_nbytes for u in units)
        store.follow_trace([u.uid for u in units])
        one_pass(store, units)
        assert _rate(store, 2, units)[0] == 1.0
    finally:
        store.close()


def test_without_a_trace_the_first_units_stay(stack: tuple) -> None:
    """Before the engine has traced a cycle there is no read-ahead, and a full cache keeps what it has."""
    model, plan, index = stack
    units = block_units(plan)
    store = open_store(model, units, index, 0.5, num_disk_workers=1)
    try:
        one_pass(store, units)
        rate, _ = _rate(store, 3, units)
        assert abs(rate - 0.5) <= 0.03
    finally:
        store.close()


@pytest.mark.parametrize("policy", ["belady", "fifo", "lru"])
def test_every_slab_holds_the_model_bytes(stack: tuple, policy: str) -> None:
    model, plan, index = stack
    units = block_units(plan)
    store = open_store(model, units, index, 0.5, num_disk_workers=3, policy=policy, verify=True)
    try:
        store.follow_trace([u.uid for u in units])
        for _ in range(3):
            for u in units:
                slab = store.acquire(u.uid)
                assert slab.dtype == torch.uint8 and slab.numel() == u.store_nbytes
                for i, ts in enumerate(u.tensors):
                    assert torch.equal(typed(slab, u, i), ts.tensor()), u.name
                store.release(u.uid)
        s = store.stats()
        assert s["disk_direct_reads"] == s["disk_reads"]  # ext4 here: every slab read is O_DIRECT
    finally:
        store.close()


def test_workers_read_ahead_in_trace_order(stack: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    model, plan, index = stack
    units = block_units(plan)
    order: list[str] = []
    real = UnitReader.read_unchecked  # the store's workers read with it (the first-read check runs beside them)

    def read_unchecked(self: Any, entry: Any, buf: torch.Tensor) -> tuple[int, bool, Any]:
        order.append(entry.name)
        return real(self, entry, buf)

    monkeypatch.setattr(UnitReader, "read_unchecked", read_unchecked)
    trace = [u.uid for u in reversed(units)]  # any order: the trace's, not the model's
    store = open_store(model, units, index, 0.0, num_disk_workers=1, stream_slots=4)
    try:
        store.follow_trace(trace)
        deadline = time.monotonic() + 10
        while len(order) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)
        # before any use: the first units of the trace, as many as the staging slots hold
        assert order == [units[-1].name, units[-2].name, units[-3].name, units[-4].name]
        assert store.stats()["disk_cache_misses"] == 0
        for uid in trace:
            store.acquire(uid)
            store.release(uid)
        assert order == [u.name for u in reversed(units)] + order[len(units):]
        assert len(order) <= len(units) + 4  # then the next cycle's first ones
    finally:
        store.close()


class _Copy:
    """A CUDA event's two calls the store makes, for a copy out of a slab that is still in flight."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


def _wait_reads(store: Any, n: int, timeout: float = 5.0) -> int:
    deadline = time.monotonic() + timeout
    while store.stats()["disk_reads"] < n and time.monotonic() < deadline:
        time.sleep(0.005)
    return store.stats()["disk_reads"]


def test_a_finished_copy_frees_its_slot_for_the_next_read_with_no_call_from_the_engine(stack: tuple) -> None:
    """The engine releases a slab with the event of its copy; when that copy ends, nothing else may be
    needed for the disk to go on reading ahead (else it idles until the engine next calls the store)."""
    model, plan, index = stack
    units = block_units(plan)
    store = open_store(model, units, index, 0.0, num_disk_workers=2, stream_slots=2)
    try:
        store.follow_trace([u.uid for u in units])
        assert _wait_reads(store, 2) == 2  # both staging slots read ahead
        copies = [_Copy(), _Copy()]
        for u, ev in zip(units[:2], copies):
            store.acquire(u.uid)
            store.release(u.uid, after=ev)
        time.sleep(0.1)
        assert store.stats()["disk_reads"] == 2  # both slots still being copied out of
        for ev in copies:
            ev.done = True
        assert _wait_reads(store, 4) == 4  # the next two units, read with no further call
        assert store.stats()["disk_ahead_units"] == 2
    finally:
        store.close()


def test_non_blocking_acquire_says_not_yet(stack: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    model, plan, index = stack
    units = block_units(plan)
    gate = threading.Event()
    real = UnitReader.read_unchecked

    def slow(self: Any, entry: Any, buf: torch.Tensor) -> tuple[int, bool, Any]:
        gate.wait(10)
        return real(self, entry, buf)

    monkeypatch.setattr(UnitReader, "read_unchecked", slow)
    store = open_store(model, units, index, 0.0, num_disk_workers=1)
    try:
        u = units[3]
        assert store.acquire(u.uid, block=False) is None  # not in memory yet: the read is now queued
        gate.set()
        slab = store.acquire(u.uid)
        assert torch.equal(typed(slab, u, 0), u.tensors[0].tensor())
        store.release(u.uid)
        assert store.stats()["disk_stall_ms"] >= 0
    finally:
        store.close()


def test_trace_positions_the_engine_never_asks_for_are_learned(stack: tuple) -> None:
    """A traced use the engine serves itself (the unit was still on the device) is read ahead once, then skipped."""
    model, plan, index = stack
    units = block_units(plan)
    store = open_store(model, units, index, 0.0, num_disk_workers=1, stream_slots=3)
    try:
        store.follow_trace([u.uid for u in units])
        asked = [u for i, u in enumerate(units) if i % 10 != 5]
        for _ in range(4):
            one_pass(store, asked)
        s = store.stats()
        assert s["disk_wasted_reads"] == len(units) - len(asked)  # the first cycle only
        assert s["disk_cache_misses"] == 4 * len(asked)
    finally:
        store.close()


@pytest.mark.parametrize("kept_at_turn", [1, 3])
def test_a_use_at_the_turn_is_its_own_not_the_one_before_it(stack: tuple, kept_at_turn: int) -> None:
    """A forward, then the backward in reverse, the engine keeping the last ``kept_at_turn`` units on the
    device across the turn: the next unit is used on both sides of it, its second use while its first is
    still in the window behind the position. Matched to the first, the second looked like a use the engine
    served itself: it was learned as skipped and read again, every step. Each use reads once now."""
    model, plan, index = stack
    units = block_units(plan)
    store = open_store(model, units, index, 0.0, num_disk_workers=2, stream_slots=4)
    try:
        store.follow_trace([u.uid for u in units + units[::-1]])
        asked = units + units[::-1][kept_at_turn:]
        for _ in range(4):
            one_pass(store, asked)
        s = store.stats()
        turn = units[-kept_at_turn - 1].uid
        core = store._core
        assert all((len(units) + kept_at_turn - 1 + i) % core.trace.length not in core.skip for i in (1, 2))
        assert core.trace.after(turn, len(units) - 1) == len(units) + kept_at_turn  # its backward use is traced
        assert s["disk_cache_misses"] == 4 * len(asked)  # no cache: every use a read, and only one
        assert s["disk_reads"] + s["disk_reads_in_flight"] == s["disk_cache_misses"] + s["disk_ahead_units"] + s["disk_wasted_reads"]
        assert s["disk_wasted_reads"] <= kept_at_turn  # the first cycle's reads for the turn's own uses, no more
    finally:
        store.close()


def test_an_acquire_again_for_the_same_use_after_unuse_matches_that_use(stack: tuple) -> None:
    """The engine took a prefetched unit's slot for a unit needed now and acquires the prefetch again later,
    for the same use: after ``unuse`` that acquire is the same use, not the unit's next one at the turn;
    without it the position would jump past the uses in between, and they would be learned as skipped."""
    model, plan, index = stack
    units = block_units(plan)
    store = open_store(model, units, index, 0.0, num_disk_workers=2, stream_slots=4)
    try:
        store.follow_trace([u.uid for u in units + units[::-1]])
        core = store._core
        n = len(units)
        one_pass(store, units[:-1])  # the forward up to its last unit
        second_last = units[-2].uid  # used again at the backward's second position (n + 1)
        assert core.pos == n - 2
        store.unuse(second_last)  # its copy was dropped before its use
        store.acquire(second_last)
        store.release(second_last)
        assert core.pos == n - 2 and core.units[second_last].used_at == n - 2  # the same use, no jump
        one_pass(store, [units[-1], units[-1], units[-2]])  # the last unit, at the turn, then the backward
        assert core.pos == n + 1 and not core.skip
    finally:
        store.close()


def test_the_position_follows_a_first_use_in_mid_trace(stack: tuple) -> None:
    """plan() comes at a cycle's start, but the first unit the engine asks for may be mid-trace."""
    model, plan, index = stack
    units = block_units(plan)
    store = open_store(model, units, index, 0.0, num_disk_workers=2, stream_slots=3)
    try:
        store.follow_trace([u.uid for u in units])
        one_pass(store, units[20:])
        for _ in range(3):
            one_pass(store, units)
        s = store.stats()
        assert s["disk_wasted_reads"] <= 6  # the reads made at plan() for the first positions, no more
        assert s["disk_cache_misses"] == 20 + 3 * len(units)
    finally:
        store.close()


# ------------------------------------------------------------------ kept units


def test_a_written_unit_is_kept_and_keeps_what_was_written(stack: tuple) -> None:
    model, plan, index = stack
    units = block_units(plan)
    store = open_store(model, units, index, 0.25, num_disk_workers=2)
    try:
        store.follow_trace([u.uid for u in units])
        one_pass(store, units)
        last = units[-1]  # streamed, not cached: the subset kept is the first quarter
        master = store.master(last.uid)
        typed(master, last, 1).fill_(7.0)  # its bias: a buffer the engine writes back
        before = store.stats()
        for _ in range(5):
            for u in units:
                slab = store.acquire(u.uid)
                if u is last:
                    assert torch.all(typed(slab, u, 1) == 7.0)
                store.release(u.uid)
        s = store.stats()
        assert s["disk_kept_bytes"] == last.store_nbytes
        # the kept unit is a hit every time, and it took one cached unit's place
        assert s["disk_cache_hits"] - before["disk_cache_hits"] == 5 * round(0.25 * len(units))
        assert torch.all(store.view(last, 1) == 7.0)
        assert store.view(last, 1).data_ptr() == typed(master, last, 1).data_ptr()  # kept: a view
        other = units[-2]
        assert torch.equal(store.view(other, 0), other.tensors[0].tensor())  # not in memory: read from disk
    finally:
        store.close()


def test_a_unit_read_ahead_into_a_staging_slot_can_be_kept(stack: tuple) -> None:
    """master() of a unit whose bytes sit in a staging slot (read ahead, not used yet): its bytes move to
    a buffer the store keeps, exactly (the slot is whole 4096-byte pages, the unit is not)."""
    model, plan, index = stack
    units = block_units(plan)
    store = open_store(model, units, index, 0.0, num_disk_workers=1, stream_slots=2)
    try:
        store.follow_trace([u.uid for u in units])
        assert _wait_reads(store, 2) == 2
        first = store._core.units[units[0].uid]
        assert first.where == "stream" and first.entry.nbytes % 4096  # a ragged unit: the case that broke
        kept = store.master(units[0].uid)
        assert torch.equal(typed(kept, units[0], 0), units[0].tensors[0].tensor())
        assert store.stats()["disk_kept_bytes"] == first.entry.nbytes
    finally:
        store.close()


def test_kept_units_beyond_max_memory_get_buffers_of_their_own(stack: tuple) -> None:
    model, plan, index = stack
    units = block_units(plan)
    store = open_store(model, units, index, 0.0, num_disk_workers=1)
    try:
        for u in units[:3]:
            store.master(u.uid)
        s = store.stats()
        assert s["disk_kept_bytes"] == sum(u.store_nbytes for u in units[:3])
        assert store.capacity_bytes >= s["disk_stream_bytes"] + s["disk_kept_bytes"]
        one_pass(store, units)
        assert store.stats()["disk_cache_hits"] == 3
    finally:
        store.close()


# ------------------------------------------------------------------ errors: named, and never a hang


def _broken_copy(tmp_path: Path, stack: tuple) -> tuple[Any, list, Any]:
    import shutil

    model, plan, index = stack
    shutil.copytree(index.root, tmp_path / "shards")
    from offload_core.disk.format import load_index

    return model, block_units(plan), load_index(tmp_path / "shards")


def _acquire_all_in_thread(store: Any, units: list, passes: int = 3) -> BaseException | None:
    """Run passes on another thread; a hang fails the test instead of stalling the suite."""
    box: list[BaseException] = []

    def run() -> None:
        try:
            for _ in range(passes):
                one_pass(store, units)
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            box.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(20)
    assert not t.is_alive(), "acquire hung"
    return box[0] if box else None


def test_missing_unit_file(tmp_path: Path, stack: tuple) -> None:
    model, units, index = _broken_copy(tmp_path, stack)
    gone = index.root / index.units[units[5].name].file
    gone.unlink()
    store = open_store(model, units, index, 0.0)
    try:
        store.follow_trace([u.uid for u in units])
        exc = _acquire_all_in_thread(store, units)
        assert isinstance(exc, ShardReadError) and str(exc).startswith(f"{gone}: missing")
    finally:
        store.close()


def test_truncated_unit_file(tmp_path: Path, stack: tuple) -> None:
    model, units, index = _broken_copy(tmp_path, stack)
    short = index.root / index.units[units[7].name].file
    with open(short, "r+b") as f:
        f.truncate(short.stat().st_size - 4096)
    store = open_store(model, units, index, 0.0)
    try:
        exc = _acquire_all_in_thread(store, units)
        assert isinstance(exc, ShardReadError) and str(exc).startswith(f"{short}:") and "the index says" in str(exc)
    finally:
        store.close()


def test_checksum_mismatch_with_verify(tmp_path: Path, stack: tuple) -> None:
    model, units, index = _broken_copy(tmp_path, stack)
    e = index.units[units[2].name]
    bad = index.root / e.file
    raw = bytearray(bad.read_bytes())
    raw[e.offset + 100] ^= 0x10
    bad.write_bytes(bytes(raw))
    store = open_store(model, units, index, 0.0, verify=True)
    try:
        exc = _acquire_all_in_thread(store, units)
        assert isinstance(exc, ShardChecksumError) and str(exc).startswith(f"{bad}: unit {units[2].name}")
    finally:
        store.close()
    # Without verify the first read in this process is still checked (xxh3): the same named error.
    store = open_store(model, units, index, 0.0, verify=False)
    try:
        exc = _acquire_all_in_thread(store, units)
        assert isinstance(exc, ShardChecksumError) and str(exc).startswith(f"{bad}: unit {units[2].name}")
    finally:
        store.close()


def test_a_unit_file_deleted_mid_run(tmp_path: Path, stack: tuple) -> None:
    """The reader thread's error comes out of the next acquire, on the engine's thread; nothing hangs."""
    model, units, index = _broken_copy(tmp_path, stack)
    store = open_store(model, units, index, 0.25, num_disk_workers=2)
    try:
        store.follow_trace([u.uid for u in units])
        assert _acquire_all_in_thread(store, units, 2) is None
        victim = index.root / index.units[units[-1].name].file  # streamed every pass
        victim.unlink()
        exc = _acquire_all_in_thread(store, units, 2)
        assert isinstance(exc, ShardReadError) and str(exc).startswith(f"{victim}: missing")
        with pytest.raises(ShardReadError, match="missing"):  # and it stays failed: no silent recovery
            store.acquire(units[0].uid)
    finally:
        store.close()


@pytest.mark.parametrize("where", ["read_unchecked", "check_first_read"])
def test_a_reader_error_of_any_kind_is_the_units_not_a_dead_worker(stack: tuple, monkeypatch: pytest.MonkeyPatch,
                                                                   where: str) -> None:
    """An error the reader does not name (a bug, a MemoryError) killed the worker thread that met it: the
    unit stayed 'reading' and its acquire waited forever. It is the unit's read error now."""
    from offload_core.disk.read import UnitReader

    model, plan, index = stack
    units = block_units(plan)
    real = getattr(UnitReader, where)

    def broken(self: Any, entry: Any, *rest: Any) -> Any:
        if entry.name == units[3].name:
            raise RuntimeError("something the reader did not expect")
        return real(self, entry, *rest)

    monkeypatch.setattr(UnitReader, where, broken)
    from offload_core.disk import checksum
    monkeypatch.setattr(checksum, "seen", lambda *a: False)  # the first-read check is due (not done in this process yet)
    store = open_store(model, units, index, 0.25, num_disk_workers=2)
    try:
        exc = _acquire_all_in_thread(store, units, 1)
        assert isinstance(exc, ShardReadError), exc
        assert units[3].name in str(exc) and "RuntimeError: something the reader did not expect" in str(exc)
    finally:
        store.close()


def test_close_while_reading_and_drop_without_close(stack: tuple) -> None:
    model, plan, index = stack
    units = block_units(plan)
    store = open_store(model, units, index, 0.5, num_disk_workers=3)
    threads = list(store._core.workers)
    assert len(threads) == 3 and all(t.is_alive() for t in threads)
    store.follow_trace([u.uid for u in units])
    t0 = time.monotonic()
    store.close()  # reads in flight: they finish or are dropped, the workers end
    assert time.monotonic() - t0 < 10 and not any(t.is_alive() for t in threads)
    store.close()  # twice is fine
    store = open_store(model, units, index, 0.5, num_disk_workers=3)
    threads = list(store._core.workers)
    store.follow_trace([u.uid for u in units])
    one_pass(store, units)
    del store  # dropped without close(): the finalizer stops the workers and frees the pool
    gc.collect()
    deadline = time.monotonic() + 10
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not any(t.is_alive() for t in threads)


def test_stats_name_what_the_issue_asks_for(stack: tuple) -> None:
    model, plan, index = stack
    units = block_units(plan)
    store = open_store(model, units, index, 0.5)
    try:
        store.follow_trace([u.uid for u in units])
        one_pass(store, units)
        one_pass(store, units)
        s = store.stats()
        for key in ("disk_bytes", "disk_gbps", "disk_stall_ms", "disk_cache_hits", "disk_cache_misses",
                    "disk_cache_evictions", "disk_cache_hit_bytes", "disk_cache_capacity_bytes",
                    "disk_cache_used_bytes"):
            assert key in s, key
        assert s["disk_bytes"] >= s["disk_cache_miss_bytes"] > 0 and s["disk_gbps"] > 0
        assert store.used_bytes > 0 and store.capacity_bytes >= s["disk_cache_capacity_bytes"]
        assert store.pinned is False  # no CUDA here: pageable memory, same code
    finally:
        store.close()
