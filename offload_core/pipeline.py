"""enable_pipeline_offload: every component of a diffusers pipeline placed or streamed, in one call.

    from offload_core.pipeline import enable_pipeline_offload
    offload = enable_pipeline_offload(pipe, target_device="cuda")              # everything offloaded
    offload = enable_pipeline_offload(pipe, t5_cpu_offload=False)              # T5 stays on the GPU
    image = pipe("a cat").images[0]
    print(offload.stats()["transformer"]["h2d_bytes"])
    offload.remove()

- The denoiser (``transformer``, ``transformer_2``, ``unet``) streams through the engine
  (``enable_offload``), with the engine keys given here (``lazy_load``, ``shard_dir``,
  ``max_memory``, ``prefetch``, ...).
- Encoders (``text_encoder*``, ``image_encoder``: T5, CLIP, Qwen2.5-VL) stream block by block
  through the engine as well: T5-XXL's 9 GB never sits on the card whole.
- The VAE (and any other module) is moved to the device for each ``encode``/``decode``/forward
  call and back afterwards: its weights are small, its activations are not.

What is offloaded follows ``cpu_offload`` unless set per component: ``text_encoder_cpu_offload``
for every encoder, ``vae_cpu_offload``, and LightX2V's names, ``t5_cpu_offload`` and
``clip_cpu_offload``, for encoders of that family. A component not offloaded is moved to the
device once. The pipeline needs no change: its execution device is the device the engine's
placeholders sit on.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from .api import OffloadHandle, enable_offload
from .errors import OffloadConfigError

__all__ = ["ComponentOffload", "PipelineOffload", "enable_pipeline_offload"]

_DENOISERS = ("transformer", "transformer_2", "unet", "prior")
_DISK_KEYS = ("lazy_load", "offload_to_disk", "shard_dir", "max_memory", "num_disk_workers", "disk_cache_policy",
              "disk_verify", "disk_direct", "disk_stream_slots", "weights")


def send_to_device(obj: Any, device: torch.device) -> Any:
    """accelerate's send_to_device, imported when a hooked component is first called (accelerate costs
    0.15 s to import, and `import offload_core` need not pay it)."""
    from accelerate.utils import send_to_device as send

    return send(obj, device)


class ComponentOffload:
    """A module kept on ``offload_device`` and moved to ``device`` for each call of ``methods`` (and forward)."""

    def __init__(self, module: nn.Module, device: torch.device, offload_device: str | torch.device = "cpu",
                 methods: tuple[str, ...] = ("encode", "decode")) -> None:
        self.module, self.device, self.offload_device = module, device, torch.device(offload_device)
        self._depth = 0
        self.onloads = 0
        self._wrapped: list[str] = []
        for name in methods:
            method = getattr(module, name, None)
            if callable(method):
                setattr(module, name, self._wrap(method))  # an instance attribute shadows the class's method
                self._wrapped.append(name)
        self._handles = [module.register_forward_pre_hook(self._pre_forward, with_kwargs=True),
                         module.register_forward_hook(lambda m, a, o: self.offload(), always_call=True)]
        module.to(self.offload_device)

    def _pre_forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        self.onload()
        return send_to_device(args, self.device), send_to_device(kwargs, self.device)

    def _wrap(self, method: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.onload()
            try:
                # Inputs follow the module, as with accelerate's offload hooks: a pipeline may put them
                # where the module's weights sit between calls (diffusers 0.42's Flux moves the latents
                # to get_module_execution_device(vae), which is the host here).
                return method(*send_to_device(args, self.device), **send_to_device(kwargs, self.device))
            finally:
                self.offload()

        call.__wrapped__ = method  # type: ignore[attr-defined]
        return call

    def onload(self) -> None:
        if self._depth == 0:
            self.module.to(self.device)
            self.onloads += 1
        self._depth += 1

    def offload(self) -> None:
        self._depth = max(self._depth - 1, 0)
        if self._depth == 0:
            self.module.to(self.offload_device)

    def stats(self) -> dict[str, Any]:
        return {"mode": "onload per call", "onloads": self.onloads,
                "bytes": sum(t.numel() * t.element_size() for t in [*self.module.parameters(), *self.module.buffers()])}

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        for name in self._wrapped:
            self.module.__dict__.pop(name, None)
        self._handles, self._wrapped = [], []


class PipelineOffload:
    """What enable_pipeline_offload returns: per-component handles, ``stats()`` and ``remove()``."""

    def __init__(self) -> None:
        self.engines: dict[str, OffloadHandle] = {}
        self.hooks: dict[str, ComponentOffload] = {}
        self.placed: dict[str, tuple[nn.Module, torch.device]] = {}  # moved to the device once: where from

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {name: h.stats() for name, h in self.engines.items()}
        out.update({name: h.stats() for name, h in self.hooks.items()})
        out.update({name: {"mode": "on the device"} for name in self.placed})
        return out

    def remove(self) -> None:
        """Every component back on the host, hooks and engines gone."""
        for h in self.engines.values():
            h.remove()
        for h in self.hooks.values():
            h.remove()
        for module, dev in self.placed.values():
            module.to(dev)
        self.engines, self.hooks, self.placed = {}, {}, {}


def _components(pipe: Any) -> dict[str, nn.Module]:
    comps = getattr(pipe, "components", None)
    if not isinstance(comps, dict):
        raise OffloadConfigError(f"pipe: expected a diffusers pipeline (with .components), got {type(pipe).__name__}")
    return {name: m for name, m in comps.items() if isinstance(m, nn.Module)}


def _family(name: str, module: nn.Module) -> str:
    cls = type(module).__name__
    if name in _DENOISERS:
        return "denoiser"
    if "encoder" in name:
        return "t5" if "T5" in cls else "clip" if "CLIP" in cls else "encoder"
    return "other"


def _first_device(module: nn.Module) -> torch.device:
    for t in [*module.parameters(), *module.buffers()]:
        return t.device
    return torch.device("cpu")


def enable_pipeline_offload(
    pipe: Any,
    cpu_offload: bool = True,
    text_encoder_cpu_offload: bool | None = None,
    vae_cpu_offload: bool | None = None,
    *,
    t5_cpu_offload: bool | None = None,
    clip_cpu_offload: bool | None = None,
    target_device: str | torch.device = "cuda",
    encoder_config: dict[str, Any] | None = None,
    **engine: Any,
) -> PipelineOffload:
    """Offload a pipeline's components (see the module docstring); ``engine`` keys go to the denoiser's
    enable_offload (``lazy_load``, ``shard_dir``, ``max_memory``, ``prefetch``, ``vram_budget``, ...),
    ``encoder_config`` to the encoders' (default: block granularity, the tensors outside the blocks
    resident, the engine's other defaults)."""
    from .engine import resolve_device

    device = resolve_device(target_device)
    components = _components(pipe)
    out = PipelineOffload()
    try:
        for name, module in components.items():
            family = _family(name, module)
            if family == "denoiser":
                offload = cpu_offload
            elif family in ("t5", "clip", "encoder"):
                own = {"t5": t5_cpu_offload, "clip": clip_cpu_offload}.get(family)
                offload = own if own is not None else (
                    text_encoder_cpu_offload if text_encoder_cpu_offload is not None else cpu_offload)
            else:
                offload = vae_cpu_offload if vae_cpu_offload is not None else cpu_offload
            if not offload:
                if any(t.device.type == "meta" for t in module.parameters()):
                    raise OffloadConfigError(f"{name}: on the meta device; only the denoiser can be loaded lazily")
                out.placed[name] = (module, _first_device(module))
                module.to(device)
            elif family == "denoiser":
                out.engines[name] = enable_offload(module, target_device=str(device), **engine)
            elif family in ("t5", "clip", "encoder"):
                # Embedding tables stay resident: text encoders read them outside their own forward
                # (CLIP checks position_embedding.weight.shape), and T5's is tied anyway.
                cfg = {"offload_granularity": "block", "stray_resident_fraction": 1.0, **(encoder_config or {})}
                bad = [k for k in _DISK_KEYS if k in cfg]
                if bad:
                    raise OffloadConfigError(f"encoder_config: {bad[0]} applies to the denoiser only")
                out.engines[name] = enable_offload(module, target_device=str(device), **cfg)
            else:
                out.hooks[name] = ComponentOffload(module, device)
    except BaseException:
        out.remove()
        raise
    return out
