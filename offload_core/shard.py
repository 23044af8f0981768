"""offload_core.shard: the checkpoint shard preprocessor, kept as a name for its callers.

The code lives in ``offload_core.disk`` (format, source, grouping, write, verify); this module
re-exports what ``offload-jobs shard``, the shard job runner and user scripts import.
"""

from __future__ import annotations

from .disk.errors import ShardError, ShardSourceNotFound
from .disk.format import FORMAT, FORMAT_VERSION, INDEX_NAME, NON_BLOCK_FILE
from .disk.verify import verify_shards
from .disk.write import shard_checkpoint, shard_model

__all__ = ["FORMAT", "FORMAT_VERSION", "INDEX_NAME", "NON_BLOCK_FILE", "ShardError", "ShardSourceNotFound",
           "shard_checkpoint", "shard_model", "verify_shards"]
