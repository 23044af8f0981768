"""One small adapter per model family: Flux, Qwen-Image, Wan 2.1 and SD3.

An adapter knows what differs between families and nothing else:
- which diffusers classes make up the model folder (so a folder of another family is refused)
- how text becomes conditioning (it calls the pipeline's own `encode_prompt`)
- how pixels become normalized latents and back (each VAE has its own shift/scale or mean/std)
- how noisy latents are packed and fed to the transformer (position ids, img_shapes, timestep scale)
- which LoRA targets it defaults to, and how LoRA keys are named where users load them
- how the family's pipeline is called with precomputed embeddings

Latents are kept unpacked everywhere ((C, H, W), or (C, F, H, W) for Wan): the flow-matching loss
is taken there, and only the transformer call packs them.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from jobs.runners.folders import FAMILY_CLASSES, FamilyError, detect_family  # the last two re-exported

__all__ = ["FamilyAdapter", "ADAPTERS", "get_adapter", "detect_family", "FamilyError"]


def _pack(x: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, H/2 * W/2, 4C): 2x2 patches as tokens (Flux and Qwen-Image)."""
    b, c, h, w = x.shape
    x = x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def _unpack(x: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """The inverse of _pack for latents of h x w."""
    b, _, d = x.shape
    x = x.view(b, h // 2, w // 2, d // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, d // 4, h, w)


class FamilyAdapter:
    name = ""
    pipeline_class = ""
    transformer_class = ""
    default_targets: tuple[str, ...] = ()
    default_max_sequence_length = 512
    default_guidance = 3.5
    lora_prefix = "transformer."
    is_video = False
    uses_negative = False  # true CFG with a negative prompt at inference

    # ------------------------------------------------------------ classes
    def classes(self) -> tuple[type, type]:
        import diffusers

        return getattr(diffusers, self.pipeline_class), getattr(diffusers, self.transformer_class)

    def spatial_factor(self, vae: Any) -> int:
        """Pixels per latent cell."""
        return 2 ** (len(vae.config.block_out_channels) - 1)

    def bucket_multiple(self, vae: Any) -> int:
        """Image sides must be a multiple of this: the VAE factor times the 2x2 patch."""
        return self.spatial_factor(vae) * 2

    def temporal_factor(self, vae: Any) -> int:
        return 1

    # ------------------------------------------------------------ text
    def encode_text(self, pipe: Any, caption: str, device: torch.device, max_len: int) -> dict[str, torch.Tensor]:
        """One caption -> its conditioning tensors (batch dim dropped, on the CPU)."""
        raise NotImplementedError

    def collate_text(self, items: list[dict[str, torch.Tensor]], device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
        return {k: torch.stack([it[k] for it in items]).to(device, dtype) for k in items[0]}

    # ------------------------------------------------------------ VAE
    def pixels_to_vae(self, pixels: torch.Tensor) -> torch.Tensor:
        """(C, H, W) or (C, F, H, W) in [-1, 1] -> what vae.encode takes, batch of 1."""
        return pixels[None]

    def encode_pixels(self, vae: Any, pixels: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def decode_latents(self, vae: Any, latents: torch.Tensor) -> torch.Tensor:
        """Normalized latents (B, ...) -> pixels in [-1, 1]: (B, 3, H, W) or (B, 3, F, H, W)."""
        raise NotImplementedError

    # ------------------------------------------------------------ training
    def model_inputs(self, transformer: Any, noisy: torch.Tensor, sigmas: torch.Tensor, text: dict[str, Any],
                     guidance: float) -> dict[str, Any]:
        raise NotImplementedError

    def prediction(self, out: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """The transformer's output in the latents' own layout."""
        return out

    # ------------------------------------------------------------ inference
    def pipeline_kwargs(self, text: dict[str, Any], negative: dict[str, Any] | None, guidance: float,
                        num_frames: int) -> dict[str, Any]:
        raise NotImplementedError

    def latents_from_pipeline(self, latents: torch.Tensor, lat_h: int, lat_w: int) -> torch.Tensor:
        return latents

    # ------------------------------------------------------------ LoRA naming
    def lora_key(self, module: str) -> str | None:
        """`transformer_blocks.0.attn.to_q` (diffusers) -> the module name written in the LoRA file."""
        return self.lora_prefix + module

    def module_from_lora_key(self, key: str) -> str | None:
        return key[len(self.lora_prefix):] if key.startswith(self.lora_prefix) else None


class FluxAdapter(FamilyAdapter):
    name = "flux"
    pipeline_class, transformer_class = FAMILY_CLASSES[name]
    # diffusers' train_dreambooth_lora_flux.py "all attention + MLP" set, double and single blocks
    default_targets = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
                       "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "proj_mlp")
    default_max_sequence_length = 512
    default_guidance = 3.5

    def encode_text(self, pipe: Any, caption: str, device: torch.device, max_len: int) -> dict[str, torch.Tensor]:
        embeds, pooled, _ = pipe.encode_prompt(prompt=[caption], prompt_2=None, device=device, max_sequence_length=max_len)
        return {"prompt_embeds": embeds[0].cpu(), "pooled_prompt_embeds": pooled[0].cpu()}

    def encode_pixels(self, vae: Any, pixels: torch.Tensor) -> torch.Tensor:
        lat = vae.encode(self.pixels_to_vae(pixels)).latent_dist.mode()
        return ((lat - vae.config.shift_factor) * vae.config.scaling_factor)[0]

    def decode_latents(self, vae: Any, latents: torch.Tensor) -> torch.Tensor:
        lat = latents / vae.config.scaling_factor + vae.config.shift_factor
        return vae.decode(lat, return_dict=False)[0]

    def model_inputs(self, transformer: Any, noisy: torch.Tensor, sigmas: torch.Tensor, text: dict[str, Any],
                     guidance: float) -> dict[str, Any]:
        b, _, h, w = noisy.shape
        ids = torch.zeros(h // 2, w // 2, 3)
        ids[..., 1] += torch.arange(h // 2)[:, None]
        ids[..., 2] += torch.arange(w // 2)[None, :]
        dev, dt = noisy.device, noisy.dtype
        kw = dict(hidden_states=_pack(noisy), timestep=sigmas.to(dt), pooled_projections=text["pooled_prompt_embeds"],
                  encoder_hidden_states=text["prompt_embeds"], img_ids=ids.reshape(-1, 3).to(dev, dt),
                  txt_ids=torch.zeros(text["prompt_embeds"].shape[1], 3, device=dev, dtype=dt), return_dict=False)
        if transformer.config.guidance_embeds:
            kw["guidance"] = torch.full((b,), float(guidance), device=dev, dtype=torch.float32)
        return kw

    def prediction(self, out: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return _unpack(out, like.shape[-2], like.shape[-1])

    def pipeline_kwargs(self, text: dict[str, Any], negative: dict[str, Any] | None, guidance: float,
                        num_frames: int) -> dict[str, Any]:
        return {"prompt_embeds": text["prompt_embeds"], "pooled_prompt_embeds": text["pooled_prompt_embeds"],
                "guidance_scale": guidance}

    def latents_from_pipeline(self, latents: torch.Tensor, lat_h: int, lat_w: int) -> torch.Tensor:
        return _unpack(latents, lat_h, lat_w)


class QwenImageAdapter(FamilyAdapter):
    name = "qwen-image"
    pipeline_class, transformer_class = FAMILY_CLASSES[name]
    # the seed workflow's targets
    default_targets = ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "to_out.0", "to_add_out",
                       "img_mlp.net.2", "img_mod.1", "txt_mlp.net.2", "txt_mod.1")
    default_max_sequence_length = 512
    default_guidance = 4.0
    lora_prefix = "diffusion_model."
    uses_negative = True

    def spatial_factor(self, vae: Any) -> int:
        return 2 ** len(vae.temperal_downsample)

    def encode_text(self, pipe: Any, caption: str, device: torch.device, max_len: int) -> dict[str, torch.Tensor]:
        embeds, mask = pipe.encode_prompt(prompt=[caption], device=device, max_sequence_length=max_len)
        if mask is not None:  # one caption: the mask is all ones up to its length
            embeds = embeds[:, : int(mask[0].sum())]
        return {"prompt_embeds": embeds[0].cpu()}

    def collate_text(self, items: list[dict[str, torch.Tensor]], device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
        n = max(it["prompt_embeds"].shape[0] for it in items)
        embeds = torch.zeros(len(items), n, items[0]["prompt_embeds"].shape[1])
        mask = torch.zeros(len(items), n, dtype=torch.long)
        for i, it in enumerate(items):
            k = it["prompt_embeds"].shape[0]
            embeds[i, :k], mask[i, :k] = it["prompt_embeds"], 1
        return {"prompt_embeds": embeds.to(device, dtype), "prompt_embeds_mask": mask.to(device)}

    def pixels_to_vae(self, pixels: torch.Tensor) -> torch.Tensor:
        return pixels[None, :, None]  # (1, C, 1, H, W): the Qwen VAE is a video VAE

    def _stats(self, vae: Any, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (1, vae.config.z_dim) + (1,) * (like.dim() - 2)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(like.device, like.dtype)
        std = torch.tensor(vae.config.latents_std).view(shape).to(like.device, like.dtype)
        return mean, std

    def encode_pixels(self, vae: Any, pixels: torch.Tensor) -> torch.Tensor:
        lat = vae.encode(self.pixels_to_vae(pixels)).latent_dist.mode()  # (1, z, 1, h, w)
        mean, std = self._stats(vae, lat)
        return ((lat - mean) / std)[0, :, 0]

    def decode_latents(self, vae: Any, latents: torch.Tensor) -> torch.Tensor:
        lat = latents[:, :, None] if latents.dim() == 4 else latents
        mean, std = self._stats(vae, lat)
        return vae.decode(lat * std + mean, return_dict=False)[0][:, :, 0]

    def model_inputs(self, transformer: Any, noisy: torch.Tensor, sigmas: torch.Tensor, text: dict[str, Any],
                     guidance: float) -> dict[str, Any]:
        b, _, h, w = noisy.shape
        mask = text.get("prompt_embeds_mask")
        return dict(hidden_states=_pack(noisy), timestep=sigmas.to(noisy.dtype),
                    encoder_hidden_states=text["prompt_embeds"],
                    encoder_hidden_states_mask=None if mask is None or bool(mask.all()) else mask,
                    img_shapes=[[(1, h // 2, w // 2)]] * b, return_dict=False)

    def prediction(self, out: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return _unpack(out, like.shape[-2], like.shape[-1])

    def pipeline_kwargs(self, text: dict[str, Any], negative: dict[str, Any] | None, guidance: float,
                        num_frames: int) -> dict[str, Any]:
        kw: dict[str, Any] = {"prompt_embeds": text["prompt_embeds"], "prompt_embeds_mask": text["prompt_embeds_mask"],
                              "true_cfg_scale": guidance}
        if negative is not None and guidance > 1.0:
            kw.update(negative_prompt_embeds=negative["prompt_embeds"],
                      negative_prompt_embeds_mask=negative["prompt_embeds_mask"])
        return kw

    def latents_from_pipeline(self, latents: torch.Tensor, lat_h: int, lat_w: int) -> torch.Tensor:
        return _unpack(latents, lat_h, lat_w)


class SD3Adapter(FamilyAdapter):
    name = "sd3"
    pipeline_class, transformer_class = FAMILY_CLASSES[name]
    # diffusers' train_dreambooth_lora_sd3.py targets: the joint attention of both streams
    default_targets = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
    default_max_sequence_length = 256
    default_guidance = 7.0
    uses_negative = True

    def bucket_multiple(self, vae: Any) -> int:
        return self.spatial_factor(vae) * 2  # SD3's 2x2 patch embedding

    def encode_text(self, pipe: Any, caption: str, device: torch.device, max_len: int) -> dict[str, torch.Tensor]:
        embeds, _, pooled, _ = pipe.encode_prompt(prompt=[caption], prompt_2=None, prompt_3=None, device=device,
                                                  do_classifier_free_guidance=False, max_sequence_length=max_len)
        return {"prompt_embeds": embeds[0].cpu(), "pooled_prompt_embeds": pooled[0].cpu()}

    def encode_pixels(self, vae: Any, pixels: torch.Tensor) -> torch.Tensor:
        lat = vae.encode(self.pixels_to_vae(pixels)).latent_dist.mode()
        return ((lat - vae.config.shift_factor) * vae.config.scaling_factor)[0]

    def decode_latents(self, vae: Any, latents: torch.Tensor) -> torch.Tensor:
        return vae.decode(latents / vae.config.scaling_factor + vae.config.shift_factor, return_dict=False)[0]

    def model_inputs(self, transformer: Any, noisy: torch.Tensor, sigmas: torch.Tensor, text: dict[str, Any],
                     guidance: float) -> dict[str, Any]:
        return dict(hidden_states=noisy, timestep=(sigmas * 1000.0).to(noisy.dtype),
                    encoder_hidden_states=text["prompt_embeds"], pooled_projections=text["pooled_prompt_embeds"],
                    return_dict=False)

    def pipeline_kwargs(self, text: dict[str, Any], negative: dict[str, Any] | None, guidance: float,
                        num_frames: int) -> dict[str, Any]:
        kw: dict[str, Any] = {"prompt_embeds": text["prompt_embeds"],
                              "pooled_prompt_embeds": text["pooled_prompt_embeds"], "guidance_scale": guidance}
        if guidance > 1.0:
            neg = negative or {k: torch.zeros_like(v) for k, v in text.items()}
            kw.update(negative_prompt_embeds=neg["prompt_embeds"],
                      negative_pooled_prompt_embeds=neg["pooled_prompt_embeds"])
        return kw


# diffusers module names of a Wan block -> the native names (Wan's own code, ComfyUI, musubi-tuner)
_WAN_BLOCK = {"attn1.to_q": "self_attn.q", "attn1.to_k": "self_attn.k", "attn1.to_v": "self_attn.v",
              "attn1.to_out.0": "self_attn.o", "attn2.to_q": "cross_attn.q", "attn2.to_k": "cross_attn.k",
              "attn2.to_v": "cross_attn.v", "attn2.to_out.0": "cross_attn.o", "ffn.net.0.proj": "ffn.0",
              "ffn.net.2": "ffn.2"}
_WAN_TOP = {"condition_embedder.time_proj": "time_projection.1", "proj_out": "head.head",
            "condition_embedder.text_embedder.linear_1": "text_embedding.0",
            "condition_embedder.text_embedder.linear_2": "text_embedding.2",
            "condition_embedder.time_embedder.linear_1": "time_embedding.0",
            "condition_embedder.time_embedder.linear_2": "time_embedding.2"}


class WanAdapter(FamilyAdapter):
    name = "wan"
    pipeline_class, transformer_class = FAMILY_CLASSES[name]
    default_targets = ("to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2")
    default_max_sequence_length = 226
    default_guidance = 5.0
    lora_prefix = "diffusion_model."
    is_video = True
    uses_negative = True

    def spatial_factor(self, vae: Any) -> int:
        return int(vae.config.scale_factor_spatial)

    def temporal_factor(self, vae: Any) -> int:
        return int(vae.config.scale_factor_temporal)

    def encode_text(self, pipe: Any, caption: str, device: torch.device, max_len: int) -> dict[str, torch.Tensor]:
        embeds, _ = pipe.encode_prompt(prompt=[caption], do_classifier_free_guidance=False, max_sequence_length=max_len,
                                       device=device)
        return {"prompt_embeds": embeds[0].cpu()}

    def _stats(self, vae: Any, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(like.device, like.dtype)
        std = torch.tensor(vae.config.latents_std).view(shape).to(like.device, like.dtype)
        return mean, std

    def encode_pixels(self, vae: Any, pixels: torch.Tensor) -> torch.Tensor:
        lat = vae.encode(pixels[None]).latent_dist.mode()  # (1, z, f, h, w)
        mean, std = self._stats(vae, lat)
        return ((lat - mean) / std)[0]

    def decode_latents(self, vae: Any, latents: torch.Tensor) -> torch.Tensor:
        mean, std = self._stats(vae, latents)
        return vae.decode(latents * std + mean, return_dict=False)[0]

    def model_inputs(self, transformer: Any, noisy: torch.Tensor, sigmas: torch.Tensor, text: dict[str, Any],
                     guidance: float) -> dict[str, Any]:
        # Wan's transformer takes the scheduler's timestep (0..1000), not sigma.
        return dict(hidden_states=noisy, timestep=(sigmas * 1000.0).to(noisy.dtype),
                    encoder_hidden_states=text["prompt_embeds"], return_dict=False)

    def pipeline_kwargs(self, text: dict[str, Any], negative: dict[str, Any] | None, guidance: float,
                        num_frames: int) -> dict[str, Any]:
        kw: dict[str, Any] = {"prompt_embeds": text["prompt_embeds"], "guidance_scale": guidance,
                              "num_frames": num_frames}
        if guidance > 1.0:
            kw["negative_prompt_embeds"] = negative["prompt_embeds"] if negative is not None else torch.zeros_like(
                text["prompt_embeds"])
        return kw

    def lora_key(self, module: str) -> str | None:
        m = re.fullmatch(r"blocks\.(\d+)\.(.+)", module)
        if m:
            native = _WAN_BLOCK.get(m.group(2))
            return None if native is None else f"{self.lora_prefix}blocks.{m.group(1)}.{native}"
        native = _WAN_TOP.get(module)
        return None if native is None else self.lora_prefix + native

    def module_from_lora_key(self, key: str) -> str | None:
        if not key.startswith(self.lora_prefix):
            return None
        rest = key[len(self.lora_prefix):]
        m = re.fullmatch(r"blocks\.(\d+)\.(.+)", rest)
        table = {v: k for k, v in (_WAN_BLOCK if m else _WAN_TOP).items()}
        if m:
            mod = table.get(m.group(2))
            return None if mod is None else f"blocks.{m.group(1)}.{mod}"
        return table.get(rest)



ADAPTERS: dict[str, FamilyAdapter] = {a.name: a for a in (FluxAdapter(), QwenImageAdapter(), WanAdapter(), SD3Adapter())}


def get_adapter(name: str) -> FamilyAdapter:
    return ADAPTERS[name]
