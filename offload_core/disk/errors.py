"""Errors of the disk tier, all under offload_core.errors.ShardError (so an OffloadError and an OSError).

    ShardError
    ├── ShardSourceNotFound  the checkpoint to shard does not exist (a FileNotFoundError too)
    ├── ShardFormatError     index.json missing, malformed, or of a format version this code does not read
    ├── ShardMismatchError   the model's units do not match the index (another model, config or dtype)
    ├── ShardWriteError      DST cannot be written (no space left, permissions); partial files are removed
    └── ShardReadError       a shard file is missing, truncated or unreadable
        └── ShardChecksumError   its bytes do not match the index's sha256

Every message starts with the file (or index) it is about, on one line.
"""

from __future__ import annotations

from ..errors import ShardError

__all__ = ["ShardError", "ShardSourceNotFound", "ShardFormatError", "ShardMismatchError", "ShardWriteError",
           "ShardReadError", "ShardChecksumError", "one_line"]


class ShardSourceNotFound(ShardError, FileNotFoundError):
    """SRC does not exist (a FileNotFoundError too, so callers that catch that see it)."""


class ShardFormatError(ShardError):
    """index.json is missing, malformed, or written by a format version this code does not read."""


class ShardMismatchError(ShardError):
    """The model's units (names, tensors, shapes, dtypes, layout) do not match the shard index."""


class ShardWriteError(ShardError):
    """A shard file could not be written; the partial file was removed, and a rerun resumes."""


class ShardReadError(ShardError):
    """A shard file is missing, shorter than the index says, or failed to read."""


class ShardChecksumError(ShardReadError):
    """A unit's bytes do not match its sha256 in the index."""


def one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__
