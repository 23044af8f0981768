"""`offload-jobs validate FILE`: check a spec without submitting it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

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
    from jobs.home import state_home

    try:
        spec = read_spec(file, sets)
        if strict:
            from jobs._cli.connect import connect
            from jobs.spec_yaml import with_origin

            try:
                connect().validate(spec.model_dump(mode="json", exclude_unset=True))
            except SpecError as exc:
                from jobs._cli.specfile import read_spec_data

                add_container_hint(exc, spec.model_dump(mode="json", exclude_unset=True), state_home())
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

    warnings = spec.deprecations() + mount_warnings(spec, state_home())
    for line in warnings:
        typer.echo(line, err=True)
    if json_out:
        print_json({"ok": True, "file": str(file), "kind": spec.kind, "name": spec.name,
                    "spec": spec.model_dump(mode="json"), "warnings": warnings})
    else:
        typer.echo("ok")


_PATH_FIELDS = ("workdir", "model.path", "model.transformer", "model.vae", "model.base", "train.dataset", "shard.src", "shard.dst", "offload.shard_dir")


def container_hint(data: dict[str, Any], field: str | None, home: Path) -> str | None:
    """When the worker `up` started runs in a container and `field` names a path it cannot see: the
    `--set` that points at the container's copy (`workdir=/app/examples` for an example), or where to
    put the file. None otherwise."""
    from jobs.home import read_worker_info

    info = (read_worker_info(home) or {}).get("compose")
    if field not in _PATH_FIELDS or not isinstance(info, dict) or not info.get("mounts"):
        return None
    value: Any = data
    for part in field.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    if not isinstance(value, str) or not value:
        return None
    path = Path(value).expanduser()
    workdir = data.get("workdir")
    if not path.is_absolute() and isinstance(workdir, str) and workdir:
        path = Path(workdir) / path
    pairs = [(Path(m["source"]), str(m["target"])) for m in info["mounts"]]
    pairs += [(Path(src), str(dst)) for src, dst in (info.get("image_paths") or {}).items()]
    for src, dst in pairs:
        try:
            rel = path.resolve().relative_to(src.resolve())
        except ValueError:
            continue
        where = Path(dst) / rel
        return f"the worker runs in a container, where this is {where}: --set {field}={where}"
    seen = ", ".join(str(t) for _, t in pairs)
    return (f"the worker runs in a container that sees only {seen}: put it under {pairs[0][0]} "
            f"and --set {field}= the container's path")


def add_container_hint(exc: Any, data: dict[str, Any], home: Path) -> None:
    """Append `container_hint` to a path error from the worker (the spec named a host path)."""
    hint = container_hint(data, getattr(exc, "field", None), home)
    if hint and ("does not exist on the worker" in str(exc) or "is not a directory" in str(exc)):
        exc.message += f"; {hint}"
        exc.args = (str(exc),)
