"""`offload-jobs init`: write a commented spec template to start from."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from jobs._cli.output import CliError


class Kind(str, Enum):
    train = "train"
    infer = "infer"
    shard = "shard"
    command = "command"


def init(
    kind: Annotated[Kind, typer.Option("--kind", "-k", help="What the job does.")] = Kind.train,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Write here instead of stdout.",
                                                   show_default=False)] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite --output if it exists.")] = False,
) -> None:
    """Write a commented job spec template (to stdout, or to --output FILE)."""
    from jobs.spec import template

    text = template(kind.value)
    if output is None:
        typer.echo(text, nl=not text.endswith("\n"))
        return
    if output.exists() and not force:
        raise CliError(f"{output}: already exists (use --force to overwrite)")
    try:
        output.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise CliError(f"{output}: cannot write: {exc.strerror or exc}") from None
    typer.echo(f"wrote {output}; next: offload-jobs validate {output} && offload-jobs submit {output}", err=True)
