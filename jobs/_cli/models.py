"""`offload-jobs models`: the checkpoints the worker sees under its model roots (jobs.catalog).

The worker answers (GET /v1/models), so the list is the worker's disk, as jobs see it: /models in
the container, the state dir's models/ locally, and each folder of $OFFLOAD_JOBS_MODEL_ROOTS.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from jobs._cli.output import print_json
from jobs.display import fmt_bytes

__all__ = ["models", "models_text_table"]

COLS = ("NAME", "KIND", "FAMILY", "LAYOUT", "DTYPE", "SIZE", "CACHE")



def _cache(m: dict[str, Any]) -> str:
    done = [w for w, on in (("converted", m.get("converted")), ("sharded", m.get("sharded"))) if on]
    if done:
        return "+".join(done)
    return "not converted" if m.get("converted") is False else "-"


def _row(m: dict[str, Any]) -> list[str]:
    kind = m.get("kind") or "?"
    family = m.get("family") or "-"
    if m.get("variant"):
        family += f" {m['variant']}"
    return [str(m.get("name")), kind, family, m.get("layout") or "-", m.get("dtype") or "-", fmt_bytes(m.get("bytes")),
            _cache(m) + (f" ({m['note']})" if m.get("note") else "")]


def models_text_table(body: dict[str, Any]) -> str:
    """One table a root, under the root's path (a missing root says so)."""
    out: list[str] = []
    ms = body.get("models") or []
    for root in body.get("roots") or []:
        rows = [_row(m) for m in ms if m.get("root") == root.get("path")]
        head = f"{root.get('path')}" + ("" if root.get("exists") else " (not there)")
        out.append(f"{head}: {len(rows)} model(s)" if rows or root.get("exists") else head)
        if rows:
            widths = [max([len(c)] + [len(r[i]) for r in rows]) for i, c in enumerate(COLS)]
            out.append("  " + " ".join(c.ljust(widths[i]) for i, c in enumerate(COLS)).rstrip())
            out += ["  " + " ".join(cell.ljust(widths[i]) for i, cell in enumerate(r)).rstrip() for r in rows]
    if body.get("truncated"):
        out.append(f"(the list stops at {len(ms)} entries)")
    return "\n".join(out)


def models(
    json_out: Annotated[bool, typer.Option("--json", help="Print the worker's answer as JSON instead of tables.")] = False,
) -> None:
    """List the models the worker sees: diffusers folders and .safetensors checkpoints under its model roots.

    Each with its kind (pipeline, transformer, vae, text_encoder, lora), family, layout (diffusers, bfl,
    comfy, native), dtype, size, and whether the model cache holds it converted or sharded already.
    The roots are the model cache (/models in the container) and $OFFLOAD_JOBS_MODEL_ROOTS on the worker.
    Only file headers are read.
    """
    from jobs._cli.connect import connect

    body = connect().models()
    if json_out:
        print_json(body)
        return
    typer.echo(models_text_table(body))
