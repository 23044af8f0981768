"""The `offload-jobs` command line (typer).

Each verb lives in its own module under `jobs._cli`; this module only assembles them and turns
errors a user can cause into one line on stderr with exit code 2. Bugs still raise.

Imports stay light on purpose: `offload-jobs --help` and `offload-jobs ps` load typer, the HTTP
client and Rich, never torch, diffusers, fastapi, sqlalchemy or uvicorn.
"""

from __future__ import annotations

import sys
from typing import Any

import typer
from typer.core import TyperGroup

from jobs._cli import cancel, delete, init, logs, prune, ps, report, retry, schema, shard, show, submit, tui, validate, worker
from jobs._cli import outputs, signal  # issue 15: train/infer runners
from jobs._cli import workers  # issue 13: workers on a shared store
from jobs._cli import pull  # issue 28: models from the hub
from jobs._cli import models  # issue 31: what the worker's model roots hold
from jobs._cli.lazy_coercion import defer_coercion
from jobs._cli.output import error_line
from jobs.errors import JobsError

try:  # typer >= 0.20 vendors click
    from typer._click.exceptions import ClickException, NoArgsIsHelpError
except ImportError:  # pragma: no cover - older typer on plain click
    from click.exceptions import ClickException, NoArgsIsHelpError  # type: ignore[no-redef]

__all__ = ["app", "main"]


class JobsGroup(TyperGroup):
    """The root group: user errors become one line on stderr and exit code 2."""

    def make_context(self, info_name: Any, args: Any, parent: Any = None, **extra: Any) -> Any:
        # Deferring needs a context for the help option; this one has the same help names.
        from typer._click import Context

        settings = {**self.context_settings, **extra}
        defer_coercion(self, Context(self, info_name=info_name, parent=parent, **settings))
        return super().make_context(info_name, args, parent=parent, **extra)

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        command = super().get_command(ctx, cmd_name)
        return defer_coercion(command, ctx) if command is not None else None

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except JobsError as exc:
            _user_error(exc, 2)
        except NoArgsIsHelpError:
            raise
        except ClickException as exc:
            # Usage errors (unknown option, bad value): one line, and where to look.
            where = getattr(getattr(exc, "ctx", None), "command_path", None) or "offload-jobs"
            _user_error(f"{exc.format_message()} (see `{where} --help`)", exc.exit_code)
        except Exception as exc:
            offload_error = _offload_error_class()
            if offload_error is not None and isinstance(exc, offload_error):
                _user_error(exc, 2)
            raise


def _user_error(exc: BaseException | str, code: int) -> None:
    typer.echo(error_line(exc), err=True)
    raise typer.Exit(code)


def _offload_error_class() -> type[BaseException] | None:
    # Only once the engine is loaded (by `shard`): importing it here would pull in torch.
    mod = sys.modules.get("offload_core.errors")
    return getattr(mod, "OffloadError", None) if mod is not None else None


app = typer.Typer(
    name="offload-jobs",
    cls=JobsGroup,
    help="Run training, inference and shard jobs for diffusion transformers bigger than your GPU.",
    epilog="Start a worker with `offload-jobs up --local`, then `offload-jobs submit examples/train.yaml`.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

_RUN = "Jobs"
_SPEC = "Specs"
_WORKER = "Worker"
app.command("submit", rich_help_panel=_RUN)(submit.submit)
app.command("ps", rich_help_panel=_RUN)(ps.ps)
app.command("show", rich_help_panel=_RUN)(show.show)
app.command("logs", rich_help_panel=_RUN)(logs.logs)
app.command("cancel", rich_help_panel=_RUN)(cancel.cancel)
app.command("retry", rich_help_panel=_RUN)(retry.retry)
app.command("delete", rich_help_panel=_RUN)(delete.delete)
app.command("prune", rich_help_panel=_RUN)(prune.prune)
app.command("tui", rich_help_panel=_RUN)(tui.tui)
app.command("signal", rich_help_panel=_RUN)(signal.signal)
app.command("outputs", rich_help_panel=_RUN)(outputs.outputs)
app.command("report", rich_help_panel=_RUN)(report.report)
app.command("validate", rich_help_panel=_SPEC)(validate.validate)
app.command("init", rich_help_panel=_SPEC)(init.init)
app.command("schema", rich_help_panel=_SPEC)(schema.schema)
app.command("shard", rich_help_panel=_SPEC)(shard.shard)
app.command("pull", rich_help_panel=_SPEC)(pull.pull)
app.command("models", rich_help_panel=_SPEC)(models.models)
app.command("worker", rich_help_panel=_WORKER)(worker.worker)
app.command("up", rich_help_panel=_WORKER)(worker.up)
app.command("down", rich_help_panel=_WORKER)(worker.down)
app.command("workers", rich_help_panel=_WORKER)(workers.workers)


def main() -> None:
    """Console-script entry point (`offload-jobs = jobs.cli:main`)."""
    app(prog_name="offload-jobs")


if __name__ == "__main__":
    main()
