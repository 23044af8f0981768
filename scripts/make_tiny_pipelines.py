"""Build tiny random diffusers pipelines for Flux, Qwen-Image, Wan 2.1 and SD3, offline, plus a dataset.

    python scripts/make_tiny_pipelines.py DIR [--families flux,qwen-image,wan,sd3] [--force]

DIR/flux, DIR/qwen-image, DIR/wan and DIR/sd3 are diffusers folders (model_index.json, transformer, VAE,
text encoders, tokenizers made from scratch, scheduler) that `FluxPipeline.from_pretrained` and
friends load with nothing downloaded. DIR/data/images is a folder of small images with a
metadata.jsonl, DIR/data/clips a folder of short clips (one sub-folder of frames each, captions in
.txt files) for Wan. Everything is seeded: the same command gives the same files.

The widths are tiny (a few thousand parameters per block) so that a train job runs in seconds on
a laptop CPU. `scripts/make_big_pipeline.py` builds the same families at their real widths.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Callable

FAMILIES = ("flux", "qwen-image", "wan", "sd3")

# The Qwen-Image pipeline drops the first 34 tokens of its chat template (the real tokenizer
# spells the system prompt in exactly 34): the tiny tokenizer must do the same.
QWEN_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
QWEN_DROP = 34

COLORS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 70, 220), "yellow": (230, 210, 40),
          "white": (240, 240, 240), "black": (20, 20, 20), "purple": (140, 50, 170), "orange": (240, 140, 30)}
SHAPES = ("square", "circle", "stripe")
CAPTION_WORDS = sorted(
    set(" ".join(f"a {c} {s} on a {b} background" for c in COLORS for s in SHAPES for b in COLORS).split())
    | {"photo", "of", "cat", "dog", "sks", "style", "in", "the", "snow", "painting", "two", "and", "with"}
)


# ---------------------------------------------------------------- tokenizers from scratch
def clip_tokenizer(model_max_length: int = 77) -> Any:
    """A CLIP BPE tokenizer over letters and a few whole words (no merges file needed)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import CLIPTokenizerFast

    vocab: dict[str, int] = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for ch in "abcdefghijklmnopqrstuvwxyz0123456789.,!?'-":
        vocab.setdefault(ch, len(vocab))
        vocab.setdefault(ch + "</w>", len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<|endoftext|>", end_of_word_suffix="</w>"))
    tok.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.BPEDecoder(suffix="</w>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|startoftext|> $A <|endoftext|>", special_tokens=[("<|startoftext|>", 0), ("<|endoftext|>", 1)])
    tok.add_special_tokens(["<|startoftext|>", "<|endoftext|>"])
    return CLIPTokenizerFast(tokenizer_object=tok, bos_token="<|startoftext|>", eos_token="<|endoftext|>",
                             unk_token="<|endoftext|>", pad_token="<|endoftext|>", model_max_length=model_max_length)


def t5_tokenizer(model_max_length: int = 64) -> Any:
    """A T5-style unigram tokenizer (whole caption words, then single letters); also serves UMT5."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -3.0)]
    pieces += [("\u2581" + w, -1.0) for w in CAPTION_WORDS]
    pieces += [(ch, -5.0) for ch in "abcdefghijklmnopqrstuvwxyz0123456789.,!?'-"]
    tok = Tokenizer(models.Unigram(pieces, unk_id=2, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>",
                                                       special_tokens=[("</s>", 1)])
    tok.add_special_tokens(["<pad>", "</s>", "<unk>"])
    return T5TokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>", pad_token="<pad>",
                           extra_ids=0, model_max_length=model_max_length)


def qwen_tokenizer() -> Any:
    """A byte-level BPE in the Qwen2 style, trained on the chat template and caption words."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Qwen2TokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.add_special_tokens(specials)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    corpus = [QWEN_TEMPLATE.format(" ".join(CAPTION_WORDS[i:i + 6])) for i in range(0, len(CAPTION_WORDS), 3)] * 8
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    out = Qwen2TokenizerFast(tokenizer_object=tok, unk_token="<|endoftext|>", eos_token="<|im_end|>",
                             pad_token="<|endoftext|>", model_max_length=2048)
    prefix = out(QWEN_TEMPLATE.split("{}")[0])["input_ids"]
    if len(prefix) != QWEN_DROP:  # the pipeline would cut into the caption, or keep template tokens
        raise RuntimeError(f"tiny Qwen tokenizer spells the template prefix in {len(prefix)} tokens, not {QWEN_DROP}")
    return out


# ---------------------------------------------------------------- pipelines
def flow_scheduler(**overrides: Any) -> Any:
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(**overrides)


def build_flux(out: Path, *, dims: dict[str, Any] | None = None) -> None:
    import torch
    from diffusers import AutoencoderKL, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    torch.manual_seed(0)
    clip_tok, t5_tok = clip_tokenizer(), t5_tokenizer()
    clip = CLIPTextModel(CLIPTextConfig(vocab_size=len(clip_tok), hidden_size=32, intermediate_size=37,
                                        num_hidden_layers=2, num_attention_heads=4, projection_dim=32,
                                        max_position_embeddings=77, bos_token_id=0, eos_token_id=1, pad_token_id=1))
    t5 = T5EncoderModel(T5Config(vocab_size=len(t5_tok) + 10, d_model=32, d_ff=37, d_kv=8, num_layers=2,
                                 num_heads=4, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(32, 64), layers_per_block=1,
                        latent_channels=4, norm_num_groups=32, sample_size=32, shift_factor=0.1, scaling_factor=0.5)
    kw = dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
              num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True,
              axes_dims_rope=(4, 4, 8))
    kw.update(dims or {})
    transformer = FluxTransformer2DModel(**kw)
    scheduler = flow_scheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                               base_image_seq_len=256, max_image_seq_len=4096)
    pipe = FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=clip, tokenizer=clip_tok, text_encoder_2=t5,
                        tokenizer_2=t5_tok, transformer=transformer)
    pipe.save_pretrained(out)


def _qwen_text_encoder(vocab_size: int, hidden: int = 16) -> Any:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = Qwen2_5_VLConfig(
        text_config={"vocab_size": vocab_size, "hidden_size": hidden, "intermediate_size": 2 * hidden,
                     "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
                     "max_position_embeddings": 2048, "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 0,
                     "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]}},
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": hidden,
                       "patch_size": 2, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 4,
                       "fullatt_block_indexes": [0]},
        vocab_size=vocab_size, bos_token_id=0, eos_token_id=2, pad_token_id=0,
    )
    return Qwen2_5_VLForConditionalGeneration(config)


def build_qwen_image(out: Path, *, dims: dict[str, Any] | None = None) -> None:
    import torch
    from diffusers import AutoencoderKLQwenImage, QwenImagePipeline, QwenImageTransformer2DModel

    torch.manual_seed(1)
    tok = qwen_tokenizer()
    text_encoder = _qwen_text_encoder(len(tok))
    z = 4
    vae = AutoencoderKLQwenImage(base_dim=16, z_dim=z, dim_mult=[1, 2], num_res_blocks=1, attn_scales=[],
                                 temperal_downsample=[False], latents_mean=[0.1, -0.2, 0.0, 0.3],
                                 latents_std=[1.5, 2.0, 1.0, 2.5])
    kw = dict(patch_size=2, in_channels=4 * z, out_channels=z, num_layers=2, attention_head_dim=16,
              num_attention_heads=3, joint_attention_dim=16, guidance_embeds=False, axes_dims_rope=(8, 4, 4))
    kw.update(dims or {})
    transformer = QwenImageTransformer2DModel(**kw)
    scheduler = flow_scheduler(shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
                               base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02,
                               time_shift_type="exponential")
    pipe = QwenImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tok,
                             transformer=transformer)
    pipe.save_pretrained(out)


def build_wan(out: Path, *, dims: dict[str, Any] | None = None) -> None:
    import torch
    from diffusers import AutoencoderKLWan, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(2)
    tok = t5_tokenizer(model_max_length=64)
    text_encoder = UMT5EncoderModel(UMT5Config(vocab_size=len(tok) + 10, d_model=16, d_ff=32, d_kv=8, num_layers=2,
                                               num_heads=2, relative_attention_num_buckets=8,
                                               decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))
    z = 4
    vae = AutoencoderKLWan(base_dim=16, z_dim=z, dim_mult=[1, 2], num_res_blocks=1, attn_scales=[],
                           temperal_downsample=[True], latents_mean=[0.1, -0.2, 0.0, 0.3],
                           latents_std=[1.5, 2.0, 1.0, 2.5], scale_factor_temporal=2, scale_factor_spatial=2)
    kw = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=z, out_channels=z,
              text_dim=16, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
              qk_norm="rms_norm_across_heads", rope_max_seq_len=32)
    kw.update(dims or {})
    transformer = WanTransformer3DModel(**kw)
    scheduler = flow_scheduler(shift=5.0, use_dynamic_shifting=False)
    pipe = WanPipeline(tokenizer=tok, text_encoder=text_encoder, vae=vae, transformer=transformer, scheduler=scheduler)
    pipe.save_pretrained(out)


def build_sd3(out: Path, *, dims: dict[str, Any] | None = None) -> None:
    import torch
    from diffusers import AutoencoderKL, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    torch.manual_seed(3)
    tok_1, tok_2, tok_3 = clip_tokenizer(), clip_tokenizer(), t5_tokenizer()

    def clip(hidden: int) -> Any:  # two CLIPs: their penultimate states side by side make T5's width
        return CLIPTextModelWithProjection(CLIPTextConfig(
            vocab_size=len(tok_1), hidden_size=hidden, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
            projection_dim=16, max_position_embeddings=77, bos_token_id=0, eos_token_id=1, pad_token_id=1))

    t5 = T5EncoderModel(T5Config(vocab_size=len(tok_3) + 10, d_model=32, d_ff=37, d_kv=8, num_layers=2, num_heads=4,
                                 decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(32, 64), layers_per_block=1,
                        latent_channels=4, norm_num_groups=32, sample_size=32, shift_factor=0.06, scaling_factor=1.5)
    kw = dict(sample_size=16, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=4,
              joint_attention_dim=32, caption_projection_dim=32, pooled_projection_dim=32, out_channels=4,
              pos_embed_max_size=32)
    kw.update(dims or {})
    pipe = StableDiffusion3Pipeline(transformer=SD3Transformer2DModel(**kw), scheduler=flow_scheduler(shift=3.0),
                                    vae=vae, text_encoder=clip(16), tokenizer=tok_1, text_encoder_2=clip(16),
                                    tokenizer_2=tok_2, text_encoder_3=t5, tokenizer_3=tok_3)
    pipe.save_pretrained(out)


BUILDERS: dict[str, Callable[..., None]] = {"flux": build_flux, "qwen-image": build_qwen_image, "wan": build_wan,
                                            "sd3": build_sd3}


# ---------------------------------------------------------------- data
def _draw(color: str, shape: str, background: str, size: tuple[int, int], phase: float = 0.0) -> Any:
    from PIL import Image, ImageDraw

    w, h = size
    img = Image.new("RGB", size, COLORS[background])
    d = ImageDraw.Draw(img)
    cx, cy, r = w * (0.5 + 0.25 * math.sin(phase)), h / 2, min(w, h) / 4
    if shape == "square":
        d.rectangle([cx - r, cy - r, cx + r, cy + r], fill=COLORS[color])
    elif shape == "circle":
        d.ellipse([cx - r, cy - r, cx + r, cy + r], fill=COLORS[color])
    else:
        for x in range(0, w, max(2, w // 4)):
            d.rectangle([x + phase, 0, x + phase + max(1, w // 8), h], fill=COLORS[color])
    return img


def build_images(out: Path, count: int = 6) -> None:
    """Images of two aspect ratios with a metadata.jsonl (file_name, text)."""
    out.mkdir(parents=True, exist_ok=True)
    colors = list(COLORS)
    lines = []
    for i in range(count):
        color, bg, shape = colors[i % len(colors)], colors[(i + 3) % len(colors)], SHAPES[i % len(SHAPES)]
        size = (32, 32) if i % 2 == 0 else (48, 32)
        name = f"img_{i:02d}.png"
        _draw(color, shape, bg, size).save(out / name)
        lines.append(json.dumps({"file_name": name, "text": f"a {color} {shape} on a {bg} background"}))
    (out / "metadata.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")


def build_clips(out: Path, count: int = 3, frames: int = 5) -> None:
    """Short clips for Wan: one folder of numbered frames each, with a same-named .txt caption."""
    out.mkdir(parents=True, exist_ok=True)
    colors = list(COLORS)
    for i in range(count):
        color, bg, shape = colors[i % len(colors)], colors[(i + 2) % len(colors)], SHAPES[i % len(SHAPES)]
        clip = out / f"clip_{i:02d}"
        clip.mkdir(exist_ok=True)
        for f in range(frames):
            _draw(color, shape, bg, (32, 32), phase=f * 0.6).save(clip / f"{f:03d}.png")
        (out / f"clip_{i:02d}.txt").write_text(f"a {color} {shape} on a {bg} background\n", encoding="utf-8")


def readable_by_all(root: Path) -> None:
    """Files 0644, folders 0755: safetensors writes 0600, which a worker under another uid (the
    container's) cannot read."""
    for path in [root, *root.rglob("*")]:
        if not path.is_symlink():
            os.chmod(path, 0o755 if path.is_dir() else 0o644)


def build_all(root: Path, families: list[str] | tuple[str, ...] = FAMILIES, force: bool = False) -> dict[str, Path]:
    root.mkdir(parents=True, exist_ok=True)
    made: dict[str, Path] = {}
    for fam in families:
        dst = root / fam
        if force and dst.exists():
            shutil.rmtree(dst)
        if not (dst / "model_index.json").exists():
            tmp = root / f".{fam}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            BUILDERS[fam](tmp)
            readable_by_all(tmp)
            tmp.rename(dst)
        made[fam] = dst
    data = root / "data"
    if force and data.exists():
        shutil.rmtree(data)
    if not (data / "images" / "metadata.jsonl").exists():
        build_images(data / "images")
    if not (data / "clips").exists():
        build_clips(data / "clips")
    made["images"], made["clips"] = data / "images", data / "clips"
    return made


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dir", type=Path, help="Output folder (one sub-folder per family, plus data/).")
    p.add_argument("--families", default=",".join(FAMILIES), help="Comma-separated: " + ", ".join(FAMILIES))
    p.add_argument("--force", action="store_true", help="Rebuild what already exists.")
    args = p.parse_args(argv)
    fams = [f.strip() for f in args.families.split(",") if f.strip()]
    bad = [f for f in fams if f not in BUILDERS]
    if bad:
        print(f"error: unknown family {bad[0]!r}; choose from {', '.join(FAMILIES)}", file=sys.stderr)
        return 2
    for name, path in build_all(args.dir, fams, force=args.force).items():
        print(f"{name:11s} {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
