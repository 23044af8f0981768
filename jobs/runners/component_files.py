"""What a single .safetensors file that is not a transformer is: a text encoder, a VAE or a LoRA,
from its header alone (no torch).

- text encoders: CLIP (`[text_model.]encoder.layers.N.self_attn.q_proj.weight`: Flux's `clip_l`),
  T5 (`encoder.block.N.layer.0.SelfAttention.q.weight` with a relative attention bias in block 0
  only: Flux's `t5xxl`), UMT5 (the same names with a bias in every block: Wan's `umt5_xxl`),
  Qwen2.5-VL (`model.layers.N.self_attn.q_proj.weight` beside `visual.`, ComfyUI's and older transformers'
  names, or `model.language_model.layers.N.` beside `model.visual.`: Qwen-Image's `qwen_2.5_vl_7b`);
- VAEs: a 2-D KL autoencoder (Flux's `ae.safetensors`, in BFL/LDM names `encoder.down.N.block.M`
  or diffusers' `encoder.down_blocks.N.resnets.M`) or a 3-D one (Wan 2.1's, which Qwen-Image's is too:
  native `encoder.conv1` / `decoder.head`, ComfyUI's `wan_2.1_vae` and `qwen_image_vae`, or diffusers' names);
- LoRAs (`lora_down`/`lora_up`/`lora_A`/`lora_B` keys).

Any prefix is taken (ComfyUI's whole checkpoints: `text_encoders.t5xxl.transformer.`,
`first_stage_model.`, ...). fp8 files are told apart: `F8_E4M3` weights, and ComfyUI's scaled layout
(`scaled_fp8` and a `scale_weight` per weight).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from jobs.errors import JobsError
from jobs.runners.errors import CheckpointError

__all__ = ["Found", "identify", "ROLES", "FAMILY_ROLES", "VAE_FAMILIES", "check_parts"]

# role -> (family, what the pipeline calls it)
ROLES = {"clip_l": ("flux", "text_encoder"), "t5xxl": ("flux", "text_encoder_2"),
         "umt5_xxl": ("wan", "text_encoder"), "qwen_2.5_vl": ("qwen-image", "text_encoder")}


@dataclass
class Found:
    kind: str  # text_encoder, vae, lora or unknown
    family: str | None = None
    role: str | None = None  # clip_l, t5xxl, umt5_xxl, qwen_2.5_vl or vae
    layout: str | None = None  # hf (transformers' names), bfl, diffusers or native
    prefix: str = ""
    dims: dict[str, int] = field(default_factory=dict)
    fp8: str | None = None  # None, "plain" or "scaled" (ComfyUI's scale_weight)
    note: str | None = None

    def describe(self) -> str:
        what = self.role or self.kind
        extra = f", fp8 {self.fp8}" if self.fp8 else ""
        pre = f", prefix {self.prefix!r}" if self.prefix else ""
        return f"{what} ({self.family or 'unknown family'}, {self.layout or '?'} names{pre}{extra})"


def _find(keys: list[str], suffix: str) -> str | None:
    """The prefix under which `suffix` is a key (``""`` for none), or None."""
    for k in keys:
        if k.endswith(suffix) and (len(k) == len(suffix) or k[-len(suffix) - 1] == "."):
            return k[: len(k) - len(suffix)]
    return None


def _fp8(header: dict[str, dict], prefix: str) -> str | None:
    mine = [v for k, v in header.items() if k.startswith(prefix) and isinstance(v, dict)]
    if not any(str(v.get("dtype", "")).startswith("F8_") for v in mine):
        return None
    scaled = any(k.endswith(".scale_weight") or k.endswith("scaled_fp8") for k in header)
    return "scaled" if scaled else "plain"


def _text_encoder(header: dict[str, dict], keys: list[str]) -> Found | None:
    p = _find(keys, "encoder.layers.0.self_attn.q_proj.weight")  # under text_model. in older transformers' files
    if p is not None:
        width = header[p + "encoder.layers.0.self_attn.q_proj.weight"]["shape"][0]
        layers = len({m.group(1) for k in keys if (m := re.match(re.escape(p) + r"encoder\.layers\.(\d+)\.", k))})
        return Found("text_encoder", "flux", "clip_l", "hf", p, {"width": width, "layers": layers}, _fp8(header, p))
    p = _find(keys, "encoder.block.0.layer.0.SelfAttention.q.weight")
    if p is not None:
        blocks = {int(m.group(1)) for k in keys if (m := re.match(re.escape(p) + r"encoder\.block\.(\d+)\.", k))}
        biased = [b for b in blocks if f"{p}encoder.block.{b}.layer.0.SelfAttention.relative_attention_bias.weight" in header]
        umt5 = len(biased) > 1  # a one-block UMT5 reads as T5: the bias per block is what tells them apart
        emb = header.get(p + "shared.weight") or header.get(p + "encoder.embed_tokens.weight") or {}
        dims = {"width": header[p + "encoder.block.0.layer.0.SelfAttention.q.weight"]["shape"][1],
                "layers": len(blocks), "vocab": (emb.get("shape") or [0])[0]}
        role = "umt5_xxl" if umt5 else "t5xxl"
        return Found("text_encoder", ROLES[role][0], role, "hf", p, dims, _fp8(header, p))
    return _qwen_vl(header, keys)


def _qwen_vl(header: dict[str, dict], keys: list[str]) -> Found | None:
    """Qwen2.5-VL in either spelling: ComfyUI's and transformers < 4.52's (`model.layers.N.`, `visual.`,
    `lm_head.`) or transformers >= 4.52's (`model.language_model.layers.N.`, `model.visual.`)."""
    for lm, tower in (("model.language_model.", "model.visual."), ("model.", "visual.")):
        q = lm + "layers.0.self_attn.q_proj."
        p = _find(keys, q + "weight")
        if p is None:
            continue
        has_tower = any(k.startswith(p + tower) for k in keys)
        # a Qwen2 decoder (biased q/k/v, no q_norm: not Qwen3, not Llama) without its vision tower: the
        # text-to-image pipeline never runs the tower (component_load leaves it out)
        qwen2 = p + q + "bias" in header and p + lm + "layers.0.self_attn.q_norm.weight" not in header
        if not (has_tower or qwen2):
            continue
        emb = (header.get(p + lm + "embed_tokens.weight") or {}).get("shape") or [0, 0]
        layers = {m.group(1) for k in keys if (m := re.match(re.escape(p + lm) + r"layers\.(\d+)\.", k))}
        dims = {"width": emb[1], "layers": len(layers), "vocab": emb[0]}
        note = None if has_tower else "no vision tower (the text-to-image pipeline does not use it)"
        return Found("text_encoder", "qwen-image", "qwen_2.5_vl", "hf", p, dims, _fp8(header, p), note)
    return None


WAN_VAE_NOTE = "Wan 2.1's 3-D VAE, also Qwen-Image's: fits wan and qwen-image models"


def _vae(header: dict[str, dict], keys: list[str]) -> Found | None:
    for suffix, layout in (("decoder.up.0.block.0.conv1.weight", "bfl"), ("decoder.up_blocks.0.resnets.0.conv1.weight",
                                                                             "diffusers")):
        p = _find(keys, suffix)
        if p is not None:
            conv = header[p + suffix]["shape"]
            if len(conv) == 5:  # diffusers' AutoencoderKLWan (and AutoencoderKLQwenImage): 3-D convolutions
                return Found("vae", "wan", "vae", "diffusers", p, {}, _fp8(header, p), note=WAN_VAE_NOTE)
            latent = (header.get(p + "decoder.conv_in.weight") or {}).get("shape") or [0, 0]
            return Found("vae", "flux", "vae", layout, p, {"latent_channels": latent[1]}, _fp8(header, p))
    p = _find(keys, "decoder.head.2.weight")  # Wan-AI's WanVAE names, ComfyUI's wan_2.1_vae and qwen_image_vae
    if p is not None:
        return Found("vae", "wan", "vae", "native", p, {}, _fp8(header, p), note=WAN_VAE_NOTE)
    return None


def identify(path: str | Path) -> Found:
    """What the file at `path` is (never raises for a file that is merely unknown or unreadable)."""
    from jobs.runners.folders import safetensors_header

    p = Path(path)
    if p.is_dir():
        return Found("unknown", note="a folder of shards that is not a transformer")
    try:
        header = dict(safetensors_header(p, "models", JobsError))
    except JobsError as exc:
        return Found("unknown", note=str(exc).split(f"{p}", 1)[-1].lstrip(": ") or str(exc))
    header.pop("__metadata__", None)
    keys = list(header)
    if any(re.search(r"lora_(down|up|A|B)\b", k) for k in keys):
        from jobs.runners.folders import lora_family_of_keys, lora_format

        return Found("lora", lora_family_of_keys(keys)[0], layout=lora_format(keys))
    found = _text_encoder(header, keys) or _vae(header, keys)
    if found is not None:
        return found
    return Found("unknown", note=f"no known kind: {len(keys)} tensors, first keys {', '.join(sorted(keys)[:3]) or '(none)'}")


# family -> {role: the pipeline's attribute}: the text encoder files each family takes
FAMILY_ROLES: dict[str, dict[str, str]] = {}
for _role, (_family, _attr) in ROLES.items():
    FAMILY_ROLES.setdefault(_family, {})[_role] = _attr
# Qwen-Image's VAE is Wan 2.1's architecture (the same names and shapes; its weights were tuned further
# for images): a 3-D VAE file fits either family, and nothing in the file tells the two apart
VAE_FAMILIES = {"wan": ("wan", "qwen-image"), "flux": ("flux", "sd3")}
TEXT_FIELD, VAE_FIELD = "model.text_encoders", "model.vae"


def _not_a(path: Path, want: str, field_: str) -> CheckpointError:
    """The error for a file that is not a `want`: what it is instead (a transformer, a VAE, ...)."""
    from jobs.runners.single_file import detect_checkpoint

    found = identify(path)
    if found.kind == "unknown":
        try:
            det = detect_checkpoint(path)
        except CheckpointError:
            return CheckpointError(f"{field_}: {path} is not a {want}: {found.note}")
        return CheckpointError(f"{field_}: {path} is a {det.family} transformer ({det.layout} layout), not a {want}")
    what = "a VAE" if found.kind == "vae" else "a LoRA" if found.kind == "lora" else f"a {found.describe()}"
    return CheckpointError(f"{field_}: {path} is {what}, not a {want}")


def check_parts(family: str, base: Path | str, text_encoders: list[Path], vae: Path | None) -> dict[str, Path]:
    """{pipeline attribute: file} for the text encoder and VAE files of a `family` model whose base is
    `base`; CheckpointError naming the field, the file and what was found for a file that does not fit."""
    parts: dict[str, Path] = {}
    roles = FAMILY_ROLES.get(family)
    if text_encoders and roles is None:
        raise CheckpointError(f"{TEXT_FIELD}: text encoder files are not read for {family} models yet")
    for path in text_encoders:
        found = identify(path)
        if found.kind != "text_encoder":
            raise _not_a(path, "text encoder", TEXT_FIELD)
        if found.role not in roles:
            raise CheckpointError(f"{TEXT_FIELD}: {path} is a {found.role} text encoder (a {found.family} model's); "
                                  f"{base} is a {family} model, whose text encoders are {' and '.join(roles)}")
        attr = roles[found.role]
        if attr in parts:
            raise CheckpointError(f"{TEXT_FIELD}: {path} and {parts[attr]} are both {found.role} text encoders")
        parts[attr] = path
    if vae is not None:
        found = identify(vae)
        if found.kind != "vae":
            raise _not_a(vae, "VAE", VAE_FIELD)
        if family not in VAE_FAMILIES.get(found.family or "", (found.family,)):
            dims, whose = ("3-D (video)", "a wan or qwen-image") if found.family == "wan" else ("2-D (image)",
                                                                                             f"a {found.family}")
            raise CheckpointError(f"{VAE_FIELD}: {vae} is a {dims} VAE, {whose} model's; {base} is a {family} model")
        parts["vae"] = vae
    return parts
