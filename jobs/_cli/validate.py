"""`offload-jobs validate FILE`: check a spec without submitting it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from jobs._cli.output import error_line, print_json
from jobs._cli.specfile import SETS_HELP


def validate(
    file: Annotated[Path, typer.Argument(help="Job spec (YAML).", show_default=False)],
    sets: Annotated[Optional[list[str]], typer.Option("--set", help=SETS_HELP, metavar="KEY=VALUE")] = None,
    strict: Annotated[bool, typer.Option(
        "--strict", help="Also ask the worker: do the paths (model, dataset, workdir) and the image exist there?")] = False,
    json_out: Annotated[bool, typer.Option(
        "--json", help="Print {ok, kind, name} or {ok, field, line, error}.")] = False,
) -> None:
    """Validate a job spec: prints "ok" (exit 0) or the offending field (exit 2)."""
    from jobs._cli.specfile import read_spec
    from jobs.errors import JobsError, SpecError

    try:
        spec = read_spec(file, sets)
        if strict:
            from jobs._cli.connect import connect
            from jobs.spec_yaml import with_origin

            try:
                connect().validate(spec.model_dump(mode="json", exclude_unset=True))
            except SpecError as exc:
                from jobs._cli.specfile import read_spec_data

                raise with_origin(exc, str(file), read_spec_data(file, sets)[1], sets) from None
    except JobsError as exc:
        if not json_out:
            raise
        field = exc.field if isinstance(exc, SpecError) else None
        line = exc.line if isinstance(exc, SpecError) else None
        print_json({"ok": False, "file": str(file), "field": field, "line": line, "error": str(exc)})
        typer.echo(error_line(exc), err=True)
        raise typer.Exit(2) from None
    from jobs._cli.compose import mount_warnings  # a worker in a container sees only its mounts
    from jobs.home import state_home

    warnings = spec.deprecations() + mount_warnings(spec, state_home())
    for line in warnings:
        typer.echo(line, err=True)
    if json_out:
        print_json({"ok": True, "file": str(file), "kind": spec.kind, "name": spec.name,
                    "spec": spec.model_dump(mode="json"), "warnings": warnings})
    else:
        typer.echo("ok")
