"""Every way of running a model that the benchmark compares: resident, our engine, and the peers.

Each variant is a small `setup(model, workload, device) -> Session`. The session carries the
model to call, the optimizer (training), optional `stats` and `after_backward`, and `teardown`.
A variant that cannot run a workload raises `NotApplicable` with the reason, which the table shows.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from .workloads import Workload

__all__ = ["NotApplicable", "Session", "Variant", "ours_variant", "registration_fails", "resident_variant", "variants_for"]


class NotApplicable(Exception):
    """This variant cannot run this workload; the message says why."""


@dataclass
class Session:
    model: nn.Module
    teardown: Callable[[], None] = lambda: None
    optimizer: torch.optim.Optimizer | None = None
    stats: Callable[[], dict[str, Any]] | None = None
    after_backward: Callable[[], None] | None = None
    config: dict[str, Any] = field(default_factory=dict)
    note: str = ""
    planning: Callable[[], bool] | None = None  # ours: the engine is still choosing its plan
    # gradient accumulation: one timed step is one optimizer step over this many micro-batches, run
    # through accumulate(batches, loss_fn) (offload_core.lockstep: micro or layer order)
    micro_batches: int = 1
    accumulate: Callable[..., list] | None = None


@dataclass
class Variant:
    name: str
    setup: Callable[[nn.Module, Workload, torch.device], Session]
    family: str  # resident | ours | peer
    config: dict[str, Any] = field(default_factory=dict)


# ---- resident ---------------------------------------------------------------------------------


def _resident(model: nn.Module, wl: Workload, device: torch.device) -> Session:
    model.to(device)
    opt = wl.make_optimizer(model) if wl.train else None
    return Session(model=model, optimizer=opt, note="plain AdamW on the device" if wl.optimizer_offload else "")


def resident_variant(name: str = "resident") -> Variant:
    return Variant(name, _resident, "resident")


def _resident_compile(model: nn.Module, wl: Workload, device: torch.device) -> Session:
    """Resident with its repeated blocks compiled the way the engine's compile=True compiles them
    (offload_core.compiled.compile_blocks: the same regional torch.compile, static shapes)."""
    from offload_core.compiled import compile_blocks

    sess = _resident(model, wl, device)
    compiler = compile_blocks(model)
    sess.stats, sess.teardown, sess.config = compiler.stats, compiler.remove, {"compile": True}
    return sess


def fresh_dynamo(variant: Variant) -> Variant:
    """A compiled variant starts with dynamo's in-memory graphs dropped, so its first step compiles
    (and counts) its own instead of reusing an earlier variant's. Inductor's on-disk cache stays, as
    it would for a second job on the box: the row says how many of its graphs came from there."""
    setup = variant.setup

    def fresh(model: nn.Module, wl: Workload, device: torch.device) -> Session:
        torch._dynamo.reset()
        return setup(model, wl, device)

    return Variant(variant.name, fresh, variant.family, variant.config)


# ---- ours -------------------------------------------------------------------------------------


def _manager(model: nn.Module, device: torch.device, opt: torch.optim.Optimizer, cfg: dict[str, Any]) -> Any:
    """OffloadTrainingManager with our config, passed as keywords or as an OffloadConfig, whichever it takes."""
    from offload_core import OffloadConfig, OffloadTrainingManager

    params = inspect.signature(OffloadTrainingManager).parameters
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    base = dict(target_device=str(device), enable_optimizer_cpu_offload=True)
    if "optimizer" in params or takes_kwargs:
        base["optimizer"] = opt
    extra = {k: v for k, v in cfg.items() if k not in base}
    if takes_kwargs or all(k in params for k in extra):
        return OffloadTrainingManager(model, **base, **extra)
    if "config" in params:
        return OffloadTrainingManager(model, **base, config=OffloadConfig(**{**extra, "target_device": str(device)}))
    raise TypeError(f"OffloadTrainingManager takes none of {sorted(extra)}")


def ours_variant(name: str, **cfg: Any) -> Variant:
    """Our engine with the given OffloadConfig overrides on top of the engine's own defaults."""
    cfg = dict(cfg)

    def setup(model: nn.Module, wl: Workload, device: torch.device) -> Session:
        from offload_core import enable_offload

        budget = cfg.get("vram_budget")
        run_cfg = dict(cfg)
        if isinstance(budget, float) and budget <= 1.0:
            # a fraction of the streamed weight bytes, resolved on this copy of the model
            run_cfg["vram_budget"] = int(budget * wl.streamed_bytes(model))
        fused = run_cfg.pop("optimizer_fused", False)
        if run_cfg.pop("as_written", False):
            # The seed's toy exactly as DiffSynth documents it: plain AdamW made on model.parameters()
            # first, then OffloadTrainingManager(model, "cuda", enable_optimizer_cpu_offload=True),
            # no optimizer argument, every other setting at its default.
            from offload_core import OffloadTrainingManager

            opt = wl.make_optimizer(model)
            mgr = OffloadTrainingManager(model, str(device), enable_optimizer_cpu_offload=True)
            return Session(model, mgr.remove, opt, mgr.stats, mgr.after_backward, run_cfg,
                           note="as written: no optimizer argument, plain AdamW, defaults",
                           planning=lambda: mgr.planning)
        if wl.optimizer_offload:
            # on the CPU master parameters, as DiffSynth does
            opt = wl.make_optimizer(model, fused=fused)
            mgr = _manager(model, device, opt, run_cfg)
            remove = getattr(mgr, "remove", None) or getattr(getattr(mgr, "handle", None), "remove", lambda: None)
            return Session(model, remove, opt, mgr.stats, mgr.after_backward, run_cfg,
                           planning=lambda: bool(getattr(mgr, "planning", False)))
        micro_batches = run_cfg.pop("micro_batches", 1)
        h = enable_offload(model, target_device=str(device), **run_cfg)
        opt = wl.make_optimizer(model) if wl.train else None  # LoRA params stay resident
        return Session(model, h.remove, opt, h.stats, None, dict(run_cfg, micro_batches=micro_batches),
                       planning=lambda: h.planning, micro_batches=micro_batches, accumulate=h.accumulate)

    return Variant(name, setup, "ours", cfg)


def _with_switch(variant: Variant, name: str, env: str, value: str, key: str) -> Variant:
    """The variant with an engine experiment switched (environment ``env`` set to ``value`` while its
    store is made), renamed ``name``; its config says so under ``key``."""
    setup = variant.setup

    def switched(model: nn.Module, wl: Workload, device: torch.device) -> Session:
        was = os.environ.get(env)
        os.environ[env] = value
        try:
            return setup(model, wl, device)
        finally:
            if was is None:
                os.environ.pop(env, None)
            else:
                os.environ[env] = was

    return Variant(name, switched, variant.family, dict(variant.config, **{key: value}))


def libc_fill(variant: Variant) -> Variant:
    """The variant with the bounce ring filled by libc's memmove instead of streaming stores
    (OFFLOAD_BOUNCE_FILL=libc while its store is made): the A/B of offload_core/streamcopy.py."""
    from offload_core import bounce

    return _with_switch(variant, variant.name, bounce.BOUNCE_FILL_ENV, "libc", "bounce_fill")


def native_ring(variant: Variant, name: str) -> Variant:
    """The variant with the bounce ring's chunk loop in native threads (OFFLOAD_BOUNCE_RING=native):
    the A/B of offload_core/native/bounce_ring.c."""
    from offload_core import bounce

    return _with_switch(variant, name, bounce.BOUNCE_RING_ENV, "native", "bounce_ring")


def registration_fails(variant: Variant) -> Variant:
    """The variant on a host whose registration of the arena fails (issue 29's acceptance: the
    bounce ring and a warning, never plain pageable copies): the arena's host buffer is registered
    with CUDA before the engine tries, exactly as tests/offload_core/test_gpu_lifecycle.py does, so
    the engine's own cudaHostRegister returns cudaErrorHostMemoryAlreadyRegistered. The range is
    unregistered after the engine's teardown."""
    setup = variant.setup

    def failing(model: nn.Module, wl: Workload, device: torch.device) -> Session:
        if device.type != "cuda":
            raise NotApplicable("registration is CUDA's: nothing to fail on a CPU device")
        import warnings

        from offload_core import hostmem

        cudart, real, taken = torch.cuda.cudart(), hostmem.host_buffer, []

        def registered_first(nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
            buf, raw = real(nbytes)
            if not taken:  # the arena's buffer; the bounce ring's (allocated after it) pins as usual
                if int(cudart.cudaHostRegister(buf.data_ptr(), nbytes, 0)) != 0:
                    raise NotApplicable("could not register the arena's buffer ahead of the engine")
                taken.append((buf, raw))
            return buf, raw

        def unregister() -> None:  # before the buffer can be freed (offload_core/hostmem.py)
            for buf, _ in taken:
                cudart.cudaHostUnregister(buf.data_ptr())
            taken.clear()

        hostmem.host_buffer = registered_first
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                sess = setup(model, wl, device)
        except BaseException:
            unregister()  # a setup that failed leaves no range registered behind it
            raise
        finally:
            hostmem.host_buffer = real
        said = [str(w.message) for w in caught if "bounce ring" in str(w.message)]
        inner = sess.teardown

        def teardown() -> None:
            inner()
            unregister()

        sess.teardown = teardown
        sess.note = (sess.note + "; " if sess.note else "") + (said[0].split(" (set pinned_limit")[0] if said else "NO bounce-ring warning")
        return sess

    return Variant(variant.name, failing, variant.family, dict(variant.config, registration="made to fail"))


# ---- peers ------------------------------------------------------------------------------------


def _diffusers_group(leaf: bool) -> Callable[[nn.Module, Workload, torch.device], Session]:
    def setup(model: nn.Module, wl: Workload, device: torch.device) -> Session:
        try:
            from diffusers.hooks import apply_group_offloading
        except ImportError as e:
            raise NotApplicable(f"diffusers is not installed ({e})") from None
        streams = device.type == "cuda"  # diffusers refuses use_stream on a CPU onload device
        kwargs: dict[str, Any] = dict(
            onload_device=device,
            offload_device=torch.device("cpu"),
            offload_type="leaf_level" if leaf else "block_level",
            use_stream=streams,
            record_stream=streams and leaf,
        )
        if not leaf:
            kwargs["num_blocks_per_group"] = 1
        if hasattr(model, "enable_group_offload"):
            model.enable_group_offload(**kwargs)
        else:  # a plain nn.Module: the same function that enable_group_offload calls
            apply_group_offloading(model, **kwargs)
        opt = wl.make_optimizer(model) if wl.train else None
        note = "" if streams else "cpu: use_stream off (diffusers needs a stream backend)"
        cfg = {k: (str(v) if isinstance(v, torch.device) else v) for k, v in kwargs.items()}
        return Session(model, lambda: _remove_diffusers_hooks(model), opt, config=cfg, note=note)

    return setup


def _remove_diffusers_hooks(model: nn.Module) -> None:
    from diffusers.hooks import HookRegistry

    for m in model.modules():
        registry = getattr(m, "_diffusers_hook", None)
        if isinstance(registry, HookRegistry):
            for name in list(registry.hooks):
                registry.remove_hook(name, recurse=False)


def _accelerate(model: nn.Module, wl: Workload, device: torch.device) -> Session:
    if wl.train:
        raise NotApplicable(
            "accelerate.cpu_offload is inference-only: its hooks put parameters on the meta device and rebuild new "
            "tensors from a frozen CPU state dict each forward, so an optimizer's updates never reach the model"
        )
    from accelerate import cpu_offload
    from accelerate.hooks import remove_hook_from_submodules

    cpu_offload(model, execution_device=device)
    return Session(model, lambda: remove_hook_from_submodules(model), config={"execution_device": str(device)})


# ---- the list ---------------------------------------------------------------------------------


def variants_for(wl: Workload) -> list[Variant]:
    """Every variant of a workload, in run order (ours before the peers, so their pinned caches can't help us)."""
    out = [Variant("resident", _resident, "resident"), Variant("resident-repeat", _resident, "resident")]
    if wl.name in ("p1", "flux-dev-lora-8g", "flux-dev-infer-8g"):
        # compiled blocks (offload_core/compiled.py): resident compiled the same way is their reference
        out.append(fresh_dynamo(Variant("resident-compile", _resident_compile, "resident", {"compile": True})))
    if wl.optimizer_offload:
        # the seed's toy unchanged, then our engine with the optimizer passed in (as before)
        out.append(ours_variant("ours-seed", as_written=True))
    out += [
        ours_variant("ours"),  # every setting at the engine's default (the ring grows into free VRAM)
        ours_variant("ours-pf2", prefetch=2),  # the depth pinned at the old default
        Variant("ours-tuned", ours_variant("ours-tuned").setup, "ours", {"sweep": "prefetch 2/4/6/8 block, 2 leaf"}),
    ]
    if wl.name in ("p1", "p2"):
        # the planner: half the weights' bytes for everything on the device, chosen from measured times
        out.append(ours_variant("ours-budget50", vram_budget=0.5))
    if wl.name == "flux-dev-lora-8g":
        out.append(ours_variant("ours-budget7g", vram_budget="7.0GiB"))
        # phase units (a block's children): a ring slot is ~151 MB instead of a 680 MB double block
        out.append(ours_variant("ours-phase", offload_granularity="phase"))
    if wl.name in ("p1", "flux-dev-lora-8g", "flux-dev-infer-8g"):
        out.append(ours_variant("ours-fp8", weight_dtype="float8_e4m3fn"))  # the default scaling (row)
        # units the plan keeps on the device held widened (as before keep_narrow): the A/B of keeping fp8 bytes
        out.append(ours_variant("ours-fp8-keep-widened", weight_dtype="float8_e4m3fn", keep_narrow=False))
        # the other fp8 scalings, for the speed side of the quality trade (bench/RESULTS.md, "fp8 quality")
        out.append(ours_variant("ours-fp8-tensor", weight_dtype="float8_e4m3fn", fp8_scaling="tensor"))
        out.append(ours_variant("ours-fp8-block", weight_dtype="float8_e4m3fn", fp8_scaling="block"))
        out.append(fresh_dynamo(ours_variant("ours-compile", compile=True)))
        out.append(fresh_dynamo(ours_variant("ours-fp8-compile", weight_dtype="float8_e4m3fn", compile=True)))
    if wl.name in ("p1", "flux-dev-lora-8g", "flux-dev-infer-8g"):
        # a box that pins at most 256 MiB (WSL2, Docker Desktop): pageable weights through the bounce ring
        out.append(ours_variant("ours-bounce", pinned_limit="256MiB"))
        out.append(ours_variant("ours-bounce-t8", pinned_limit="256MiB", num_copy_threads=8))
        # a host whose registration fails (every other setting at the default): the ring, never pageable copies
        out.append(registration_fails(ours_variant("ours-regfail")))
        # the ring filled by libc's memmove, as before streaming stores (streamcopy.py)
        out.append(libc_fill(ours_variant("ours-bounce-libc", pinned_limit="256MiB")))
        # the ring's chunk loop in pthreads, without the GIL (bounce.py, _NativeRing)
        out.append(native_ring(ours_variant("ours-bounce", pinned_limit="256MiB"), "ours-bounce-native"))
        out.append(native_ring(registration_fails(ours_variant("ours-regfail")), "ours-regfail-native"))
    if wl.optimizer_offload:
        # the optimizer's own (for-loop) kernel, still overlapped: bitwise plain AdamW
        out.append(ours_variant("ours-exact", fused_cpu_optimizer=False))
        # every step inside optimizer.step(), with the optimizer's own kernel: the engine as it was
        out.append(ours_variant("ours-serial-step", overlap_optimizer_step=False, fused_cpu_optimizer=False))
    if wl.name in ("p2", "flux-dev-lora-8g"):
        # gradient accumulation, one optimizer step over K micro-batches: the plain loop streams the
        # weights K times, layer-major order once (issue 32: layer K=4 within 1.35x of one micro-batch)
        for k in (2, 4):
            out.append(ours_variant(f"ours-accum{k}", micro_batches=k, accumulation_order="micro"))
            out.append(ours_variant(f"ours-accum{k}-layer", micro_batches=k, accumulation_order="layer"))
        # the K micro-batches' checkpointed block inputs parked in host memory until the backward (parking.py)
        out.append(ours_variant("ours-accum4-layer-park", micro_batches=4, accumulation_order="layer",
                                park_saved_tensors=True))
    if wl.train:
        out.append(ours_variant("serial-hooks", use_streams=False, prefetch=0))
    out += [
        Variant("diffusers-leaf", _diffusers_group(leaf=True), "peer", {"offload_type": "leaf_level", "use_stream": True, "record_stream": True}),
        Variant("diffusers-block", _diffusers_group(leaf=False), "peer", {"offload_type": "block_level", "num_blocks_per_group": 1, "use_stream": True}),
        Variant("accelerate", _accelerate, "peer", {"fn": "accelerate.cpu_offload"}),
    ]
    return out


# Deeper prefetch means more slots: the units the backward pass ends on are the ones the next
# forward starts with, so a bigger ring turns them into hits (P2), at the cost of VRAM.
TUNE_GRID: list[dict[str, Any]] = [  # (granularity pinned as the sweep's second axis)
    {"prefetch": pf, "offload_granularity": "block"} for pf in (2, 4, 6, 8)
] + [{"prefetch": 2, "offload_granularity": "leaf"}]
