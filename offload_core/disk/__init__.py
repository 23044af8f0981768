"""offload_core.disk: the disk tier. Shards whose layout is the slab layout, read into a bounded cache.

    format     the shard directory and index.json (version 2; 3 with fp8 row/block scales): a unit on disk is its slab
    source     a safetensors checkpoint read tensor by tensor into the caller's memory
    grouping   which unit each checkpoint tensor belongs to (units.py decides)
    write      shard_checkpoint (from a checkpoint) and shard_model (offload_to_disk)
    verify     verify_shards
    read       UnitReader: one O_DIRECT read of a unit into a pinned slab, checked against the index
    checksum   which units this process has checked (xxh3 on a unit's first read; sha256 with disk_verify)
    pool       HostPool: one pinned buffer carved into 4096-aligned slabs
    cache      SlabCache: Belady (FIFO, LRU) over the cache bytes (max_memory less the staging slots)
    diskstore  DiskStore: the engine's host store over the cache, staging slots and disk workers
    bind       a live (or meta) model's units matched to the index; its other tensors read
    integrate  open_disk_store: what the engine calls for lazy_load / offload_to_disk
"""

from __future__ import annotations

from .errors import (ShardChecksumError, ShardError, ShardFormatError, ShardMismatchError, ShardReadError,
                     ShardSourceNotFound, ShardWriteError)
from .format import FORMAT, FORMAT_VERSION, INDEX_NAME, NON_BLOCK_FILE, ShardIndex, load_index
from .source import SafetensorsSource
from .diskstore import DiskStore
from .verify import verify_shards
from .write import free_host_copies, shard_checkpoint, shard_model

__all__ = [
    "DiskStore", "FORMAT", "FORMAT_VERSION", "INDEX_NAME", "NON_BLOCK_FILE", "SafetensorsSource", "ShardChecksumError",
    "ShardError", "ShardFormatError", "ShardIndex", "ShardMismatchError", "ShardReadError", "ShardSourceNotFound",
    "ShardWriteError", "free_host_copies", "load_index", "shard_checkpoint", "shard_model", "verify_shards",
]
