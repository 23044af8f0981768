"""`offload-jobs outputs JOB`: list (or copy) what a job wrote to its outputs/ folder.

Also `run_state(job)`, the train/infer summary `show` prints: the last samples and the checkpoints.
Both read the run dir from this machine's disk (a local worker, or a docker worker's state volume
mounted at the same path). Where the run dir is not here (a worker in a container, on another
host; or OFFLOAD_JOBS_RUN_DIRS=remote), `outputs` lists and downloads the files through the API.
"""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from jobs._cli.connect import JobRef
from jobs._cli.output import CliError, console, fmt_duration, print_json
from jobs.errors import RunDirError
from jobs.rundir import RunDir

__all__ = ["outputs", "run_state", "list_outputs"]


REMOTE_ENV = "OFFLOAD_JOBS_RUN_DIRS"  # "remote": never read run dirs from this disk, even if a path matches


def _local_run_dir(job: dict[str, Any]) -> Path | None:
    """The job's run dir when it is on this machine, None when only the worker has it."""
    rd = job.get("run_dir")
    if not rd:
        raise CliError(f"job {job.get('id')} has no run dir yet")
    if os.environ.get(REMOTE_ENV, "").strip().lower() == "remote":
        return None
    return Path(rd) if Path(rd).is_dir() else None


def _remote_files(client: Any, job_id: str) -> list[dict[str, Any]]:
    return [{"path": f["path"], "bytes": f.get("size", 0), "modified": f.get("mtime", 0.0)}
            for f in client.outputs(job_id) if not Path(f["path"]).name.startswith(".")]


def list_outputs(run_dir: Path) -> list[dict[str, Any]]:
    root = run_dir / "outputs"
    if not root.is_dir():
        return []
    out = []
    for f in sorted(root.rglob("*")):
        try:
            st = f.lstat()  # a link planted by the job is neither listed nor followed, nor a hard-linked file
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and not f.name.startswith("."):
            out.append({"path": f.relative_to(root).as_posix(), "bytes": st.st_size, "modified": st.st_mtime,
                        "abs_path": str(f)})
    return out


def _checkpoints(run_dir: Path) -> dict[str, Any]:
    root = run_dir / "checkpoints"
    complete, partial = [], 0
    if root.is_dir():
        for p in sorted(root.glob("step-*"), reverse=True):
            if (p / "COMPLETE.json").is_file():
                complete.append({"step": int(p.name.split("-")[1]), "path": str(p)})
            else:
                partial += 1
        partial += len(list(root.glob(".step-*.tmp-*")))
    return {"complete": complete, "latest_step": complete[0]["step"] if complete else None, "incomplete": partial}


def _last_event(run_dir: Path, type: str) -> dict[str, Any] | None:
    try:  # the safe reader: a FIFO or link planted as events.jsonl must not hang `show`
        records = RunDir(run_dir).read_events()
    except (OSError, RunDirError):
        return None
    last = None
    for rec in records:
        if rec.get("type") == type:
            last = rec
    return last


def run_state(job: dict[str, Any]) -> dict[str, Any] | None:
    """For train/infer jobs: the LoRA, the last samples and the checkpoints; None when not readable here."""
    if job.get("kind") not in ("train", "infer") or not job.get("run_dir") or not Path(job["run_dir"]).is_dir():
        return None
    run_dir = Path(job["run_dir"])
    samples = _last_event(run_dir, "runner.samples")
    files = list_outputs(run_dir)
    state: dict[str, Any] = {
        "outputs": len(files),
        "lora": next((f["abs_path"] for f in files if f["path"].endswith(".safetensors")), None),
        "last_samples": {"step": samples.get("step"), "paths": samples.get("paths", [])} if samples else None,
    }
    if job.get("kind") == "train":
        state["checkpoints"] = _checkpoints(run_dir)
    return state


def outputs(
    job: JobRef,
    copy: Annotated[Optional[Path], typer.Option("--copy", help="Copy the outputs into this folder (created).",
                                                 show_default=False)] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the files as JSON.")] = False,
) -> None:
    """List the files a job wrote to its outputs/ folder (LoRA, samples, images), or copy them."""
    from jobs._cli.connect import connect, resolve_job

    client = connect()
    data = resolve_job(client, job)
    local = _local_run_dir(data)
    run_dir = local or Path(data["run_dir"])
    files = list_outputs(local) if local is not None else _remote_files(client, data["id"])
    copied: list[str] = []
    if copy is not None:
        dest = copy.expanduser()
        if dest.exists() and not dest.is_dir():
            raise CliError(f"--copy: {dest} exists and is not a folder")
        for f in files:
            target = dest / f["path"]
            target.parent.mkdir(parents=True, exist_ok=True)
            if local is not None:
                try:  # the run dir's safe reader: a file swapped for a FIFO or link since the listing is refused
                    RunDir(run_dir).copy_file(f"outputs/{f['path']}", target)
                except RunDirError as exc:
                    raise CliError(str(exc)) from None
            else:  # downloaded from the worker (its run dir is not on this machine)
                tmp = target.with_name(f".{target.name}.part")
                tmp.write_bytes(client.output_file(data["id"], f["path"]))
                os.replace(tmp, target)
                if f.get("modified"):
                    os.utime(target, (f["modified"], f["modified"]))
            copied.append(str(target))
    if json_out:
        print_json({"id": data["id"], "outputs_dir": str(run_dir / "outputs"), "files": files,
                    "on_this_machine": local is not None,
                    **({"copied_to": str(copy.expanduser()), "copied": len(copied)} if copy is not None else {})})
        return
    if not files:
        typer.echo(f"{data['id']}: no outputs yet ({run_dir / 'outputs'})")
        return
    if copy is not None:
        typer.echo(f"copied {len(copied)} files to {copy.expanduser()}")
        return
    from rich.markup import escape
    from rich.table import Table

    table = Table(box=None, header_style="bold", pad_edge=False)
    for col in ("FILE", "SIZE", "MODIFIED"):
        table.add_column(col, justify="right" if col == "SIZE" else "left", no_wrap=True)
    for f in files:
        table.add_row(escape(f["path"]), _size(f["bytes"]), fmt_duration(max(0.0, time.time() - f["modified"])) + " ago")
    console().print(table)
    typer.echo(f"in {run_dir / 'outputs'}" + ("" if local is not None else " on the worker (--copy DIR downloads them)"))


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)
