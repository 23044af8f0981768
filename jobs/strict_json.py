"""JSON that is always JSON: NaN and Infinity never reach the store, the API or a client.

Python's `json` writes `NaN` and `Infinity` by default, which is not JSON: SQLite's json()
rejects the row ("malformed JSON") and browsers reject the response. Everything the store and the
worker's API write goes through `dumps` (non-finite floats become null), and everything they read
through `loads` (a stray `NaN` in a job's metrics file reads as null).
"""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["dumps", "loads", "finite"]


def finite(obj: Any) -> Any:
    """`obj` with every non-finite float (NaN, +-inf) replaced by None, containers copied."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def dumps(obj: Any, *, compact: bool = True, **kwargs: Any) -> str:
    """Strict JSON text of `obj` (non-finite floats as null)."""
    if compact:
        kwargs.setdefault("separators", (",", ":"))
    try:
        return json.dumps(obj, allow_nan=False, **kwargs)
    except ValueError:  # a NaN somewhere: the rare case pays for the walk
        return json.dumps(finite(obj), allow_nan=False, **kwargs)


def _null(_constant: str) -> None:
    return None


def loads(text: str | bytes) -> Any:
    """Parse JSON; the non-standard constants NaN, Infinity and -Infinity read as None."""
    return json.loads(text, parse_constant=_null)
