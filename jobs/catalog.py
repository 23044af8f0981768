"""What checkpoints the worker sees under its model roots (`offload-jobs models`, GET /v1/models).

The roots are the model cache (`jobs.home.model_cache`: /models in the container, the state dir's
`models/` locally) and the folders of `$OFFLOAD_JOBS_MODEL_ROOTS` (os.pathsep-separated), in that
order. Under each, a walk (at most `MAX_DEPTH` folders deep, `MAX_ENTRIES` checkpoints) finds:
- diffusers folders (a `model_index.json`; the hub cache's `models--org--name/snapshots/<rev>/`
  shows as `org/name`): `model.path`;
- single `.safetensors` files and folders of shards (a `*.safetensors.index.json`): a transformer
  (`model.transformer`), a VAE, a text encoder, a LoRA, or unknown with the reason.

Only safetensors headers and config JSON are read (never a tensor, never torch), so the listing
answers in a fraction of a second for a disk of 24 GB checkpoints. Whether a checkpoint is already
in the model cache is read from the cache's own markers (`converted/<key>/cache.json` and
`shards/<key>/cache.json` name their source): `converted` (a single file turned into a diffusers
transformer folder) and `sharded` (shards for the disk tier).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from jobs.errors import JobsError

__all__ = ["ROOTS_ENV", "MAX_DEPTH", "MAX_ENTRIES", "ModelEntry", "model_roots", "list_models"]

ROOTS_ENV = "OFFLOAD_JOBS_MODEL_ROOTS"
MAX_DEPTH = 6
MAX_ENTRIES = 2000
# the cache's own folders: its entries are listed as the state of their sources, not as models
CACHE_DIRS = ("converted", "shards")
# kind -> the spec field a picker fills with it
FIELDS = {"pipeline": "model.path", "transformer": "model.transformer", "vae": "model.vae",
          "text_encoder": "model.text_encoders", "lora": "infer.lora"}


@dataclass
class ModelEntry:
    name: str  # the path under its root, or a hub id
    path: str
    root: str
    kind: str  # pipeline, transformer, vae, text_encoder, lora or unknown
    family: str | None = None
    layout: str | None = None  # diffusers, bfl, comfy, native, ...
    variant: str | None = None  # a transformer's (Flux dev or schnell), a text encoder's role (t5xxl, qwen_2.5_vl, ...)
    dtype: str | None = None  # the weights' safetensors dtypes, e.g. BF16 or F8_E4M3/F32
    bytes: int = 0
    converted: bool | None = None  # a single-file transformer already converted in the model cache
    sharded: bool = False  # shards for the disk tier in the model cache
    note: str | None = None  # why a file is unknown or unreadable

    @property
    def field(self) -> str | None:
        return FIELDS.get(self.kind)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "field": self.field}


def model_roots(home: Path) -> list[Path]:
    """The model cache, then each folder of $OFFLOAD_JOBS_MODEL_ROOTS (once each, as given)."""
    from jobs.home import model_cache

    roots = [model_cache(home)]
    for raw in (os.environ.get(ROOTS_ENV) or "").split(os.pathsep):
        if raw.strip():
            roots.append(Path(raw.strip()).expanduser())
    seen: dict[str, Path] = {}
    for r in roots:
        seen.setdefault(os.path.abspath(r), r)
    return list(seen.values())


def _markers(cache: Path, sub: str) -> dict[str, list[dict[str, Any]]]:
    """The complete entries of the cache's `sub` folder, by the source they name (resolved)."""
    out: dict[str, list[dict[str, Any]]] = {}
    base = cache / sub
    try:
        entries = list(os.scandir(base))
    except OSError:
        return out
    for e in entries:
        if not e.is_dir() or e.name.endswith(".partial"):
            continue
        try:
            marker = json.loads((Path(e.path) / "cache.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(marker, dict) and marker.get("key") == e.name and marker.get("source"):
            marker = {**marker, "entry": e.path}
            out.setdefault(os.path.realpath(marker["source"]), []).append(marker)
    return out


def _fresh(marker: dict[str, Any], source: Path) -> bool:
    """The entry was made from `source` as it is now (its files' size and mtime, where the marker has them)."""
    files = marker.get("files")
    if isinstance(files, list) and files:
        try:
            return all(Path(p).stat().st_size == size and Path(p).stat().st_mtime_ns == mtime for p, size, mtime in files)
        except (OSError, TypeError, ValueError):
            return False
    try:  # an older marker: made after the file was last written
        return float(marker.get("created") or 0) >= source.stat().st_mtime
    except OSError:
        return False


class _Cache:
    def __init__(self, cache: Path) -> None:
        self.converted = _markers(cache, "converted")
        self.shards = _markers(cache, "shards")

    def state(self, source: Path, transformer_folder: Path | None = None) -> tuple[bool, bool]:
        """(converted, sharded) for a single-file `source`, or a diffusers `transformer_folder`."""
        if transformer_folder is not None:
            return False, bool(self.shards.get(os.path.realpath(transformer_folder)))
        conv = [m for m in self.converted.get(os.path.realpath(source), []) if _fresh(m, source)]
        sharded = any(self.shards.get(os.path.realpath(m["entry"])) for m in conv)
        return bool(conv), sharded


def _header_dtypes(files: list[Path]) -> tuple[str | None, int]:
    """(the tensors' dtypes, 'BF16' or 'F8_E4M3/F32'; the files' bytes) from safetensors headers alone."""
    from jobs.runners.folders import safetensors_header
    from jobs.runners.single_file import TensorInfo

    counts: dict[str, int] = {}
    size = 0
    for f in files:
        try:
            header = safetensors_header(f, "models", JobsError)
            size += f.stat().st_size
        except (JobsError, OSError):
            continue
        for name, info in header.items():
            if name != "__metadata__" and isinstance(info, dict):
                t = TensorInfo(f, str(info.get("dtype")), tuple(int(s) for s in info.get("shape") or ()))
                counts[t.dtype] = counts.get(t.dtype, 0) + t.nbytes
    order = sorted(counts, key=lambda d: -counts[d])
    return ("/".join(order) or None), size


def _pipeline(folder: Path, root: Path, cache: _Cache) -> ModelEntry:
    from jobs.runners.folders import detect_family

    name = _hub_name(folder, root) or str(folder.relative_to(root))
    entry = ModelEntry(name, str(folder), str(root), "pipeline", layout="diffusers")
    try:
        entry.family = detect_family(folder)
    except JobsError as exc:
        entry.note = str(exc).split(": ", 1)[-1]
    transformer = folder / "transformer"
    entry.dtype, _ = _header_dtypes(sorted(transformer.glob("*.safetensors")))
    entry.bytes = sum(p.stat().st_size for p in folder.rglob("*.safetensors") if p.is_file())
    entry.sharded = cache.state(folder, transformer)[1]
    return entry


def _hub_name(folder: Path, root: Path) -> str | None:
    """`org/name@rev` for the hub cache's `models--org--name/snapshots/<rev>/` (rev shortened)."""
    parts = folder.relative_to(root).parts
    if len(parts) == 3 and parts[0].startswith("models--") and parts[1] == "snapshots":
        return parts[0].removeprefix("models--").replace("--", "/") + "@" + parts[2][:10]
    return None


def _checkpoint(path: Path, root: Path, cache: _Cache) -> ModelEntry:
    """A single .safetensors file or a folder of shards: what it is, from its header."""
    from jobs.runners.component_files import identify
    from jobs.runners.errors import CheckpointError
    from jobs.runners.single_file import detect_checkpoint

    entry = ModelEntry(str(path.relative_to(root)), str(path), str(root), "unknown")
    try:
        det = detect_checkpoint(path)
    except CheckpointError as exc:
        found = identify(path)
        entry.kind, entry.family, entry.layout, entry.note = found.kind, found.family, found.layout, found.note
        if found.kind == "text_encoder":  # which of the family's encoders: clip_l, t5xxl, umt5_xxl, qwen_2.5_vl
            entry.variant = found.role
        if entry.kind == "unknown" and not entry.note:
            entry.note = str(exc).split(f"{path}", 1)[-1].lstrip(": ") or str(exc)
        files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
        entry.dtype, entry.bytes = _header_dtypes(files)
        return entry
    entry.kind, entry.family, entry.layout, entry.variant = "transformer", det.family, det.layout, det.variant
    entry.dtype, entry.bytes = _header_dtypes(det.files)
    entry.converted, entry.sharded = cache.state(path)
    return entry


def _walk(root: Path, cache: _Cache, out: list[ModelEntry]) -> None:
    stack: list[tuple[Path, int]] = [(root, 0)]
    while stack and len(out) < MAX_ENTRIES:
        folder, depth = stack.pop()
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name, reverse=True)
        except OSError:
            continue
        names = {e.name for e in entries}
        if "model_index.json" in names and folder != root:
            out.append(_pipeline(folder, root, cache))
            continue
        if any(n.endswith(".safetensors.index.json") for n in names) and folder != root:
            out.append(_checkpoint(folder, root, cache))
            continue
        for e in entries:
            if e.name.startswith("."):
                continue
            if e.is_dir(follow_symlinks=True):
                if depth == 0 and e.name in CACHE_DIRS or depth == 0 and e.name.endswith(".lock"):
                    continue
                if e.name == "blobs" and folder.name.startswith("models--"):
                    continue  # the hub cache's content-addressed copies: shown through snapshots/
                if depth < MAX_DEPTH:
                    stack.append((Path(e.path), depth + 1))
            elif e.name.endswith(".safetensors") and e.is_file():
                out.append(_checkpoint(Path(e.path), root, cache))


def list_models(home: Path, roots: list[Path] | None = None) -> dict[str, Any]:
    """{"roots": [...], "models": [entry dicts], "truncated": bool}, roots in order, each root's entries by name."""
    from jobs.home import model_cache

    roots = model_roots(home) if roots is None else roots
    cache = _Cache(model_cache(home))
    models: list[ModelEntry] = []
    for root in roots:
        found: list[ModelEntry] = []
        if root.is_dir():
            _walk(root, cache, found)
        models += sorted(found, key=lambda m: m.name)
    return {"roots": [{"path": str(r), "exists": r.is_dir()} for r in roots],
            "models": [m.to_dict() for m in models[:MAX_ENTRIES]], "truncated": len(models) >= MAX_ENTRIES}
