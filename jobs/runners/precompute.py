"""Precompute: text embeddings and latents, once, through the cache; the encoders are freed after.

Text encoders and the VAE run under component offload (on a GPU they visit the device only while
they encode). Only what the cache lacks is computed, and an encoder nobody needs is never moved.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from jobs.runners.cache import EmbeddingCache, component_fingerprint
from jobs.runners.data import Item, load_pixels
from jobs.runners.families import FamilyAdapter
from jobs.runners.load import component_offload

__all__ = ["make_cache", "encode_texts", "encode_items", "TEXT_PARTS", "frames_for"]

TEXT_PARTS = ["text_encoder", "text_encoder_2", "text_encoder_3", "tokenizer", "tokenizer_2", "tokenizer_3"]


def make_cache(root: Path, model_dir: Path, family: FamilyAdapter, dtype: torch.dtype,
               files: dict[str, Path] | None = None) -> EmbeddingCache:
    """The cache, keyed by the base's parts and the files given in place of some (`files`: attribute -> file)."""
    from jobs.runners.component_load import part_fingerprint

    files = files or {}
    vae_key = component_fingerprint(model_dir, ["vae"]) + f":{dtype}" + part_fingerprint(files, ["vae"])
    text_key = component_fingerprint(model_dir, TEXT_PARTS) + f":{dtype}" + part_fingerprint(files, TEXT_PARTS)
    return EmbeddingCache(root, family=family.name, vae_key=vae_key, text_key=text_key)


def _encoders(pipe: Any) -> list[torch.nn.Module]:
    return [m for m in (getattr(pipe, n, None) for n in TEXT_PARTS if n.startswith("text_encoder"))
            if isinstance(m, torch.nn.Module)]


def encode_texts(pipe: Any, family: FamilyAdapter, cache: EmbeddingCache, texts: list[str], max_len: int,
                 device: torch.device, budget: int | None = None) -> dict[str, dict[str, torch.Tensor]]:
    """caption -> its conditioning tensors, from the cache or the pipeline's text encoders."""
    wanted = list(dict.fromkeys(texts))
    keys = {t: cache.text_key_for(t, max_len) for t in wanted}
    missing = [t for t in wanted if not cache.has_text(keys[t])]
    out: dict[str, dict[str, torch.Tensor]] = {}
    if missing:
        encoders = _encoders(pipe)
        with torch.no_grad(), _all_on(encoders, device, budget):
            for t in missing:
                out[t] = cache.text(keys[t], lambda t=t: family.encode_text(pipe, t, device, max_len))
    for t in wanted:
        if t not in out:
            out[t] = cache.text(keys[t], lambda: {})  # a hit: never computes
    return out


class _all_on:
    """component_offload for several modules at once (the text encoders run one after the other)."""

    def __init__(self, modules: list[torch.nn.Module], device: torch.device, budget: int | None) -> None:
        self.ctx = [component_offload(m, device, budget) for m in modules]

    def __enter__(self) -> None:
        for c in self.ctx:
            c.__enter__()

    def __exit__(self, *exc: Any) -> None:
        for c in reversed(self.ctx):
            c.__exit__(*exc)


def frames_for(item: Item, wanted: int, temporal: int) -> int:
    """Frames to take from a clip: at most `wanted`, and 1 + k * temporal (what the video VAE encodes)."""
    n = min(wanted, len(item.files))
    return max(1, (n - 1) // temporal * temporal + 1)


def encode_items(vae: Any, family: FamilyAdapter, cache: EmbeddingCache, items: list[Item], num_frames: int,
                 device: torch.device, budget: int | None = None) -> list[torch.Tensor]:
    """Each item's normalized latents, from the cache or the VAE."""
    temporal = family.temporal_factor(vae)
    frames = [frames_for(it, num_frames, temporal) if family.is_video else 1 for it in items]
    keys = [cache.latent_key(it.digest, it.bucket, f) for it, f in zip(items, frames)]
    missing = [i for i, k in enumerate(keys) if not cache.has_latent(k)]
    latents: dict[int, torch.Tensor] = {}
    if missing:
        with torch.no_grad(), component_offload(vae, device, budget):
            for i in missing:
                def compute(i: int = i) -> torch.Tensor:
                    px = load_pixels(items[i], frames[i])
                    if family.is_video and px.dim() == 3:
                        px = px[:, None]  # a still image is a one-frame clip
                    return family.encode_pixels(vae, px.to(device, vae.dtype)).float()

                latents[i] = cache.latent(keys[i], compute)
    return [latents[i] if i in latents else cache.latent(k, lambda: torch.empty(0)) for i, k in enumerate(keys)]
