"""The contract end to end: real tiny train and infer jobs, run by a real worker, write metrics.jsonl
rows that every reader can draw, with the names of jobs/contract.py.

The rows go to the dashboard's history (tui/history.py) and detail summary, to the HTML report
(through the worker's HTTP API), `show`'s progress row and the Prometheus exporter's job gauges; the detail screen of
each finished job is then opened in the real dashboard (Textual's Pilot) against the same worker.
Before the contract, a real train job's ETA showed "-" (the screen read eta_s, the runner wrote
eta_seconds), an infer job's hit-rate chart was empty and disk GB/s was never forwarded.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from jobs.contract import ENGINE_STATS, JobState, Metric, StepMetrics

REPO = Path(__file__).resolve().parents[2]
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
CPU_OFFLOAD = {"target_device": "cpu", "offload_granularity": "block"}
TRAIN_STEPS = 6

# What each kind's step rows must carry (a null or missing one draws as "-" or an empty chart).
TRAIN_FIELDS = {Metric.step, Metric.total_steps, Metric.loss, Metric.lr, Metric.epoch, Metric.it_s,
                Metric.step_seconds, Metric.eta_seconds, Metric.host_rss_bytes, Metric.host_total_bytes,
                Metric.ema_distance, Metric.val_loss}  # train.ema and train.validation are on (see _specs)
VALIDATE_EVERY = 2
# Charts that only a train job draws: its loss, and the trainer options' (train.ema).
TRAIN_CHARTS = {Metric.loss, Metric.ema_distance}
INFER_FIELDS = {Metric.step, Metric.total_steps, Metric.seconds, Metric.host_rss_bytes, Metric.host_total_bytes}
# Every forwarded engine stat but the disk rate, which only a disk-backed store has, the bounce
# ring's fill rate, which only the bounce store has (the infer job runs through it: see _specs), and
# the compile counts, which only offload.compile writes (tests/offload_core/test_compiled_blocks.py).
DISK_FIELDS = {Metric.disk_gbps, Metric.disk_bytes, Metric.disk_stall_ms, Metric.disk_cache_hit_rate,
               Metric.disk_cache_capacity_bytes, Metric.disk_cache_hit_bytes, Metric.disk_cache_miss_bytes,
               Metric.disk_read_s, Metric.disk_cache_planned, Metric.disk_cache_plan_bytes}
ENGINE_FIELDS = set(ENGINE_STATS) - DISK_FIELDS - {Metric.bounce_fill_gbps, Metric.compile_graphs,
                                     Metric.recompiles, Metric.compile_seconds, Metric.compile_cache_hits,
                                     Metric.compile_cache_misses}
# The engine panel's host store line: the infer job streams through the bounce store (offload.pinned_limit
# 64KiB), the train job through the arena (on the CPU: nothing to pin, and it says so).
HOST_STORE_LINES = {
    "infer": r"host store bounce: pinned \d[\d.]* \w+ / limit 64\.0 KiB, fill \d[\d.e-]* GB/s — the streamed weights",
    "train": r"host store arena: no CUDA device, or cpu_offload is off: nothing to pin",
}


def _builder() -> Any:
    path = REPO / "scripts" / "make_tiny_pipelines.py"
    spec = importlib.util.spec_from_file_location("make_tiny_pipelines", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("make_tiny_pipelines", mod)
    spec.loader.exec_module(mod)
    return mod


def _specs(tiny: dict[str, Path], shards: Path) -> dict[str, dict[str, Any]]:
    common = {"resources": {"gpus": 0}, "limits": {"max_duration": "5m"}, "env": dict(ONE_THREAD)}
    infer = {"prompt": ["a red square", "a green circle --seed 7", "a blue line"], "steps": 2, "width": 32, "height": 32,
             "num_frames": 5, "max_sequence_length": 32}
    return {
        "train": {"kind": "train", "name": "contract-train", "model": {"path": str(tiny["flux"])},
                  "offload": dict(CPU_OFFLOAD),
                  "train": {"dataset": str(tiny["images"]), "steps": TRAIN_STEPS, "learning_rate": 1e-2,
                            "lora_rank": 4, "max_sequence_length": 32, "max_pixels": 1024,
                            "validation": {"items": 1, "every": VALIDATE_EVERY, "timesteps": [0.5]}, "ema": 0.9},
                  **common},
        # a pinned limit under the streamed bytes: the bounce store (its CPU path) carries this one
        "infer": {"kind": "infer", "name": "contract-infer", "model": {"path": str(tiny["flux"])},
                  "offload": {**CPU_OFFLOAD, "pinned_limit": "64KiB"}, "infer": dict(infer), **common},
        # wan: its rope tables are computed, not read, so every weight comes from the shards
        "lazy": {"kind": "infer", "name": "contract-lazy", "model": {"path": str(tiny["wan"])},
                 "offload": {**CPU_OFFLOAD, "lazy_load": True, "shard_dir": str(shards), "max_memory": 0},
                 "infer": dict(infer), **common},
    }


@pytest.fixture(scope="module")
def jobs_done(worker: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """{"train"|"infer"|"lazy": the finished job}, all three run by the module's worker."""
    import warnings

    warnings.filterwarnings("ignore")
    root = tmp_path_factory.mktemp("tiny")
    tiny = _builder().build_all(root, families=["flux", "wan"])
    from offload_core.shard import shard_checkpoint

    shard_checkpoint(tiny["wan"] / "transformer", root / "wan-shards", progress=False)
    with worker.client() as c:
        ids = {name: c.submit(spec)["id"] for name, spec in _specs(tiny, root / "wan-shards").items()}
        done = {name: c.wait(jid, timeout=400) for name, jid in ids.items()}
    for name, job in done.items():
        log = (Path(job["run_dir"]) / "output.log").read_text(errors="replace")[-3000:]
        assert job["status"] == JobState.SUCCEEDED, f"{name}: {job.get('reason')} {job.get('message')}\n{log}"
    return done


def _rows(job: dict[str, Any]) -> list[dict[str, Any]]:
    text = (Path(job["run_dir"]) / "metrics.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _steps(job: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in _rows(job) if Metric.step in r and "phase" not in r]


def _history(job: dict[str, Any]) -> Any:
    from tui.history import MetricHistory, budget_of

    h = MetricHistory(budget=budget_of(job.get("spec")))
    h.extend(_rows(job))
    return h


def _missing(row: dict[str, Any], fields: set[str]) -> list[str]:
    return sorted(f for f in fields if row.get(f) is None)


def test_the_runners_write_every_field_of_the_contract(jobs_done: dict[str, dict[str, Any]]) -> None:
    train, infer, lazy = (_steps(jobs_done[k]) for k in ("train", "infer", "lazy"))
    assert len(train) == TRAIN_STEPS and len(infer) == len(lazy) == 3
    assert _missing(train[-1], TRAIN_FIELDS | ENGINE_FIELDS) == []
    assert _missing(infer[-1], INFER_FIELDS | ENGINE_FIELDS) == []
    assert lazy[-1].get(Metric.disk_gbps) is not None and lazy[-1][Metric.disk_gbps] > 0
    assert _missing(lazy[-1], DISK_FIELDS) == [] and lazy[-1][Metric.disk_bytes] > 0  # the disk store's own fields
    assert lazy[-1][Metric.disk_stall_ms] >= 0 and 0 <= lazy[-1][Metric.disk_cache_hit_rate] <= 1
    # every use that reached the store was served from its cache or read: the disk floor's bytes
    assert lazy[-1][Metric.disk_cache_hit_bytes] + lazy[-1][Metric.disk_cache_miss_bytes] > 0
    assert infer[-1].get(Metric.host_store) == "bounce" and infer[-1].get(Metric.bounce_fill_gbps) is not None
    assert train[-1].get(Metric.host_store) == "arena"
    # the trainer options' fields: val_loss every VALIDATE_EVERY steps (and after the last), ema_distance every step
    assert [r[Metric.step] for r in train if r.get(Metric.val_loss) is not None] == list(
        range(VALIDATE_EVERY, TRAIN_STEPS + 1, VALIDATE_EVERY))
    assert all(r.get(Metric.ema_distance) is not None and r[Metric.ema_distance] >= 0 for r in train)
    # Only names the contract knows: a new field is added there first
    for rows in (train, infer, lazy):
        assert set(rows[-1]) <= set(StepMetrics.__annotations__) | set(ENGINE_STATS)


def test_the_dashboards_history_and_summary_draw_every_field(jobs_done: dict[str, dict[str, Any]]) -> None:
    from tui.history import CHARTS
    from tui.screens.detail import summary_text

    for name, job in jobs_done.items():
        h = _history(job)
        for chart in CHARTS:
            for series, label in chart.series:
                if series == Metric.disk_gbps and name != "lazy" or (chart.key in TRAIN_CHARTS and name != "train"):
                    continue
                assert h.get(series).finite(), f"{name}: chart {chart.title!r} draws no {label}"
        text = summary_text(job, h, time.time()).plain
        for label in ("it/s", "lr", "ETA", "loss") if name == "train" else ():
            assert re.search(rf"{re.escape(label)} [\d.]", text), f"train: {label} drawn as '-': {text}"
        assert re.search(r"cache hits \d+% \(\d+ hit, \d+ miss, \d+ evicted\)", text), text
        assert re.search(r"host RSS \S+ \w+ / \S+ \w+ \(\d+%\)", text), text  # host_total_bytes is written
        if name == "train":
            assert re.search(r"ETA \d", text), text
        if name == "lazy":
            assert re.search(r"disk \d[\d.e-]* GB/s", text), text
    assert _history(jobs_done["infer"]).get("hit_rate").finite()
    train = _history(jobs_done["train"])
    assert len(train.get(Metric.val_loss).finite()) >= TRAIN_STEPS - VALIDATE_EVERY + 1  # held between validations
    assert train.draws(next(c for c in CHARTS if c.key == Metric.ema_distance))
    assert not _history(jobs_done["infer"]).draws(next(c for c in CHARTS if c.key == Metric.ema_distance))
    texts = {name: summary_text(job, _history(job), time.time()).plain for name, job in jobs_done.items()}
    assert re.search(r"EMA distance \d", texts["train"]), texts["train"]
    assert re.search(HOST_STORE_LINES["infer"], texts["infer"]), texts["infer"]
    assert re.search(HOST_STORE_LINES["train"], texts["train"]), texts["train"]


def test_the_report_draws_every_chart_and_the_plan(worker: Any, jobs_done: dict[str, dict[str, Any]]) -> None:
    from tui.history import CHARTS
    from tui.report import build_report

    with worker.client() as c:
        pages = {name: build_report(c, job["id"]) for name, job in jobs_done.items()}
    for name, page in pages.items():
        assert "carry no engine plan" not in page, name
        charts = re.findall(r'<svg [^>]*aria-label="([^"]+)">(.*?)</svg>', page, re.S)
        assert len(charts) >= len(CHARTS), name
        for title, body in charts:
            if title == "loss" and name != "train":
                continue  # an infer job has no loss
            assert "no data in this job" not in body, f"{name}: the report's {title!r} chart is empty"
            assert "<polyline" in body or "<circle" in body, f"{name}: {title!r}"
        titles = [title for title, _ in charts]
        assert ("EMA distance" in titles) == (name == "train"), (name, titles)  # a trainer option's chart
    assert re.search(r"disk [\d.]+ GB/s", pages["lazy"])
    loss = dict(re.findall(r'<svg [^>]*aria-label="([^"]+)">(.*?)</svg>', pages["train"], re.S))["loss"]
    assert re.search(r">validation \d[\d.e-]*<", loss) and loss.count("<polyline") >= 3, loss  # val_loss drawn
    assert re.search(r"<p>" + HOST_STORE_LINES["infer"], pages["infer"])
    assert re.search(r"<p>" + HOST_STORE_LINES["train"], pages["train"])


def test_show_draws_the_progress_of_a_running_train_job(jobs_done: dict[str, dict[str, Any]]) -> None:
    from rich.console import Console

    from jobs._cli.output import job_detail

    job = jobs_done["train"]
    console = Console(record=True, width=200, color_system=None)
    console.print(job_detail({**job, "last_metrics": _steps(job)[-1]}))  # the row a running job's `show` reads
    assert re.search(rf"progress +step {TRAIN_STEPS}/{TRAIN_STEPS}  loss [\d.]+  [\d.]+ it/s  ETA \d", console.export_text())


def test_the_prometheus_exporter_reads_the_contract(jobs_done: dict[str, dict[str, Any]]) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from jobs.worker.metrics import JOB_GAUGES, job_gauges

    live = [{**jobs_done[k], "last_metrics": _steps(jobs_done[k])[-1]} for k in ("train", "lazy")]

    class Jobs:
        def collect(self) -> Any:
            return job_gauges(live)

    registry = CollectorRegistry()
    registry.register(Jobs())
    text = generate_latest(registry).decode()
    train_id, lazy_id = live[0]["id"], live[1]["id"]
    for name, (exported, _, _) in JOB_GAUGES.items():
        if name != Metric.disk_gbps:
            assert re.search(rf'^{exported}{{job="{train_id}",kind="train"}} ', text, re.M), exported
    disk = re.search(rf'^offload_jobs_job_disk_read_bytes_per_second{{job="{lazy_id}",kind="infer"}} (\S+)', text, re.M)
    assert disk and float(disk.group(1)) == pytest.approx(live[1]["last_metrics"][Metric.disk_gbps] * 1e9)


def test_the_worker_exports_a_running_jobs_metrics_over_http(worker: Any) -> None:
    # The dashboard's stand-in job (bench/tui_job.py, the engine on the CPU) writes through the contract
    # too; while it runs, the worker's /metrics carries its last row under the exporter's names.
    import httpx

    spec = {"kind": "command", "name": "contract-live", "workdir": str(REPO), "limits": {"stop_grace": 2},
            "command": [sys.executable, str(REPO / "bench" / "tui_job.py"), "--steps", "400", "--rate", "5"]}
    with worker.client() as c:
        jid = c.submit(spec)["id"]
        try:
            deadline, text = time.monotonic() + 120, ""
            while time.monotonic() < deadline:
                text = httpx.get(f"{worker.url}/metrics", headers={"Authorization": f"Bearer {worker.token}"}).text
                if f'offload_jobs_job_eta_seconds{{job="{jid}",kind="command"}}' in text:
                    break
                time.sleep(0.5)
            for exported in ("step", "total_steps", "loss", "steps_per_second", "eta_seconds", "host_rss_bytes",
                             "cache_hits", "h2d_bytes_per_second", "stall_seconds"):
                assert re.search(rf'^offload_jobs_job_{exported}{{job="{jid}",kind="command"}} \d', text, re.M), exported
            assert re.search(rf'^offload_jobs_job_total_steps{{job="{jid}",kind="command"}} 400.0$', text, re.M)
        finally:
            c.cancel(jid)
            c.wait(jid, timeout=60)


async def test_the_detail_screen_of_real_jobs(worker: Any, jobs_done: dict[str, dict[str, Any]]) -> None:
    from jobs.client import JobsClient
    from tui.app import DashboardApp
    from tui.screens.detail import DetailScreen
    from tui.widgets.chart import TimeChart

    async def opened(job_id: str) -> tuple[str, DetailScreen, Any, bool]:
        app = DashboardApp(lambda: JobsClient(worker.url, worker.token, timeout=10.0), url=worker.url,
                           open_job=job_id, poll_s=0.2, refresh_s=0.2, start_dir=str(REPO))
        async with app.run_test(size=(160, 50)) as pilot:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                screen = app.screen
                if isinstance(screen, DetailScreen) and screen.replayed and screen.history.rows:
                    break
                await pilot.pause(0.1)
            screen = app.screen
            assert isinstance(screen, DetailScreen) and screen.replayed, "the detail screen never loaded the rows"
            await pilot.pause(0.5)
            summary = str(screen.query_one("#summary").render())
            hit = screen.query_one("#chart-hit", TimeChart).plot_text().plain
            ema_shown = screen.query_one(f"#chart-{Metric.ema_distance}", TimeChart).display
        return summary, screen, hit, ema_shown

    summary, _, _, ema_shown = await opened(jobs_done["train"]["id"])
    assert re.search(r"ETA \d", summary), summary
    assert ema_shown and re.search(HOST_STORE_LINES["train"], " ".join(summary.split())), summary  # train.ema's chart is shown
    summary, screen, hit, ema_shown = await opened(jobs_done["infer"]["id"])
    assert screen.history.get("hit_rate").finite()
    assert any(0x2800 < ord(ch) <= 0x28FF for ch in hit), hit  # braille points: the chart is not empty
    assert not ema_shown and re.search(HOST_STORE_LINES["infer"], " ".join(summary.split())), summary
    summary, _, _, _ = await opened(jobs_done["lazy"]["id"])
    assert re.search(r"disk \d[\d.e-]* GB/s", summary), summary
