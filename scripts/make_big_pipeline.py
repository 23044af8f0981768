"""Build a full-width random pipeline (Flux-dev, Qwen-Image or Wan 2.1 14B dims) as a diffusers folder.

    python scripts/make_big_pipeline.py FAMILY DIR [--blocks N] [--single-blocks N]

The transformer has the real model's widths and, by default, its real depth:
- flux:       FLUX.1-dev, 19 double + 38 single blocks, width 3072 (11.9B parameters, 23.8 GB bf16)
- qwen-image: Qwen-Image, 60 blocks, width 3072, text width 3584 (20.4B, ~41 GB bf16)
- wan:        Wan 2.1 T2V-14B widths (5120, 40 heads, FFN 13824), 8 of its 40 blocks by default
The text encoders and the VAE are tiny but their output widths match what the transformer expects
(T5 4096 + CLIP 768 for Flux, Qwen2.5-VL 3584, UMT5 4096; 16-channel latents at 8x for all three).

The weights are random: the model is built on the meta device, and each weight is filled from one
random tile scaled by 1/sqrt(fan_in) (drawing 12B random numbers would take minutes), norms get 1
and biases 0, so activations stay O(1) through 60 blocks in bf16. Everything is offline.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_tiny_pipelines as tiny  # noqa: E402  (the tokenizers, scheduler settings and drawings)

TILE = 1 << 24


def _materialize(model: Any, dtype: Any, seed: int = 0) -> int:
    """Replace every meta parameter of `model` by a CPU tensor filled from a random tile; returns bytes."""
    import torch

    g = torch.Generator().manual_seed(seed)
    tile = torch.randn(TILE, generator=g).to(dtype)
    total = 0
    for mod_name, module in model.named_modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            full = f"{mod_name}.{name}" if mod_name else name
            t = torch.empty(p.shape, dtype=dtype, device="cpu")
            if t.dim() >= 2:
                fan_in = math.prod(t.shape[1:])
                flat = t.view(-1)
                off = (hash(full) & 0xFFFFFF) % TILE
                i = 0
                while i < flat.numel():
                    n = min(TILE - off, flat.numel() - i)
                    flat[i:i + n].copy_(tile[off:off + n])
                    i += n
                    off = 0
                t.mul_(0.5 / math.sqrt(fan_in))
            elif name == "weight" or full.endswith(("norm.weight", "scale_shift_table")):
                t.fill_(1.0 if name == "weight" else 0.0)
            else:
                t.zero_()
            if full.endswith("scale_shift_table"):  # Wan's modulation table: small, like a trained one
                t.normal_(0, 0.02, generator=g)
            module._parameters[name] = torch.nn.Parameter(t, requires_grad=False)
            total += t.numel() * t.element_size()
    return total


def _transformer(cls: Any, dtype: Any, **config: Any) -> tuple[Any, int]:
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):  # buffers (rotary tables) are computed for real
        model = cls(**config)
    return model, _materialize(model, dtype)


def _vae_8x(kind: str) -> Any:
    from diffusers import AutoencoderKL, AutoencoderKLQwenImage, AutoencoderKLWan

    if kind == "flux":
        return AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                             up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(32, 32, 32, 32),
                             layers_per_block=1, latent_channels=16, norm_num_groups=32, sample_size=1024,
                             shift_factor=0.1159, scaling_factor=0.3611)
    mean, std = [0.0] * 16, [1.0] * 16
    cls = AutoencoderKLQwenImage if kind == "qwen-image" else AutoencoderKLWan
    extra = {} if kind == "qwen-image" else {"scale_factor_temporal": 4, "scale_factor_spatial": 8}
    return cls(base_dim=16, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1, attn_scales=[],
               temperal_downsample=[False, True, True], latents_mean=mean, latents_std=std, **extra)


def build_flux(out: Path, dtype: Any, blocks: int | None = None, single: int | None = None) -> int:
    import torch
    from diffusers import FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    torch.manual_seed(0)
    clip_tok, t5_tok = tiny.clip_tokenizer(), tiny.t5_tokenizer(model_max_length=512)
    clip = CLIPTextModel(CLIPTextConfig(vocab_size=len(clip_tok), hidden_size=768, intermediate_size=256,
                                        num_hidden_layers=1, num_attention_heads=12, projection_dim=768,
                                        max_position_embeddings=77, bos_token_id=0, eos_token_id=1, pad_token_id=1))
    t5 = T5EncoderModel(T5Config(vocab_size=len(t5_tok) + 10, d_model=4096, d_ff=256, d_kv=64, num_layers=1,
                                 num_heads=2, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))
    transformer, nbytes = _transformer(
        FluxTransformer2DModel, dtype, patch_size=1, in_channels=64, num_layers=19 if blocks is None else blocks,
        num_single_layers=38 if single is None else single, attention_head_dim=128, num_attention_heads=24,
        joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56))
    scheduler = tiny.flow_scheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                    base_image_seq_len=256, max_image_seq_len=4096)
    pipe = FluxPipeline(scheduler=scheduler, vae=_vae_8x("flux"), text_encoder=clip.to(dtype), tokenizer=clip_tok,
                        text_encoder_2=t5.to(dtype), tokenizer_2=t5_tok, transformer=transformer)
    pipe.save_pretrained(out, max_shard_size="5GB")
    return nbytes


def build_qwen_image(out: Path, dtype: Any, blocks: int | None = None, single: int | None = None) -> int:
    import torch
    from diffusers import QwenImagePipeline, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(1)
    tok = tiny.qwen_tokenizer()
    config = Qwen2_5_VLConfig(
        text_config={"vocab_size": len(tok), "hidden_size": 3584, "intermediate_size": 256, "num_hidden_layers": 1,
                     "num_attention_heads": 28, "num_key_value_heads": 4, "max_position_embeddings": 2048,
                     "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 0,
                     "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}},
        vision_config={"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 3584,
                       "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
                       "fullatt_block_indexes": [0]},
        vocab_size=len(tok), bos_token_id=0, eos_token_id=2, pad_token_id=0)
    text_encoder = Qwen2_5_VLForConditionalGeneration(config).to(dtype)
    transformer, nbytes = _transformer(
        QwenImageTransformer2DModel, dtype, patch_size=2, in_channels=64, out_channels=16,
        num_layers=60 if blocks is None else blocks, attention_head_dim=128, num_attention_heads=24,
        joint_attention_dim=3584, guidance_embeds=False, axes_dims_rope=(16, 56, 56))
    scheduler = tiny.flow_scheduler(shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
                                    base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02,
                                    time_shift_type="exponential")
    pipe = QwenImagePipeline(scheduler=scheduler, vae=_vae_8x("qwen-image"), text_encoder=text_encoder, tokenizer=tok,
                             transformer=transformer)
    pipe.save_pretrained(out, max_shard_size="5GB")
    return nbytes


def build_wan(out: Path, dtype: Any, blocks: int | None = None, single: int | None = None) -> int:
    import torch
    from diffusers import WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(2)
    tok = tiny.t5_tokenizer(model_max_length=512)
    text_encoder = UMT5EncoderModel(UMT5Config(vocab_size=len(tok) + 10, d_model=4096, d_ff=256, d_kv=64, num_layers=1,
                                               num_heads=2, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))
    transformer, nbytes = _transformer(
        WanTransformer3DModel, dtype, patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128,
        in_channels=16, out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=13824,
        num_layers=8 if blocks is None else blocks, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        eps=1e-6, rope_max_seq_len=1024)
    scheduler = tiny.flow_scheduler(shift=5.0, use_dynamic_shifting=False)
    pipe = WanPipeline(tokenizer=tok, text_encoder=text_encoder.to(dtype), vae=_vae_8x("wan"), transformer=transformer,
                       scheduler=scheduler)
    pipe.save_pretrained(out, max_shard_size="5GB")
    return nbytes


BUILDERS = {"flux": build_flux, "qwen-image": build_qwen_image, "wan": build_wan}


def build(family: str, out: Path, blocks: int | None = None, single: int | None = None) -> int:
    """Build into `out` (through a temp folder, renamed when complete); returns the transformer's bytes."""
    import shutil

    import torch

    out = Path(out)
    if (out / "model_index.json").exists():
        return sum(f.stat().st_size for f in (out / "transformer").glob("*.safetensors"))
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    nbytes = BUILDERS[family](tmp, torch.bfloat16, blocks, single)
    tmp.rename(out)
    return nbytes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("family", choices=sorted(BUILDERS))
    p.add_argument("dir", type=Path)
    p.add_argument("--blocks", type=int, default=None, help="Transformer blocks (Flux: double blocks); default the real count (Wan: 8).")
    p.add_argument("--single-blocks", type=int, default=None, help="Flux single blocks (default 38).")
    args = p.parse_args(argv)
    t0 = time.time()
    nbytes = build(args.family, args.dir, args.blocks, args.single_blocks)
    print(f"{args.family}: {nbytes / 1e9:.2f} GB transformer written to {args.dir} in {time.time() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
