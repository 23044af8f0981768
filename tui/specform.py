"""The submit screen's logic, apart from its widgets: a spec source, its fields, and validation.

Validation goes through `jobs._cli.specfile.read_spec`, the very path `offload-jobs validate` and
`submit` take, so the screen shows the same one-line error, naming the same field.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from jobs.errors import JobsError, SpecError

__all__ = ["SpecSource", "flatten", "show_value", "overrides_from", "check_spec", "complete_path"]


@dataclass
class SpecSource:
    """A YAML file, or a kind's template (what `offload-jobs init --kind KIND` writes)."""

    text: str
    path: Path | None = None
    kind: str | None = None  # set for a template
    data: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> "SpecSource":
        p = Path(path).expanduser()
        try:
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise SpecError(None, f"cannot read spec file: {getattr(exc, 'strerror', None) or exc}", file=str(p)) from None
        return cls(text, path=p, data=_load(text))

    @classmethod
    def from_template(cls, kind: str) -> "SpecSource":
        from jobs.spec import template

        text = template(kind)
        return cls(text, kind=kind, data=_load(text))

    @property
    def label(self) -> str:
        return str(self.path) if self.path is not None else f"template {self.kind}"


def _load(text: str) -> dict[str, Any]:
    try:
        data = yaml.load(text, Loader=_loader())
    except yaml.YAMLError:
        return {}
    return data if isinstance(data, dict) else {}


def _loader() -> Any:
    # The spec's own YAML 1.2 loader (`on:` stays a string), else a safe loader.
    import jobs.spec as js

    return getattr(js, "_Loader", yaml.SafeLoader)


def flatten(data: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """Leaves of a nested mapping as (dotted key, value); lists are leaves."""
    out: list[tuple[str, Any]] = []
    if isinstance(data, dict):
        for k, v in data.items():
            key = f"{prefix}.{k}" if prefix else str(k)
            if isinstance(v, dict) and v:
                out += flatten(v, key)
            else:
                out.append((key, v))
    return out


def show_value(value: Any) -> str:
    """A value as one line that `--set key=...` parses back to the same value."""
    if isinstance(value, str):
        if "\n" not in value and value.strip() == value and value:
            try:
                if yaml.load(value, Loader=_loader()) == value:
                    return value
            except yaml.YAMLError:
                pass
        return json.dumps(value)
    if value is None:
        return "null"
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("...").strip()


def overrides_from(fields: dict[str, str], initial: dict[str, str], extra: str = "") -> list[str]:
    """`--set` items: every form field that differs from the file, then the extra lines."""
    sets = [f"{k}={v}" for k, v in fields.items() if v != initial.get(k)]
    sets += [line.strip() for line in extra.splitlines() if line.strip() and not line.strip().startswith("#")]
    return sets


def check_spec(source: SpecSource, sets: list[str]) -> tuple[Any, str | None]:
    """(the validated JobSpec, None) or (None, the one-line error `offload-jobs validate` prints)."""
    from jobs._cli.output import error_line
    from jobs._cli.specfile import read_spec

    try:
        if source.path is not None:
            return read_spec(source.path, sets), None
        with tempfile.TemporaryDirectory() as d:
            p = Path(d) / f"{source.kind}.yaml"
            p.write_text(source.text, encoding="utf-8")
            try:
                return read_spec(p, sets), None
            except SpecError as exc:
                exc.file = source.label
                raise
    except JobsError as exc:
        return None, error_line(exc)


def complete_path(value: str) -> str | None:
    """The first directory entry that extends `value` (directories end with /, YAML files first)."""
    if not value:
        return None
    p = Path(value).expanduser()
    parent, stem = (p, "") if value.endswith("/") else (p.parent, p.name)
    try:
        entries = sorted(os.scandir(parent), key=lambda e: (not e.name.endswith((".yaml", ".yml")) and not e.is_dir(),
                                                            e.name))
    except OSError:
        return None
    for e in entries:
        if e.name.startswith(stem) and not e.name.startswith(".") and e.name != stem:
            if e.is_dir() or e.name.endswith((".yaml", ".yml")):
                return value + e.name[len(stem):] + ("/" if e.is_dir() else "")
    return None
