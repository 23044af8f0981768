"""The detail screen of one job: live charts from its metrics, its spec, events, checkpoints, samples.

A running job's rows stream in (`MetricsTail` every half second); a finished job's metrics.jsonl is
replayed from the start into the same charts.

Each part is redrawn only when what it shows changed: the charts and the summary when rows
arrive (or the job changes), the events when there are new ones, the spec once, the files when
the list differs, and the latest-metrics tab only while it is the tab in view.
"""

from __future__ import annotations

import time
from typing import Any

import yaml
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Header, Static, TabbedContent, TabPane

from jobs.contract import TERMINAL, JobState, Metric
from jobs.display import batch_line
from jobs.errors import JobsError
from tui.feed import MetricRows, MetricsTail
from tui.fmt import fmt_bytes, fmt_duration, fmt_host_store, fmt_num, fmt_pct, fmt_ratio_bytes, num
from tui.history import CHARTS, MetricHistory, budget_of, hit_rate_of, progress_of
from tui.outputs import summarize_outputs
from tui.screens.actions import JobActions
from tui.screens.jobs import STATUS_STYLE
from tui.widgets.chart import TimeChart
from tui.widgets.panels import ConnectionBar

__all__ = ["DetailScreen", "summary_text", "latest_text"]

DETAILS_EVERY_S = 10.0  # a running job's checkpoints and samples: re-listed this often


def summary_text(job: dict[str, Any], h: MetricHistory, now: float) -> Text:
    m = h.latest if h.rows else (job.get("last_metrics") or {})
    status = str(job.get("status") or "?")
    t = Text(no_wrap=False)
    t.append(f"{job.get('id', '?')} ", style="bold")
    t.append(f"{job.get('name') or '-'} ({job.get('kind') or '-'})  ")
    t.append(status, style=STATUS_STYLE.get(status, ""))
    if job.get("reason") and status != JobState.SUCCEEDED:
        t.append(f" ({job['reason']})", style="dim")
    if job.get("attempt"):
        t.append(f"  attempt {job['attempt']}" + (f"/{job['max_attempts']}" if job.get("max_attempts") else ""))
    start, end = num(job.get("started_at")), num(job.get("finished_at"))
    if start is not None:
        t.append(f"  runtime {fmt_duration((end if end is not None else now) - start)}")
    frac, steps = progress_of(m, job.get("spec"))
    if steps:
        t.append(f"  step {steps}" + (f" ({fmt_pct(frac)})" if frac is not None else ""))
    t.append("\n")
    parts = [(Metric.loss, fmt_num(m.get(Metric.loss), 5)), ("it/s", fmt_num(m.get(Metric.it_s), 3)),
             ("ETA", fmt_duration(m.get(Metric.eta_seconds))), (Metric.lr, fmt_num(m.get(Metric.lr), 3))]
    vram = num(m.get(Metric.vram_allocated_bytes))
    budget = h.budget or budget_of(job.get("spec"))
    parts.append(("VRAM", fmt_ratio_bytes(vram, budget) if vram is not None else "-"))
    parts.append(("peak", fmt_bytes(m.get(Metric.vram_peak_bytes))))
    parts.append(("pinned", fmt_ratio_bytes(m.get(Metric.pinned_used_bytes), m.get(Metric.pinned_capacity_bytes))))
    hit = h.latest.get("_hit_rate_interval") if h.rows else None
    parts.append(("cache hits", f"{fmt_pct(hit_rate_of(m))} ({fmt_num(m.get(Metric.cache_hits))} hit, "
                                f"{fmt_num(m.get(Metric.cache_misses))} miss, {fmt_num(m.get(Metric.cache_evictions))} evicted)"
                  + (f", now {fmt_pct(hit)}" if hit is not None else "")))
    parts.append(("H2D", f"{fmt_num(m.get(Metric.h2d_gbps), 3)} GB/s"))
    if m.get(Metric.disk_gbps) is not None:
        parts.append(("disk", f"{fmt_num(m.get(Metric.disk_gbps), 3)} GB/s"))
    stall = h.latest.get("_stall_per_step") if h.rows else None
    parts.append(("stall", f"{fmt_num(stall, 3)} ms/step" if stall is not None else fmt_num(m.get(Metric.stall_ms), 4) + " ms"))
    rss = m.get(Metric.host_rss_bytes)
    if rss is not None:
        parts.append(("host RSS", fmt_ratio_bytes(rss, m.get(Metric.host_total_bytes))))
    ema = num(m.get(Metric.ema_distance))
    if ema is not None:
        parts.append(("EMA distance", fmt_num(ema, 3)))
    for i, (k, v) in enumerate(parts):
        t.append(f"{k} ", style="dim")
        t.append(v + ("   " if i < len(parts) - 1 else ""), style="bold")
    store = fmt_host_store(m)
    if store is not None:
        t.append("\n" + store, style="dim")
    batch = batch_line(m) or batch_line(job.get("last_metrics"))  # co-scheduled inference: who ran together
    if batch:
        t.append("\n" + batch, style="dim")
    return t


def latest_text(h: MetricHistory) -> Text:
    """Every key of the newest row (known or not), one per line."""
    t = Text()
    if not h.latest:
        t.append("no metrics yet", style="dim")
    for k in sorted(h.latest):
        if k.startswith("_") or k == "units":
            continue
        v = h.latest[k]
        if k.endswith("_bytes"):
            shown = fmt_bytes(v)
        elif isinstance(v, dict):
            shown = ", ".join(f"{a}={fmt_num(b) if isinstance(b, (int, float)) else b}" for a, b in v.items())
        else:
            shown = fmt_num(v) if isinstance(v, (int, float)) else str(v)
        t.append(f"{k:>24} ", style="dim")
        t.append(shown[:200] + "\n")
    return t


class DetailScreen(JobActions, Screen):
    BINDINGS = [Binding("escape", "back", "Back"), *JobActions.ACTION_BINDINGS,
                Binding("pagedown", "scroll_body(1)", "Scroll down", show=False),
                Binding("pageup", "scroll_body(-1)", "Scroll up", show=False)]
    # The summary stays above the scrolling part (charts, tabs): on a small terminal the charts
    # alone are taller than the screen, and the job's status must stay in view.
    # No automatic focus: it scrolls the focused tabs into view, at a moment that depends on timing;
    # the first resume focuses them without scrolling, so the screen opens at the charts.
    AUTO_FOCUS = ""
    DEFAULT_CSS = """
    DetailScreen #summary { height: auto; max-height: 50%; padding: 0 1; border-bottom: solid $primary-darken-2; }
    DetailScreen #body { height: 1fr; }
    DetailScreen #charts { grid-size: 2; grid-gutter: 0 1; height: auto; grid-rows: 8; }
    DetailScreen #charts.-narrow { grid-size: 1; }
    DetailScreen TabbedContent { height: 1fr; min-height: 12; }
    """

    def __init__(self, job_id: str) -> None:
        super().__init__()
        self.job_id = job_id
        self.history = MetricHistory()
        self.tail: MetricsTail | None = None
        self.replayed = False
        self.files: list[dict[str, Any]] = []
        self.past_events: list[dict[str, Any]] = []
        self.detail: dict[str, Any] = {}
        self._drawn: dict[str, Any] = {}  # part -> the key it was last drawn for
        self._details_at = 0.0

    def selected_job_id(self) -> str | None:
        return self.job_id

    @property
    def job(self) -> dict[str, Any]:
        job = dict(self.detail)
        job.update(self.app.jobs.get(self.job_id, {}))
        job.setdefault("id", self.job_id)
        return job

    def compose(self) -> ComposeResult:
        yield Header(show_clock=False)
        yield Static(id="summary")
        with VerticalScroll(id="body", can_focus=False):
            with Grid(id="charts"):
                for c in CHARTS:
                    chart = TimeChart(c, lambda: self.history, id=f"chart-{c.key}")
                    chart.display = not c.optional  # until the job writes its series
                    yield chart
            with TabbedContent(id="tabs"):
                with TabPane("events", id="tab-events"):
                    yield VerticalScroll(Static(id="events"))
                with TabPane("spec", id="tab-spec"):
                    yield VerticalScroll(Static(id="spec"))
                with TabPane("checkpoints & samples", id="tab-outputs"):
                    yield VerticalScroll(Static(id="outputs"))
                with TabPane("latest metrics", id="tab-latest"):
                    yield VerticalScroll(Static(id="latest"))
        yield ConnectionBar()
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = f"job {self.job_id}"
        self.history.budget = budget_of(self.job.get("spec"))
        replay = getattr(self.app, "replay", None) or {}
        if self.job_id in replay:  # recorded rows (tests, snapshots)
            self.history.extend(replay[self.job_id])
            self.replayed = True
        elif self.app.make_client is not None:
            self.app.after_first_frame(self._start_feeds)
        self.sync()
        self._timer = self.set_interval(self.app.refresh_s, self.sync)
        self._opened = False

    def _start_feeds(self) -> None:
        if not self.is_attached:
            return
        jobs, job_id = self.app.jobs, self.job_id

        def status_of() -> str | None:
            # Events keep the app's copy current; this screen's own GET (every DETAILS_EVERY_S while
            # the job runs) covers a worker whose list fails. Two atomic reads: safe from a thread.
            return (jobs.get(job_id) or {}).get("status") or self.detail.get("status")

        # With a feed there is no need to ask the worker for the whole job on every metrics read.
        self.tail = MetricsTail(self.app.make_client, job_id, self.app.post_message,
                                status_of=status_of if self.app.feed is not None else None).start()
        self._load_details()

    def on_unmount(self) -> None:
        if self.tail is not None:
            self.tail.stop()

    def on_resize(self) -> None:
        self.query_one("#charts").set_class(self.size.width < 100, "-narrow")

    def add_metric_rows(self, msg: MetricRows) -> None:
        if msg.job_id != self.job_id:
            return
        if self.history.budget is None:
            self.history.budget = budget_of(self.job.get("spec"))
        self.history.extend(msg.rows)
        if msg.done:
            self.replayed = True

    def _load_details(self) -> None:
        self._details_at = time.monotonic()
        app, job_id = self.app, self.job_id

        def run() -> None:
            try:
                with app.client() as c:
                    detail = c.get(job_id)
                    events = c.job_events(job_id) if hasattr(c, "job_events") else []
                    files = c.outputs(job_id) if hasattr(c, "outputs") else []
            except JobsError as exc:
                app.call_from_thread(app.notify, f"job {job_id}: {exc}", severity="error", timeout=5)
                return
            app.call_from_thread(self._details_loaded, detail, events, files)

        app.run_worker(run, thread=True, group=f"detail-{job_id}", exclusive=True, exit_on_error=False)

    def _details_loaded(self, detail: dict[str, Any], events: list[dict[str, Any]], files: list[dict[str, Any]]) -> None:
        self.detail, self.past_events, self.files = detail, events, files
        if self.history.budget is None:
            self.history.budget = budget_of(detail.get("spec"))
        self.sync()

    # ------------------------------------------------------------ drawing
    def _due(self, part: str, key: Any) -> bool:
        """Whether `part` shows something else than when last drawn (and remember `key`)."""
        if self._drawn.get(part, self) == key:
            return False
        self._drawn[part] = key
        return True

    def sync(self) -> None:
        job = self.job
        status = str(job.get("status"))
        running = status not in TERMINAL
        if self.tail is not None and running and time.monotonic() - self._details_at > DETAILS_EVERY_S:
            self._load_details()  # new checkpoints and samples
        if not self.is_current:
            return
        rows, version = self.history.rows, self.app.changed_at.get(self.job_id, 0)
        now = self.app.clock()
        drew = False
        # The runtime in the summary ticks while the job runs: once a second is enough.
        if self._due("summary", (rows, version, int(now) if running else 0)):
            self._draw_summary(summary_text(job, self.history, now))
            drew = True
        if self._due("charts", rows):
            for chart in self.query(TimeChart):
                if chart.chart.optional:
                    chart.display = self.history.draws(chart.chart)
                chart.refresh_data()
            drew = True
        events = self.app.job_events.get(self.job_id, ())
        if self._due("events", (len(self.past_events), len(events), events[-1].get("id") if events else None,
                                len(self.detail.get("attempts") or ()))):
            self.query_one("#events", Static).update(self._events_text())
        spec = job.get("spec") or {}
        if self._due("spec", spec):
            self.query_one("#spec", Static).update(yaml.safe_dump(spec, sort_keys=False) if spec else "(no spec yet)")
        if self._due("outputs", self.files):
            self.query_one("#outputs", Static).update(self._outputs_text())
        if self.query_one("#tabs", TabbedContent).active == "tab-latest" and self._due("latest", rows):
            self.query_one("#latest", Static).update(latest_text(self.history))
        if drew:
            self.app.refreshes += 1

    def _draw_summary(self, text: Text) -> None:
        box = self.query_one("#summary", Static)
        width = box.content_size.width
        shape = (width, len(text.wrap(self.app.console, width)) if width > 0 else -1)
        # A layout pass only when its height may change (the text wraps to another line count).
        box.update(text, layout=shape != self._drawn.get("summary-shape") or width <= 0)
        self._drawn["summary-shape"] = shape

    def on_tabbed_content_tab_activated(self) -> None:
        self.sync()  # the latest-metrics tab is drawn only while shown

    def on_screen_suspend(self) -> None:
        self._timer.pause()  # under the logs screen: rows are still collected, drawn when shown again

    def on_screen_resume(self) -> None:
        self._timer.resume()
        self.sync()
        if not self._opened:
            self._opened = True
            self.set_focus(self.query_one("#tabs Tabs"), scroll_visible=False)

    def _events_text(self) -> Text:
        seen: set[Any] = set()
        rows: list[dict[str, Any]] = []
        for ev in [*self.past_events, *self.app.job_events.get(self.job_id, ())]:
            mark = (round(float(ev.get("ts") or 0), 3), ev.get("type"), ev.get("status"))
            if mark in seen:
                continue
            seen.add(mark)
            rows.append(ev)
        t = Text()
        if not rows:
            for a in self.detail.get("attempts") or []:
                rows.append({"ts": a.get("started_at"), "type": f"attempt {a.get('number')}",
                             "status": a.get("status"), "reason": a.get("reason"), "message": a.get("message")})
        if not rows:
            t.append("no events yet", style="dim")
        for ev in rows:
            ts = num(ev.get("ts"))
            t.append(time.strftime("%H:%M:%S ", time.localtime(ts)) if ts else "         ", style="dim")
            t.append(f"{ev.get('type', '?')} ")
            if ev.get("status"):
                t.append(str(ev["status"]), style=STATUS_STYLE.get(str(ev["status"]), "bold"))
            extra = {k: v for k, v in ev.items() if k not in ("ts", "type", "status", "id", "job_id") and v is not None}
            if extra:
                t.append("  " + " ".join(f"{k}={v}" for k, v in extra.items()), style="dim")
            t.append("\n")
        return t

    def _outputs_text(self) -> Text:
        checkpoints, samples = summarize_outputs(self.files)
        t = Text()
        t.append("checkpoints\n", style="bold")
        if not checkpoints:
            t.append("  none yet\n", style="dim")
        for ck in checkpoints[:10]:
            state = Text("complete", style="green") if ck.complete else Text("no completion marker", style="yellow")
            t.append(f"  {ck.path}  {ck.files} files, {fmt_bytes(ck.bytes)}  ")
            t.append_text(state)
            t.append("\n")
        t.append("latest samples\n", style="bold")
        if not samples:
            t.append("  none yet\n", style="dim")
        for s in samples[:10]:
            t.append(f"  outputs/{s['path']}  {fmt_bytes(s.get('size'))}\n")
        return t

    def deleted(self, job_id: str) -> None:
        super().deleted(job_id)
        if self.is_current:
            self.app.pop_screen()  # nothing left to show

    def action_scroll_body(self, pages: int) -> None:
        body = self.query_one("#body", VerticalScroll)
        body.scroll_to(y=body.scroll_y + pages * max(1, body.scrollable_content_region.height - 2), animate=False)

    def action_back(self) -> None:
        self.app.pop_screen()
