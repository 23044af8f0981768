"""OffloadConfig: the engine's settings, named as DiffSynth-Studio and LightX2V users know them."""

from __future__ import annotations

import dataclasses
import enum
import math
import os
from dataclasses import dataclass
from typing import Any

from byte_sizes import parse_bytes as _parse_size

from .errors import OffloadConfigError

__all__ = ["Granularity", "OffloadConfig", "parse_bytes"]


class Granularity(str, enum.Enum):
    LEAF = "leaf"
    BLOCK = "block"
    PHASE = "phase"
    AUTO = "auto"


def parse_bytes(value: int | float | str | None, *, key: str = "value") -> int | None:
    """Turn 123, "7.5GiB", "800MB" or "1e9" into a number of bytes (the one parser: byte_sizes)."""
    try:
        return _parse_size(value)
    except ValueError as exc:
        raise OffloadConfigError(f"{key}: {exc}") from None


@dataclass
class OffloadConfig:
    """How a model is split, where its weights live and how they move.

    Defaults stream every unit through pinned host memory. The prefetch depth starts at two units
    and, on a card, grows into free VRAM while that cuts the measured stall (``prefetch=N`` pins it).
    """

    target_device: str = "cuda"
    cpu_offload: bool = True
    offload_granularity: Granularity | str = Granularity.AUTO
    offload_ratio: float | None = None
    vram_budget: int | str | None = None
    # Units fetched ahead. None (auto): start at 2, then deepen the ring into the card's free memory
    # (less vram_margin) once the traced steps show it cuts the stall. A number pins the depth.
    prefetch: int | None = None
    # Block/phase granularity: the tensors outside the block lists (embedders, final norm and
    # projection) stay resident when they total at most this fraction of the streamed bytes.
    # 0 streams them like the blocks.
    stray_resident_fraction: float = 0.05
    # The disk tier (offload_core/disk/): lazy_load streams a model built on the meta device from
    # the shards in shard_dir; offload_to_disk writes a model's shards there first, then frees its
    # RAM copy. max_memory bounds the pinned host bytes of the disk tier: the staging slots the disk
    # workers read into (disk_stream_slots, default num_disk_workers + 2, each the largest unit) and
    # the cache (the rest), whose hit rate on repeated passes is its share of the streamed bytes.
    # 0: no cache (staging slots only). None: the streamed bytes plus staging, at most half the RAM free.
    lazy_load: bool = False
    offload_to_disk: bool = False
    shard_dir: str | None = None
    num_disk_workers: int = 2
    max_memory: int | str | None = None
    disk_cache_policy: str = "belady"  # next use in the traced order; "fifo" and "lru" are ablations
    disk_verify: bool = False  # sha256 of every unit read; off, each unit's xxh3 is checked on its first read
    disk_direct: bool | None = None  # O_DIRECT reads: None where the filesystem allows, else buffered + DONTNEED
    disk_stream_slots: int | None = None
    # Pinned host memory the engine may register (bytes or "512MiB"; the OFFLOAD_PINNED_LIMIT
    # environment variable caps it too). Streamed weights over the limit, or a registration the host
    # refuses (WSL2 and Docker Desktop stop near 0.5-1 GiB), stay in pageable RAM and go to the
    # device through a pinned bounce ring of at most this size, filled by num_copy_threads threads
    # (bounce.py). None: pin everything the host allows.
    pinned_limit: int | str | None = None
    num_copy_threads: int | None = None
    # A checkpoint to read the weights from (a diffusers model folder with one or several safetensors
    # files, or one .safetensors file), for a model built on the meta device: each streamed tensor is
    # read straight into its host slab and each resident one onto the device, so host RAM never
    # holds the weights twice.
    weights: str | None = None
    # Memory the auto prefetch leaves free on the card (bytes or "1GiB"; default max(512 MiB, 5%)).
    vram_margin: int | str | None = None
    enable_optimizer_cpu_offload: bool = False
    # None (auto): a model with no frozen parameter is taken as an inference model, and every
    # weight is streamed as frozen (no gradient reaches it). False: trainable parameters stay
    # resident (what the training manager uses). True: always stream them as frozen.
    treat_as_inference: bool | None = None
    # With optimizer offload: step each parameter on the CPU as soon as its gradient lands,
    # overlapping the rest of backward. None (auto): from the second step on, once the first step
    # showed the optimizer and that nothing changes the gradients between after_backward() and
    # step() (clip_grad_norm_ does). True: also from the first step when the optimizer is passed.
    # False: every step runs inside optimizer.step().
    overlap_optimizer_step: bool | None = None
    # With optimizer offload: Adam/AdamW steps of streamed parameters use torch's fused CPU kernel
    # (one pass over memory; bitwise equal to AdamW(fused=True), which rounds differently in the
    # last bit from the default for-loop kernel). False: the optimizer's own kernel, bitwise equal
    # to calling optimizer.step() on a resident model.
    fused_cpu_optimizer: bool = True
    gradient_accumulation_steps: int = 1
    # handle.accumulate(micro_batches, loss_fn): "micro" runs each micro-batch's forward and backward in
    # turn (the model streams K times a step); "layer" runs all K through each unit before the next,
    # forward and backward, so each weight crosses once as for one micro-batch, with the same gradients
    # bitwise (lockstep.py)
    accumulation_order: str = "micro"
    # Saved activations of at least 4 MiB (with checkpointing: each block's inputs) held in host memory
    # from the forward until the backward needs them (parking.py): layer-major accumulation keeps K
    # micro-batches' worth until its one backward (6.4 GB for K=4 at Flux-dev dims). A D2H copy in the
    # forward beside the weights' H2D copies, an H2D copy in the backward.
    park_saved_tensors: bool = False
    weight_dtype: str | None = None
    # With weight_dtype float8_e4m3fn: one scale per tensor, per output channel ("row") or per
    # 128 x 128 tile ("block"); quant.py. None: row (the measured trade: bench/RESULTS.md, "fp8
    # quality"); with lazy_load, what the shards hold (set, it must be what they hold).
    fp8_scaling: str | None = None
    # Units a plan keeps on the device (sticky) that are stored narrower (fp8) keep their stored bytes
    # there and are widened into a ring slot at each use: half the device bytes per kept unit, so the
    # same room takes twice the bytes off the link. False: kept widened (the bench's A/B).
    keep_narrow: bool = True
    # Compile each repeated block class once with torch.compile (regional, static shapes), the
    # engine's hooks outside the compiled region (compiled.py). The first step pays the compile
    # (tens of seconds at Flux-dev size); swapping weights between slots never recompiles. Needs
    # each block streamed whole: block (or auto) granularity, no split_threshold_mb.
    compile: bool = False
    # Units bigger than this many MB (of bytes) are split into their children.
    split_threshold_mb: float | None = None
    # Copy on side streams with events; False gives the serial baseline (same code path).
    use_streams: bool = True
    # Time units and stalls with CUDA events (cheap; resolved lazily).
    record_timings: bool = True
    # Once the plan is settled, time one step in this many (1: every step). Every step is timed while
    # the planner decides; stats() scales the sampled totals to all steps.
    timing_every: int = 8
    # Test-only: sleep a random 0..N ms on the host inside hooks, to shake out races.
    debug_host_delay_ms: float = 0.0
    # Bench/test only: emulate a slower host-to-device link (GB/s, e.g. 13, 25, 50) by holding the
    # copy stream after every H2D weight copy for the time that link would need on top (link.py).
    # None: the real link. On the CPU copies are counted, not slowed.
    debug_link_gbps: float | None = None

    def __post_init__(self) -> None:
        try:
            self.offload_granularity = Granularity(str(getattr(self.offload_granularity, "value", self.offload_granularity)))
        except ValueError:
            choices = ", ".join(g.value for g in Granularity)
            raise OffloadConfigError(
                f"offload_granularity: unknown value {self.offload_granularity!r} (choose one of {choices})"
            ) from None
        if self.offload_ratio is not None and not (0.0 <= float(self.offload_ratio) <= 1.0):
            raise OffloadConfigError(f"offload_ratio: must be between 0 and 1, got {self.offload_ratio!r}")
        if self.offload_ratio is not None and self.vram_budget is not None:
            raise OffloadConfigError("offload_ratio and vram_budget: set one or the other, not both")
        self.vram_budget = parse_bytes(self.vram_budget, key="vram_budget")
        self.max_memory = parse_bytes(self.max_memory, key="max_memory")
        self.vram_margin = parse_bytes(self.vram_margin, key="vram_margin")
        self.pinned_limit = parse_bytes(self.pinned_limit, key="pinned_limit")
        if self.pinned_limit is not None and self.pinned_limit < (16 << 10):
            raise OffloadConfigError(f"pinned_limit: must be at least 16KiB (four 4 KiB buffers), got {self.pinned_limit!r} bytes")
        if self.num_copy_threads is not None and (not isinstance(self.num_copy_threads, int)
                                                  or isinstance(self.num_copy_threads, bool) or self.num_copy_threads < 1):
            raise OffloadConfigError(f"num_copy_threads: must be a whole number >= 1, got {self.num_copy_threads!r}")
        link = self.debug_link_gbps
        if link is not None:
            if isinstance(link, bool) or not isinstance(link, (int, float)) or not math.isfinite(link) or link <= 0:
                raise OffloadConfigError(f"debug_link_gbps: must be a link rate in GB/s above 0 (13, 25, 50), "
                                         f"or null for the real link, got {link!r}")
            self.debug_link_gbps = float(link)
        if not isinstance(self.timing_every, int) or isinstance(self.timing_every, bool) or self.timing_every < 1:
            raise OffloadConfigError(f"timing_every: must be a whole number >= 1, got {self.timing_every!r}")
        if self.prefetch is not None and (not isinstance(self.prefetch, int) or isinstance(self.prefetch, bool)
                                          or self.prefetch < 0):
            raise OffloadConfigError(f"prefetch: must be a whole number >= 0 (or None: grow from free VRAM), got {self.prefetch!r}")
        if isinstance(self.stray_resident_fraction, bool) or not isinstance(self.stray_resident_fraction, (int, float)) \
                or not 0.0 <= float(self.stray_resident_fraction) <= 1.0:
            raise OffloadConfigError(
                f"stray_resident_fraction: must be a number between 0 and 1, got {self.stray_resident_fraction!r}"
            )
        if not isinstance(self.gradient_accumulation_steps, int) or self.gradient_accumulation_steps < 1:
            raise OffloadConfigError(
                f"gradient_accumulation_steps: must be a whole number >= 1, got {self.gradient_accumulation_steps!r}"
            )
        if self.accumulation_order not in ("micro", "layer"):
            raise OffloadConfigError(
                f"accumulation_order: unknown value {self.accumulation_order!r} (choose micro or layer)")
        if self.accumulation_order == "layer" and self.enable_optimizer_cpu_offload:
            raise OffloadConfigError("accumulation_order: layer needs the trainable parameters resident; "
                                     "enable_optimizer_cpu_offload streams them (use micro, or turn it off)")
        if not isinstance(self.park_saved_tensors, bool):
            raise OffloadConfigError(f"park_saved_tensors: expected true or false, got {self.park_saved_tensors!r}")
        for key in ("overlap_optimizer_step", "treat_as_inference"):
            if getattr(self, key) not in (None, True, False):
                raise OffloadConfigError(f"{key}: expected true, false or null, got {getattr(self, key)!r}")
        if self.overlap_optimizer_step and not self.enable_optimizer_cpu_offload:
            raise OffloadConfigError("overlap_optimizer_step: needs enable_optimizer_cpu_offload=True")
        if self.num_disk_workers < 1:
            raise OffloadConfigError(f"num_disk_workers: must be >= 1, got {self.num_disk_workers!r}")
        if self.split_threshold_mb is not None and self.split_threshold_mb <= 0:
            raise OffloadConfigError(f"split_threshold_mb: must be > 0, got {self.split_threshold_mb!r}")
        if self.weight_dtype not in (None, "float8_e4m3fn", "bfloat16", "float16", "float32"):
            raise OffloadConfigError(
                f"weight_dtype: unknown value {self.weight_dtype!r} (choose float8_e4m3fn, bfloat16, float16 or float32)"
            )
        if self.fp8_scaling is not None:
            if self.fp8_scaling not in ("tensor", "row", "block"):
                raise OffloadConfigError(f"fp8_scaling: unknown value {self.fp8_scaling!r} (choose tensor, row or block)")
            if self.weight_dtype != "float8_e4m3fn":
                raise OffloadConfigError(f"fp8_scaling: applies to weight_dtype float8_e4m3fn only "
                                         f"(weight_dtype is {self.weight_dtype!r})")
        if self.compile is True and (self.offload_granularity in (Granularity.LEAF, Granularity.PHASE)
                                     or self.split_threshold_mb is not None):
            what = ("split_threshold_mb splits blocks" if self.split_threshold_mb is not None
                    else f"offload_granularity {self.offload_granularity.value} hooks modules")
            raise OffloadConfigError(f"compile: compiled blocks need each block streamed whole, but {what} inside "
                                     "them; use offload_granularity block (or auto) without split_threshold_mb")
        if (self.lazy_load or self.offload_to_disk) and not self.shard_dir:
            raise OffloadConfigError("shard_dir: required when lazy_load or offload_to_disk is set")
        if self.lazy_load and self.offload_to_disk:
            raise OffloadConfigError("lazy_load and offload_to_disk: set one (lazy_load reads shards that exist; "
                                     "offload_to_disk writes them from the model in RAM)")
        if self.weights is not None and (self.lazy_load or self.offload_to_disk):
            raise OffloadConfigError("weights: streams from host RAM; with lazy_load the weights come from shard_dir "
                                     "(shard the checkpoint first: offload-jobs shard SRC DST)")
        if self.weights is not None and not isinstance(self.weights, (str, os.PathLike)):
            raise OffloadConfigError(f"weights: expected a path, got {type(self.weights).__name__}")
        if self.weights is not None:
            self.weights = os.fspath(self.weights)
        if self.disk_cache_policy not in ("belady", "fifo", "lru"):
            raise OffloadConfigError(f"disk_cache_policy: unknown value {self.disk_cache_policy!r} (choose belady, fifo or lru)")
        for key in ("disk_verify", "compile"):
            if not isinstance(getattr(self, key), bool):
                raise OffloadConfigError(f"{key}: expected true or false, got {getattr(self, key)!r}")
        if self.disk_direct not in (None, True, False):
            raise OffloadConfigError(f"disk_direct: expected true, false or null, got {self.disk_direct!r}")
        if self.disk_stream_slots is not None and (not isinstance(self.disk_stream_slots, int)
                                                   or isinstance(self.disk_stream_slots, bool)
                                                   or self.disk_stream_slots < 1):
            raise OffloadConfigError(f"disk_stream_slots: must be a whole number >= 1, got {self.disk_stream_slots!r}")

    @property
    def resolved_fp8_scaling(self) -> str:
        """The fp8 scaling the engine packs with: the key, else the default (lazy_load then takes the shards')."""
        from .quant import DEFAULT_SCALING

        return self.fp8_scaling or DEFAULT_SCALING

    @classmethod
    def from_overrides(cls, config: "OffloadConfig | dict | None" = None, **overrides: Any) -> "OffloadConfig":
        base: dict[str, Any] = {}
        if isinstance(config, OffloadConfig):
            base = {f.name: getattr(config, f.name) for f in dataclasses.fields(cls)}
        elif isinstance(config, dict):
            base = dict(config)
        elif config is not None:
            raise OffloadConfigError(f"config: expected an OffloadConfig or a dict, got {type(config).__name__}")
        base.update(overrides)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(base) - names)
        if unknown:
            hint = " (pass the optimizer as an argument: enable_offload(model, optimizer=opt))" if unknown[0] == "extra" else ""
            raise OffloadConfigError(f"{unknown[0]}: unknown offload key{hint} (known keys: {', '.join(sorted(names))})")
        return cls(**base)
