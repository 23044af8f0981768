"""On-disk cache of latents and text embeddings, keyed by content.

A latent's key hashes the VAE (its config and weight files), the resolution bucket, the frame
count and the bytes of the image (every frame of a clip); a text embedding's key hashes the text
encoders and tokenizers, the sequence length and the caption. So a changed caption recomputes
exactly one text embedding and no latent; a changed resolution recomputes the latents and no
text. Entries are written atomically (temp file, then rename); a corrupt entry is recomputed.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file, save_file

__all__ = ["EmbeddingCache", "CacheCounts", "component_fingerprint"]


@dataclass
class CacheCounts:
    latents_computed: int = 0
    latents_cached: int = 0
    text_computed: int = 0
    text_cached: int = 0
    computed_keys: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, int]:
        return {"latents_computed": self.latents_computed, "latents_cached": self.latents_cached,
                "text_computed": self.text_computed, "text_cached": self.text_cached}


def component_fingerprint(model_dir: Path, subfolders: list[str]) -> str:
    """Hash of the named sub-folders: configs by content, weight files by name, size and mtime.

    Hashing multi-GB weight files would cost minutes per job; a rewritten file changes its mtime.
    """
    h = hashlib.sha256()
    for sub in subfolders:
        folder = model_dir / sub
        if not folder.is_dir():
            continue
        for f in sorted(folder.rglob("*")):
            if not f.is_file():
                continue
            rel = f.relative_to(model_dir).as_posix()
            h.update(rel.encode())
            if f.suffix in (".json", ".txt", ".model") and f.stat().st_size < (8 << 20):
                h.update(f.read_bytes())
            else:
                st = f.stat()
                h.update(f"{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:24]


def _key(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


class EmbeddingCache:
    """`latent(...)` and `text(...)` return the cached tensors, computing (and storing) on a miss."""

    def __init__(self, root: str | Path, *, family: str, vae_key: str, text_key: str) -> None:
        self.root = Path(root).expanduser()
        (self.root / "latents").mkdir(parents=True, exist_ok=True)
        (self.root / "text").mkdir(parents=True, exist_ok=True)
        self.family, self.vae_key, self.text_key = family, vae_key, text_key
        self.counts = CacheCounts()

    def latent_key(self, digest: str, bucket: tuple[int, int], frames: int) -> str:
        return _key("latent", self.family, self.vae_key, list(bucket), frames, digest)

    def text_key_for(self, caption: str, max_len: int) -> str:
        return _key("text", self.family, self.text_key, max_len, caption)

    def has_latent(self, key: str) -> bool:
        return self._load(self.root / "latents" / f"{key}.safetensors") is not None

    def has_text(self, key: str) -> bool:
        return self._load(self.root / "text" / f"{key}.safetensors") is not None

    def latent(self, key: str, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        path = self.root / "latents" / f"{key}.safetensors"
        got = self._load(path)
        if got is not None:
            self.counts.latents_cached += 1
            return got["latent"]
        value = compute().detach().to("cpu").contiguous()
        self._store(path, {"latent": value})
        self.counts.latents_computed += 1
        self.counts.computed_keys.append(f"latent:{key}")
        return value

    def text(self, key: str, compute: Callable[[], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        path = self.root / "text" / f"{key}.safetensors"
        got = self._load(path)
        if got is not None:
            self.counts.text_cached += 1
            return got
        value = {k: v.detach().to("cpu").contiguous() for k, v in compute().items()}
        self._store(path, value)
        self.counts.text_computed += 1
        self.counts.computed_keys.append(f"text:{key}")
        return value

    @staticmethod
    def _load(path: Path) -> dict[str, torch.Tensor] | None:
        if not path.is_file():
            return None
        try:
            return load_file(str(path))
        except Exception:  # a torn or foreign file: recompute it
            return None

    @staticmethod
    def _store(path: Path, tensors: dict[str, torch.Tensor]) -> None:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        save_file(tensors, str(tmp))
        os.replace(tmp, path)
