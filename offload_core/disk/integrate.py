"""How the engine builds a DiskStore instead of a PinnedArena (``lazy_load``, ``offload_to_disk``).

``open_disk_store`` is the one call the engine makes. Wiring, in ``OffloadEngine.__init__`` of
offload_core part 3 (the host-store seam), after the units are found, the residency is planned
and ``weight_dtype``'s storage dtypes are set, and *before* the resident tensors are moved:

    disk = config.lazy_load or config.offload_to_disk
    if disk:
        from .disk.integrate import open_disk_store
        self.store = open_disk_store(model, self.units, self.plan.block_lists, config,
                                     pin=self.is_cuda and config.cpu_offload)
        self.streamed = [u for u in self.units if u.streamed]  # units the shards lack turn resident
    ... the resident moves, unchanged (lazy_load: the residents were just read from the shards) ...
    if not disk:
        self.store = PinnedArena(self.streamed, pin=...)
    if not getattr(self.store, "filled", False):
        self._pack()
    else:
        for u in self.streamed:                 # the bytes are in the store already:
            for ts in u.tensors:                # only the placeholders
                ts.tensor().data = self.placeholder_for(ts)

Two rules for the rest of the engine, because a disk store's ``view()`` of a unit it does not keep
is a *copy* (the cache may let the slab go at any time):

- before writing into ``store.view(u, i)``, call ``store.master(u.uid)``: the unit is then kept and
  ``view`` is a view into its kept slab, so the write stays. Two places: ``write_master``
  (``load_state_dict``), right after its ``self.transfer.synchronize()``, and ``OptimizerOffload``'s
  setup, before ``view = engine.store.view(it.unit, it.index)``. (For the PinnedArena ``master``
  is a lookup, so both cost nothing there.) Without them a ``load_state_dict`` into a lazily loaded
  model would be lost silently;
- ``remove()`` reads every unit back through ``view`` (from disk where not cached): a model built
  on the meta device then holds its weights in RAM, as after a plain ``from_pretrained``.

Config keys it reads: ``shard_dir``, ``max_memory`` (bytes of cache; default: the streamed bytes or
half the RAM available, whichever is smaller), ``num_disk_workers``, and, where ``OffloadConfig``
has them, ``disk_cache_policy`` ("belady", "fifo", "lru"), ``disk_verify`` (sha256 on each read),
``disk_direct`` (O_DIRECT: None = where it works) and ``disk_stream_slots``. ``OffloadConfig``
must stop refusing ``lazy_load``; ``shard_dir`` stays required.
"""

from __future__ import annotations

import os
from typing import Any, Iterable

from torch import nn

from ..errors import OffloadConfigError
from ..units import Unit
from .bind import base_name, bind_units, materialize
from .format import load_index
from .store import DiskStore
from .write import free_host_copies, shard_model

__all__ = ["open_disk_store", "default_max_memory"]


def default_max_memory(streamed_bytes: int) -> int:
    """The streamed bytes, or half the RAM available now, whichever is smaller."""
    try:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return streamed_bytes
    return min(streamed_bytes, avail // 2)


def _keep_unmatched_resident(units: Iterable[Unit], names: set[str]) -> None:
    """A streamed unit the shards have no slab for, whose tensors the model holds anyway (e.g. rope
    tables: non-persistent buffers no checkpoint carries), is kept resident; one on the meta device
    stays streamed, so that bind_units names what is missing."""
    for u in units:
        if u.streamed and base_name(u.name) not in names and all(ts.tensor().device.type != "meta" for ts in u.tensors):
            u.streamed = False
            u.sticky = False


def open_disk_store(model: nn.Module, units: list[Unit], block_lists: Iterable[str], config: Any, *,
                    pin: bool) -> DiskStore:
    """The engine's host store for ``lazy_load`` (frozen weights only from ``shard_dir``) or
    ``offload_to_disk`` (write the model's shards to ``shard_dir``, free its RAM copy, stream back).

    Mutates the units as the engine needs: storage dtypes and fp8 scales from the index, tensors in
    the index's order, units the shards lack turned resident; lazy_load also gives every other meta
    tensor of the model its value from the shards (on the CPU: the engine then moves the residents).
    """
    shard_dir = config.shard_dir
    if config.lazy_load:
        index = load_index(shard_dir)
        shards_dtype = index.meta.get("dtype")
        if config.weight_dtype is not None and shards_dtype != config.weight_dtype:
            raise OffloadConfigError(
                f"weight_dtype: the shards in {shard_dir} hold {shards_dtype}; leave weight_dtype unset (the "
                f"storage dtype comes from the shards) or re-shard with --dtype {config.weight_dtype}")
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
    max_memory = config.max_memory
    if max_memory is None:
        max_memory = default_max_memory(sum(e.read_nbytes for e in entries.values()))
    return DiskStore(streamed, index, entries, max_memory=max_memory, num_disk_workers=config.num_disk_workers,
                     stream_slots=getattr(config, "disk_stream_slots", None),
                     policy=getattr(config, "disk_cache_policy", "belady"), pin=pin,
                     verify=bool(getattr(config, "disk_verify", False)), direct=getattr(config, "disk_direct", None))
