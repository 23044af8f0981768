"""The YAML job spec: pydantic models, loading with field-naming errors, overrides, schema.

Every field is optional except what a kind needs:
command needs `command`, shard needs `shard.src` and `shard.dst`, train and infer need `model.path`.
Kept light on purpose (pydantic + pyyaml only): the CLI imports it for `validate` and `submit`.
"""

from __future__ import annotations

import copy
import datetime
import difflib
import math
import re
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from jobs.errors import SpecError
from jobs.vocab import EXECUTORS, KINDS, REASONS

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
    "json_schema",
    "template",
]

Kind = Literal[KINDS]  # type: ignore[valid-type]
Reason = Literal[REASONS]  # type: ignore[valid-type]
Executor = Literal[EXECUTORS]  # type: ignore[valid-type]

# Bounds: what a worker can hold in SQLite, pass to exec(), and wait for.
MAX_SPEC_BYTES = 1 << 20  # a spec file, and a spec sent to the worker
MAX_DEPTH = 32  # nesting of mappings and lists
MAX_NODES = 100_000  # values in one spec (aliases counted each time they are used)
MAX_INT = 2**63 - 1  # SQLite's INTEGER
MAX_BYTES = 1 << 60  # 1 EiB: any size past this is a typo
MAX_DURATION_S = 366 * 86400.0
MAX_STOP_GRACE_S = 3600.0
MAX_ARG_BYTES = 128 * 1024 - 1  # Linux MAX_ARG_STRLEN, less the NUL
MAX_ARGV_TOTAL = 1 << 20  # argv + env of the child, well under ARG_MAX
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
IMAGE_REF = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/:@+-]*")

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_SECONDS = {"": 1, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "d": 86400, "ms": 0.001}


class _FieldError(ValueError):
    """A cross-field rule failed; carries the dotted field it is about."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(message)


def parse_bytes(value: Any) -> Any:
    """`7.5GiB`, `512MB`, `1e9` or an int -> bytes (int), at most 1 EiB. Other types pass to pydantic to reject."""
    if isinstance(value, bool):
        raise ValueError("expected bytes (an int or a size like '7.5GiB'), got a boolean")
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", value)
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"not a size: {value!r:.60} (use bytes or e.g. '7.5GiB', '512MB')")
        value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError("must be a finite size")
        if value < 0:
            raise ValueError("must be >= 0")
        if value > MAX_BYTES:
            raise ValueError("is larger than 1 EiB; check the units")
        return int(value)
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
        if name.startswith("OFFLOAD_JOBS_"):
            raise _FieldError(f"env.{name}", "OFFLOAD_JOBS_* variables are set by the worker; choose another name")
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


class ModelSpec(_Strict):
    path: Optional[str] = Field(None, description="Diffusers folder, single-file checkpoint or shard dir.")
    family: Optional[str] = Field(None, description="Model family (flux, sd3, wan, qwen-image); guessed when unset.")
    dtype: Optional[str] = Field(None, description="Compute dtype: bfloat16, float16 or float32.")


class OffloadSpec(_Strict):
    """The engine's config keys (offload_core.OffloadConfig); unset keys keep the engine's defaults."""

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
    max_memory: Optional[Bytes] = Field(None, description="CPU cache budget in bytes or a size.")
    enable_optimizer_cpu_offload: Optional[bool] = None
    weight_dtype: Optional[str] = Field(None, description="Storage dtype, e.g. float8_e4m3fn.")

    def engine_kwargs(self) -> dict[str, Any]:
        """The keys the user set, ready for `enable_offload(model, **kwargs)`."""
        return self.model_dump(exclude_none=True)


class TrainSpec(_Strict):
    dataset: Optional[str] = Field(None, description="Folder of images with captions.")
    steps: int = Field(1000, ge=1, le=10**9)
    lr: float = Field(1e-4, gt=0.0, le=1e3)
    rank: int = Field(16, ge=1, le=65536, description="LoRA rank.")
    lora_alpha: Optional[float] = Field(None, gt=0.0, le=1e6)
    target_modules: Optional[list[str]] = None
    batch_size: int = Field(1, ge=1, le=65536)
    gradient_accumulation_steps: int = Field(1, ge=1, le=65536)
    gradient_checkpointing: bool = True
    save_every: int = Field(250, ge=1, le=10**9)
    seed: int = Field(0, ge=0, le=MAX_INT)
    resolution: int = Field(1024, ge=8, le=65536)


class InferSpec(_Strict):
    prompt: str = ""
    negative_prompt: Optional[str] = None
    steps: int = Field(28, ge=1, le=100_000)
    guidance: float = Field(3.5, ge=0.0, le=1e4)
    height: int = Field(1024, ge=8, le=65536)
    width: int = Field(1024, ge=8, le=65536)
    seed: int = Field(0, ge=0, le=MAX_INT)
    num_images: int = Field(1, ge=1, le=10_000)


class ShardSpec(_Strict):
    src: Optional[str] = Field(None, description="Diffusers folder or single-file checkpoint.")
    dst: Optional[str] = Field(None, description="Output shard directory.")
    dtype: Optional[str] = Field(None, description="Convert to this dtype (bfloat16, float8_e4m3fn).")


class ResourcesSpec(_Strict):
    gpus: Optional[int] = Field(None, ge=0, le=1024, description="GPUs needed; default 0 for command/shard, 1 otherwise.")
    vram_budget: Optional[Bytes] = None
    shm_size: Optional[Bytes] = Field(None, description="Shared memory for the docker executor.")


class RetrySpec(_Strict):
    max_attempts: int = Field(3, ge=1, le=1000, description="Attempts in total, the first included.")
    on: list[Reason] = Field(default_factory=lambda: ["worker_lost"], description="Reasons that trigger a retry.")


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
    executor: Executor = "process"
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
        elif not self.model.path:
            raise _FieldError("model.path", f"a {self.kind} job needs `model.path`")
        if "cancelled" in self.retry.on:
            raise _FieldError("retry.on", "a cancelled job is never retried; remove `cancelled`")
        env_bytes = sum(len(k) + len(v.encode("utf-8", "surrogatepass")) + 2 for k, v in self.env.items())
        cmd = self.command if isinstance(self.command, list) else [self.command or ""]
        if env_bytes + sum(len(a.encode("utf-8", "surrogatepass")) + 1 for a in cmd) > MAX_ARGV_TOTAL:
            raise _FieldError("env", f"`env` and `command` add up to more than {MAX_ARGV_TOTAL} bytes, "
                                     "more than a process can be started with")
        return self

    @property
    def gpus(self) -> int:
        """GPUs this job holds while it runs."""
        if self.resources.gpus is not None:
            return self.resources.gpus
        return 0 if self.kind in ("command", "shard") else 1

    def display_name(self) -> str:
        return self.name or self.kind


# ---------------------------------------------------------------- loading and errors


class _Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 booleans: `on:` (as in `retry.on`) stays a string key, not True."""


_Loader.yaml_implicit_resolvers = {
    ch: [(tag, rx) for tag, rx in rs if tag != "tag:yaml.org,2002:bool"]
    for ch, rs in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


def _yaml_scalar(raw: str) -> Any:
    data, _ = _yaml_load(raw)
    return data

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
    return list(getattr(model, "model_fields", {}))


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


def _line_of(node: Any, field: str | None) -> int | None:
    """1-based line of `field` (dotted) in a composed YAML node tree, or of the deepest parent found."""
    if node is None:
        return None
    line = node.start_mark.line + 1
    if not field:
        return line
    for seg in re.findall(r"[^.\[\]]+", field):
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                if isinstance(k, yaml.ScalarNode) and k.value == seg:
                    line, node = k.start_mark.line + 1, v
                    break
            else:
                return line
        elif isinstance(node, yaml.SequenceNode) and seg.isdigit() and int(seg) < len(node.value):
            node = node.value[int(seg)]
            line = node.start_mark.line + 1
        else:
            return line
    return line


_PLAIN = (str, int, float, bool, type(None))


def _check_tree(data: Any) -> None:
    """Refuse, naming the field, what no field can hold: NaN/inf, huge ints, NUL bytes, binary,
    dates, non-string keys, nesting past MAX_DEPTH, more than MAX_NODES values (alias bombs)."""
    stack: list[tuple[Any, str, int]] = [(data, "", 0)]
    seen = 0
    while stack:
        value, path, depth = stack.pop()
        seen += 1
        if seen > MAX_NODES:
            raise SpecError(path or None, f"the spec holds more than {MAX_NODES} values (a YAML alias bomb?)")
        where = path or None
        if isinstance(value, dict):
            if depth >= MAX_DEPTH:
                raise SpecError(where, f"nested more than {MAX_DEPTH} levels deep")
            for k, v in value.items():
                if not isinstance(k, str):
                    raise SpecError(where, f"keys must be strings, got {k!r:.40}")
                if "\0" in k:
                    raise SpecError(where, f"key {k!r:.40} holds a NUL byte")
                stack.append((v, f"{path}.{k}" if path else k, depth + 1))
        elif isinstance(value, list):
            if depth >= MAX_DEPTH:
                raise SpecError(where, f"nested more than {MAX_DEPTH} levels deep")
            for i, v in enumerate(value):
                stack.append((v, f"{path}[{i}]", depth + 1))
        elif isinstance(value, bool) or value is None:
            continue
        elif isinstance(value, int):
            if abs(value) > MAX_INT:
                raise SpecError(where, f"integer {str(value)[:20]}... is out of range (at most {MAX_INT})")
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise SpecError(where, f"{value} is not allowed (numbers must be finite; quote it for a string)")
        elif isinstance(value, str):
            if "\0" in value:
                raise SpecError(where, "holds a NUL byte")
            if len(value) > MAX_SPEC_BYTES:
                raise SpecError(where, f"is longer than {MAX_SPEC_BYTES} characters")
        elif isinstance(value, bytes):
            raise SpecError(where, "binary values (!!binary) are not allowed")
        elif isinstance(value, (datetime.date, datetime.datetime)):
            raise SpecError(where, f"{value} reads as a date; quote it if you mean a string")
        else:
            raise SpecError(where, f"a YAML {type(value).__name__} is not allowed here")


def _validate(data: Any, node: Any = None, file: str | None = None) -> JobSpec:
    if not isinstance(data, dict):
        raise SpecError(None, f"a job spec must be a mapping with a `kind`, got {type(data).__name__}", file=file)
    try:
        _check_tree(data)
    except SpecError as exc:
        exc.file, exc.line = file, _line_of(node, exc.field) if node is not None else None
        raise exc from None
    try:
        return JobSpec.model_validate(data)
    except ValidationError as exc:
        field, msg = _first_error(exc, data)
        raise SpecError(field, msg, line=_line_of(node, field) if node is not None else None, file=file) from None
    except RecursionError:
        raise SpecError(None, f"nested more than {MAX_DEPTH} levels deep", file=file) from None


def _check_nodes(root: Any, file: str | None) -> None:
    """On the composed YAML: duplicate keys are an error (YAML says so; PyYAML keeps the last),
    nesting is bounded, and so is the count of nodes aliases expand to."""
    stack: list[tuple[Any, str, int]] = [(root, "", 0)]
    seen = 0
    while stack:
        node, path, depth = stack.pop()
        seen += 1
        if seen > MAX_NODES:
            raise SpecError(path or None, f"the spec holds more than {MAX_NODES} values (a YAML alias bomb?)",
                            line=node.start_mark.line + 1, file=file)
        if isinstance(node, (yaml.MappingNode, yaml.SequenceNode)) and depth >= MAX_DEPTH:
            raise SpecError(path or None, f"nested more than {MAX_DEPTH} levels deep",
                            line=node.start_mark.line + 1, file=file)
        if isinstance(node, yaml.MappingNode):
            keys: dict[str, int] = {}
            for k, v in node.value:
                if isinstance(k, yaml.ScalarNode) and k.tag != "tag:yaml.org,2002:merge":
                    name = k.value
                    here = f"{path}.{name}" if path else name
                    if name in keys:
                        raise SpecError(here, f"duplicate key (first set on line {keys[name]})",
                                        line=k.start_mark.line + 1, file=file)
                    keys[name] = k.start_mark.line + 1
                else:
                    here = path
                stack.append((v, here, depth + 1))
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                stack.append((v, f"{path}[{i}]", depth + 1))


def _yaml_load(text: str, file: str | None = None) -> tuple[Any, Any]:
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is not None:
            _check_nodes(node, file)
        data = loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        line = mark.line + 1 if mark is not None else None
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise SpecError(None, f"malformed YAML: {problem}", line=line, file=file) from None
    except RecursionError:
        raise SpecError(None, f"malformed YAML: nested more than {MAX_DEPTH} levels deep", file=file) from None
    finally:
        loader.dispose()
    return data, node


def decode_spec_bytes(raw: bytes, file: str | None = None) -> str:
    """Spec file bytes -> text: UTF-8 (a BOM is allowed), no NUL bytes, at most MAX_SPEC_BYTES."""
    if len(raw) > MAX_SPEC_BYTES:
        raise SpecError(None, f"the spec is {len(raw)} bytes; the limit is {MAX_SPEC_BYTES} (1 MiB)", file=file)
    nul = raw.find(b"\0")
    if nul >= 0:
        raise SpecError(None, f"a binary file, not a YAML spec (NUL byte at offset {nul})", file=file)
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise SpecError(None, f"not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start})",
                        line=line, file=file) from None


def parse_spec(source: str | bytes | dict[str, Any], *, file: str | None = None) -> JobSpec:
    """Validate a spec given as YAML text (or bytes) or an already-parsed dict."""
    if isinstance(source, dict):
        return _validate(source, file=file)
    if isinstance(source, bytes):
        source = decode_spec_bytes(source, file)
    elif len(source) > MAX_SPEC_BYTES:
        raise SpecError(None, f"the spec is longer than {MAX_SPEC_BYTES} characters (1 MiB)", file=file)
    data, node = _yaml_load(source, file)
    return _validate(data, node, file)


def load_spec(path: str | Path, sets: list[str] | None = None) -> JobSpec:
    """Read, override (`a.b=c` strings) and validate a YAML spec file.

    Errors name the file (and line), the field, and the `--set` a bad value came from.
    """
    p = Path(path)
    try:
        with open(p, "rb") as f:
            raw = f.read(MAX_SPEC_BYTES + 1)
    except OSError as exc:
        raise SpecError(None, f"cannot read spec file: {exc.strerror or exc}", file=str(p)) from None
    text = decode_spec_bytes(raw, str(p))
    data, node = _yaml_load(text, str(p))
    if not sets:
        return _validate(data, node, str(p))
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise SpecError(None, "a job spec must be a mapping with a `kind`", file=str(p))
    data = apply_overrides(data, sets)
    try:
        return _validate(data, node, str(p))
    except SpecError as exc:
        origin = _set_origin(exc.field, sets)
        if origin is not None:
            exc.message += f" (from --set {origin})"
            exc.line = None  # the value is not on a line of the file
            exc.args = (str(exc),)
        raise


def _set_origin(field: str | None, sets: list[str]) -> str | None:
    """The last --set whose key is `field` or one of its parents (or children)."""
    if not field:
        return None
    for item in reversed(sets):
        key = item.partition("=")[0].strip()
        if field == key or field.startswith(key + ".") or field.startswith(key + "[") or key.startswith(field + "."):
            return item if len(item) <= 80 else item[:77] + "..."
    return None


def apply_overrides(data: dict[str, Any], sets: list[str]) -> dict[str, Any]:
    """Return a copy of `data` with dotted `key.sub=value` overrides applied (values parsed as YAML)."""
    out = copy.deepcopy(data)
    for item in sets:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            raise SpecError(key or None, f"override must look like key.sub=value, got {item!r}")
        try:
            value = _yaml_scalar(raw) if raw.strip() else ""
        except SpecError:  # not YAML: the text itself (pydantic says whether it fits)
            value = raw
        cur: Any = out
        parts = key.split(".")
        for i, part in enumerate(parts[:-1]):
            nxt = cur.get(part)
            if nxt is None:
                nxt = cur[part] = {}
            elif not isinstance(nxt, dict):
                raise SpecError(".".join(parts[: i + 1]), f"is not a mapping, cannot set {key}")
            cur = nxt
        cur[parts[-1]] = value
    return out


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
