"""Byte sizes as people write them ("7.5GiB", "512MB", "1e9", 8589934592): the one parser.

Stdlib only, and outside both packages on purpose: the engine (`offload_core.config`) and the spec
(`jobs.spec`, on the torch-free CLI path) read sizes the same way, and neither may import the other.
"""

from __future__ import annotations

import math
import re

__all__ = ["MAX_BYTES", "UNITS", "parse_bytes"]

MAX_BYTES = 1 << 60  # 1 EiB: any size past this is a typo
UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*")


def parse_bytes(value: int | float | str | None) -> int | None:
    """`7.5GiB`, `512MB`, `1e9` or a number -> bytes (int), None -> None; ValueError says what is wrong."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"expected bytes (an int or a size like '7.5GiB'), got {type(value).__name__}")
    if isinstance(value, str):
        m = _SIZE.fullmatch(value)
        if not m or m.group(2).lower() not in UNITS:
            raise ValueError(f"not a size: {value!r:.60} (use bytes or e.g. '7.5GiB', '512MB')")
        value = float(m.group(1)) * UNITS[m.group(2).lower()]
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("must be a finite size")
    if value < 0:
        raise ValueError("must be >= 0")
    if value > MAX_BYTES:
        raise ValueError("is larger than 1 EiB; check the units")
    return int(value)
