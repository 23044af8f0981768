"""Loading a model folder's parts, and the offload around them.

`offload_config` is the one place a spec's offload settings become the engine's `OffloadConfig`.
`load_transformer` is the one place the transformer's weights come from. With the engine on, the transformer is built on the meta device exactly as diffusers'
`from_pretrained(torch_dtype=...)` builds it (`meta_transformer`), and the engine reads each tensor
of `transformer/*.safetensors` straight into its pinned arena (`weights=`), or streams it from
shards (`lazy_load`), so host RAM never holds the weights twice. Without the engine, or with
`offload_to_disk` (which writes shards from a model in RAM), it is `from_pretrained`. It reports
host RSS against the weight bytes.

`component_offload` runs a text encoder or the VAE on the device only while it is needed.
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from jobs.runners.families import FamilyAdapter
from jobs.spec import JobSpec

__all__ = ["resolve_device", "resolve_dtype", "apply_vram_cap", "offload_config", "load_transformer", "meta_transformer", "LoadedTransformer",
           "load_pipeline_parts", "component_offload", "free_host_memory", "module_bytes"]

VRAM_CAP_ENV = "OFFLOAD_JOBS_VRAM_CAP"


def resolve_device(target: str | None) -> torch.device:
    if target:
        device = torch.device(target)
        if device.type == "cuda" and not torch.cuda.is_available():
            from jobs.runners.errors import NoCuda

            build = f"torch {torch.__version__}" + ("" if torch.version.cuda else " (a CPU build)")
            raise NoCuda(f"offload.target_device: {target} asked for, but {build} sees no CUDA device on this "
                         "worker; install a CUDA build of torch or set offload.target_device: cpu")
        return device
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    if name:
        return getattr(torch, name)
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def apply_vram_cap(device: torch.device) -> int | None:
    """Emulate a smaller card: $OFFLOAD_JOBS_VRAM_CAP (bytes or '8GiB') caps this process's VRAM."""
    raw = os.environ.get(VRAM_CAP_ENV)
    if not raw or device.type != "cuda":
        return None
    from offload_core import parse_bytes

    cap = parse_bytes(raw, key=VRAM_CAP_ENV)
    index = device.index if device.index is not None else torch.cuda.current_device()  # torch wants an index
    total = torch.cuda.get_device_properties(index).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), index)
    return cap


def offload_config(spec: JobSpec, device: torch.device, *, training: bool) -> Any:
    """The one mapping from a spec to the engine's `OffloadConfig` (None: no engine, the model stays resident).

    `spec.offload` holds every offload setting (the deprecated train.* keys were moved there when the
    spec was read); `resources.vram_budget` is the engine's budget when the offload section sets
    neither a budget nor a ratio.
    """
    for line in spec.deprecations():  # into the job's log
        print(f"[offload-jobs] warning: {line}", flush=True)
    if spec.offload.enabled is False:
        return None
    from offload_core import OffloadConfig

    keys = spec.offload.engine_kwargs()
    if keys.get("lazy_load") and not keys.get("shard_dir"):
        keys.pop("lazy_load")  # the model cache's shards: host_tier.choose_host_tier turns it back on with them
    if spec.resources.vram_budget is not None and "vram_budget" not in keys and "offload_ratio" not in keys:
        keys["vram_budget"] = spec.resources.vram_budget
    keys["target_device"] = str(device)
    if training:
        keys.setdefault("treat_as_inference", False)  # trainable parameters get gradients: never streamed as frozen
        keys["accumulation_order"] = spec.train.accumulation_order
        if keys.get("enable_optimizer_cpu_offload") and spec.train.gradient_accumulation_steps > 1:
            keys["gradient_accumulation_steps"] = spec.train.gradient_accumulation_steps
    else:
        keys.pop("enable_optimizer_cpu_offload", None)
    return OffloadConfig(**keys)


def module_bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in list(module.parameters()) + list(module.buffers()))


def free_host_memory() -> None:
    """Collect garbage and hand freed heap pages back to the OS, so RSS shows what is really held."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


@dataclass
class LoadedTransformer:
    model: torch.nn.Module
    handle: Any = None          # the engine's OffloadHandle (inference) or OffloadTrainingManager (training)
    compiler: Any = None        # offload.compile with no engine: the resident blocks' BlockCompiler
    optimizer: Any = None
    weight_bytes: int = 0
    load_seconds: float = 0.0
    offload_seconds: float = 0.0
    memory: dict[str, int] = field(default_factory=dict)

    def stats(self) -> dict[str, Any]:
        if self.handle is not None:
            return self.handle.stats()
        return self.compiler.stats() if self.compiler is not None else {}

    def release_growth(self) -> int:
        """Before a VAE decode: the device memory the engine's ring grew into, back to torch's allocator
        until the transformer's next call (0 without an engine)."""
        return self.handle.release_growth() if self.handle is not None else 0

    @property
    def vram_budget(self) -> int | None:
        """The VRAM budget the engine was given (None: none, or no engine)."""
        return self.handle.engine.config.vram_budget if self.handle is not None else None


def meta_transformer(cls: Any, folder: str | Path, dtype: torch.dtype) -> torch.nn.Module:
    """The transformer of `folder` (its config) with every parameter on the meta device, in the dtypes
    `cls.from_pretrained(folder, torch_dtype=dtype)` gives: built under `dtype` as the default (tables
    computed at init follow it, as there), parameters and persistent buffers cast to `dtype` except
    the class's `_keep_in_fp32_modules`, which stay float32. Buffers computed at init are real."""
    import accelerate

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with accelerate.init_empty_weights():
            model = cls.from_config(cls.load_config(str(folder)))
    finally:
        torch.set_default_dtype(previous)
    keep = list(getattr(cls, "_keep_in_fp32_modules", None) or [])
    for mname, m in model.named_modules():
        persistent = [(a, t) for a, t in m._buffers.items() if a not in m._non_persistent_buffers_set]
        for attr, t in [*m._parameters.items(), *persistent]:
            if t is None or not t.is_floating_point():
                continue
            name = f"{mname}.{attr}" if mname else attr
            want = torch.float32 if any(k in name.split(".") for k in keep) else dtype
            if t.dtype != want:
                t.data = t.data.to(want)
    return model.eval()


def compile_cache(run_dir: Path) -> Path:
    """offload.compile: inductor's cache folder in the state dir (<home>/cache/torch-compile), so that a
    later job, in this container or after a restart, finds the graphs compiled (seconds, not a
    minute). A TORCHINDUCTOR_CACHE_DIR set in the job's env wins, unless it is inductor's own default
    (inductor writes that into the environment of a process that compiled: a worker started from one
    passes it on)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    key = "TORCHINDUCTOR_CACHE_DIR"
    if os.environ.get(key) in (None, "", default_cache_dir()):
        os.environ[key] = str(Path(run_dir).parent.parent / "cache" / "torch-compile")
    return Path(os.environ[key])


def load_transformer(model_dir: str | Path, family: FamilyAdapter, dtype: torch.dtype, device: torch.device, *,
                     offload: Any, training: bool = False,
                     prepare: Callable[[torch.nn.Module], None] | None = None,
                     with_weights: Callable[[torch.nn.Module], None] | None = None,
                     make_optimizer: Callable[[torch.nn.Module], Any] | None = None,
                     rss: Callable[[], int] | None = None, transformer_dir: Path | None = None,
                     compile: bool = False) -> LoadedTransformer:
    """The family's transformer from `model_dir`, prepared (LoRA, checkpointing), then on the engine.

    `offload` is the engine's OffloadConfig (`offload_config(spec, ...)`; None keeps the model resident on `device`). `prepare(model)` runs
    before the engine takes the model, on the meta device when the engine loads the weights
    (peft's adapters get values there: `lora.inject_lora`). `with_weights(model)` runs where the base
    weights have their values (a LoRA fused into them): before the engine when the model was loaded
    into RAM, after it (on its host masters) when it was built on the meta device.
    `make_optimizer(model)` builds the optimizer over what `prepare` made trainable.
    `transformer_dir`: where the transformer is when not in `model_dir`'s transformer/ (a converted
    `model.transformer` checkpoint: jobs.runners.convert).
    `compile` (offload.compile) with no engine compiles the resident blocks the way the engine's
    `compile` does (an engine's config carries the key itself).
    """
    _, cls = family.classes()
    rss = rss or (lambda: 0)
    folder = Path(transformer_dir) if transformer_dir is not None else Path(model_dir) / "transformer"
    if isinstance(offload, dict):  # engine keys, as enable_offload takes them
        from offload_core import OffloadConfig

        offload = OffloadConfig(**{"target_device": str(device), **offload})
    meta = offload is not None and not offload.offload_to_disk
    t0 = time.perf_counter()
    before = rss()
    if meta:
        model = meta_transformer(cls, folder, dtype)
        if not offload.lazy_load:
            offload = dataclasses.replace(offload, weights=str(folder))
    else:
        model = cls.from_pretrained(str(folder), dtype=dtype, low_cpu_mem_usage=True)
        model.eval()
    fp8 = _fp8_folder(folder, model, dtype, meta, offload)
    loaded = LoadedTransformer(model=model, weight_bytes=module_bytes(model))
    loaded.memory["rss_before_load"] = before
    loaded.memory["rss_after_load"] = rss()
    if prepare is not None:
        prepare(model)
    if fp8 is not None and meta:
        _keep_fp8(model, fp8, folder, dtype, fusing=with_weights is not None)
        loaded.weight_bytes = module_bytes(model)
    if with_weights is not None and not meta:
        with_weights(model)
    if make_optimizer is not None:
        loaded.optimizer = make_optimizer(model)
    loaded.load_seconds = time.perf_counter() - t0

    t1 = time.perf_counter()
    if offload is None:
        model.to(device)
        if compile:
            from offload_core.compiled import compile_blocks

            loaded.compiler = compile_blocks(model)
    elif training:
        from offload_core import OffloadTrainingManager

        loaded.handle = OffloadTrainingManager(model, config=offload, optimizer=loaded.optimizer)
    else:
        from offload_core import enable_offload

        loaded.handle = enable_offload(model, offload)
    if with_weights is not None and meta:
        with_weights(model)
    free_host_memory()
    loaded.offload_seconds = time.perf_counter() - t1
    loaded.memory["rss_after_offload"] = rss()
    return loaded


def _fp8_folder(folder: Path, model: torch.nn.Module, dtype: torch.dtype, meta: bool, offload: Any) -> Any:
    """The fp8 weights of a transformer folder (a converted fp8 `model.transformer` file), or None.
    A model loaded whole has them widened already: their file scales are applied here."""
    from jobs.runners.fp8_weights import apply_scales, read_fp8_folder

    found = read_fp8_folder(folder)
    if found is None:
        return None
    if meta and offload.lazy_load and found.scales:
        _check_shard_scales(folder, found.scales, offload.shard_dir)
    if not meta:
        n = apply_scales(model, found)
        print(f"[offload-jobs] transformer: {len(found.fp8)} fp8 tensors widened to "
              f"{str(dtype).removeprefix('torch.')} at load ({n} times their scale_weight): no engine streams them",
              flush=True)
        return None
    return None if offload.lazy_load else found  # the disk tier binds them from its index: fp8 with their scales


def _check_shard_scales(folder: Path, scales: dict[str, torch.Tensor], shard_dir: str | None) -> None:
    """Shards of a scaled fp8 folder stream right only if their writer read each weight's scale_weight
    (offload_core.disk.write keeps it as the fp8 tensor's scale, or applies it when widening, and says
    so in the index): shards written before that hold the bare fp8 values, off by their scales."""
    from offload_core.disk.format import load_index

    from jobs.runners.errors import SetupError

    if shard_dir is None:
        return
    if not load_index(shard_dir).meta.get("native_fp8_scales"):
        raise SetupError(f"offload.shard_dir: {shard_dir} was written without the scale_weight of {folder}'s "
                         f"{len(scales)} scaled fp8 weights (by an older offload-jobs): shard it again")


def _keep_fp8(model: torch.nn.Module, fp8: Any, folder: Path, dtype: torch.dtype, *, fusing: bool) -> None:
    """The fp8 block weights of a model built on meta kept as stored for the engine (fp8_weights.py)."""
    from jobs.runners.fp8_weights import keep_as_stored

    if fusing:  # peft would add the LoRA's delta to the fp8 bytes, its scale unseen
        from jobs.runners.errors import SetupError

        raise SetupError(f"infer.lora: fusing a LoRA into the fp8 weights of {folder} is not supported yet; "
                         "give a bf16 model.transformer file, or leave infer.lora out")
    count, nbytes = keep_as_stored(model, fp8)
    print(f"[offload-jobs] transformer: {count} fp8 block weights ({bytes_text(nbytes)}) kept as stored, streamed "
          f"by the engine and widened to {str(dtype).removeprefix('torch.')} where they compute; "
          f"{len(fp8.fp8) - count} other fp8 tensors widened at load", flush=True)


def load_pipeline_parts(model_dir: str | Path, family: FamilyAdapter, dtype: torch.dtype, *,
                        text: bool = True, vae: bool = True, files: dict[str, Path] | None = None) -> Any:
    """The family's pipeline without its transformer (and without text encoders or VAE if not asked);
    `files` (pipeline attribute -> a single file: model.text_encoders, model.vae) in place of the base's."""
    pipe_cls, _ = family.classes()
    skip: dict[str, Any] = {"transformer": None}
    wanted = {a: f for a, f in (files or {}).items() if (vae if a == "vae" else text)}
    if wanted:
        from jobs.runners.component_load import load_parts

        modules, said = load_parts(wanted, Path(model_dir), dtype)
        for info in said:
            held, to = bytes_text(info["held_bytes"]), str(dtype).removeprefix("torch.")
            how = f", {held}"
            if info["fp8"]:
                how = (f", fp8 ({info['fp8']}): {info['fp8_kept']:,} of {info['fp8_params']:,} fp8 weights kept as "
                       f"stored, streamed by the engine and widened to {to} where they compute, the rest widened at "
                       f"load; {held} held")
            if info.get("left_out"):
                how += "; not in the file, not needed: " + ", ".join(info["left_out"])
            print(f"[offload-jobs] {info['part']}: {info['file']} ({info['role']}, {info['layout']} names{how})",
                  flush=True)
        skip.update(modules)
    if not text:
        for name in ("text_encoder", "text_encoder_2", "text_encoder_3", "tokenizer", "tokenizer_2", "tokenizer_3"):
            skip[name] = None
    if not vae:
        skip["vae"] = None
    import json

    index = json.loads((Path(model_dir) / "model_index.json").read_text(encoding="utf-8"))
    skip = {k: v for k, v in skip.items() if k in index}
    pipe = pipe_cls.from_pretrained(str(model_dir), dtype=dtype, **skip)
    for name in ("text_encoder", "text_encoder_2", "text_encoder_3", "vae"):
        m = getattr(pipe, name, None)
        if isinstance(m, torch.nn.Module):
            m.requires_grad_(False).eval()
    return pipe


@contextmanager
def component_offload(module: torch.nn.Module | None, device: torch.device, budget: int | None = None) -> Iterator[None]:
    """Run `module` on `device` for the duration, then give the VRAM back.

    On the CPU this is just running it. On a GPU the module moves whole when it fits in what is
    free (under the VRAM cap, if one is set); otherwise its blocks stream through the engine. A
    module holding fp8 weights as stored (a `model.text_encoders` fp8 file) always goes through the
    engine, on the CPU too: it streams them as they are and widens them where they compute.
    """
    from jobs.runners.component_load import holds_fp8

    if module is not None and holds_fp8(module):
        from offload_core import enable_offload

        handle = enable_offload(module, target_device=str(device), offload_granularity="block")
        try:
            yield
        finally:
            handle.remove()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        return
    if module is None or device.type == "cpu":
        yield
        return
    size = module_bytes(module)
    free, _ = torch.cuda.mem_get_info(device)
    if budget is not None:
        free = min(free, budget - torch.cuda.memory_reserved(device))
    if size < 0.7 * free:
        module.to(device)
        try:
            yield
        finally:
            module.to("cpu")
            torch.cuda.empty_cache()
        return
    from offload_core import enable_offload

    handle = enable_offload(module, target_device=str(device), offload_granularity="block")
    try:
        yield
    finally:
        handle.remove()
        torch.cuda.empty_cache()


# Below this many bytes of weights the process's own RAM (torch, the data, the tokenizer) is most
# of the peak, and a ratio to the weights says nothing about the engine: give the figures only.
RATIO_MIN_WEIGHT_BYTES = 1 << 30


def bytes_text(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"  # pragma: no cover - the loop returns


def host_ram_on_load(peak_bytes: int, before_bytes: int, weight_bytes: int) -> str:
    """The log's words for host RAM while loading: figures, with a ratio only where it means
    something ("peaked at 12.3 MB for 14.1 KB of weights" for a tiny model, not "833x")."""
    added = max(0, peak_bytes - before_bytes)
    if weight_bytes < RATIO_MIN_WEIGHT_BYTES:
        return (f"host RAM while loading peaked at {bytes_text(peak_bytes)} for {bytes_text(weight_bytes)} of weights "
                f"(loading added {bytes_text(added)}; fixed overhead dominates at this size)")
    return (f"host RAM while loading peaked at {bytes_text(peak_bytes)}, {peak_bytes / weight_bytes:.2f}x the "
            f"{bytes_text(weight_bytes)} of weights (loading added {added / weight_bytes:.2f}x)")
