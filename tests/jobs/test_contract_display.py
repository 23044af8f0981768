"""One display module (jobs/display.py) for the CLI and the dashboard: the same formatters and the
same colour for each state, so `ps`, `show`, `follow` and the TUI cannot drift apart again."""

from __future__ import annotations

import math

import pytest

import jobs._cli.output as cli_output
import jobs.display as display
import tui.fmt as tui_fmt
import tui.screens.jobs as tui_jobs
from jobs.contract import JobState, Metric


def test_the_cli_and_the_dashboard_use_the_same_functions_and_colours() -> None:
    for name in ("fmt_duration", "status_markup"):
        assert getattr(cli_output, name) is getattr(display, name)
    for name in ("num", "fmt_bytes", "fmt_pct", "fmt_num", "fmt_age", "fmt_duration", "fmt_ratio_bytes"):
        assert getattr(tui_fmt, name) is getattr(display, name)
    assert cli_output.STATUS_STYLE is tui_jobs.STATUS_STYLE is display.STATUS_STYLE


def test_every_state_has_a_style_and_a_terminal_colour() -> None:
    assert set(display.STATUS_STYLE) == set(JobState)
    assert all(display.STATUS_ANSI.get(style) for style in display.STATUS_STYLE.values())
    text = cli_output.jobs_text_table([{"id": "a1", "name": "x", "kind": "command", "status": "FAILED",
                                        "reason": "timeout"}], color=True)
    assert "\x1b[1;31mFAILED (timeout)" in text  # bold red, from the shared table
    assert display.status_markup("FAILED", "timeout") == "[bold red]FAILED[/] [dim](timeout)[/]"


@pytest.mark.parametrize("value,shown", [(None, "-"), (math.nan, "-"), (math.inf, "-"), ("soon", "-"), (True, "-"),
                                         (-3.0, "0.0s"), (4.25, "4.2s"), (75, "1m15s"), (7300, "2h01m"),
                                         (90000, "1d01h")])
def test_fmt_duration_takes_what_a_metrics_row_holds(value: object, shown: str) -> None:
    # The CLI's copy raised on NaN (int(nan)) and printed a negative time ('-3.0s') for a clock step back.
    assert display.fmt_duration(value) == shown


def test_progress_line_reads_the_contract_names() -> None:
    row = {Metric.step: 6, Metric.total_steps: 30, Metric.loss: 0.13184, Metric.it_s: 8.66, Metric.eta_seconds: 2.77}
    assert display.progress_line(row) == "step 6/30  loss 0.1318  8.66 it/s  ETA 2.8s"
    assert display.progress_line({"phase": "load"}) == ""


def test_batch_line_says_who_ran_together_in_show_and_the_dashboard() -> None:
    import io
    import re
    import time

    from tui.history import MetricHistory
    from tui.screens.detail import summary_text

    row = {Metric.step: 1, Metric.total_steps: 1, Metric.batch_of: "aa11", Metric.batch_with: ["aa11", "bb22", "cc33"],
           Metric.image_seconds: 0.41234}
    want = "in the batch of aa11 (3 jobs: aa11, bb22, cc33), 0.412s an image"
    assert display.batch_line(row) == want
    assert display.batch_line({Metric.step: 1}) == ""  # ran alone
    job = {"id": "bb22", "kind": "infer", "status": "SUCCEEDED", "last_metrics": row}
    from rich.console import Console

    console = Console(width=200, record=True, file=io.StringIO())
    console.print(cli_output.job_detail(job))
    assert re.search(r"\nbatch +" + re.escape(want), console.export_text())  # `show`
    assert want in summary_text(job, MetricHistory(), time.time()).plain
