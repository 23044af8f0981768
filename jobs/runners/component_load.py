"""Text encoders and VAEs from single files (`model.text_encoders`, `model.vae`), in place of the base's.

The module is the base's own: its class from the base's model_index.json and its config from the
base's folder (transformers' `_from_config`, diffusers' `from_config`), built with its parameters on
the meta device; then each tensor of the file is read on its own (safetensors' `safe_open`) and
assigned in place of the meta one, so host RAM holds the weights once. The names are taken as the
file has them, under any prefix (`text_model.` of older transformers' CLIP files is dropped; a
Qwen2.5-VL's names in either transformers spelling, component_names); a VAE in the BFL/LDM layout
(`ae.safetensors`) goes through diffusers' `convert_ldm_vae_checkpoint`, a Wan/Qwen-Image VAE in
Wan's native names through component_names' renaming (a VAE is small: whole). A tensor of another
shape than the base's (another size of the model) is refused naming it.

fp8 files (`t5xxl_fp8_e4m3fn`, ComfyUI's `..._fp8_e4m3fn_scaled` with a `scale_weight` per weight):
a T5/UMT5's block weights (a Qwen2.5-VL's decoder layers) stay fp8 as stored, each module given its `scale_weight`; the engine's
native-fp8 storage (offload_core.quant.adopt_native_fp8) streams them as they are and widens them
where they compute (`w8 * scale_weight` taken in fp32, rounded once to the job's dtype), on the CPU too:
component_offload always offloads such a module. Host RAM holds the fp8 bytes, not their widening.
The other fp8 tensors (embeddings, norms, a CLIP's weights) are widened to the job's dtype as they
are read, one at a time. The job's log says which, and the bytes held.

The dtypes are those `from_pretrained(dtype=...)` gives: every float tensor in the job's dtype,
except the class's keep-in-fp32 modules (transformers: for float16, or bfloat16 with `_strict`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable

import torch

from jobs.runners.component_files import Found, identify
from jobs.runners.component_names import QWEN_BLOCK_RE, qwen_spellings, wan_vae_to_diffusers
from jobs.runners.errors import CheckpointError

__all__ = ["load_part", "load_parts", "part_fingerprint", "widen_fp8", "holds_fp8"]

# tensors a file may carry that the module does not have: dropped without a word
_EXTRA = ("text_projection.weight", "logit_scale", "embeddings.position_ids", "scaled_fp8", "spiece_model")
FIELDS = {"vae": "model.vae"}


def _field(attr: str) -> str:
    return FIELDS.get(attr, "model.text_encoders")


FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
# an encoder's block lists, as the file names them: the units the engine streams, so fp8 weights there
# stay fp8 (the rest is widened)
BLOCK_RE = {"t5xxl": re.compile(r"^encoder\.block\.\d+\."), "umt5_xxl": re.compile(r"^encoder\.block\.\d+\."),
            "qwen_2.5_vl": QWEN_BLOCK_RE}
# the encoders whose fp8 files keep their block weights fp8: T5's, UMT5's and Qwen2.5-VL's (gigabytes).
# CLIP's read their position table's size from the weight before it runs, which the engine's placeholder hides
STREAMED_ROLES = tuple(BLOCK_RE)


def widen_fp8(state: dict[str, torch.Tensor], dtype: torch.dtype,
              keep: Callable[[str], bool] = lambda k: False) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], int]:
    """fp8 weights widened to `dtype` (times their `scale_weight`, where the file has one, in fp32), except those
    `keep(name)` holds, which stay as stored; the other tensors as they are. Returns the state, the
    scales of the weights kept in fp8 (by weight name), and the fp8 parameters the file held."""
    scales = {k.removesuffix("scale_weight") + "weight": state.pop(k) for k in [k for k in state if
                                                                                  k.endswith(".scale_weight")]}
    for k in [k for k in state if k.endswith((".scale_input", "scaled_fp8"))]:
        state.pop(k)  # the input scale is for fp8 matmuls, which widening does not do; the marker says "scaled"
    fp8, kept = 0, {}
    for k, t in state.items():
        if t.dtype in FP8:
            fp8 += t.numel()
            if keep(k):
                kept[k] = scales.get(k, torch.ones((), dtype=torch.float32)).float().reshape(())
                continue
            # as the engine widens (offload_core.quant): the product in fp32, rounded once to dtype
            state[k] = (t.float() * scales[k].float()).to(dtype) if k in scales else t.to(dtype)
    return state, kept, fp8


def _read(path: Path, prefix: str, field: str) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    try:
        with safe_open(str(path), framework="pt") as f:
            for k in f.keys():
                if k.startswith(prefix):
                    out[k[len(prefix):]] = f.get_tensor(k)
    except (OSError, RuntimeError, ValueError) as exc:  # a file cut short after its header: named
        raise CheckpointError(f"{field}: {path} cannot be read ({exc})") from None
    return out


def _class_of(model_dir: Path, attr: str) -> Any:
    index = json.loads((model_dir / "model_index.json").read_text(encoding="utf-8"))
    lib, name = index.get(attr) or (None, None)
    if lib not in ("transformers", "diffusers"):
        raise CheckpointError(f"{_field(attr)}: the base {model_dir} has no {attr} to take the file's config from")
    import importlib

    return importlib.import_module(lib), getattr(importlib.import_module(lib), name)


def _fp32_names(cls: Any, lib: str, dtype: torch.dtype) -> set[str]:
    if lib == "diffusers":
        return set(getattr(cls, "_keep_in_fp32_modules", None) or [])
    keep = set(getattr(cls, "_keep_in_fp32_modules", None) or []) if dtype == torch.float16 else set()
    if dtype in (torch.float16, torch.bfloat16):
        keep |= set(getattr(cls, "_keep_in_fp32_modules_strict", None) or [])
    return keep


def _build(model_dir: Path, attr: str, dtype: torch.dtype) -> tuple[torch.nn.Module, Any, str]:
    import accelerate

    lib, cls = _class_of(model_dir, attr)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # tables computed at init follow it, as from_pretrained's
    try:
        with accelerate.init_empty_weights():
            if lib.__name__ == "transformers":
                config = cls.config_class.from_pretrained(str(model_dir / attr))
                model = cls._from_config(config, dtype=dtype)
            else:
                model = cls.from_config(cls.load_config(str(model_dir / attr)))
    finally:
        torch.set_default_dtype(previous)
    return model, cls, lib.__name__


def _vae_state(found: Found, state: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from diffusers.loaders import single_file_utils as sfu

    if found.layout == "bfl":
        return sfu.convert_ldm_vae_checkpoint(state, dict(model.config))
    if found.layout == "native":
        return wan_vae_to_diffusers(state, dict(model.config))
    return state


def _module_name(k: str, want: dict[str, Any], role: str | None) -> str | None:
    """The module's name for the file's tensor `k`, or None: as written, without older transformers'
    `text_model.` (CLIP), or a Qwen2.5-VL name in the other transformers spelling."""
    names = qwen_spellings(k) if role == "qwen_2.5_vl" else (k, k.removeprefix("text_model."))
    return next((n for n in names if n in want), None)


def _qwen_unread(model: torch.nn.Module) -> list[str]:
    """What a Qwen2.5-VL file may leave out that the text-to-image pipeline does not need, settled:
    - `lm_head` (ComfyUI's model has none): the pipeline reads the hidden states, never the logits, so
      the head shares the token embedding's tensor (no bytes) rather than stay on the meta device;
    - the vision tower, or what the file lacks of it: run only for images in the prompt (Qwen-Image-Edit),
      which this pipeline never passes: left out of the module (a tower on the meta device could not be
      moved or offloaded).
    Returns what was settled, for the log."""
    said = []
    head = getattr(model, "lm_head", None)
    if head is not None and head.weight.is_meta:
        head.weight = model.get_input_embeddings().weight
        said.append("lm_head (shares the token embedding: its logits are not used)")
    inner = getattr(model, "model", model)
    tower = getattr(inner, "visual", None)
    if tower is not None and any(t.is_meta for t in tower.parameters()):
        some = sum(not t.is_meta for t in tower.parameters())
        inner.visual = None
        said.append(f"the vision tower ({f'{some} of its tensors read, ' if some else ''}for images in the prompt, "
                    "which this pipeline never passes)")
    return said


def load_part(path: Path, attr: str, model_dir: Path, dtype: torch.dtype,
              keep_fp8: bool = True) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The pipeline's `attr` (text_encoder, text_encoder_2 or vae) built from the base's config, with the
    file's weights; and what was loaded (for the job's log and events). An encoder's fp8 block weights
    stay fp8 (`keep_fp8`), each module given its `scale_weight`: the engine streams them as stored
    (jobs.runners.load.component_offload); `keep_fp8=False` widens every one at load."""
    found = identify(path)
    field = _field(attr)
    model, cls, lib = _build(model_dir, attr, dtype)
    state = _read(path, found.prefix, field)
    streams = keep_fp8 and found.role in STREAMED_ROLES
    keep = (lambda k: bool(BLOCK_RE[found.role].match(k))) if streams else (lambda k: False)
    state, kept, fp8 = widen_fp8(state, dtype, keep)
    if found.kind == "vae":
        state = _vae_state(found, state, model)
    want = model.state_dict()
    keep_fp32 = _fp32_names(cls, lib, dtype)
    named: dict[str, torch.Tensor] = {}
    unknown, misfit, names = [], [], {}
    for k in list(state):
        t = state.pop(k)  # one tensor at a time: the file's dict lets go of what the module takes
        name = _module_name(k, want, found.role)
        if name is None:
            if not k.endswith(_EXTRA):
                unknown.append(k)
            continue
        if tuple(t.shape) != tuple(want[name].shape):
            misfit.append(f"{k} {list(t.shape)} (the base's {list(want[name].shape)})")
            continue
        target = torch.float32 if any(m in name.split(".") for m in keep_fp32) else dtype
        named[name], names[k] = (t.to(target) if t.is_floating_point() and t.dtype not in FP8 else t), name
    if unknown:
        raise CheckpointError(f"{field}: {path} ({found.describe()}) holds {len(unknown)} tensor(s) the base's {attr} "
                              f"({cls.__name__}) has not: {', '.join(sorted(unknown)[:3])}")
    if misfit:  # another size of the model (a 3B encoder for a 7B base, Wan 2.2's VAE for 2.1's)
        raise CheckpointError(f"{field}: {path} ({found.describe()}) is another size than the base's {attr} "
                              f"({cls.__name__}): {len(misfit)} tensor(s) differ, {', '.join(misfit[:2])}")
    model.load_state_dict(named, strict=False, assign=True)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    settled = _qwen_unread(model) if found.role == "qwen_2.5_vl" else []
    empty = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if empty:
        raise CheckpointError(f"{field}: {path} ({found.describe()}) lacks {len(empty)} tensor(s) of the base's {attr} "
                              f"({cls.__name__}): {', '.join(empty[:3])}")
    for k, scale in kept.items():  # what the engine's adopt_native_fp8 reads: one scale per module
        name = names[k]
        model.get_submodule(name.rsplit(".", 1)[0]).register_buffer("scale_weight", scale)
    model.requires_grad_(False).eval()
    held = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return model, {"part": attr, "file": str(path), "role": found.role or "vae", "layout": found.layout,
                   "fp8": found.fp8, "fp8_params": fp8, "fp8_kept": sum(named[k].numel() for k in named
                                                                       if named[k].dtype in FP8),
                   "held_bytes": held, "left_out": settled}


def load_parts(parts: dict[str, Path], model_dir: Path, dtype: torch.dtype) -> tuple[dict[str, torch.nn.Module],
                                                                                      list[dict[str, Any]]]:
    """Each file of `parts` (pipeline attribute -> file) loaded; with a line of what each one is."""
    modules, said = {}, []
    for attr, path in parts.items():
        modules[attr], info = load_part(Path(path), attr, Path(model_dir), dtype)
        said.append(info)
    return modules, said


def part_fingerprint(parts: dict[str, Path], attrs: list[str]) -> str:
    """What the caches key on for the parts given as files: each file's path, size and mtime."""
    rows = []
    for attr in attrs:
        if attr in parts:
            st = Path(parts[attr]).stat()
            rows.append(f"{attr}={Path(parts[attr]).resolve()}:{st.st_size}:{st.st_mtime_ns}")
    return ";".join(rows)


def holds_fp8(module: torch.nn.Module) -> bool:
    """Whether `module` keeps fp8 weights as stored (they compute only through the engine, which widens them)."""
    return any(p.dtype in FP8 for p in module.parameters())
