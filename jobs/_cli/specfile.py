"""Reading a spec file the way `submit` and `validate` both need it."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from jobs._cli.output import CliError

if TYPE_CHECKING:
    from jobs.spec import JobSpec

__all__ = ["SETS_HELP", "read_spec"]

SETS_HELP = "Override a field, e.g. --set train.lr=5e-5 (dotted path; value parsed as YAML). Repeatable."


def read_spec(path: Path, sets: list[str] | None) -> JobSpec:
    """Load, override and validate `path`; raises SpecError (names the field) or CliError."""
    if not path.exists():
        raise CliError(f"{path}: no such file")
    if path.is_dir():
        raise CliError(f"{path}: is a directory, not a YAML spec file")
    from jobs.spec import load_spec  # pydantic + yaml: only for the verbs that read specs

    spec = load_spec(path, sets or None)
    # A relative workdir means "next to the spec file": the worker may run anywhere.
    if spec.workdir and not Path(spec.workdir).expanduser().is_absolute():
        spec.workdir = str((path.parent / spec.workdir).resolve())
    return spec
