"""The YAML job spec: pydantic models, loading with field-naming errors, overrides, schema.

Every field is optional except what a kind needs:
command needs `command`, shard needs `shard.src` and `shard.dst`, train and infer need `model.path`.
Kept light on purpose (pydantic + pyyaml only): the CLI imports it for `validate` and `submit`.
"""

from __future__ import annotations

import copy
import difflib
import re
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from jobs.errors import SpecError
from jobs.spec_runners import InferSpec, ModelSpec, TrainSpec  # the runners' sections live there

__all__ = [
    "KINDS",
    "REASONS",
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

KINDS = ("train", "infer", "shard", "command")
REASONS = ("exit_nonzero", "setup_failed", "cuda_oom", "host_oom", "timeout", "cancelled", "worker_lost")
Kind = Literal["train", "infer", "shard", "command"]
Reason = Literal["exit_nonzero", "setup_failed", "cuda_oom", "host_oom", "timeout", "cancelled", "worker_lost"]

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
    """`7.5GiB`, `512MB`, `1e9` or an int -> bytes (int). Other types pass to pydantic to reject."""
    if isinstance(value, bool):
        raise ValueError("expected bytes (an int or a size like '7.5GiB'), got a boolean")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError("must be >= 0")
        return int(value)
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", value)
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"not a size: {value!r} (use bytes or e.g. '7.5GiB', '512MB')")
        return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    return value


def parse_duration(value: Any) -> Any:
    """`30m`, `1h`, `90s`, `1h30m` or a number of seconds -> seconds (float)."""
    if isinstance(value, bool):
        raise ValueError("expected a duration (seconds or e.g. '30m'), got a boolean")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError("must be >= 0")
        return float(value)
    if isinstance(value, str):
        parts = re.findall(r"([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)", value)
        rest = re.sub(r"([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)", "", value).strip()
        bare = len(parts) > 1 and any(not u for _, u in parts)  # "1h30": 30 what?
        if not parts or rest or bare or any(u.lower() not in _SECONDS for _, u in parts):
            raise ValueError(f"not a duration: {value!r} (use seconds or e.g. '30m', '1h30m', '90s')")
        return float(sum(float(n) * _SECONDS[u.lower()] for n, u in parts))
    return value


def _command(value: Any) -> Any:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in value):
        return [str(v) for v in value]
    raise ValueError("must be a string (run by /bin/sh -c) or a list of strings (run directly)")


def _env_value(value: Any) -> Any:
    # YAML turns `FOO: 1` into an int; environment values are strings.
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, (int, float)):
        return str(value)
    return value


Bytes = Annotated[int, BeforeValidator(parse_bytes)]
Seconds = Annotated[float, BeforeValidator(parse_duration)]
EnvValue = Annotated[str, BeforeValidator(_env_value)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=False)


class OffloadSpec(_Strict):
    """The engine's config keys (offload_core.OffloadConfig); unset keys keep the engine's defaults."""

    target_device: Optional[str] = Field(None, description="cuda, cuda:N or cpu.")
    cpu_offload: Optional[bool] = None
    offload_granularity: Optional[Literal["leaf", "block", "phase", "auto"]] = None
    offload_ratio: Optional[float] = Field(None, ge=0.0, le=1.0, description="Fraction of units streamed.")
    vram_budget: Optional[Bytes] = Field(None, description="Bytes or a size like '7.5GiB'.")
    prefetch: Optional[int] = Field(None, ge=0, description="Prefetch depth in units.")
    stray_resident_fraction: Optional[float] = Field(
        None, ge=0.0, le=1.0,
        description="Tensors outside the block lists stay resident when at most this share of the streamed bytes.")
    lazy_load: Optional[bool] = None
    offload_to_disk: Optional[bool] = None
    shard_dir: Optional[str] = None
    num_disk_workers: Optional[int] = Field(None, ge=1)
    max_memory: Optional[Bytes] = Field(None, description="CPU cache budget in bytes or a size.")
    enable_optimizer_cpu_offload: Optional[bool] = None
    weight_dtype: Optional[str] = Field(None, description="Storage dtype, e.g. float8_e4m3fn.")

    def engine_kwargs(self) -> dict[str, Any]:
        """The keys the user set, ready for `enable_offload(model, **kwargs)`."""
        return self.model_dump(exclude_none=True)


class ShardSpec(_Strict):
    src: Optional[str] = Field(None, description="Diffusers folder or single-file checkpoint.")
    dst: Optional[str] = Field(None, description="Output shard directory.")
    dtype: Optional[str] = Field(None, description="Convert to this dtype (bfloat16, float8_e4m3fn).")


class ResourcesSpec(_Strict):
    gpus: Optional[int] = Field(None, ge=0, description="GPUs needed; default 0 for command/shard, 1 otherwise.")
    vram_budget: Optional[Bytes] = None
    shm_size: Optional[Bytes] = Field(None, description="Shared memory for the docker executor.")


class RetrySpec(_Strict):
    max_attempts: int = Field(3, ge=1, description="Attempts in total, the first included.")
    on: list[Reason] = Field(default_factory=lambda: ["worker_lost"], description="Reasons that trigger a retry.")


class LimitsSpec(_Strict):
    max_duration: Optional[Seconds] = Field(None, gt=0, description="Seconds or e.g. '30m'; exceeded -> timeout.")
    stop_grace: Seconds = Field(10.0, ge=0, description="Seconds between SIGTERM and SIGKILL.")


class JobSpec(_Strict):
    kind: Kind
    name: Optional[str] = Field(None, max_length=200)
    model: ModelSpec = Field(default_factory=ModelSpec)
    offload: OffloadSpec = Field(default_factory=OffloadSpec)
    train: TrainSpec = Field(default_factory=TrainSpec)
    infer: InferSpec = Field(default_factory=InferSpec)
    shard: ShardSpec = Field(default_factory=ShardSpec)
    command: Annotated[Optional[Union[str, list[str]]], BeforeValidator(_command)] = None
    workdir: Optional[str] = Field(None, description="Working directory; default the job's run dir.")
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    retry: RetrySpec = Field(default_factory=RetrySpec)
    limits: LimitsSpec = Field(default_factory=LimitsSpec)
    env: dict[str, EnvValue] = Field(default_factory=dict)
    outputs: Optional[Union[str, list[str]]] = None
    priority: int = Field(0, description="Higher runs first; ties run oldest first.")
    executor: Literal["process", "docker"] = "process"
    image: Optional[str] = Field(None, description="Container image for executor: docker.")

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
    return yaml.load(raw, Loader=_Loader)

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


def _validate(data: Any, node: Any = None, file: str | None = None) -> JobSpec:
    if not isinstance(data, dict):
        raise SpecError(None, f"a job spec must be a mapping with a `kind`, got {type(data).__name__}", file=file)
    try:
        return JobSpec.model_validate(data)
    except ValidationError as exc:
        field, msg = _first_error(exc, data)
        raise SpecError(field, msg, line=_line_of(node, field) if node is not None else None, file=file) from None


def _yaml_load(text: str, file: str | None = None) -> tuple[Any, Any]:
    try:
        node = yaml.compose(text, Loader=_Loader)
        data = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        line = mark.line + 1 if mark is not None else None
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise SpecError(None, f"malformed YAML: {problem}", line=line, file=file) from None
    return data, node


def parse_spec(source: str | dict[str, Any], *, file: str | None = None) -> JobSpec:
    """Validate a spec given as YAML text or an already-parsed dict."""
    if isinstance(source, dict):
        return _validate(source, file=file)
    data, node = _yaml_load(source, file)
    return _validate(data, node, file)


def load_spec(path: str | Path, sets: list[str] | None = None) -> JobSpec:
    """Read, override (`a.b=c` strings) and validate a YAML spec file."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise SpecError(None, f"cannot read spec file: {exc.strerror or exc}", file=str(p)) from None
    data, node = _yaml_load(text, str(p))
    if sets:
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise SpecError(None, "a job spec must be a mapping with a `kind`", file=str(p))
        data = apply_overrides(data, sets)
    return _validate(data, node, str(p))


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
        except yaml.YAMLError:
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
