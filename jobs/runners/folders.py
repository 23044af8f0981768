"""What a job's folders and files are, read without torch (so bad input fails in a second).

- `detect_family`: the family of a diffusers folder, from model_index.json or transformer/config.json
- `read_lora_header` / `lora_family`: a LoRA's metadata and key names from its safetensors header,
  and the family it was made for (our header, else guessed from its key names)
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from jobs.runners.errors import FamilyError, LoraError, SetupError  # on the tree drawn in jobs.errors

__all__ = ["FamilyError", "LoraError", "SetupError", "FAMILY_CLASSES", "detect_family", "safetensors_header",
           "read_lora_header", "lora_family"]

# family -> (pipeline class, transformer class): the names model_index.json and config.json use
FAMILY_CLASSES = {"flux": ("FluxPipeline", "FluxTransformer2DModel"),
                  "qwen-image": ("QwenImagePipeline", "QwenImageTransformer2DModel"),
                  "wan": ("WanPipeline", "WanTransformer3DModel"),
                  "sd3": ("StableDiffusion3Pipeline", "SD3Transformer2DModel")}
_BY_PIPELINE = {p: f for f, (p, _) in FAMILY_CLASSES.items()}
_BY_TRANSFORMER = {t: f for f, (_, t) in FAMILY_CLASSES.items()}


def detect_family(model_dir: str | Path, expected: str | None = None, field: str = "model.path") -> str:
    """The family of a diffusers folder, from model_index.json (or transformer/config.json).

    Raises FamilyError naming the folder when it is not a diffusers folder, is of a family we do
    not train, or is of another family than `expected`.
    """
    root = Path(model_dir).expanduser()
    if not root.is_dir():
        raise FamilyError(f"{field}: {root} is not a folder (a diffusers model folder is expected)")
    found: str | None = None
    index = root / "model_index.json"
    tconf = root / "transformer" / "config.json"
    try:
        if index.is_file():
            cls = json.loads(index.read_text(encoding="utf-8")).get("_class_name", "")
            found = _BY_PIPELINE.get(cls)
            what = f"a {cls or 'unnamed'} folder"
        elif tconf.is_file():
            cls = json.loads(tconf.read_text(encoding="utf-8")).get("_class_name", "")
            found = _BY_TRANSFORMER.get(cls)
            what = f"a folder whose transformer is a {cls or 'unnamed'}"
        else:
            raise FamilyError(f"{field}: {root} has no model_index.json (a diffusers model folder is expected)")
    except (OSError, ValueError) as exc:
        raise FamilyError(f"{field}: cannot read {index if index.exists() else tconf}: {exc}") from None
    if found is None:
        raise FamilyError(f"{field}: {root} is {what}; supported families: {', '.join(FAMILY_CLASSES)}")
    if expected is not None and expected != found:
        raise FamilyError(f"model.family: the spec says {expected}, but {root} is a {found} model ({what})")
    return found


def safetensors_header(path: str | Path, field: str, error: type[Exception] = LoraError) -> dict[str, dict]:
    """The JSON header of a .safetensors file (``__metadata__`` included), read alone; `error` names `field`.

    Every tensor's ``data_offsets`` are checked as offload_core's reader checks them: two integers,
    0 <= start <= end, inside the file (else the file is truncated), no two tensors sharing bytes.
    """
    p = Path(path)
    try:
        size = p.stat().st_size
        with open(p, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > min(100 << 20, size - 8):
                raise ValueError(f"header of {n} bytes")
            header = json.loads(f.read(n))
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
    except (OSError, ValueError, struct.error) as exc:
        raise error(f"{field}: {p} is not a readable .safetensors file ({exc})") from None
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        a, b = offsets if isinstance(offsets, list) and len(offsets) == 2 else (None, None)
        if not (type(a) is int and type(b) is int) or a < 0 or b < a:
            raise error(f"{field}: {p}: tensor {name}: data_offsets {offsets!r} are not two integers "
                        "0 <= start <= end (a damaged or hand-made header)")
        if 8 + n + b > size:
            raise error(f"{field}: {p}: tensor {name} ends at byte {8 + n + b}, the file has {size} (truncated)")
        spans.append((a, b, name))
    reach, holder = 0, ""
    for a, b, name in sorted(spans):
        if a < b and a < reach:
            raise error(f"{field}: {p}: tensor {name}: data_offsets overlap tensor {holder}'s")
        if a < b:
            reach, holder = b, name
    return header


def read_lora_header(path: str | Path) -> tuple[dict[str, str], list[str]]:
    """(metadata, tensor names) of a LoRA .safetensors file, from its JSON header alone."""
    header = dict(safetensors_header(path, "infer.lora"))
    meta = header.pop("__metadata__", None) or {}
    return {str(k): str(v) for k, v in meta.items()}, list(header)


def lora_family(path: str | Path) -> str | None:
    """The family a LoRA file was made for: from our header, else guessed from its key names."""
    meta, keys = read_lora_header(path)
    if meta.get("offload_jobs.family"):
        return meta["offload_jobs.family"]
    body = [k.split(".", 1)[1] if k.startswith(("transformer.", "diffusion_model.")) else k for k in keys]
    if any(k.startswith("single_transformer_blocks.") or "double_blocks" in k or "single_blocks" in k for k in body):
        return "flux"
    if any(k.startswith("blocks.") and (".self_attn." in k or ".cross_attn." in k or ".attn1." in k) for k in body):
        return "wan"
    if any(".img_mlp." in k or ".txt_mlp." in k or ".img_mod." in k for k in body):
        return "qwen-image"
    return None  # e.g. double blocks only: Flux and SD3 name them alike
