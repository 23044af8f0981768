"""Training checkpoints: atomic, verified, bounded, resumable.

    checkpoints/step-000120/
        trainable.safetensors   the LoRA parameters as the model holds them (exact, unscaled)
        optimizer.pt            optimizer and LR-scheduler state
        state.pt                step, epoch, position in the data order, the order itself, RNG states
        COMPLETE.json           written last: the step and each file's size and sha256

A checkpoint is written into a hidden temp folder; every file is fsynced, COMPLETE.json goes last,
then the folder is renamed into place and its parent fsynced. Resuming takes the newest folder whose
COMPLETE.json is there and whose files match it: one cut off mid-write (or corrupted later) is
skipped for the previous complete one.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any, Callable

__all__ = ["CheckpointStore", "MARKER"]

MARKER = "COMPLETE.json"
_NAME = re.compile(r"step-(\d{6,})")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class CheckpointStore:
    def __init__(self, root: str | Path, keep_last: int = 3) -> None:
        self.root = Path(root)
        self.keep_last = keep_last

    def save(self, step: int, writers: dict[str, Callable[[Path], None]]) -> Path:
        """Write one checkpoint; `writers` maps a file name to a function that writes it."""
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / f"step-{step:06d}"
        tmp = self.root / f".step-{step:06d}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        files: dict[str, dict[str, Any]] = {}
        for name, write in writers.items():
            path = tmp / name
            write(path)
            with open(path, "rb+") as f:
                os.fsync(f.fileno())
            files[name] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
        marker = tmp / MARKER
        with open(marker, "w", encoding="utf-8") as f:
            json.dump({"step": step, "time": time.time(), "files": files}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        if final.exists():  # the same step saved again (e.g. a retry that repeats it)
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(self.root)
        self.prune()
        return final

    def candidates(self) -> list[tuple[int, Path]]:
        if not self.root.is_dir():
            return []
        out = []
        for p in self.root.iterdir():
            m = _NAME.fullmatch(p.name)
            if m and p.is_dir():
                out.append((int(m.group(1)), p))
        return sorted(out, reverse=True)

    def verify(self, path: Path) -> str | None:
        """None when the checkpoint is complete and intact, else why not."""
        marker = path / MARKER
        try:
            meta = json.loads(marker.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return f"{path.name}: no {MARKER} (cut off mid-write)"
        except (OSError, ValueError) as exc:
            return f"{path.name}: unreadable {MARKER} ({exc})"
        for name, info in meta.get("files", {}).items():
            f = path / name
            if not f.is_file():
                return f"{path.name}: {name} is missing"
            if f.stat().st_size != info.get("bytes"):
                return f"{path.name}: {name} is {f.stat().st_size} bytes, expected {info.get('bytes')} (truncated)"
            if _sha256(f) != info.get("sha256"):
                return f"{path.name}: {name} does not match its checksum"
        return None

    def latest(self, on_skip: Callable[[str], None] | None = None) -> Path | None:
        """The newest complete, intact checkpoint; `on_skip` hears why newer ones were passed over."""
        for _, path in self.candidates():
            why = self.verify(path)
            if why is None:
                return path
            if on_skip is not None:
                on_skip(why)
        return None

    def complete(self) -> list[dict[str, Any]]:
        """Complete checkpoints, newest first: [{"step", "path"}] (for `show` and summaries)."""
        return [{"step": s, "path": str(p)} for s, p in self.candidates() if (p / MARKER).is_file()]

    def prune(self) -> None:
        complete = [(s, p) for s, p in self.candidates() if (p / MARKER).is_file()]
        for _, path in complete[self.keep_last:]:
            shutil.rmtree(path, ignore_errors=True)
        for p in self.root.glob(".step-*.tmp-*"):  # temp folders of attempts that died mid-write
            pid = p.name.rsplit("-", 1)[-1]
            if pid != str(os.getpid()):
                shutil.rmtree(p, ignore_errors=True)
