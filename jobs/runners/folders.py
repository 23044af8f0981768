"""What a job's folders and files are, read without torch (so bad input fails in a second).

- `detect_family`: the family of a diffusers folder, from model_index.json or transformer/config.json
- `read_lora_header` / `lora_family`: a LoRA's metadata and key names from its safetensors header,
  and the family it was made for (our header, else guessed from its key names)
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

from jobs.runners.errors import FamilyError, LoraError, SetupError  # on the tree drawn in jobs.errors

__all__ = ["FamilyError", "LoraError", "SetupError", "FAMILY_CLASSES", "detect_family", "safetensors_header",
           "read_lora_header", "lora_family", "lora_format", "lora_family_of_keys", "check_lora_family"]

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


# A LoRA file's format, from its key names (see jobs/runners/lora_formats.py for each one's names)
_FORMAT_PREFIXES = (("lora_unet_", "kohya"), ("diffusion_model.", "comfy"), ("transformer.", "diffusers"),
                    ("lora_transformer_", "kohya"))
# family -> a pattern over a key's module part, dots and underscores alike (kohya flattens the dots)
_FAMILY_KEYS = (("flux", re.compile(r"(double_blocks|single_blocks|single_transformer_blocks)_\d+_")),
                ("wan", re.compile(r"blocks_\d+_(self_attn|cross_attn|attn1|attn2|ffn)_")),
                ("qwen-image", re.compile(r"transformer_blocks_\d+_(img_mlp|txt_mlp|img_mod|txt_mod)_")))


def _module_part(key: str) -> str:
    for prefix, _ in _FORMAT_PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix):].replace(".", "_")
    return key.replace(".", "_")


def lora_format(keys: list[str]) -> str | None:
    """kohya (`lora_unet_...`, musubi-tuner too), comfy (`diffusion_model....`), diffusers (`transformer....`)."""
    for prefix, fmt in _FORMAT_PREFIXES:
        if any(k.startswith(prefix) for k in keys):
            return fmt
    return None


def lora_family_of_keys(keys: list[str]) -> tuple[str | None, str]:
    """(the family the keys name, one key that says so); (None, a key) when they could be several."""
    for family, pattern in _FAMILY_KEYS:
        for k in keys:
            body = _module_part(k)
            if pattern.match(body) and not (family == "wan" and body.startswith(("transformer_blocks", "single_"))):
                return family, k
    return None, keys[0] if keys else ""


def lora_family(path: str | Path) -> str | None:
    """The family a LoRA file was made for: from our header, else guessed from its key names."""
    meta, keys = read_lora_header(path)
    if meta.get("offload_jobs.family"):
        return meta["offload_jobs.family"]
    return lora_family_of_keys(keys)[0]  # None e.g. for double blocks only: Flux and SD3 name them alike


def check_lora_family(path: str | Path, family: str, where: str, model: str | Path) -> None:
    """Refuse a LoRA made for another family, naming the file, its format and a key that shows it."""
    meta, keys = read_lora_header(path)
    made_for = meta.get("offload_jobs.family")
    example = f"its header says offload_jobs.family={made_for}"
    if not made_for:
        made_for, key = lora_family_of_keys(keys)
        example = f"{lora_format(keys) or 'unknown'} names, e.g. {key}"
    if made_for is not None and made_for != family:
        raise LoraError(f"{where}: {path} is a {made_for} LoRA; {model} is a {family} model ({example})")
