"""How the engine builds a DiskStore instead of a PinnedArena (``lazy_load``, ``offload_to_disk``).

``open_disk_store`` is the one call the engine makes, from ``OffloadEngine._make_store``: after
the units are found, the residency is planned and ``weight_dtype``'s storage dtypes are set, and
before the resident tensors are moved (lazy_load reads the residents from the shards onto the
CPU here; the engine then moves them as any others). The store is ``filled``: the engine packs
nothing into it and gives the streamed tensors their placeholders.

A disk store's ``view()`` of a unit it does not keep is a *copy* (the cache may let the slab go at
any time), so every write into the host masters first calls ``store.master(uid)``, after which the
store keeps the unit and ``view`` is its slab: ``Masters.write`` (``load_state_dict``) and the
optimizer offload's setup do. ``remove()`` reads every unit back through ``view`` (from disk
where not cached): a model built on the meta device then holds its weights in RAM, as after a
plain ``from_pretrained``.

``max_memory`` is every pinned byte of the disk tier: the staging slots the disk workers read into
(``disk_stream_slots``, default ``num_disk_workers + 2``, each the size of the largest unit; fewer,
down to two, when max_memory cannot hold that many) and the cache, which gets the rest. So the
process's RSS is bounded by what was asked, and the cache's hit rate on repeated passes is its
share of the streamed bytes (``disk_cache_capacity_bytes`` over them; Belady keeps a fixed
subset). ``max_memory=0`` is no cache: the staging slots only. Units written to (``load_state_dict``
into a lazily loaded model, buffers updated in place) are kept on top, since their files no longer
hold their bytes.
"""

from __future__ import annotations

import os
from typing import Any, Iterable

from torch import nn

from ..errors import OffloadConfigError
from ..units import Unit
from ..weights import fill_computed_tensors
from .bind import base_name, bind_units, materialize
from .format import ShardIndex, load_index
from .diskstore import DiskStore
from .write import free_host_copies, shard_model

__all__ = ["open_disk_store", "default_max_memory", "split_max_memory", "max_memory_for"]

MIN_STREAM_SLOTS = 2  # one being read while the engine copies out of the other


def default_max_memory(needed: int) -> int:
    """``needed`` (the streamed bytes and the staging), or half the RAM available now, whichever is smaller."""
    try:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return needed
    return min(needed, avail // 2)


def split_max_memory(max_memory: int | None, streamed: int, largest: int, num_disk_workers: int,
                     stream_slots: int | None = None) -> tuple[int, int]:
    """(cache bytes, staging slots) for a ``max_memory`` budget over units of ``streamed`` bytes in all,
    the largest ``largest`` bytes (both as read: aligned). See the module docstring."""
    want = stream_slots if stream_slots is not None else num_disk_workers + 2
    if max_memory is None:
        max_memory = default_max_memory(streamed + want * largest)
    if max_memory == 0:
        return 0, want
    if largest == 0:
        return min(max_memory, streamed), want
    slots = min(want, max_memory // largest)
    if slots < min(want, MIN_STREAM_SLOTS) or (stream_slots is not None and slots < stream_slots):
        need = (stream_slots or MIN_STREAM_SLOTS) * largest
        raise OffloadConfigError(
            f"max_memory: {max_memory} bytes cannot hold the disk tier's staging slots ({stream_slots or MIN_STREAM_SLOTS} "
            f"x the largest unit, {largest} bytes: {need} bytes); give at least that, or 0 for no cache")
    return min(max_memory - slots * largest, streamed), slots


def max_memory_for(index: ShardIndex, names: Iterable[str], cache_fraction: float, num_disk_workers: int,
                   stream_slots: int | None = None) -> int:
    """The ``max_memory`` whose cache holds ``cache_fraction`` of the units ``names`` (benchmarks, tests)."""
    sizes = [index.units[n].read_nbytes for n in names]
    slots = stream_slots if stream_slots is not None else num_disk_workers + 2
    return int(cache_fraction * sum(sizes)) + slots * max(sizes, default=0)


def _keep_unmatched_resident(units: Iterable[Unit], names: set[str]) -> None:
    """A streamed unit the shards have no slab for, whose tensors the model holds anyway (e.g. rope
    tables: non-persistent buffers no checkpoint carries), is kept resident; one on the meta device
    stays streamed, so that bind_units names what is missing."""
    for u in units:
        if u.streamed and base_name(u.name) not in names and all(ts.tensor().device.type != "meta" for ts in u.tensors):
            u.streamed = False


def open_disk_store(model: nn.Module, units: list[Unit], block_lists: Iterable[str], config: Any, *,
                    pin: bool, inference: bool) -> DiskStore:
    """The engine's host store for ``lazy_load`` (frozen weights only from ``shard_dir``) or
    ``offload_to_disk`` (write the model's shards to ``shard_dir``, free its RAM copy, stream back).

    Mutates the units as the engine needs: storage dtypes and fp8 scales from the index, tensors in
    the index's order, units the shards lack turned resident; lazy_load also gives every other meta
    tensor of the model its value from the shards (on the CPU: the engine then moves the residents),
    and tables the model computes at init (rotary buffers) from the model built again from its config.
    """
    shard_dir = config.shard_dir
    if config.lazy_load:
        index = load_index(shard_dir)
        shards_dtype = index.meta.get("dtype")
        if config.weight_dtype is not None and shards_dtype != config.weight_dtype:
            raise OffloadConfigError(
                f"weight_dtype: the shards in {shard_dir} hold {shards_dtype}; leave weight_dtype unset (the "
                f"storage dtype comes from the shards) or re-shard with --dtype {config.weight_dtype}")
        held = sorted({t.scaling for s in index.slabs() for t in s.tensors
                       if t.scaling and t.source_dtype is not None})  # fp8 the writer made (not fp8 as stored)
        if config.fp8_scaling is not None and held and held != [config.fp8_scaling]:
            raise OffloadConfigError(
                f"fp8_scaling: the shards in {shard_dir} hold {'/'.join(held)} fp8 scales; leave fp8_scaling unset "
                f"(the scales come from the shards) or re-shard with --fp8-scaling {config.fp8_scaling}")
        in_shards = {t.name for s in index.slabs() for t in s.tensors}
        fill_computed_tensors(model, lambda n: n in in_shards)
        _keep_unmatched_resident(units, set(index.units))
        streamed = [u for u in units if u.streamed]
        entries = bind_units(streamed, index, model)
        materialize(model, index, streamed, "cpu")
    else:
        streamed = [u for u in units if u.streamed]
        shard_model(model, streamed, shard_dir, block_lists)
        free_host_copies(streamed)
        index = load_index(shard_dir)
        entries = bind_units(streamed, index, model)
    sizes = [e.read_nbytes for e in entries.values()]
    cache, slots = split_max_memory(config.max_memory, sum(sizes), max(sizes, default=0), config.num_disk_workers,
                                    config.disk_stream_slots)
    store = DiskStore(streamed, index, entries, cache_bytes=cache, num_disk_workers=config.num_disk_workers,
                      stream_slots=slots, policy=config.disk_cache_policy, pin=pin, verify=config.disk_verify,
                      direct=config.disk_direct,
                      reason=(f"lazy_load: the shards in {shard_dir}" if config.lazy_load else
                              f"offload_to_disk: the model's shards written to {shard_dir}")
                      + f" (cache {cache} bytes, {slots} staging slots)")
    if inference:
        # A model with nothing to train (the engine's call: no trainable parameter, or one taken as an
        # inference model, as from_pretrained leaves it): before its first pass no trace exists, so the disk would read each
        # unit only when asked. The blocks run in their module order (the shards' order), so the disk reads
        # ahead in that order from the start; the embedders and heads around them come when asked, and
        # the first traced cycle replaces the guess. Training is not guessed: its first step also runs
        # backward, in reverse.
        store.follow_trace([u.uid for u in streamed if not u.stray])
    return store
