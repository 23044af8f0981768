"""Reading a spec file the way `submit` and `validate` need it.

`submit` sends the plain data (`read_spec_data`: YAML, strictly) and lets the worker validate it,
which keeps pydantic off its path; `validate` validates here (`read_spec`). Errors name the file,
the line and the field either way, or the `--set` a bad value came from.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from jobs._cli.output import CliError

if TYPE_CHECKING:
    from jobs.spec import JobSpec

__all__ = ["SETS_HELP", "read_spec", "read_spec_data", "check_file"]

SETS_HELP = "Override a field, e.g. --set train.lr=5e-5 (dotted path; value parsed as YAML). Repeatable."


def check_file(path: Path) -> None:
    if not path.exists():
        raise CliError(f"{path}: no such file")
    if path.is_dir():
        raise CliError(f"{path}: is a directory, not a YAML spec file")


def _resolve_workdir(path: Path, workdir: Any) -> Any:
    # A relative workdir means "next to the spec file": the worker may run anywhere.
    if isinstance(workdir, str) and workdir and "\0" not in workdir and not Path(workdir).expanduser().is_absolute():
        return str((path.parent / workdir).resolve())
    return workdir


def read_spec_data(path: Path, sets: list[str] | None) -> tuple[Any, Any]:
    """(data, YAML node) of `path` with overrides applied and a relative workdir resolved; no pydantic."""
    check_file(path)
    from jobs.spec_yaml import read_spec_data as read

    data, node = read(path, sets or None)
    if isinstance(data, dict) and "workdir" in data:
        data["workdir"] = _resolve_workdir(path, data["workdir"])
    return data, node


def read_spec(path: Path, sets: list[str] | None) -> JobSpec:
    """Load, override and validate `path`; raises SpecError (names the field) or CliError."""
    check_file(path)
    from jobs.spec import load_spec  # pydantic + yaml: only for the verbs that validate here

    spec = load_spec(path, sets or None)
    spec.workdir = _resolve_workdir(path, spec.workdir)
    return spec
