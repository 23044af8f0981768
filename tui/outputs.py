"""Reading a job's outputs/ listing: its checkpoints (and whether each is complete) and its samples."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

__all__ = ["Checkpoint", "summarize_outputs", "IMAGE_TYPES"]

IMAGE_TYPES = {".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".webp": "image/webp",
               ".gif": "image/gif"}
_MARKERS = {"complete", ".complete", "done", ".done", "_success", "complete.json", "checkpoint.json"}


@dataclass
class Checkpoint:
    path: str
    files: int
    bytes: int
    mtime: float
    complete: bool


def summarize_outputs(files: list[dict[str, Any]]) -> tuple[list[Checkpoint], list[dict[str, Any]]]:
    """(checkpoints newest first, sample images newest first) from `client.outputs(job)`."""
    groups: dict[str, Checkpoint] = {}
    samples: list[dict[str, Any]] = []
    for f in files:
        path = PurePosixPath(str(f.get("path", "")))
        parts = [p.lower() for p in path.parts]
        if path.suffix.lower() in IMAGE_TYPES:
            samples.append(f)
        ck_idx = next((i for i, p in enumerate(parts[:-1]) if "checkpoint" in p or "ckpt" in p), None)
        if ck_idx is None:
            continue
        # The checkpoint is the directory below `checkpoints/` (step-000250/), or that directory itself.
        depth = ck_idx + 2 if len(parts) > ck_idx + 2 else ck_idx + 1
        key = str(PurePosixPath(*path.parts[:depth]))
        ck = groups.setdefault(key, Checkpoint(key, 0, 0, 0.0, False))
        ck.files += 1
        ck.bytes += int(f.get("size") or 0)
        ck.mtime = max(ck.mtime, float(f.get("mtime") or 0))
        if path.name.lower() in _MARKERS:
            ck.complete = True
    samples.sort(key=lambda f: float(f.get("mtime") or 0), reverse=True)
    checkpoints = sorted(groups.values(), key=lambda c: c.mtime, reverse=True)
    return checkpoints, samples
