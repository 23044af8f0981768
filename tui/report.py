"""`offload-jobs report JOB`: one self-contained HTML file about a job, to attach to a bug report.

It holds the spec, the timeline (events and attempts), charts of loss, VRAM, GB/s, cache hits,
pinned pool and stall (inline SVG: no script, no network), the engine's host store and its plan
with its predicted against measured step time, and the sample images inlined as data URIs.
Everything comes through the client API; the series come from `tui.history`, as the dashboard's
charts do.
"""

from __future__ import annotations

import base64
import html
import math
import time
from typing import Any, Callable

import yaml

from jobs.contract import JobState, Metric
from jobs.errors import InvalidTransition
from jobs.redact import redact_spec
from tui.fmt import fmt_bytes, fmt_duration, fmt_host_store, fmt_num, fmt_pct, fmt_value, num
from tui.history import CHARTS, ChartSpec, MetricHistory, Series, budget_of, hit_rate_of
from tui.outputs import IMAGE_TYPES, summarize_outputs

__all__ = ["gather", "render_report", "build_report", "svg_chart", "step_axis"]

MAX_IMAGES = 16
MAX_IMAGE_BYTES = 8 << 20
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e")
STEP_CHART = ChartSpec("step_time", "step time: predicted vs measured",
                       ((Metric.measured_step_ms, "measured"), (Metric.predicted_step_ms, "predicted")), "ms")


def gather(client: Any, job_id: str) -> dict[str, Any]:
    """Everything the report shows, read through the client API."""
    job = client.get(job_id)
    jid = job["id"]
    rows: list[dict[str, Any]] = []
    offset = 0
    refused: list[str] = []  # files of the run dir the worker refused to read (a planted FIFO or link)
    while True:
        chunk = _or_refused(lambda: client.metrics(jid, offset), {}, refused)
        rows += chunk.get("records") or []
        nxt = int(chunk.get("next_offset", offset))
        if nxt <= offset:
            break
        offset = nxt
    events = _or_refused(lambda: client.job_events(jid), [], refused) if hasattr(client, "job_events") else []
    files = client.outputs(jid) if hasattr(client, "outputs") else []
    _, samples = summarize_outputs(files)
    images = []
    for f in samples[:MAX_IMAGES]:
        if int(f.get("size") or 0) > MAX_IMAGE_BYTES:
            continue
        data = _or_refused(lambda: client.output_file(jid, f["path"]), None, refused)
        if data is not None:
            images.append({"path": f["path"], "bytes": data})
    return {"job": job, "rows": rows, "events": events, "files": files, "images": images, "refused": refused}


def _or_refused(read: Any, default: Any, refused: list[str]) -> Any:
    """`read()`, or `default` with the worker's reason noted when it refused an unsafe run-dir file."""
    try:
        return read()
    except InvalidTransition as exc:  # the worker's 409: a RunDirError naming the file
        refused.append(str(exc))
        return default


def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _fmt(value: float | None, unit: str) -> str:
    return fmt_value(value, unit)


def step_axis(rows: list[Any]) -> Callable[[float, bool], str]:
    """The x-axis label of a chart point: the training step of its metrics row.

    `MetricHistory` numbers the dict rows from 1 (its x); a row without a step (the load phase)
    takes the nearest step after it for the axis' start (`start=True`) and before it for its end.
    A job whose rows carry no step at all is labelled by row."""
    steps = [num(r.get(Metric.step)) for r in rows if isinstance(r, dict)]
    if all(s is None for s in steps):
        return lambda x, start: f"row {int(x) or 1}"

    def label(x: float, start: bool) -> str:
        i = min(max(int(x) - 1, 0), len(steps) - 1)
        order = list(range(i, len(steps))) + list(range(i - 1, -1, -1)) if start else \
            list(range(i, -1, -1)) + list(range(i + 1, len(steps)))
        step = next(steps[j] for j in order if steps[j] is not None)
        return f"step {int(step)}"

    return label


def svg_chart(chart: ChartSpec, h: MetricHistory, width: int = 560, height: int = 200,
              x_label: Callable[[float, bool], str] | None = None) -> str:
    """One chart as inline SVG: a polyline per series (gaps at NaN), a dashed limit line, axis labels
    (x: `x_label(x, start)`, the step by default when the caller passes `step_axis(rows)`)."""
    series: list[tuple[str, Series]] = [(label, h.get(name)) for name, label in chart.series]
    series = [(label, s) for label, s in series if s.finite()]
    limit = h.get(chart.limit).last() if chart.limit else None
    title = f'<text x="8" y="16" class="t">{_e(chart.title)}</text>'
    if not series:
        return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
                f'aria-label="{_e(chart.title)}">{title}<text x="8" y="{height // 2}" class="n">no data in this '
                f'job&#39;s metrics</text></svg>')
    values = [y for _, s in series for y in s.finite()]
    if chart.unit == "pct":
        lo, hi = 0.0, 1.0
    else:
        hi = max(values + ([limit] if limit else []))
        lo = 0.0 if chart.unit in ("bytes", "gbps", "ms") else min(values)
        if hi == lo:
            hi = lo + (abs(lo) * 0.1 or 1.0)
    left, right, top, bottom = 70, 10, 26, 22
    pw, ph = width - left - right, height - top - bottom
    x_label = x_label or (lambda x, start: f"row {int(x) or 1}")
    xs_all = [x for _, s in series for x in s.xs]
    x0, x1 = min(xs_all), max(xs_all)
    xspan = (x1 - x0) or 1.0

    def pt(x: float, y: float) -> str:
        return f"{left + (x - x0) / xspan * pw:.1f},{top + (hi - y) / (hi - lo) * ph:.1f}"

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
             f'aria-label="{_e(chart.title)}">', title,
             f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" class="f"/>',
             f'<text x="{left - 4}" y="{top + 10}" class="a" text-anchor="end">{_e(_fmt(hi, chart.unit))}</text>',
             f'<text x="{left - 4}" y="{top + ph}" class="a" text-anchor="end">{_e(_fmt(lo, chart.unit))}</text>',
             f'<text x="{left}" y="{height - 6}" class="a">{_e(x_label(x0, True))}</text>',
             f'<text x="{left + pw}" y="{height - 6}" class="a" text-anchor="end">{_e(x_label(x1, False))}</text>']
    if limit is not None and lo <= limit <= hi:
        y = top + (hi - limit) / (hi - lo) * ph
        parts.append(f'<line x1="{left}" x2="{left + pw}" y1="{y:.1f}" y2="{y:.1f}" class="lim"/>')
    legend_x = max(200, 16 + 8 * len(chart.title))
    legend_step = min(150, (width - legend_x) // len(series))  # three legends still fit the width
    for i, (label, s) in enumerate(series):
        color = COLORS[i % len(COLORS)]
        run: list[str] = []
        for x, y in zip(s.xs, s.ys):
            if math.isfinite(y):
                run.append(pt(x, y))
            elif run:
                parts.append(f'<polyline points="{" ".join(run)}" stroke="{color}" class="l"/>')
                run = []
        if len(run) == 1:
            cx, cy = run[0].split(",")
            parts.append(f'<circle cx="{cx}" cy="{cy}" r="2" fill="{color}"/>')
        elif run:
            parts.append(f'<polyline points="{" ".join(run)}" stroke="{color}" class="l"/>')
        parts.append(f'<text x="{legend_x}" y="16" class="a" fill="{color}">{_e(label)} '
                     f'{_e(_fmt(s.last(), chart.unit))}</text>')
        legend_x += legend_step
    if limit is not None:
        parts.append(f'<text x="{legend_x}" y="16" class="a lt">limit {_e(_fmt(limit, chart.unit))}</text>')
    parts.append("</svg>")
    return "".join(parts)


_CSS = """
body{font-family:system-ui,sans-serif;margin:24px;color:#222;max-width:1200px}
h1{font-size:22px}h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ddd;padding:3px 8px;text-align:left}
pre{background:#f6f6f6;padding:10px;overflow:auto;font-size:12px}
.charts{display:flex;flex-wrap:wrap;gap:12px}.charts svg{border:1px solid #ddd;background:#fff}
svg .t{font:bold 13px sans-serif}svg .a{font:11px sans-serif}svg .n{font:12px sans-serif;fill:#888}
svg .f{fill:#fafafa;stroke:#ccc}svg .l{fill:none;stroke-width:1.5}svg .lim{stroke:#d62728;stroke-dasharray:5 4}
svg .lt{fill:#d62728}.imgs{display:flex;flex-wrap:wrap;gap:12px}.imgs figure{margin:0}
.imgs img{width:192px;max-height:384px;object-fit:contain;border:1px solid #ccc;image-rendering:pixelated}
.imgs figcaption{font-size:11px;color:#555}
"""


def _ts(t: Any) -> str:
    f = num(t)
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(f)) if f else "-"


def _v(value: Any) -> Any:
    """A value for the page: "-" for one that is not there (never "None")."""
    return "-" if value is None else value


def render_report(data: dict[str, Any], generated_at: float | None = None) -> str:
    job, rows = data["job"], data["rows"]
    h = MetricHistory(budget=budget_of(job.get("spec")))
    h.extend(rows)
    last = h.latest
    status = job.get("status", "?")
    out = ["<!doctype html><html lang=en><head><meta charset=utf-8>",
           f"<title>offload-jobs report: {_e(job.get('name') or job['id'])} ({_e(job['id'])})</title>",
           f"<style>{_CSS}</style></head><body>",
           f"<h1>{_e(job.get('name') or '-')} <small>job {_e(job['id'])}, {_e(_v(job.get('kind')))}</small></h1>"]
    runtime = None
    if num(job.get("started_at")):
        runtime = (num(job.get("finished_at")) or time.time()) - num(job.get("started_at"))  # type: ignore[operator]
    facts = [("status", f"{status}" + (f" ({job['reason']})" if job.get("reason") and status != JobState.SUCCEEDED else "")),
             ("attempt", f"{_v(job.get('attempt'))} of {_v(job.get('max_attempts'))}"),
             ("created", _ts(job.get("created_at"))),
             ("started", _ts(job.get("started_at"))), ("finished", _ts(job.get("finished_at"))),
             ("runtime", fmt_duration(runtime)),
             ("exit code", _v(job.get("exit_code")) if job.get("finished_at") or job.get("exit_code") is not None
              else "- (not finished)"),
             ("metrics rows", len(rows)), ("last step", fmt_num(last.get(Metric.step))), ("last loss", fmt_num(last.get(Metric.loss), 6)),
             ("peak VRAM", fmt_bytes(last.get(Metric.vram_peak_bytes))), ("VRAM budget", fmt_bytes(h.budget) if h.budget else "none"),
             ("pinned pool", f"{fmt_bytes(last.get(Metric.pinned_used_bytes))} of {fmt_bytes(last.get(Metric.pinned_capacity_bytes))}"),
             ("cache hit rate", f"{fmt_pct(hit_rate_of(last), 1)} ({fmt_num(last.get(Metric.cache_hits))} hits, "
                                f"{fmt_num(last.get(Metric.cache_misses))} misses, {fmt_num(last.get(Metric.cache_evictions))} evictions)"),
             ("H2D", f"{fmt_bytes(last.get(Metric.h2d_bytes))} at {fmt_num(last.get(Metric.h2d_gbps), 3)} GB/s"),
             ("stall", f"{fmt_num(last.get(Metric.stall_ms), 4)} ms in total")]
    out.append("<table>" + "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in facts) + "</table>")
    out.append("<h2>Charts</h2><div class=charts>")
    x_label = step_axis(rows)
    out += [svg_chart(c, h, x_label=x_label) for c in CHARTS if not c.optional or h.draws(c)]
    out.append(svg_chart(STEP_CHART, h, x_label=x_label))
    out.append("</div>")
    out.append("<h2>The engine's plan</h2>")
    store = fmt_host_store(last)
    if store is not None:
        out.append(f"<p>{_e(store)}</p>")
    plan = h.plan
    step_rows = [("measured step", _fmt(h.get(Metric.measured_step_ms).last(), "ms")),
                 ("predicted step", _fmt(h.get(Metric.predicted_step_ms).last(), "ms"))]
    if plan or any(v != "-" for _, v in step_rows):
        items = list((plan or {}).items()) + step_rows
        out.append("<table>" + "".join(
            f"<tr><th>{_e(k)}</th><td>{_e(fmt_bytes(v) if k.endswith('_bytes') else fmt_num(v) if isinstance(v, (int, float)) else _v(v))}</td></tr>"
            for k, v in items) + "</table>")
    else:
        out.append("<p>This job's metrics carry no engine plan.</p>")
    out.append("<h2>Timeline</h2><table><tr><th>time</th><th>event</th><th>status</th><th>details</th></tr>")
    for ev in data.get("events") or []:
        extra = {k: v for k, v in ev.items() if k not in ("ts", "type", "status") and v is not None}
        out.append(f"<tr><td>{_e(_ts(ev.get('ts')))}</td><td>{_e(ev.get('type') or '')}</td><td>{_e(ev.get('status') or '')}</td>"
                   f"<td>{_e(', '.join(f'{k}={v}' for k, v in extra.items()))}</td></tr>")
    for a in job.get("attempts") or []:
        out.append(f"<tr><td>{_e(_ts(a.get('started_at')))}</td><td>attempt {_e(_v(a.get('number')))}</td>"
                   f"<td>{_e(_v(a.get('status')))}</td><td>{_e(a.get('reason') or '')} {_e(a.get('message') or '')} "
                   f"ended {_e(_ts(a.get('finished_at')))}</td></tr>")
    out.append("</table>")
    out.append("<h2>Samples</h2>")
    images = data.get("images") or []
    if images:
        out.append("<div class=imgs>")
        for img in images:
            mime = IMAGE_TYPES.get("." + img["path"].rsplit(".", 1)[-1].lower(), "application/octet-stream")
            b64 = base64.b64encode(img["bytes"]).decode("ascii")
            out.append(f'<figure><img alt="{_e(img["path"])}" src="data:{mime};base64,{b64}">'
                       f"<figcaption>outputs/{_e(img['path'])}</figcaption></figure>")
        out.append("</div>")
    else:
        out.append("<p>No sample images in this job's outputs.</p>")
    checkpoints, _ = summarize_outputs(data.get("files") or [])
    if checkpoints:
        out.append("<h2>Checkpoints</h2><table>" + "".join(
            f"<tr><td>{_e(c.path)}</td><td>{c.files} files, {_e(fmt_bytes(c.bytes))}</td>"
            f"<td>{'complete' if c.complete else 'no completion marker'}</td></tr>" for c in checkpoints) + "</table>")
    spec = redact_spec(job.get("spec") or {})  # the file is made to be shared: env values never in it
    out.append("<h2>Spec</h2><pre>" + _e(yaml.safe_dump(spec, sort_keys=False)) + "</pre>")
    for why in data.get("refused") or []:
        out.append(f"<p><small>not included: {_e(why)}</small></p>")
    out.append(f"<p><small>generated by offload-jobs report at {_e(_ts(generated_at or time.time()))}</small></p>")
    out.append("</body></html>")
    return "\n".join(out)


def build_report(client: Any, job_id: str) -> str:
    return render_report(gather(client, job_id))
