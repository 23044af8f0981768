"""`offload-jobs show JOB`: one job in detail."""

from __future__ import annotations

from jobs._cli.connect import JobAsJson, JobRef
from jobs._cli.output import console, job_detail, job_summary, print_json


def run_state_lines(state: dict) -> str:
    from rich.markup import escape

    lines = []
    if state.get("lora"):
        lines.append(f"[bold]lora[/]       {escape(state['lora'])}")
    ck = state.get("checkpoints")
    if ck is not None:
        text = f"latest step {ck['latest_step']}, {len(ck['complete'])} kept" if ck["complete"] else "none yet"
        if ck.get("incomplete"):
            text += f", {ck['incomplete']} incomplete (skipped on resume)"
        lines.append(f"[bold]checkpoint[/] {text}")
    samples = state.get("last_samples")
    if samples:
        lines.append(f"[bold]samples[/]    step {samples['step']}: " + ", ".join(escape(p) for p in samples["paths"]))
    return "\n".join(lines)


def show(
    job: JobRef,
    json_out: JobAsJson = False,
) -> None:
    """Show one job: status and reason, attempt, times, exit code, run dir and latest metrics."""
    from jobs._cli.connect import connect, resolve_job

    data = resolve_job(connect(), job)
    from jobs._cli.outputs import run_state  # issue 15: samples and checkpoints of train/infer jobs

    state = run_state(data)
    if json_out:
        print_json(job_summary(data) | ({"run_state": state} if state is not None else {}))
        return
    console().print(job_detail(data))
    if state is not None:
        console().print(run_state_lines(state), highlight=False, soft_wrap=True)  # paths stay whole
