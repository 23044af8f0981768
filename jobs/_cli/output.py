"""How the CLI talks to the terminal: one-line errors, JSON, Rich tables and job formatting.

Rich is imported inside the functions that draw, so verbs that only print JSON never load it.
"""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, NoReturn

import typer

from jobs.errors import JobsError
from jobs.contract import ACTIVE, TERMINAL, JobState
from jobs.display import STATUS_ANSI, STATUS_STYLE, batch_line, fmt_duration, progress_line, status_markup

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

__all__ = [
    "CliError",
    "TERMINAL",
    "ACTIVE",
    "fail",
    "error_line",
    "print_json",
    "console",
    "job_summary",
    "jobs_table",
    "jobs_text_table",
    "job_detail",
    "fmt_time",
    "fmt_timestamp",
    "fmt_duration",
    "status_markup",
]


# The fields `show --json` and `ps --json` always carry, even when the worker leaves one out.
SUMMARY_FIELDS = ("id", "name", "kind", "status", "reason", "attempt", "priority", "worker_id",
                  "created_at", "started_at", "finished_at", "exit_code")


class CliError(JobsError):
    """A mistake the CLI itself detects (missing file, ambiguous job prefix, no docker, ...)."""


def error_line(exc: BaseException | str) -> str:
    """The single line printed for a user error: the message, newlines folded away."""
    text = str(exc).strip() or type(exc).__name__
    return "error: " + " ".join(text.split())


def fail(message: str, code: int = 2) -> NoReturn:
    """Print one error line to stderr and exit (2 = the user can fix it)."""
    typer.echo(error_line(message), err=True)
    raise typer.Exit(code)


def print_json(obj: Any) -> None:
    """Machine-readable output on stdout (stable key order, ISO times left as the worker sent them)."""
    typer.echo(json.dumps(obj, indent=2, default=str))


_consoles: dict[bool, Console] = {}


def console(stderr: bool = False) -> Console:
    """A shared Rich console on stdout (or stderr), created on first use."""
    if stderr not in _consoles:
        from rich.console import Console

        _consoles[stderr] = Console(stderr=stderr, highlight=False, soft_wrap=False)
    return _consoles[stderr]


def job_summary(job: dict[str, Any]) -> dict[str, Any]:
    """The job dict with the summary fields guaranteed present (None when the worker omits one)."""
    out = {k: job.get(k) for k in SUMMARY_FIELDS}
    out.update(job)
    return out


def _to_epoch(value: Any) -> float | None:
    if value is None or value == "":
        return None
    if isinstance(value, (int, float)):
        return float(value)
    try:
        dt = datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError:
        return None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return dt.timestamp()


def fmt_time(value: Any) -> str:
    """A timestamp as 'N ago' (short, for tables)."""
    t = _to_epoch(value)
    if t is None:
        return "-"
    return fmt_duration(max(0.0, time.time() - t)) + " ago"


def fmt_timestamp(value: Any) -> str:
    """A timestamp in local time, to the second (for `show`)."""
    t = _to_epoch(value)
    if t is None:
        return "-"
    return datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")


def job_runtime(job: dict[str, Any]) -> float | None:
    """Seconds the current attempt has run (until now, or until it finished)."""
    start = _to_epoch(job.get("started_at"))
    if start is None:
        return None
    end = _to_epoch(job.get("finished_at"))
    return max(0.0, (end if end is not None else time.time()) - start)


def jobs_table(jobs: list[dict[str, Any]]) -> Table:
    """The `ps` table."""
    from rich.markup import escape
    from rich.table import Table

    table = Table(box=None, header_style="bold", pad_edge=False)
    for col in ("ID", "NAME", "KIND", "STATUS", "ATTEMPT", "PRIO", "CREATED", "RUNTIME"):
        table.add_column(col, no_wrap=col != "NAME", justify="right" if col in ("ATTEMPT", "PRIO") else "left")
    for job in jobs:
        table.add_row(
            escape(str(job.get("id", "?"))),
            escape(str(job.get("name") or "-")),
            escape(str(job.get("kind") or "-")),
            status_markup(job.get("status"), job.get("reason")),
            str(job.get("attempt") if job.get("attempt") is not None else "-"),
            str(job.get("priority") if job.get("priority") is not None else 0),
            fmt_time(job.get("created_at")),
            fmt_duration(job_runtime(job)),
        )
    return table


_COLUMNS = ("ID", "NAME", "KIND", "STATUS", "ATTEMPT", "PRIO", "CREATED", "RUNTIME")
_RIGHT = {"ATTEMPT", "PRIO"}
NAME_WIDTH = 40


def _clean(text: str) -> str:
    """One printable line: control characters (a name could hold escapes) become spaces."""
    return "".join(ch if ch.isprintable() else " " for ch in text)


def jobs_text_table(jobs: list[dict[str, Any]], color: bool = False, worker: bool = False) -> str:
    """The `ps` table as plain text (ANSI colour on a terminal): the same columns as `jobs_table`,
    drawn without Rich, so 1,000 rows print in milliseconds. `worker` adds the WORKER column
    (a store that several workers share)."""
    columns = _COLUMNS if not worker else (*_COLUMNS[:4], "WORKER", *_COLUMNS[4:])
    rows = []
    for job in jobs:
        status = str(job.get("status") or "?")
        reason = job.get("reason")
        name = _clean(str(job.get("name") or "-"))
        if len(name) > NAME_WIDTH:
            name = name[: NAME_WIDTH - 3] + "..."
        status_text = status + (f" ({reason})" if reason and status != JobState.SUCCEEDED else "")
        row = [
            _clean(str(job.get("id", "?"))), name, _clean(str(job.get("kind") or "-")), _clean(status_text),
            str(job.get("attempt") if job.get("attempt") is not None else "-"),
            str(job.get("priority") if job.get("priority") is not None else 0),
            fmt_time(job.get("created_at")), fmt_duration(job_runtime(job)),
        ]
        if worker:
            row.insert(4, _clean(str(job.get("worker_id") or "-")))
        rows.append(row)
    widths = [max([len(c)] + [len(r[i]) for r in rows]) for i, c in enumerate(columns)]

    def line(cells: list[str], styles: list[str | None]) -> str:
        out = []
        for i, (cell, width) in enumerate(zip(cells, widths)):
            text = cell.rjust(width) if columns[i] in _RIGHT else cell.ljust(width)
            code = STATUS_ANSI.get(styles[i] or "") if color else None
            out.append(f"\x1b[{code}m{text}\x1b[0m" if code else text)
        return " ".join(out).rstrip()

    header = line(list(columns), ["bold"] * len(columns))
    body = [line(r, [None, None, None, STATUS_STYLE.get(str(j.get("status")))] + [None] * (len(columns) - 4))
            for r, j in zip(rows, jobs)]
    return "\n".join([header, *body])


def job_detail(job: dict[str, Any]) -> Table:
    """The `show` view: one row per field, then the last metrics."""
    from rich.markup import escape
    from rich.table import Table

    table = Table(box=None, show_header=False, pad_edge=False)
    table.add_column(style="bold", no_wrap=True)
    table.add_column()
    rows: list[tuple[str, str]] = [
        ("id", escape(str(job.get("id")))),
        ("name", escape(str(job.get("name") or "-"))),
        ("kind", escape(str(job.get("kind") or "-"))),
        ("status", status_markup(job.get("status"), job.get("reason"))),
        ("attempt", f"{job.get('attempt', '-')}" + (f" of {job['max_attempts']}" if job.get("max_attempts") else "")),
        ("priority", str(job.get("priority", 0))),
        ("created", f"{fmt_timestamp(job.get('created_at'))}  ({fmt_time(job.get('created_at'))})"),
        ("started", fmt_timestamp(job.get("started_at"))),
        ("finished", fmt_timestamp(job.get("finished_at"))),
        ("runtime", fmt_duration(job_runtime(job))),
        ("exit code", str(job.get("exit_code") if job.get("exit_code") is not None else "-")),
        ("run dir", escape(str(job.get("run_dir") or "-"))),
    ]
    if job.get("worker_id"):
        rows.insert(5, ("worker", escape(str(job["worker_id"]))))
    metrics = job.get("last_metrics")
    if progress_line(metrics):
        rows.append(("progress", escape(progress_line(metrics))))
    if batch_line(metrics):
        rows.append(("batch", escape(batch_line(metrics))))
    if isinstance(metrics, dict) and metrics:
        rows.append(("metrics", escape(", ".join(f"{k}={_short(v)}" for k, v in metrics.items()))))
    for k, v in rows:
        table.add_row(k, v)
    return table


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    text = str(value)
    return text if len(text) <= 40 else text[:37] + "..."

