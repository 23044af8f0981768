"""What a `model.transformer` checkpoint is, from its safetensors headers alone (no torch).

`detect_checkpoint(path)` reads the JSON header of a single .safetensors file (or of each file of a
folder of shards) and says, from the tensors' names and shapes:
- the layout: `bfl` (Black Forest Labs' original names, `double_blocks.N.img_attn.qkv.weight`, fused
  qkv), `comfy` (the same names under a prefix, `model.diffusion_model.` when saved from a whole
  ComfyUI checkpoint; any prefix is taken), or `diffusers` (`transformer_blocks.N.attn.to_q.weight`);
  for Wan 2.1, `native` (Wan-AI's and Comfy-Org's `blocks.N.self_attn.q.weight`, any prefix) or `diffusers`;
  for Qwen-Image, `diffusers` (ComfyUI's `qwen_image_bf16.safetensors` holds diffusers' own names under
  `model.diffusion_model.`; diffusers has no single-file converter for it, and none is needed);
- the family and variant (Flux dev has the guidance embedder, schnell has none; Wan by its width);
- the diffusers config the weights fit (block counts, width, heads from the qk-norm's width, text
  and pooled widths, input channels), which `jobs.runners.convert` writes beside the converted blocks.

A file that is none of these is refused with its name and what was found (a VAE, a text encoder,
or "no known family: 812 tensors, first keys ..."). The worker runs this at submit (preflight), so
such a file fails with exit 2 before a job starts; the job runs it again (setup_failed).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jobs.runners.errors import CheckpointError
from jobs.runners.folders import safetensors_header

__all__ = ["CheckpointError", "Detected", "TensorInfo", "detect_checkpoint", "checkpoint_files", "FIELD"]

FIELD = "model.transformer"
BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4, "I16": 2,
         "I8": 1, "U8": 1, "BOOL": 1}

# (family, layout): a key that only that layout of that family has, as the block-0 tensor it is.
MARKERS = {("flux", "bfl"): "double_blocks.0.img_attn.qkv.weight",
           ("flux", "diffusers"): "single_transformer_blocks.0.attn.to_q.weight",
           ("wan", "native"): "blocks.0.self_attn.q.weight",  # Wan-AI's and Comfy-Org's repackaged files
           ("wan", "diffusers"): "blocks.0.attn1.to_q.weight",
           # ComfyUI's qwen_image_*.safetensors hold diffusers' own names (under model.diffusion_model.)
           ("qwen-image", "diffusers"): "transformer_blocks.0.img_mlp.net.0.proj.weight"}
# What a refused file is, when it is not a transformer at all: (key suffix, what it is)
NOT_A_TRANSFORMER = [("decoder.conv_in.weight", "a VAE (encoder/decoder tensors)"),
                     ("text_model.encoder.layers.0.self_attn.q_proj.weight", "a CLIP text encoder"),
                     ("encoder.block.0.layer.0.SelfAttention.q.weight", "a T5 text encoder"),
                     ("transformer_blocks.0.img_mlp.gate_up.weight", "a Qwen-Image 2.1 transformer (not supported "
                                                                      "as a file yet)")]
# A real Flux head is 128 wide; its rotary axes then split it 16 + 56 + 56.
FLUX_ROPE = {128: [16, 56, 56]}


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: str  # safetensors' code: BF16, F32, F8_E4M3, ...
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = BYTES.get(self.dtype, 0)
        for s in self.shape:
            n *= s
        return n


@dataclass
class Detected:
    path: Path
    files: list[Path]
    family: str
    layout: str  # Flux: bfl, comfy (bfl names under a prefix) or diffusers; Wan: native or diffusers
    prefix: str
    variant: str  # dev or schnell (Flux)
    config: dict[str, Any]  # the diffusers config keys the weights decide
    width: int = 0  # the model's hidden size (Wan's head count is not in its tensors: the base's config says it)
    tensors: dict[str, TensorInfo] = field(default_factory=dict)  # the transformer's, by their names in the file
    ignored: int = 0  # tensors outside the prefix (a whole checkpoint's VAE and text encoders)

    @property
    def weight_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    @property
    def dtypes(self) -> list[str]:
        return sorted({t.dtype for t in self.tensors.values()})

    @property
    def fp8(self) -> str | None:
        """None, "plain" (float8 weights as they are) or "scaled" (ComfyUI's, a `scale_weight` per weight)."""
        if not any(t.dtype.startswith("F8") for t in self.tensors.values()):
            return None
        return "scaled" if any(k.endswith(".scale_weight") for k in self.tensors) else "plain"

    def names(self) -> dict[str, TensorInfo]:
        """The tensors by their names without the prefix."""
        n = len(self.prefix)
        return {k[n:]: t for k, t in self.tensors.items()}

    def describe(self) -> str:
        c = self.config
        blocks = f"{c['num_layers']}" + (f"+{c['num_single_layers']}" if "num_single_layers" in c else "")
        return (f"{self.family}{' ' + self.variant if self.variant else ''}, {self.layout} layout" + (f" (prefix {self.prefix!r})" if self.prefix else "")
                + f", {blocks} blocks, width {self.width}, {'/'.join(self.dtypes)}" + (f" ({self.fp8} fp8)" if self.fp8 else "")
                + f", {self.weight_bytes / 1e9:.2f} GB")


def checkpoint_files(path: Path) -> list[Path]:
    """A .safetensors file, or the shards of a folder (its *.safetensors.index.json, else every .safetensors)."""
    if path.is_file():
        if not path.name.endswith(".safetensors"):
            raise CheckpointError(f"{FIELD}: {path} is not a .safetensors file (only safetensors checkpoints are read)")
        return [path]
    if not path.is_dir():
        raise CheckpointError(f"{FIELD}: {path} not found")
    for index in sorted(path.glob("*.safetensors.index.json")):
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map") or {}
        except (OSError, ValueError, AttributeError) as exc:
            raise CheckpointError(f"{FIELD}: {index} is not a readable index ({exc})") from None
        files = [path / f for f in dict.fromkeys(weight_map.values())]
        missing = [f for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{FIELD}: {missing[0]} is listed in {index.name} but missing")
        if files:
            return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{FIELD}: {path} holds no .safetensors files")
    return files


def _read(files: list[Path]) -> dict[str, TensorInfo]:
    out: dict[str, TensorInfo] = {}
    for f in files:
        for name, info in safetensors_header(f, FIELD, CheckpointError).items():
            if name == "__metadata__":
                continue
            if name in out:
                raise CheckpointError(f"{FIELD}: tensor {name} is in both {out[name].file} and {f}")
            out[name] = TensorInfo(f, str(info.get("dtype")), tuple(int(s) for s in info.get("shape") or ()))
    return out


def _prefix_of(keys: list[str], marker: str) -> str | None:
    for k in keys:
        if k.endswith(marker) and (len(k) == len(marker) or k[-len(marker) - 1] == "."):
            return k[: len(k) - len(marker)]
    return None


def _shape(names: dict[str, TensorInfo], key: str, where: Path) -> tuple[int, ...]:
    if key not in names:
        raise CheckpointError(f"{FIELD}: {where} looks like a Flux transformer but has no {key} "
                              "(a Flux variant offload-jobs does not know?)")
    return names[key].shape


def _count(names: dict[str, TensorInfo], block: str) -> int:
    found = {int(m.group(1)) for k in names if (m := re.match(rf"{re.escape(block)}\.(\d+)\.", k))}
    if found and found != set(range(len(found))):
        raise CheckpointError(f"{FIELD}: {block} numbered {sorted(found)[:8]}...: some blocks are missing")
    return len(found)


def _flux_config(names: dict[str, TensorInfo], layout: str, where: Path) -> dict[str, Any]:
    if layout == "bfl":
        keys = dict(img="img_in.weight", txt="txt_in.weight", vec="vector_in.in_layer.weight",
                    head="double_blocks.0.img_attn.norm.query_norm.scale", out="final_layer.linear.weight",
                    guidance="guidance_in.in_layer.weight", double="double_blocks", single="single_blocks")
    else:
        keys = dict(img="x_embedder.weight", txt="context_embedder.weight",
                    vec="time_text_embed.text_embedder.linear_1.weight", head="transformer_blocks.0.attn.norm_q.weight",
                    out="proj_out.weight", guidance="time_text_embed.guidance_embedder.linear_1.weight",
                    double="transformer_blocks", single="single_transformer_blocks")
    hidden, in_channels = _shape(names, keys["img"], where)
    head_dim = _shape(names, keys["head"], where)[0]
    if head_dim <= 0 or hidden % head_dim:
        raise CheckpointError(f"{FIELD}: {where}: width {hidden} is not a whole number of {head_dim}-wide heads")
    config: dict[str, Any] = {
        "in_channels": in_channels, "num_layers": _count(names, keys["double"]),
        "num_single_layers": _count(names, keys["single"]), "attention_head_dim": head_dim,
        "num_attention_heads": hidden // head_dim, "joint_attention_dim": _shape(names, keys["txt"], where)[1],
        "pooled_projection_dim": _shape(names, keys["vec"], where)[1], "guidance_embeds": keys["guidance"] in names}
    out = _shape(names, keys["out"], where)[0]
    config["out_channels"] = None if out == in_channels else out
    if layout == "bfl" and config["num_single_layers"]:
        rows = _shape(names, "single_blocks.0.linear1.weight", where)[0]
        if rows != 7 * hidden:  # q, k, v and an MLP 4x the width, as diffusers' FluxSingleTransformerBlock has
            raise CheckpointError(f"{FIELD}: {where}: single_blocks.0.linear1 has {rows} rows; a Flux block of "
                                  f"width {hidden} has {7 * hidden} (an unknown MLP ratio)")
    return config


def _wan_config(names: dict[str, TensorInfo], layout: str, where: Path) -> dict[str, Any]:
    native = layout == "native"
    keys = dict(text="text_embedding.0.weight", time="time_embedding.0.weight", ffn="blocks.0.ffn.0.weight",
                out="head.head.weight", norm="blocks.0.norm3.weight", qk="blocks.0.self_attn.norm_q.weight",
                img="img_emb.proj.1.weight") if native else dict(
        text="condition_embedder.text_embedder.linear_1.weight", time="condition_embedder.time_embedder.linear_1.weight",
        ffn="blocks.0.ffn.net.0.proj.weight", out="proj_out.weight", norm="blocks.0.norm2.weight",
        qk="blocks.0.attn1.norm_q.weight", img="condition_embedder.image_embedder.ff.net.0.proj.weight")
    if keys["img"] in names:
        raise CheckpointError(f"{FIELD}: {where} is a Wan image-to-video transformer; only text-to-video files "
                              "are read yet")
    patch = _shape(names, "patch_embedding.weight", where)
    if len(patch) != 5:
        raise CheckpointError(f"{FIELD}: {where}: patch_embedding.weight has shape {list(patch)}, not a 3-D conv's")
    cells = patch[2] * patch[3] * patch[4]
    return {"in_channels": patch[1], "patch_size": list(patch[2:]), "num_layers": _count(names, "blocks"),
            "out_channels": _shape(names, keys["out"], where)[0] // cells, "text_dim": _shape(names, keys["text"], where)[1],
            "freq_dim": _shape(names, keys["time"], where)[1], "ffn_dim": _shape(names, keys["ffn"], where)[0],
            "cross_attn_norm": keys["norm"] in names, "qk_norm": "rms_norm_across_heads" if keys["qk"] in names else None}


def _qwen_config(names: dict[str, TensorInfo], where: Path) -> dict[str, Any]:
    """Qwen-Image's dimensions; the patch size (and so out_channels) and the rotary axes come from the base."""
    hidden, in_channels = _shape(names, "img_in.weight", where)
    head_dim = _shape(names, "transformer_blocks.0.attn.norm_q.weight", where)[0]
    if head_dim <= 0 or hidden % head_dim:
        raise CheckpointError(f"{FIELD}: {where}: width {hidden} is not a whole number of {head_dim}-wide heads")
    _shape(names, "proj_out.weight", where)
    return {"in_channels": in_channels, "num_layers": _count(names, "transformer_blocks"), "attention_head_dim": head_dim,
            "num_attention_heads": hidden // head_dim, "joint_attention_dim": _shape(names, "txt_in.weight", where)[1],
            "guidance_embeds": any(k.startswith("time_text_embed.guidance_embedder.") for k in names)}


def _refuse_unknown(path: Path, tensors: dict[str, TensorInfo]) -> None:
    keys = list(tensors)
    for suffix, what in NOT_A_TRANSFORMER:
        if any(k.endswith(suffix) for k in keys):
            raise CheckpointError(f"{FIELD}: {path} is {what}, not a transformer of a family offload-jobs reads "
                                  f"({len(keys)} tensors, first keys {', '.join(sorted(keys)[:3])})")
    raise CheckpointError(f"{FIELD}: {path}: no known family: {len(keys)} tensors, first keys "
                          f"{', '.join(sorted(keys)[:4]) or '(none)'}")


def detect_checkpoint(path: str | Path) -> Detected:
    """The family, layout and config of the transformer checkpoint at `path` (headers only)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise CheckpointError(f"{FIELD}: {p} not found")
    files = checkpoint_files(p)
    tensors = _read(files)
    keys = list(tensors)
    for (family, layout), marker in MARKERS.items():
        prefix = _prefix_of(keys, marker)
        if prefix is None:
            continue
        mine = {k: t for k, t in tensors.items() if k.startswith(prefix)}
        names = {k[len(prefix):]: t for k, t in mine.items()}
        if family == "wan":
            config = _wan_config(names, layout, p)
            width = names["patch_embedding.weight"].shape[0]
            variant = f"t2v {'14B' if width >= 5120 else '1.3B' if width == 1536 else f'width {width}'}"
            return Detected(p, files, family, layout, prefix, variant, config, width, mine, len(tensors) - len(mine))
        if family == "qwen-image":
            config = _qwen_config(names, p)
            width = config["attention_head_dim"] * config["num_attention_heads"]
            return Detected(p, files, family, layout, prefix, "", config, width, mine, len(tensors) - len(mine))
        config = _flux_config(names, layout, p)
        shown = "comfy" if layout == "bfl" and prefix else layout
        return Detected(p, files, family, shown, prefix, "dev" if config["guidance_embeds"] else "schnell", config,
                        config["attention_head_dim"] * config["num_attention_heads"], mine, ignored=len(tensors) - len(mine))
    _refuse_unknown(p, tensors)
    raise AssertionError("unreachable")  # pragma: no cover
