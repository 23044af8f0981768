"""`offload-jobs pull MODEL`: fetch a hub model into the worker's model cache ahead of a job.

What a job with `model.path: MODEL` would fetch, here and now: the same files, the same cache
(`$OFFLOAD_JOBS_MODEL_CACHE`, /models in the container, else the state dir's `models/`), the same
token (HF_TOKEN or OFFLOAD_JOBS_HF_TOKEN_FILE). Before it starts it prints the disk space the files
need against what is free, and the host RAM the transformer needs with the engine.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from jobs._cli.output import CliError, print_json


def _ram_total() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def advice(plan: Any, cache: Path) -> dict[str, Any]:
    """Disk and RAM figures for `plan` (a jobs.hub.FetchPlan), and a line for each."""
    import shutil

    free = shutil.disk_usage(cache).free
    parts: dict[str, int] = {}
    for name, size, _ in plan.files:
        part = name.split("/", 1)[0] if "/" in name else "."
        parts[part] = parts.get(part, 0) + size
    transformer = parts.get("transformer", 0)
    others = max((v for k, v in parts.items() if k.startswith(("text_encoder", "vae"))), default=0)
    ram = _ram_total()
    # The engine pins the transformer's weights in host RAM once (PinnedArena); the text encoders
    # and the VAE are loaded beside it, one at a time on the device. lazy_load streams from shards.
    need = transformer + others
    disk_ok = plan.to_fetch <= free
    lines = [f"disk: {plan.total_bytes / 1e9:.2f} GB in {len(plan.files)} files, {plan.to_fetch / 1e9:.2f} GB to fetch; "
             f"{free / 1e9:.2f} GB free in {cache}" + ("" if disk_ok else " (NOT ENOUGH)")]
    if ram and need > ram:
        lines.append(f"ram: the transformer is {transformer / 1e9:.2f} GB and the largest other part "
                     f"{others / 1e9:.2f} GB, more than this machine's {ram / 1e9:.2f} GB: use offload.lazy_load "
                     "(shards on disk, `offload-jobs shard`) or a smaller weight_dtype")
    else:
        lines.append(f"ram: the transformer is {transformer / 1e9:.2f} GB (pinned once by the engine) and the largest "
                     f"other part {others / 1e9:.2f} GB; this machine has {ram / 1e9:.2f} GB")
    return {"disk_free": free, "disk_ok": disk_ok, "transformer_bytes": transformer, "largest_other_bytes": others,
            "ram_total": ram, "ram_needed": need, "parts": parts, "lines": lines}


def pull(
    model: Annotated[str, typer.Argument(help="Hub id: org/name, optionally @revision.", show_default=False)],
    cache: Annotated[Optional[Path], typer.Option(
        "--cache", help="Model cache (default: $OFFLOAD_JOBS_MODEL_CACHE, else the state dir's models/).",
        show_default=False)] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the plan and advice; fetch nothing.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print {model, commit, files, advice, path} as JSON.")] = False,
) -> None:
    """Fetch a hub model (only the parts a pipeline loads) into the worker's model cache."""
    from jobs.home import model_cache, state_home
    from jobs.hub import HubError, fetch_model, parse_hub_id, plan_fetch

    ref = parse_hub_id(model)
    if ref is None:
        raise CliError(f"{model}: not a hub id (org/name[@revision]); a local folder needs no pull")
    where = (cache or model_cache(state_home())).expanduser()
    try:
        where.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CliError(f"{where}: cannot make the model cache: {exc.strerror or exc}") from None
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    out: dict[str, Any] = {"model": str(ref), "cache": str(where)}
    say = (lambda line: typer.echo(line, err=True)) if json_out else typer.echo
    try:
        plan = None
        try:
            plan = None if offline else plan_fetch(ref, where)
        except Exception as exc:
            from jobs.hub import _unreachable

            if not _unreachable(exc):
                raise
            say("the hub cannot be reached: looking in the model cache")  # fetch_model says what is missing
        if plan is not None:
            tips = advice(plan, where)
            out.update(commit=plan.commit, files=[{"path": n, "bytes": b, "cached": c} for n, b, c in plan.files],
                       total_bytes=plan.total_bytes, to_fetch=plan.to_fetch, advice=tips)
            for line in tips["lines"]:
                say(line)
            if not tips["disk_ok"]:
                raise CliError(f"{where}: {plan.to_fetch / 1e9:.2f} GB to fetch, {tips['disk_free'] / 1e9:.2f} GB free")
        if not dry_run:
            out["path"] = str(fetch_model(ref, where, say=say))
    except HubError as exc:
        raise CliError(str(exc)) from None
    if json_out:
        print_json(out)
    elif "path" in out:
        typer.echo(out["path"])
