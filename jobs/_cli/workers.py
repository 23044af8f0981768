"""`offload-jobs workers`: the workers on the store, their GPUs and what each one runs."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from jobs._cli.output import fmt_duration, print_json

__all__ = ["workers", "workers_text_table"]


def _gpus(w: dict[str, Any]) -> str:
    gpus = w.get("gpus") or []
    if not gpus:
        return "-"
    busy = sum(1 for g in gpus if g.get("job_id"))
    sizes = sorted({g.get("memory_total") or 0 for g in gpus})
    size = "/".join(f"{s / 2**30:.0f}G" if s else "?" for s in sizes)
    cpu_torch = " torch sees none: a CPU build" if any(g.get("torch") == "no CUDA" for g in gpus) else ""
    return f"{len(gpus)}x{size} ({busy} busy){cpu_torch}"


def workers_text_table(ws: list[dict[str, Any]], this: str | None = None) -> str:
    cols = ("WORKER", "HOST", "STATUS", "HEARTBEAT", "GPUS", "RUNNING", "EXECUTORS")
    rows = []
    for w in ws:
        running = w.get("running") or []
        jobs = ", ".join(r["job_id"] for r in running[:3]) + (f" +{len(running) - 3}" if len(running) > 3 else "")
        rows.append([
            str(w.get("id")) + (" *" if w.get("id") == this else ""), str(w.get("host") or "-"), str(w.get("status")),
            fmt_duration(w.get("heartbeat_age_s")) + " ago" if w.get("heartbeat_age_s") is not None else "-",
            _gpus(w), f"{len(running)}" + (f": {jobs}" if jobs else ""), ",".join(w.get("executors") or []) or "-",
        ])
    widths = [max([len(c)] + [len(r[i]) for r in rows]) for i, c in enumerate(cols)]
    lines = [" ".join(c.ljust(widths[i]) for i, c in enumerate(cols)).rstrip()]
    lines += [" ".join(cell.ljust(widths[i]) for i, cell in enumerate(r)).rstrip() for r in rows]
    return "\n".join(lines)


def workers(
    json_out: Annotated[bool, typer.Option("--json", help="Print a JSON list instead of a table.")] = False,
) -> None:
    """List the workers on the store (one on SQLite; every host's on a shared Postgres): status, GPUs, jobs.

    A worker is `lost` once it missed its heartbeat_timeout; its jobs are then retried elsewhere.
    `*` marks the worker this CLI talks to.
    """
    from jobs._cli.connect import connect

    body = connect().workers()
    ws = body.get("workers") or []
    if json_out:
        print_json(ws)
        return
    if not ws:
        typer.echo("no workers")
        return
    typer.echo(workers_text_table(ws, body.get("this")))
