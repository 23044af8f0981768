"""A `model.transformer` checkpoint converted once into a diffusers transformer folder, block by block.

    <model cache>/converted/<key>/      config.json, diffusion_pytorch_model.safetensors.index.json,
                                        one safetensors file per block, cache.json (the marker, last)

The normal loader (jobs.runners.load: the engine's arena, or the disk tier's shards) then reads the
folder as it reads any diffusers transformer. The names are diffusers' own converters'
(`diffusers.loaders.single_file_utils`: `convert_wan_transformer_to_diffusers`, names only, takes
each block as it is; `convert_flux_transformer_checkpoint_to_diffusers`, below), applied to one
block at a time. For Flux: the block's tensors are read from the file (pread, page cache dropped:
`offload_core.disk.source`), renamed to block 0, and passed with meta-device stand-ins for the
other tensors the converter pops; what comes back real is the block, renamed back and written to its
own file. Host RAM holds one block (and the converter's copy of it), never the model. The fused
tensors (BFL's qkv, linear1) are split on the way; the converter's one hard-coded width (Flux-dev's
`inner_dim = 3072`, used to split `linear1`) is replaced by the detected width. The file's dtype is
kept. The written names must be exactly the diffusers model's (built on meta from the config):
a tensor the converter passed through unknown, or one missing, is refused naming it. The key is
content-addressed as the shard cache's is (each file's path, size, mtime and tensor headers, the
config and the diffusers version); the lock, the `.partial` folder and the marker are that cache's.

A job says what it did in events.jsonl: `runner.convert` (hit or miss, seconds, the entry).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from jobs.contract import Metric
from jobs.runners.errors import CheckpointError
from jobs.runners.shard_cache import is_complete, locked, publish_entry
from jobs.runners.single_file import FIELD, FLUX_ROPE, Detected

__all__ = ["ConvertedTransformer", "converted_transformer", "converted_root", "transformer_config", "convert_key",
           "flux_converter", "transformer_folder", "shard_source"]

CONVERTER_VERSION = 1  # bump when the written folder changes for the same input
INDEX = "diffusion_pytorch_model.safetensors.index.json"
CLASSES = {"flux": "FluxTransformer2DModel", "wan": "WanTransformer3DModel", "qwen-image": "QwenImageTransformer2DModel"}
# BFL block lists -> diffusers': the unit of conversion is one block of either list
FLUX_BLOCKS = {"double_blocks": "transformer_blocks", "single_blocks": "single_transformer_blocks"}
WAN_HEAD_DIM = 128  # every released Wan 2.1 (1.3B: 12 heads, 14B: 40); its files do not say


def _blocks(det: Detected) -> dict[str, str]:
    """The file's block lists -> the diffusers model's."""
    if det.family == "wan":
        return {"blocks": "blocks"}
    if det.family == "qwen-image":
        return {"transformer_blocks": "transformer_blocks"}
    return FLUX_BLOCKS if det.layout != "diffusers" else {v: v for v in FLUX_BLOCKS.values()}


def converted_root(model_cache: Path) -> Path:
    return model_cache / "converted"


@dataclass
class ConvertedTransformer:
    path: Path
    key: str
    hit: bool
    seconds: float = 0.0
    written_bytes: int = 0
    source: str = ""
    layout: str = ""

    def event(self) -> dict[str, Any]:
        return {"result": "hit" if self.hit else "miss", Metric.seconds: round(self.seconds, 3), "path": str(self.path),
                "key": self.key, "source": self.source, "layout": self.layout, "written_bytes": self.written_bytes}


def transformer_config(det: Detected, base_dir: Path | None) -> dict[str, Any]:
    """The config.json of the converted transformer: the base's (when it has one) with every
    dimension the weights decide taken from the weights."""
    base: dict[str, Any] = {}
    conf = base_dir / "transformer" / "config.json" if base_dir is not None else None
    if conf is not None and conf.is_file():
        base = json.loads(conf.read_text(encoding="utf-8"))
        if base.get("_class_name") not in (None, CLASSES[det.family]):
            raise CheckpointError(f"{FIELD}: {det.path} is a {det.family} transformer; the base's {conf} is a "
                                  f"{base.get('_class_name')}")
    config = {**base, "_class_name": CLASSES[det.family], **det.config}
    if det.family == "wan":
        head = base.get("attention_head_dim")
        if not head or det.width % head:
            head = WAN_HEAD_DIM if det.width % WAN_HEAD_DIM == 0 else None
        if head is None:
            raise CheckpointError(f"{FIELD}: {det.path} is {det.width} wide, not a whole number of {WAN_HEAD_DIM}-wide "
                                  "heads: give a model.base whose transformer/config.json has its attention_head_dim")
        config.update(attention_head_dim=head, num_attention_heads=det.width // head)
        return config
    if det.family == "qwen-image":  # proj_out is patch x patch x out_channels rows; the patch is the base's
        patch = int(config.get("patch_size") or 2)
        config.update(patch_size=patch, out_channels=det.names()["proj_out.weight"].shape[0] // (patch * patch))
    head = config["attention_head_dim"]
    rope = base.get("axes_dims_rope")
    if not rope or sum(rope) != head:
        rope = FLUX_ROPE.get(head)
        if rope is None:
            raise CheckpointError(f"{FIELD}: {det.path} has {head}-wide heads; its rotary axes (axes_dims_rope) are "
                                  "not in the file: give a model.base whose transformer/config.json has them")
    config["axes_dims_rope"] = list(rope)
    config.setdefault("patch_size", 1)
    return config


def convert_key(det: Detected, config: dict[str, Any]) -> str:
    import diffusers

    h = hashlib.sha256()
    h.update(json.dumps({"converter": CONVERTER_VERSION, "diffusers": diffusers.__version__, "prefix": det.prefix,
                         "config": config}, sort_keys=True).encode())
    for f in det.files:
        real = f.resolve()
        st = real.stat()
        h.update(json.dumps([str(real), st.st_size, st.st_mtime_ns]).encode())
    h.update(json.dumps(sorted((k, t.dtype, t.shape) for k, t in det.tensors.items())).encode())
    return h.hexdigest()[:32]


@functools.lru_cache(maxsize=8)
def flux_converter(inner_dim: int) -> Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """diffusers' Flux converter with its Flux-dev width (`inner_dim = 3072`, which splits each single
    block's fused linear1) replaced by `inner_dim`; the code is otherwise diffusers' own."""
    from diffusers.loaders import single_file_utils as sfu

    fn = sfu.convert_flux_transformer_checkpoint_to_diffusers
    source = inspect.getsource(fn)
    fixed = re.findall(r"^\s*inner_dim = (\d+)\s*$", source, flags=re.M)
    if inner_dim == 3072 or not fixed:
        return fn  # Flux-dev's width, or a diffusers that no longer hard-codes it
    if len(fixed) != 1:
        raise RuntimeError(f"diffusers {sfu.__name__}: expected one hard-coded inner_dim, found {fixed}")
    patched = re.sub(r"^(\s*)inner_dim = \d+\s*$", rf"\g<1>inner_dim = {int(inner_dim)}", source, flags=re.M)
    namespace = dict(fn.__globals__)
    exec(compile(patched, inspect.getsourcefile(fn) or "<diffusers>", "exec"), namespace)  # noqa: S102 - diffusers' own code
    return namespace[fn.__name__]


def _pieces(names: list[str], blocks: dict[str, str]) -> Iterator[tuple[str, int | None, list[str]]]:
    """(block list, index, names) for each block, then (``""``, None, the rest)."""
    by_block: dict[tuple[str, int], list[str]] = {}
    rest = []
    for n in names:
        m = re.match(r"(\w+)\.(\d+)\.", n)
        if m and m.group(1) in blocks:
            by_block.setdefault((m.group(1), int(m.group(2))), []).append(n)
        else:
            rest.append(n)
    for (lst, i), keys in sorted(by_block.items()):
        yield lst, i, keys
    yield "", None, rest


def _flux_piece(det: Detected, read: Callable[[str], torch.Tensor], lst: str, index: int | None,
                keys: list[str], convert: Callable[..., dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One block (or the tensors outside the blocks) through diffusers' converter."""
    names = det.names()
    state: dict[str, torch.Tensor] = {}
    for n, t in names.items():  # stand-ins: block 0 of each list and the non-block tensors, on meta
        m = re.match(r"(\w+)\.(\d+)\.", n)
        if m and (m.group(1) not in FLUX_BLOCKS or m.group(2) != "0"):
            continue
        state[n] = torch.empty(t.shape, dtype=_dtype(t.dtype), device="meta")
    original = {}
    for n in keys:  # the real tensors, as block 0
        as0 = re.sub(rf"^{lst}\.\d+\.", f"{lst}.0.", n) if lst else n
        state[as0], original[as0] = read(det.prefix + n), det.prefix + n
    out = convert(state)  # pops what it converts
    left = [original.get(k, k) for k, v in state.items() if not v.is_meta]
    if left:  # never dropped without a word
        raise CheckpointError(f"{FIELD}: {det.path}: diffusers' converter does not know {len(left)} tensor(s) of "
                              f"{lst or 'the non-block part'}: {', '.join(left[:3])}")
    mine = {}
    for k, v in out.items():
        if v.is_meta:
            continue
        if lst:
            k = re.sub(rf"^{FLUX_BLOCKS[lst]}\.0\.", f"{FLUX_BLOCKS[lst]}.{index}.", k)
        mine[k] = v.contiguous()
    return mine


_ST = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
       "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
       "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


def _dtype(code: str) -> torch.dtype:
    return _ST[code]


# ComfyUI's scaled fp8: `X.scale_weight` (one fp32 per weight) beside `X.weight`, `X.scale_input` (for
# fp8 matmuls, which widening does not do) and a top-level `scaled_fp8` marker
SCALE = ".scale_weight"
DROPPED = (".scale_input",)


def _split_scales(keys: list[str], read: Callable[[str], torch.Tensor],
                  prefix: str) -> tuple[list[str], dict[str, torch.Tensor]]:
    """The piece's tensor names without the fp8 scale bookkeeping, and the scales by their weight's name."""
    scales = {k.removesuffix(SCALE) + ".weight": read(prefix + k).float().reshape(()) for k in keys if k.endswith(SCALE)}
    rest = [k for k in keys if not k.endswith((SCALE, *DROPPED)) and k != "scaled_fp8"]
    return rest, scales


def _flux_sources(det: Detected, lst: str, index: int | None, keys: list[str],
                  convert: Callable[..., dict[str, torch.Tensor]]) -> dict[str, str]:
    """Which file tensor each converted tensor of the piece comes from (by name): the converter run
    once more on (rows, 1) tensors holding each input's number, so a split or a swap of halves (all
    along dim 0) keeps it; what comes out says where it came from, at a few bytes a row."""
    numbered = {n: i for i, n in enumerate(keys)}
    tag = {n: torch.full((det.names()[n].shape[0], 1), float(i)) for n, i in numbered.items()}
    out = _flux_piece(det, lambda name: tag[name[len(det.prefix):]], lst, index, keys, convert)
    sources = {}
    for k, v in out.items():
        lo, hi = int(v.min()), int(v.max())
        if lo != hi:  # a tensor made of two of the file's: no one scale for it
            raise CheckpointError(f"{FIELD}: {det.path}: {k} is made of {keys[lo]} and {keys[hi]}, which have "
                                  "separate fp8 scales")
        sources[k] = keys[lo]
    return sources


def _apply_scales(tensors: dict[str, torch.Tensor], scales: dict[str, torch.Tensor], sources: dict[str, str],
                  in_block: bool) -> dict[str, torch.Tensor]:
    """A block's fp8 weights kept as stored, each with its `scale_weight` (the loader hands it to the
    engine, which widens them where they compute); the other scaled weights (embedders, the output
    layer: a few MB) widened here, `w8 * scale` in fp32 as the engine widens."""
    out = {}
    for k, v in tensors.items():
        scale = scales.get(sources.get(k, k)) if k.endswith(".weight") else None
        if scale is None:
            out[k] = v
        elif in_block:
            out[k], out[k.removesuffix(".weight") + SCALE] = v, scale.clone()
        else:
            out[k] = v.float() * scale
    return out


def _check_names(det: Detected, config: dict[str, Any], written: set[str]) -> None:
    """The converted names are exactly the diffusers model's (built on meta from `config`)."""
    import accelerate
    import diffusers

    cls = getattr(diffusers, config["_class_name"])
    with accelerate.init_empty_weights():
        model = cls.from_config({k: v for k, v in config.items() if not k.startswith("_")})
    want = set(model.state_dict())
    scales = {k for k in written if k.endswith(SCALE) and k.removesuffix(SCALE) + ".weight" in want}
    missing, unknown = sorted(want - written), sorted(written - want - scales)
    if missing or unknown:
        what = (f"lacks {len(missing)} tensor(s) the model has ({', '.join(missing[:3])})" if missing else
                f"holds {len(unknown)} tensor(s) the model has not ({', '.join(unknown[:3])})")
        raise CheckpointError(f"{FIELD}: {det.path} ({det.describe()}), converted to diffusers' names, {what}")


def _write(det: Detected, partial: Path, config: dict[str, Any], say: Callable[[str], None]) -> int:
    """Every block converted and written into `partial`; returns the bytes written."""
    import diffusers
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers
    from safetensors.torch import save_file

    from offload_core.disk.source import SafetensorsSource
    from offload_core.errors import OffloadError

    names = list(det.names())
    blocks = _blocks(det)
    convert = flux_converter(det.width) if det.family == "flux" else None
    weight_map: dict[str, str] = {}
    total = 0
    pieces = list(_pieces(names, blocks))
    src = SafetensorsSource(det.files)
    try:
        for done, (lst, index, keys) in enumerate(pieces, 1):
            keys, scales = _split_scales(keys, src.read, det.prefix)
            sources: dict[str, str] = {}
            if convert is not None and det.layout != "diffusers":
                tensors = _flux_piece(det, src.read, lst, index, keys, convert)
                if scales:
                    sources = _flux_sources(det, lst, index, keys, convert)
            elif det.layout == "native":  # Wan: names only, so the converter takes any part of the model
                tensors = convert_wan_transformer_to_diffusers({n: src.read(det.prefix + n) for n in keys})
                scales = convert_wan_transformer_to_diffusers(scales)  # the weights' new names
            else:
                tensors = {n: src.read(det.prefix + n) for n in keys}
            if scales:
                tensors = _apply_scales(tensors, scales, sources, in_block=bool(lst))
            fname = f"{done:05d}-{(blocks[lst] + '.' + str(index)) if lst else 'non_block'}.safetensors"
            save_file(tensors, str(partial / fname), metadata={"format": "pt"})
            for k, v in tensors.items():
                weight_map[k] = fname
                total += v.numel() * v.element_size()
            del tensors
            if done == len(pieces) or done % max(1, len(pieces) // 10) == 0:
                say(f"  converted {done}/{len(pieces)} blocks")
    except CheckpointError:
        raise
    except OffloadError as exc:  # a file cut short after its header was read, an I/O error: named
        raise CheckpointError(f"{FIELD}: {exc}") from None
    except (KeyError, ValueError, RuntimeError) as exc:  # the converter met a tensor it did not expect
        raise CheckpointError(f"{FIELD}: {det.path}: diffusers' {det.family} converter failed ({type(exc).__name__}: "
                              f"{exc})") from None
    finally:
        src.close()
    _check_names(det, config, set(weight_map))
    (partial / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (partial / "config.json").write_text(json.dumps({**config, "_diffusers_version": diffusers.__version__}, indent=2))
    return total


def converted_transformer(det: Detected, base_dir: Path | None, root: Path,
                          say: Callable[[str], None] = print) -> ConvertedTransformer:
    """The diffusers transformer folder of the checkpoint `det`, from the cache under `root`, or converted now (once)."""
    if det.family not in CLASSES:
        raise CheckpointError(f"{FIELD}: {det.path}: converting {det.family} files is not supported yet")
    config = transformer_config(det, base_dir)
    key = convert_key(det, config)
    entry = root / key
    out = ConvertedTransformer(entry, key, hit=True, source=str(det.path), layout=det.layout)
    if is_complete(entry, key, INDEX):
        return out
    root.mkdir(parents=True, exist_ok=True)
    with locked(root / f"{key}.lock"):
        if is_complete(entry, key, INDEX):  # another job converted it while this one waited
            return out
        out.hit = False
        if entry.exists():
            shutil.rmtree(entry)  # never trusted without its marker
        partial = root / f"{key}.partial"
        shutil.rmtree(partial, ignore_errors=True)  # a conversion killed half-way: started again
        partial.mkdir()
        free = shutil.disk_usage(root).free
        if free < det.weight_bytes:
            raise CheckpointError(f"{FIELD}: converting {det.path} needs {det.weight_bytes / 2**30:.1f} GiB in {root}, "
                                  f"which has {free / 2**30:.1f} GiB free; free space or set OFFLOAD_JOBS_MODEL_CACHE")
        say(f"converting {det.path} ({det.describe()}) into the model cache, once: {entry}")
        t0 = time.monotonic()
        try:
            out.written_bytes = _write(det, partial, config, say)
        except CheckpointError:
            shutil.rmtree(partial, ignore_errors=True)  # the user's file is at fault: keep no half of it
            raise
        files = [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in det.files]  # `models` reads them
        publish_entry(partial, entry, {"key": key, "source": str(det.path), "layout": det.layout, "files": files,
                                       "bytes": out.written_bytes, "created": time.time()})
        out.seconds = time.monotonic() - t0
    return out


def _say(line: str) -> None:
    print(f"[offload-jobs] {line}", flush=True)


def transformer_folder(model_dir: Path, transformer: Path | None, run_dir: Path,
                       say: Callable[[str], None] = _say) -> Path:
    """Where a job's transformer is: `model_dir`'s transformer/, the `model.transformer` folder as it
    is (a diffusers folder with its config.json), or its conversion in the model cache (an event
    `runner.convert`: hit or miss, with the seconds it took)."""
    if transformer is None:
        return Path(model_dir) / "transformer"
    from jobs.home import model_cache
    from jobs.runners.single_file import detect_checkpoint
    from jobs.runners.telemetry import emit_event

    det = detect_checkpoint(transformer)
    if det.layout == "diffusers" and not det.prefix and transformer.is_dir() and (transformer / "config.json").is_file():
        return transformer
    got = converted_transformer(det, Path(model_dir), converted_root(model_cache(Path(run_dir).parent.parent)), say)
    emit_event(run_dir, "convert", **got.event())
    return got.path


def shard_source(src: Path, base: Path | None, model_cache: Path, say: Callable[[str], None] = _say) -> Path:
    """What `offload-jobs shard` (and a shard job) reads for SRC: a BFL/ComfyUI (or prefixed) transformer
    checkpoint converted into the model cache first; any other source as it is (the sharder judges it)."""
    from jobs.runners.single_file import detect_checkpoint

    try:
        det = detect_checkpoint(src)
    except CheckpointError:
        return src  # not a transformer of a family we convert: sharded by its own names, as before
    if det.layout == "diffusers" and not det.prefix:
        return src
    return converted_transformer(det, base, converted_root(model_cache), say).path
