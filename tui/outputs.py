"""Reading a job's outputs/ listing: its checkpoints (and whether each is complete) and its samples."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

__all__ = ["Checkpoint", "summarize_outputs", "distinct_samples", "IMAGE_TYPES"]

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
    samples = distinct_samples(samples)
    samples.sort(key=lambda f: float(f.get("mtime") or 0), reverse=True)
    checkpoints = sorted(groups.values(), key=lambda c: c.mtime, reverse=True)
    return checkpoints, samples


def distinct_samples(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One copy of each sample: the train runner also writes each step's images as a contact sheet
    (`step000010_sheet.png` beside `step000010_00.png`), and a video's frames (`step000010_00/0000.png`)
    beside its GIF (`step000010_00.gif`). A sheet or frame with its own images listed is dropped."""
    paths = {str(f.get("path", "")) for f in samples}
    prefixes = {p.rsplit("_", 1)[0] for p in paths if "_" in PurePosixPath(p).name and not _is_sheet(p)}
    keep = []
    for f in samples:
        path = PurePosixPath(str(f.get("path", "")))
        if _is_sheet(str(path)) and str(path.with_suffix("")).removesuffix("_sheet") in prefixes:
            continue
        if path.parent != PurePosixPath(".") and str(path.parent) + ".gif" in paths:
            continue  # one frame of a clip shown as its GIF
        keep.append(f)
    return keep


def _is_sheet(path: str) -> bool:
    return PurePosixPath(path).stem.endswith("_sheet")
