"""verify_shards: re-read a shard directory and check it against its index."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from .errors import ShardChecksumError, ShardReadError
from .format import INDEX_NAME, load_index, read_json
from .source import drop_page_cache

__all__ = ["verify_shards"]

_CHUNK = 16 << 20


def verify_shards(dst: str | os.PathLike[str]) -> dict[str, int]:
    """Check every file's size and header, and every unit's sha256; returns counts.

    Raises ShardFormatError for a missing, malformed or unknown-version index, ShardReadError for
    a missing or wrongly sized file, ShardChecksumError for bytes that do not match.
    """
    root = Path(dst)
    index = load_index(root)
    headers = {f: v.get("header_sha256") for f, v in read_json(root / INDEX_NAME)["files"].items()}
    by_file: dict[str, list] = {}
    for s in index.slabs():
        by_file.setdefault(s.file, []).append(s)
    checked = 0
    for fname, nbytes in index.files.items():
        path = root / fname
        if not path.is_file():
            raise ShardReadError(f"{path}: missing (the index lists it)")
        size = path.stat().st_size
        if size != nbytes:
            raise ShardReadError(f"{path}: {size} bytes, the index says {nbytes}")
        with open(path, "rb") as f:
            if headers.get(fname):
                n = int.from_bytes(f.read(8), "little")
                if hashlib.sha256(f.read(n)).hexdigest() != headers[fname]:
                    raise ShardChecksumError(f"{path}: the safetensors header does not match its sha256 in the index")
            for s in sorted(by_file.get(fname, []), key=lambda s: s.offset):
                f.seek(s.offset)
                digest = hashlib.sha256()
                left = s.nbytes
                while left and (chunk := f.read(min(left, _CHUNK))):
                    digest.update(chunk)
                    left -= len(chunk)
                if digest.hexdigest() != s.sha256:
                    raise ShardChecksumError(f"{path}: unit {s.name} (bytes {s.offset}..{s.offset + s.nbytes}) "
                                             "does not match its sha256 in the index")
                checked += 1
        drop_page_cache(path)
    return {"files": len(index.files), "slabs": checked, "bytes": sum(index.files.values())}
