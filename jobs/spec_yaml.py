"""Reading a job spec file into plain data, strictly, without pydantic (so `submit` stays fast).

Turns bytes into the dict the worker validates, refusing on the way what YAML allows and a job
cannot hold: non-UTF-8 or binary files, files over 1 MiB, duplicate keys (YAML forbids them;
PyYAML keeps the last), nesting past 32 levels, alias bombs, NaN and infinities, integers past
int64, NUL bytes, binary and date values. Every error is a `SpecError` naming the file, the line
and the dotted field (or the `--set` it came from). `jobs.spec` validates the result.
"""

from __future__ import annotations

import copy
import datetime
import math
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml

from jobs.errors import SpecError

__all__ = ["MAX_SPEC_BYTES", "MAX_DEPTH", "MAX_NODES", "MAX_INT", "read_spec_data", "decode_spec_bytes",
           "yaml_load", "check_tree", "line_of", "apply_overrides", "set_origin", "with_origin"]

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
    data, _ = yaml_load(raw)
    return data


def line_of(node: Any, field: str | None) -> int | None:
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


class _BoundedWalk:
    """A depth-first walk over a spec's values (or its YAML nodes) that refuses an alias bomb (more
    than MAX_NODES values) and nesting past MAX_DEPTH; `refuse(item, field, message)` makes the
    SpecError, so each walker names what it knows (the YAML line, the file)."""

    def __init__(self, root: Any, refuse: Callable[[Any, str | None, str], SpecError]) -> None:
        self.stack: list[tuple[Any, str, int]] = [(root, "", 0)]
        self.refuse = refuse

    def __iter__(self) -> Iterator[tuple[Any, str, int]]:
        seen = 0
        while self.stack:
            item, path, depth = self.stack.pop()
            seen += 1
            if seen > MAX_NODES:
                raise self.refuse(item, path or None, f"the spec holds more than {MAX_NODES} values (a YAML alias bomb?)")
            yield item, path, depth

    def enter(self, item: Any, path: str, depth: int) -> None:
        """`item` is a mapping or a list: refuse it past MAX_DEPTH."""
        if depth >= MAX_DEPTH:
            raise self.refuse(item, path or None, f"nested more than {MAX_DEPTH} levels deep")

    def push(self, item: Any, path: str, depth: int) -> None:
        self.stack.append((item, path, depth))

    def push_items(self, seq: Any, items: list[Any], path: str, depth: int) -> None:
        """The items of the list `seq` (at `path`, `depth`), after the depth check."""
        self.enter(seq, path, depth)
        for i, v in enumerate(items):
            self.push(v, f"{path}[{i}]", depth + 1)


def check_tree(data: Any) -> None:
    """Refuse, naming the field, what no field can hold: NaN/inf, huge ints, NUL bytes, binary,
    dates, non-string keys, nesting past MAX_DEPTH, more than MAX_NODES values (alias bombs)."""
    walk = _BoundedWalk(data, lambda _value, where, message: SpecError(where, message))
    for value, path, depth in walk:
        where = path or None
        if isinstance(value, dict):
            walk.enter(value, path, depth)
            for k, v in value.items():
                if not isinstance(k, str):
                    raise SpecError(where, f"keys must be strings, got {k!r:.40}")
                if "\0" in k:
                    raise SpecError(where, f"key {k!r:.40} holds a NUL byte")
                walk.push(v, f"{path}.{k}" if path else k, depth + 1)
        elif isinstance(value, list):
            walk.push_items(value, value, path, depth)
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


def _check_nodes(root: Any, file: str | None) -> None:
    """On the composed YAML: duplicate keys are an error (YAML says so; PyYAML keeps the last),
    nesting is bounded, and so is the count of nodes aliases expand to."""
    walk = _BoundedWalk(root, lambda node, where, message: SpecError(
        where, message, line=node.start_mark.line + 1, file=file))
    for node, path, depth in walk:
        if isinstance(node, yaml.MappingNode):
            walk.enter(node, path, depth)
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
                walk.push(v, here, depth + 1)
        elif isinstance(node, yaml.SequenceNode):
            walk.push_items(node, node.value, path, depth)


_FLOW_LIMIT = 4 * MAX_DEPTH  # past this, PyYAML's scanner slows quadratically: refuse before parsing
_FLOW_CHARS = re.compile(r"[\[\]{}\"'#\n\\]")


def _flow_too_deep(text: str) -> int | None:
    """The line where `[`/`{` nesting first passes _FLOW_LIMIT (outside quotes and comments), or None."""
    depth, line, quote, comment = 0, 1, "", False
    escape_at = -1  # in a "string", the position a backslash escapes
    for m in _FLOW_CHARS.finditer(text):
        ch, at = m.group(), m.start()
        if ch == "\n":
            line += 1
            comment = False
            continue
        if comment:
            continue
        if quote == '"':
            if at == escape_at:
                escape_at = -1
            elif ch == "\\":
                escape_at = at + 1
            elif ch == '"':
                quote = ""
            continue
        if quote == "'":
            if ch == "'":
                quote = ""  # '' (an escaped quote) closes and reopens: the same to us
            continue
        if ch in "\"'":
            quote = ch
        elif ch == "#":
            comment = at == 0 or text[at - 1] in " \t"
        elif ch in "[{":
            depth += 1
            if depth > _FLOW_LIMIT:
                return line
        elif ch in "]}":
            depth = max(0, depth - 1)
    return None


def yaml_load(text: str, file: str | None = None) -> tuple[Any, Any]:
    deep = _flow_too_deep(text)
    if deep is not None:
        raise SpecError(None, f"malformed YAML: nested more than {MAX_DEPTH} levels deep", line=deep, file=file)
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


def read_spec_data(path: str | Path, sets: list[str] | None = None) -> tuple[Any, Any]:
    """(data, YAML node) of a spec file with `--set` overrides applied; the node gives error lines."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            raw = f.read(MAX_SPEC_BYTES + 1)
    except OSError as exc:
        raise SpecError(None, f"cannot read spec file: {exc.strerror or exc}", file=str(p)) from None
    text = decode_spec_bytes(raw, str(p))
    data, node = yaml_load(text, str(p))
    if sets:
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise SpecError(None, "a job spec must be a mapping with a `kind`", file=str(p))
        data = apply_overrides(data, sets)
    return data, node


def with_origin(exc: SpecError, file: str | None, node: Any, sets: list[str] | None) -> SpecError:
    """`exc` pointed at where its value came from: the --set that set it, else the file's line."""
    origin = set_origin(exc.field, sets or [])
    exc.file = file
    if origin is not None:
        if "(from --set" not in exc.message:
            exc.message += f" (from --set {origin})"
        exc.line = None  # the value is not on a line of the file
    elif node is not None and exc.line is None:
        exc.line = line_of(node, exc.field)
    exc.args = (str(exc),)
    return exc


def set_origin(field: str | None, sets: list[str]) -> str | None:
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


