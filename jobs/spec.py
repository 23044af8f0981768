"""The YAML job spec: pydantic models, validation with field-naming errors, schema.

Every field is optional except what a kind needs:
command needs `command`, shard needs `shard.src` and `shard.dst`, train and infer need `model.path`
(or `model.transformer` with `model.base`).
Every number has bounds a worker can hold and wait for. Reading files (UTF-8, duplicate keys,
nesting, --set overrides) is `jobs.spec_yaml`; this module validates what it reads.
Kept light on purpose (pydantic + pyyaml only): the CLI imports it for `validate`.
"""

from __future__ import annotations

import difflib
import math
import re
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union

from byte_sizes import parse_bytes as _parse_size
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from jobs.errors import SpecError
from jobs.spec_yaml import (
    ENV_NAME, IMAGE_REF, MAX_ARG_BYTES, MAX_ARGV_TOTAL, MAX_DEPTH, MAX_DURATION_S,
    MAX_SPEC_BYTES, MAX_STOP_GRACE_S, apply_overrides, check_tree, decode_spec_bytes, line_of, read_spec_data,
    with_origin, yaml_load,
)
from jobs import contract
from jobs.contract import EXECUTORS, KINDS, REASONS, RUNNER_ENV_OPTIONS, RUNNER_ENV_SIZES
from jobs.spec_runners import MOVED_TO_OFFLOAD, InferSpec, ModelSpec, TrainSpec  # the runners' sections live there

__all__ = [
    "KINDS",
    "REASONS",
    "MAX_SPEC_BYTES",
    "JobSpec",
    "ModelSpec",
    "OffloadSpec",
    "TrainSpec",
    "InferSpec",
    "ShardSpec",
    "ResourcesSpec",
    "RetrySpec",
    "LimitsSpec",
    "parse_bytes",
    "parse_duration",
    "load_spec",
    "parse_spec",
    "apply_overrides",
    "check_tree",
    "json_schema",
    "template",
]

Kind = Literal[KINDS]  # type: ignore[valid-type]
Reason = Literal[REASONS]  # type: ignore[valid-type]
Executor = Literal[EXECUTORS]  # type: ignore[valid-type]

_SECONDS = {"": 1, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "d": 86400, "ms": 0.001}


class _FieldError(ValueError):
    """A cross-field rule failed; carries the dotted field it is about."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(message)


def parse_bytes(value: Any) -> Any:
    """`7.5GiB`, `512MB`, `1e9` or an int -> bytes (int), at most 1 EiB (byte_sizes, the engine's parser too).
    Types that are no size pass to pydantic to reject."""
    if value is None or (isinstance(value, (int, float, str)) and not isinstance(value, bool)):
        return _parse_size(value)
    if isinstance(value, bool):
        raise ValueError("expected bytes (an int or a size like '7.5GiB'), got a boolean")
    return value


def parse_duration(value: Any) -> Any:
    """`30m`, `1h`, `90s`, `1h30m` or a number of seconds -> seconds (float), at most 366 days."""
    if isinstance(value, bool):
        raise ValueError("expected a duration (seconds or e.g. '30m'), got a boolean")
    if isinstance(value, str):
        parts = re.findall(r"([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)", value)
        rest = re.sub(r"([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)", "", value).strip()
        bare = len(parts) > 1 and any(not u for _, u in parts)  # "1h30": 30 what?
        if not parts or rest or bare or any(u.lower() not in _SECONDS for _, u in parts):
            raise ValueError(f"not a duration: {value!r:.60} (use seconds or e.g. '30m', '1h30m', '90s')")
        value = float(sum(float(n) * _SECONDS[u.lower()] for n, u in parts))
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError("must be a finite duration")
        if value < 0:
            raise ValueError("must be >= 0")
        if value > MAX_DURATION_S:
            raise ValueError("is longer than 366 days")
        return float(value)
    return value


def _command(value: Any) -> Any:
    if value is None:
        return value
    if isinstance(value, str):
        if len(value.encode("utf-8", "surrogatepass")) > MAX_ARG_BYTES:
            raise ValueError(f"is longer than {MAX_ARG_BYTES} bytes (the kernel's limit for one argument); "
                             "put it in a script and run that")
        return value
    if isinstance(value, list) and all(isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in value):
        argv = [str(v) for v in value]
        if any(len(a.encode("utf-8", "surrogatepass")) > MAX_ARG_BYTES for a in argv):
            raise ValueError(f"an argument is longer than {MAX_ARG_BYTES} bytes (the kernel's limit for one argument)")
        if sum(len(a) + 1 for a in argv) > MAX_ARGV_TOTAL:
            raise ValueError(f"the arguments add up to more than {MAX_ARGV_TOTAL} bytes")
        return argv
    raise ValueError("must be a string (run by /bin/sh -c) or a list of strings (run directly)")


def _env_value(value: Any) -> Any:
    # YAML turns `FOO: 1` into an int; environment values are strings.
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, str) and len(value.encode("utf-8", "surrogatepass")) > MAX_ARG_BYTES:
        raise ValueError(f"is longer than {MAX_ARG_BYTES} bytes (the kernel's limit for one variable)")
    return value


def _env(value: Any) -> Any:
    if not isinstance(value, dict):
        return value
    for name in value:
        if not isinstance(name, str) or not ENV_NAME.fullmatch(name):
            raise _FieldError(f"env.{name}", "is not a valid environment variable name (letters, digits and _, "
                                             "not starting with a digit)")
        if len(name) > 256:
            raise _FieldError(f"env.{name[:40]}...", "name is longer than 256 characters")
        if name.startswith("OFFLOAD_JOBS_") and name not in RUNNER_ENV_OPTIONS:
            raise _FieldError(f"env.{name}", "OFFLOAD_JOBS_* variables are set by the worker; choose another name "
                                             f"(a job may set {', '.join(sorted(RUNNER_ENV_OPTIONS))})")
        if name in RUNNER_ENV_SIZES and isinstance(value[name], (str, int, float)) and not isinstance(value[name], bool):
            try:  # found at submit, not when the job's runner reads it
                _parse_size(value[name].strip() if isinstance(value[name], str) else value[name])
            except ValueError as exc:
                raise _FieldError(f"env.{name}", str(exc)) from None
    return value


def _image(value: Any) -> Any:
    if isinstance(value, str) and (len(value) > 255 or not IMAGE_REF.fullmatch(value)):
        raise ValueError(f"not a container image reference: {value!r:.60}")
    return value


Bytes = Annotated[int, BeforeValidator(parse_bytes)]
Seconds = Annotated[float, BeforeValidator(parse_duration)]
EnvValue = Annotated[str, BeforeValidator(_env_value)]
Count = Annotated[int, Field(ge=1, le=10**9)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=False, allow_inf_nan=False)


class OffloadSpec(_Strict):
    """Every offload setting of a job: `enabled`, and the engine's config keys (offload_core.OffloadConfig;
    unset keys keep the engine's defaults)."""

    # The runners map this section to an OffloadConfig in one place: jobs.runners.load.offload_config

    enabled: Optional[bool] = Field(
        None, description="Stream the transformer's weights through the engine (default); false keeps it resident.")
    target_device: Optional[str] = Field(None, description="cuda, cuda:N or cpu.")
    cpu_offload: Optional[bool] = None
    offload_granularity: Optional[Literal["leaf", "block", "phase", "auto"]] = None
    offload_ratio: Optional[float] = Field(None, ge=0.0, le=1.0, description="Fraction of units streamed.")
    vram_budget: Optional[Bytes] = Field(None, description="Bytes or a size like '7.5GiB'.")
    prefetch: Optional[int] = Field(None, ge=0, le=4096, description="Prefetch depth in units.")
    stray_resident_fraction: Optional[float] = Field(
        None, ge=0.0, le=1.0,
        description="Tensors outside the block lists stay resident when at most this share of the streamed bytes.")
    lazy_load: Optional[bool] = None
    offload_to_disk: Optional[bool] = None
    shard_dir: Optional[str] = None
    num_disk_workers: Optional[int] = Field(None, ge=1, le=1024)
    max_memory: Optional[Bytes] = Field(
        None, description="Disk tier: pinned host bytes for the staging slots and the cache (0: no cache).")
    disk_cache_policy: Optional[Literal["belady", "fifo", "lru"]] = Field(
        None, description="Disk cache eviction: next use in the traced order (belady), or fifo/lru.")
    disk_verify: Optional[bool] = Field(None, description="Check every unit read from disk against its sha256 "
                                        "(unset: each unit's fast checksum on its first read in the job).")
    disk_direct: Optional[bool] = Field(None, description="O_DIRECT disk reads (default: where the filesystem allows).")
    disk_stream_slots: Optional[int] = Field(
        None, ge=1, le=1024, description="Staging slots the disk workers read into (default num_disk_workers + 2).")
    pinned_limit: Optional[Bytes] = Field(
        None, description="Most host memory to pin (default: what the box allows); past it, weights stream from "
                          "pageable RAM through a pinned bounce ring of this size.")
    num_copy_threads: Optional[int] = Field(
        None, ge=1, le=64, description="Threads filling the bounce ring from pageable RAM (default: by core count).")
    enable_optimizer_cpu_offload: Optional[bool] = None
    weight_dtype: Optional[Literal["float8_e4m3fn", "bfloat16", "float16", "float32"]] = Field(
        None, description="Storage dtype of the streamed weights: float8_e4m3fn halves the bytes each step copies "
                          "(LoRAs are still trained and saved in the model's dtype).")
    fp8_scaling: Optional[Literal["tensor", "row", "block"]] = Field(
        None, description="With weight_dtype float8_e4m3fn: one scale per tensor, per output row or per 128x128 tile "
                          "(default row; with lazy_load, what the shards hold).")
    vram_margin: Optional[Bytes] = Field(
        None, description="VRAM the ring's growth leaves free (default the larger of 512 MiB and 5% of the card).")
    overlap_optimizer_step: Optional[bool] = Field(
        None, description="Optimizer offload: step each unit on the CPU while backward goes on (default: on once it is safe).")
    fused_cpu_optimizer: Optional[bool] = Field(
        None, description="Optimizer offload: torch's fused CPU Adam/AdamW (false: bitwise equal to the plain kernel).")
    split_threshold_mb: Optional[float] = Field(None, gt=0.0, le=1e9, description="Units bigger than this many MB are split.")
    treat_as_inference: Optional[bool] = Field(
        None, description="Stream every weight as frozen (default: when no parameter is frozen).")
    park_saved_tensors: Optional[bool] = Field(
        None, description="Training: hold saved activations of 4 MiB or more (with checkpointing, each block's "
                          "inputs) in host memory until the backward; for train.accumulation_order layer, which keeps "
                          "every micro-batch's until its one backward (default off).")
    compile: Optional[bool] = Field(
        None, description="torch.compile each repeated block class once (regional, static shapes; with enabled "
                          "false too): the first step pays the compile (tens of seconds at Flux-dev size), later "
                          "steps run faster. Needs offload_granularity block or auto, and no split_threshold_mb.")

    @model_validator(mode="after")
    def _compile_needs_whole_blocks(self) -> "OffloadSpec":
        if self.compile and (self.offload_granularity in ("leaf", "phase") or self.split_threshold_mb is not None):
            what = "split_threshold_mb" if self.split_threshold_mb is not None else f"offload_granularity: {self.offload_granularity}"
            raise _FieldError("offload.compile", f"compiles whole blocks, but {what} streams parts of them "
                                                 "(the engine's hooks would land inside the compiled graph); use "
                                                 "offload_granularity block or auto, without split_threshold_mb")
        return self

    @model_validator(mode="after")
    def _fp8_scaling_needs_fp8(self) -> "OffloadSpec":
        if self.fp8_scaling is not None and self.weight_dtype != "float8_e4m3fn":
            raise _FieldError("offload.fp8_scaling", "applies to offload.weight_dtype: float8_e4m3fn only; "
                                                     "set that too, or remove fp8_scaling")
        return self

    def engine_kwargs(self) -> dict[str, Any]:
        """The engine keys the user set, ready for `enable_offload(model, **kwargs)`."""
        return self.model_dump(exclude_none=True, exclude={"enabled"})


class ShardSpec(_Strict):
    src: Optional[str] = Field(None, description="Diffusers folder or single-file checkpoint.")
    dst: Optional[str] = Field(None, description="Output shard directory.")
    dtype: Optional[str] = Field(None, description="Convert to this dtype (bfloat16, float8_e4m3fn).")
    fp8_scaling: Optional[Literal["tensor", "row", "block"]] = Field(
        None, description="With dtype float8_e4m3fn: one scale per tensor, per output row or per 128x128 tile "
                          "(default row, as the engine's).")
    overwrite: bool = Field(False, description="Write into a non-empty dst this tool did not write (its other files stay).")

    @model_validator(mode="after")
    def _fp8_scaling_needs_fp8(self) -> "ShardSpec":
        if self.fp8_scaling is not None and str(self.dtype).lower() not in ("float8_e4m3fn", "fp8"):
            raise _FieldError("shard.fp8_scaling", "applies to shard.dtype: float8_e4m3fn only; set that too, "
                                                   "or remove fp8_scaling")
        return self


class ResourcesSpec(_Strict):
    gpus: Optional[int] = Field(None, ge=0, le=1024, description="GPUs needed; default 0 for command/shard, 1 otherwise.")
    min_vram: Optional[Bytes] = Field(None, description="Memory each of its GPUs must have (e.g. '24GiB'); "
                                                        "only a worker with such GPUs free claims the job.")
    vram_budget: Optional[Bytes] = Field(None, description="The engine's VRAM budget when offload.vram_budget "
                                                           "and offload.offload_ratio are unset.")
    shm_size: Optional[Bytes] = Field(None, description="Shared memory for the docker executor.")
    ram: Optional[Bytes] = Field(None, description="Host RAM this train/infer job may hold (default: what the box can "
                                                   "give); past it the weights stream from shards in the model cache.")


class RetrySpec(_Strict):
    max_attempts: int = Field(3, ge=1, le=1000, description="Attempts in total, the first included.")
    on: list[Reason] = Field(default_factory=lambda: [contract.Reason.WORKER_LOST.value], description="Reasons that trigger a retry.")


class LimitsSpec(_Strict):
    max_duration: Optional[Seconds] = Field(None, gt=0, description="Seconds or e.g. '30m' (at most 366 days); exceeded -> timeout.")
    stop_grace: Seconds = Field(10.0, ge=0, le=MAX_STOP_GRACE_S, description="Seconds between SIGTERM and SIGKILL (at most 1h).")


class JobSpec(_Strict):
    kind: Kind
    name: Optional[str] = Field(None, max_length=200)
    model: ModelSpec = Field(default_factory=ModelSpec)
    offload: OffloadSpec = Field(default_factory=OffloadSpec)
    train: TrainSpec = Field(default_factory=TrainSpec)
    infer: InferSpec = Field(default_factory=InferSpec)
    shard: ShardSpec = Field(default_factory=ShardSpec)
    command: Annotated[Optional[Union[str, list[str]]], BeforeValidator(_command)] = None
    workdir: Optional[str] = Field(None, max_length=4096, description="Working directory; default the job's run dir.")
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    retry: RetrySpec = Field(default_factory=RetrySpec)
    limits: LimitsSpec = Field(default_factory=LimitsSpec)
    env: Annotated[dict[str, EnvValue], BeforeValidator(_env)] = Field(default_factory=dict, max_length=1024)
    outputs: Optional[Union[str, list[str]]] = None
    priority: int = Field(0, ge=-10**6, le=10**6, description="Higher runs first; ties run oldest first.")
    executor: Executor = Field("process", description="process (default), docker, or slurm (an sbatch per attempt).")
    image: Annotated[Optional[str], BeforeValidator(_image)] = Field(None, description="Container image for executor: docker.")

    @model_validator(mode="after")
    def _kind_needs(self) -> "JobSpec":
        if self.kind == "command":
            if self.command is None or (isinstance(self.command, str) and not self.command.strip()):
                raise _FieldError("command", "a command job needs `command` (a string or a list)")
            if isinstance(self.command, list) and not self.command:
                raise _FieldError("command", "must not be an empty list")
        elif self.kind == "shard":
            if not self.shard.src:
                raise _FieldError("shard.src", "a shard job needs `shard.src`")
            if not self.shard.dst:
                raise _FieldError("shard.dst", "a shard job needs `shard.dst`")
        else:
            self._model_sources()
        if self.resources.min_vram and self.gpus == 0:
            raise _FieldError("resources.min_vram", "needs a GPU job: set resources.gpus too")
        if contract.Reason.CANCELLED in self.retry.on:
            raise _FieldError("retry.on", "a cancelled job is never retried; remove `cancelled`")
        self._move_offload_keys()
        if self.kind == "train" and self.train.accumulation_order == "layer" and self.offload.enable_optimizer_cpu_offload:
            raise _FieldError("train.accumulation_order", "layer needs the LoRA weights resident; "
                                                          "offload.enable_optimizer_cpu_offload streams them (use micro, "
                                                          "or turn optimizer offload off)")
        env_bytes = sum(len(k) + len(v.encode("utf-8", "surrogatepass")) + 2 for k, v in self.env.items())
        cmd = self.command if isinstance(self.command, list) else [self.command or ""]
        if env_bytes + sum(len(a.encode("utf-8", "surrogatepass")) + 1 for a in cmd) > MAX_ARGV_TOTAL:
            raise _FieldError("env", f"`env` and `command` add up to more than {MAX_ARGV_TOTAL} bytes, "
                                     "more than a process can be started with")
        return self

    def _model_sources(self) -> None:
        m = self.model
        for i, f in enumerate(m.text_encoders or []):
            if not f.strip():
                raise _FieldError("model.text_encoders", f"item {i} must not be empty")
        if m.vae is not None and not m.vae.strip():
            raise _FieldError("model.vae", "must not be empty")
        if m.transformer is None:
            parts = bool(m.text_encoders) or m.vae is not None
            if not m.path and not (parts and m.base):
                raise _FieldError("model.path", f"a {self.kind} job needs `model.path` (or `model.transformer` "
                                                "and `model.base`)")
            if m.base and not parts:
                raise _FieldError("model.base", "is read only with `model.transformer`, `model.text_encoders` or "
                                                "`model.vae`; use `model.path`")
            if m.base and m.path:
                raise _FieldError("model.base", "set `model.base` or `model.path`, not both")
            return
        if not m.transformer.strip():
            raise _FieldError("model.transformer", "must not be empty")
        if m.base and m.path:
            raise _FieldError("model.base", "set `model.base` or `model.path`, not both (with `model.transformer` "
                                            "they mean the same: where the text encoders, VAE and configs come from)")
        if not (m.base or m.path):
            raise _FieldError("model.base", "a transformer file needs `model.base`: a diffusers folder or hub id "
                                            "for the text encoders, VAE, tokenizers and configs")

    def _move_offload_keys(self) -> None:
        # The train.* offload keys of older specs are read for one release, into offload.*
        for old, new in MOVED_TO_OFFLOAD.items():
            if old not in self.train.model_fields_set:
                continue
            value, current = getattr(self.train, old), getattr(self.offload, new)
            if current is not None and current != value:
                raise _FieldError(f"train.{old}", f"is deprecated and conflicts with offload.{new}={current}; "
                                                  f"remove train.{old}")
            setattr(self.offload, new, value)

    def deprecations(self) -> list[str]:
        """One line per deprecated key the spec sets, naming the key to use instead."""
        return [f"train.{old} is deprecated (read for one more release): use offload.{new}"
                for old, new in MOVED_TO_OFFLOAD.items() if old in self.train.model_fields_set]

    @property
    def gpus(self) -> int:
        """GPUs this job holds while it runs."""
        if self.resources.gpus is not None:
            return self.resources.gpus
        return 0 if self.kind in ("command", "shard") else 1

    def display_name(self) -> str:
        return self.name or self.kind


# ---------------------------------------------------------------- loading and errors


_TYPE_TAG = re.compile(r"^(int|str|float|bool|list|dict|none|literal|function-|list\[|dict\[|union\[|tagged-union)")


def _field_path(loc: tuple[Any, ...], data: Any) -> str:
    """Dotted path from a pydantic loc, dropping union/validator tags that are not field names."""
    parts: list[str] = []
    cur = data
    for seg in loc:
        if isinstance(seg, int):
            parts.append(f"[{seg}]") if parts else parts.append(str(seg))
            cur = cur[seg] if isinstance(cur, list) and seg < len(cur) else None
            continue
        if isinstance(cur, dict) and seg in cur:
            parts.append(seg)
            cur = cur[seg]
        elif _TYPE_TAG.match(str(seg)):
            continue
        else:
            parts.append(str(seg))
            cur = None
    return ".".join(parts).replace(".[", "[")


def _allowed_fields(loc: tuple[Any, ...]) -> list[str]:
    model: Any = JobSpec
    for seg in loc[:-1]:
        f = getattr(model, "model_fields", {}).get(seg)
        ann = getattr(f, "annotation", None) if f else None
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            model = ann
        else:
            return []
    return [name for name in getattr(model, "model_fields", {})
            if not (model is TrainSpec and name in MOVED_TO_OFFLOAD)]  # deprecated keys are not offered


def _first_error(exc: ValidationError, data: Any) -> tuple[str | None, str]:
    # The deepest error is the most precise one (a union reports one error per member).
    errors = exc.errors(include_url=False)
    err = max(errors, key=lambda e: len(e.get("loc", ())))
    ctx_err = (err.get("ctx") or {}).get("error")
    if isinstance(ctx_err, _FieldError):
        return ctx_err.field, str(ctx_err)
    loc = tuple(err.get("loc", ()))
    field = _field_path(loc, data) or None
    msg = err.get("msg", "invalid value")
    if err.get("type") == "extra_forbidden":
        allowed = _allowed_fields(loc)
        close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
        msg = "unknown field" + (f" (did you mean `{close[0]}`?)" if close else "")
        if allowed:
            msg += f"; allowed: {', '.join(allowed)}"
    elif err.get("type") == "missing":
        msg = "required field is missing"
    else:
        msg = msg.removeprefix("Value error, ")
        inp = err.get("input")
        if not isinstance(inp, (dict, list)) and err.get("type") != "value_error":
            msg += f" (got {inp!r:.60})"
    extra = len(errors) - 1
    if extra > 0:
        msg += f" (+{extra} more error{'s' if extra > 1 else ''})"
    return field, msg


def _validate(data: Any, node: Any = None, file: str | None = None) -> JobSpec:
    if not isinstance(data, dict):
        raise SpecError(None, f"a job spec must be a mapping with a `kind`, got {type(data).__name__}", file=file)
    try:
        check_tree(data)
    except SpecError as exc:
        exc.file, exc.line = file, line_of(node, exc.field) if node is not None else None
        exc.args = (str(exc),)
        raise exc from None
    try:
        return JobSpec.model_validate(data)
    except ValidationError as exc:
        field, msg = _first_error(exc, data)
        raise SpecError(field, msg, line=line_of(node, field) if node is not None else None, file=file) from None
    except RecursionError:
        raise SpecError(None, f"nested more than {MAX_DEPTH} levels deep", file=file) from None


def parse_spec(source: str | bytes | dict[str, Any], *, file: str | None = None) -> JobSpec:
    """Validate a spec given as YAML text (or bytes) or an already-parsed dict."""
    if isinstance(source, dict):
        return _validate(source, file=file)
    if isinstance(source, bytes):
        source = decode_spec_bytes(source, file)
    elif len(source) > MAX_SPEC_BYTES:
        raise SpecError(None, f"the spec is longer than {MAX_SPEC_BYTES} characters (1 MiB)", file=file)
    data, node = yaml_load(source, file)
    return _validate(data, node, file)


def load_spec(path: str | Path, sets: list[str] | None = None) -> JobSpec:
    """Read, override (`a.b=c` strings) and validate a YAML spec file.

    Errors name the file (and line), the field, and the `--set` a bad value came from.
    """
    data, node = read_spec_data(path, sets)
    try:
        return _validate(data, node, str(path))
    except SpecError as exc:
        raise with_origin(exc, str(path), node, sets) from None


def json_schema() -> dict[str, Any]:
    """JSON Schema of a job spec (for editors and the README reference)."""
    schema = JobSpec.model_json_schema()
    schema["title"] = "offload-jobs job spec"
    return schema


def template(kind: str) -> str:
    """A commented YAML template for `kind` (what `offload-jobs init --kind KIND` writes)."""
    if kind not in KINDS:
        raise SpecError("kind", f"unknown kind {kind!r}; choose one of {', '.join(KINDS)}")
    return resources.files("jobs").joinpath("templates", f"{kind}.yaml").read_text(encoding="utf-8")
