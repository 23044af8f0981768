"""Rendering images and clips with the family's diffusers pipeline, from precomputed embeddings.

Used by the infer runner and by samples during training. Text embeddings come from the text
encoders (already run, then freed), the transformer is the one on the engine, and the VAE decodes
under component offload, so rendering a sample needs no more VRAM than a training step.

Prompts and their inline options: `jobs.runners.prompts`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from jobs.runners.families import FamilyAdapter
from jobs.runners.load import component_offload
from jobs.runners.prompts import PromptError, PromptSpec, parse_prompt, read_prompts

__all__ = ["PromptError", "PromptSpec", "parse_prompt", "read_prompts", "embedding_pipeline", "render", "render_batch", "to_pil", "contact_sheet",
           "save_frames", "write_params"]


def to_pil(pixels: torch.Tensor) -> list[Any]:
    """(B, 3, H, W) in [-1, 1] -> PIL images."""
    from PIL import Image

    arr = ((pixels.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    return [Image.fromarray(a) for a in arr]


def contact_sheet(images: list[Any], path: Path, columns: int | None = None) -> None:
    from PIL import Image

    if not images:
        return
    cols = columns or min(len(images), max(1, math.ceil(math.sqrt(len(images)))))
    rows = math.ceil(len(images) / cols)
    cw, ch = max(i.width for i in images), max(i.height for i in images)
    sheet = Image.new("RGB", (cols * cw, rows * ch), (16, 16, 16))
    for n, im in enumerate(images):
        sheet.paste(im, ((n % cols) * cw, (n // cols) * ch))
    sheet.save(path)


def save_frames(frames: list[Any], folder: Path, fps: int) -> list[Path]:
    """A clip as numbered PNGs plus an animated GIF preview (and an MP4 when imageio-ffmpeg is there)."""
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for i, im in enumerate(frames):
        p = folder / f"{i:04d}.png"
        im.save(p)
        written.append(p)
    gif = folder.with_suffix(".gif")
    frames[0].save(gif, save_all=True, append_images=frames[1:], duration=max(1, round(1000 / fps)), loop=0)
    written.append(gif)
    try:  # optional: users who installed imageio[ffmpeg] get an MP4 too
        import imageio.v2 as imageio
        import numpy as np

        mp4 = folder.with_suffix(".mp4")
        imageio.mimwrite(mp4, [np.asarray(f) for f in frames], fps=fps)
        written.append(mp4)
    except Exception:
        pass
    return written


def embedding_pipeline(family: FamilyAdapter, transformer: Any, vae: Any, scheduler: Any) -> Any:
    """The family's pipeline around `transformer`, without text encoders (embeddings are passed in)."""
    import inspect

    pipe_cls, _ = family.classes()
    given = {"transformer": transformer, "vae": vae, "scheduler": scheduler}
    params = inspect.signature(pipe_cls.__init__).parameters
    kwargs = {n: given.get(n) for n in params if n != "self" and params[n].default is inspect.Parameter.empty}
    kwargs.update({n: v for n, v in given.items() if n in params})
    pipe = pipe_cls(**kwargs)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def render(family: FamilyAdapter, pipe: Any, vae: Any, text: dict[str, torch.Tensor],
           negative: dict[str, torch.Tensor] | None, spec: PromptSpec, device: torch.device,
           dtype: torch.dtype, vae_budget: int | None = None, before_decode: Any = None) -> list[Any]:
    """One prompt -> PIL images (a list of frames for Wan)."""
    return render_batch(family, pipe, vae, [text], [negative] if negative is not None else None, spec, [spec.seed],
                        device, dtype, vae_budget, before_decode=before_decode)[0]


def render_batch(family: FamilyAdapter, pipe: Any, vae: Any, texts: list[dict[str, torch.Tensor]],
                 negatives: list[dict[str, torch.Tensor]] | None, spec: PromptSpec, seeds: list[int],
                 device: torch.device, dtype: torch.dtype, vae_budget: int | None = None,
                 on_step: Any = None, before_decode: Any = None) -> list[list[Any]]:
    """Several prompts in one pipeline call (one pass of the weights per step for all of them) at
    `spec`'s size, steps and guidance, row b seeded with seeds[b] (its own generator, so its noise
    is the one it gets alone) -> PIL images per row. Decoded row by row: the VAE's activations stay
    those of one image. `on_step(pipe)` runs after each denoising step (it may set `pipe._interrupt`);
    `before_decode()` between the denoising and the decode (the engine's release_growth: the VAE gets
    the memory the transformer's ring grew into)."""
    f = family.spatial_factor(vae)
    mult = family.bucket_multiple(vae)
    width, height = max(mult, spec.width // mult * mult), max(mult, spec.height // mult * mult)
    batch = family.collate_text(texts, device, dtype)
    neg = family.collate_text(negatives, device, dtype) if negatives is not None else None
    kwargs = family.pipeline_kwargs(batch, neg, spec.guidance, spec.frames)
    generators = [torch.Generator("cpu").manual_seed(s) for s in seeds]
    if on_step is not None:
        def step_end(p: Any, i: int, t: Any, kw: dict[str, Any]) -> dict[str, Any]:
            on_step(p)
            return kw

        kwargs["callback_on_step_end"] = step_end
    rows: list[list[Any]] = []
    with torch.no_grad():
        out = pipe(height=height, width=width, num_inference_steps=spec.steps, generator=generators,
                   output_type="latent", return_dict=False, **kwargs)[0]
        latents = family.latents_from_pipeline(out, height // f, width // f)
        if before_decode is not None:
            before_decode()
        with component_offload(vae, device, vae_budget):
            for b in range(latents.shape[0]):
                pixels = family.decode_latents(vae, latents[b:b + 1].to(device, vae.dtype))
                rows.append(to_pil(pixels[0].permute(1, 0, 2, 3)) if family.is_video else to_pil(pixels))
    return rows


def write_params(path: Path, record: dict[str, Any]) -> None:
    path.write_text(json.dumps(record, indent=2, default=str) + "\n", encoding="utf-8")
