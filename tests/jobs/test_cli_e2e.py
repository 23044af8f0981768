"""End-to-end: the REAL `offload-jobs` console script against a REAL worker process.

The worker is the shared module-scoped `worker` fixture (tests/jobs/conftest.py): a
`python -m jobs.worker` child on a temporary state dir and a free port. The CLI finds it the way a
user's shell does, through OFFLOAD_JOBS_HOME (worker.json + token).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from jobs.client import JobsClient

REPO = Path(__file__).resolve().parents[2]
TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}


def console_script() -> str:
    path = Path(sys.executable).parent / "offload-jobs"
    found = str(path) if path.exists() else shutil.which("offload-jobs")
    if not found:
        pytest.fail("the offload-jobs console script is not installed; run: .venv/bin/pip install -e . --no-deps")
    return found


def cli_env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OFFLOAD_JOBS_")}
    env["OFFLOAD_JOBS_HOME"] = str(home)
    env.update(extra)
    return env


class CLI:
    """Runs `offload-jobs ...` as a child process against one state dir."""

    def __init__(self, home: Path, cwd: Path) -> None:
        self.exe = console_script()
        self.home = home
        self.cwd = cwd

    def __call__(self, *args: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([self.exe, *args], capture_output=True, text=True, timeout=timeout,
                              env=cli_env(self.home, **env), cwd=self.cwd)

    def popen(self, *args: str) -> subprocess.Popen[str]:
        # As from a terminal: SIGINT at its default. A shell without job control starts background
        # commands (a CI script run with `&`) with SIGINT ignored, and a child inherits that.
        return subprocess.Popen([self.exe, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=cli_env(self.home), cwd=self.cwd,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


@pytest.fixture
def cli(worker: Any, tmp_path: Path) -> CLI:
    return CLI(worker.home, tmp_path)


@pytest.fixture
def api(worker: Any) -> Iterator[JobsClient]:
    with worker.client() as c:
        yield c


def write_spec(tmp_path: Path, command: str, name: str = "e2e", **extra: Any) -> Path:
    spec: dict[str, Any] = {"kind": "command", "name": name, "command": command,
                            "limits": {"max_duration": "2m", "stop_grace": "2s"}}
    spec.update(extra)
    path = tmp_path / f"{name}.yaml"
    path.write_text(json.dumps(spec))  # JSON is YAML
    return path


def wait_status(api: JobsClient, job_id: str, wanted: set[str], timeout: float = 30) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        job = api.get(job_id)
        if job["status"] in wanted:
            return job
        if time.monotonic() > deadline:
            raise AssertionError(f"job {job_id} is {job['status']}, wanted {wanted}")
        time.sleep(0.05)


def submit_detached(cli: CLI, spec: Path, *args: str) -> str:
    res = cli("submit", str(spec), "-d", *args)
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


def process_alive(pid: int) -> bool:
    """Running (a zombie, exited but not yet reaped by init, counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def assert_one_error_line(res: subprocess.CompletedProcess[str]) -> str:
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    assert "Traceback" not in res.stdout + res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    return lines[0]


# ------------------------------------------------------------------ submit


def test_submit_streams_logs_until_succeeded(cli: CLI, api: JobsClient, tmp_path: Path) -> None:
    spec = write_spec(tmp_path, "for i in 1 2 3; do echo line-$i; sleep 0.1; done; echo the-end", name="stream")
    res = cli("submit", str(spec))
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert out.index("line-1") < out.index("line-2") < out.index("line-3") < out.index("the-end")
    job_id = re.search(r"submitted job (\S+)", res.stderr).group(1)
    assert f"job {job_id} SUCCEEDED" in res.stderr
    assert api.get(job_id)["status"] == "SUCCEEDED"


def test_submit_failed_job_exits_1(cli: CLI, tmp_path: Path) -> None:
    spec = write_spec(tmp_path, "echo about-to-fail; exit 3", name="fails")
    res = cli("submit", str(spec))
    assert res.returncode == 1
    assert "about-to-fail" in res.stdout
    assert "FAILED (exit_nonzero, exit code 3)" in res.stderr
    assert "Traceback" not in res.stderr


def test_submit_set_override_reaches_the_job(cli: CLI, tmp_path: Path) -> None:
    spec = write_spec(tmp_path, 'echo "greeting=$GREETING"', name="override", env={"GREETING": "hello"})
    res = cli("submit", str(spec), "--set", "env.GREETING=bonjour")
    assert res.returncode == 0, res.stderr
    assert "greeting=bonjour" in res.stdout


def test_submit_json_keeps_stdout_for_the_result(cli: CLI, tmp_path: Path) -> None:
    spec = write_spec(tmp_path, "echo to-stderr-with-json", name="json-attached")
    res = cli("submit", str(spec), "--json")
    assert res.returncode == 0, res.stderr
    job = json.loads(res.stdout)  # the log went to stderr, so stdout is pure JSON
    assert (job["name"], job["status"], job["exit_code"]) == ("json-attached", "SUCCEEDED", 0)
    assert "to-stderr-with-json" in res.stderr


def test_submit_detach_prints_the_id_alone(cli: CLI, api: JobsClient, tmp_path: Path) -> None:
    spec = write_spec(tmp_path, "echo detached", name="detach")
    res = cli("submit", str(spec), "-d")
    assert res.returncode == 0, res.stderr
    job_id = res.stdout.strip()
    assert res.stdout == job_id + "\n" and re.fullmatch(r"[A-Za-z0-9_-]+", job_id)
    assert api.get(job_id)["name"] == "detach"

    res = cli("submit", str(spec), "-d", "--json")
    assert res.returncode == 0
    data = json.loads(res.stdout)
    assert data["id"] != job_id and api.get(data["id"])["name"] == "detach"


def test_submit_bad_spec_is_refused_before_the_worker(cli: CLI, api: JobsClient, tmp_path: Path) -> None:
    before = len(api.list())
    spec = write_spec(tmp_path, "echo x", name="bad", priority="high")
    line = assert_one_error_line(cli("submit", str(spec)))
    assert "priority" in line
    assert len(api.list()) == before


def test_ctrl_c_during_submit_detaches(cli: CLI, api: JobsClient, tmp_path: Path) -> None:
    spec = write_spec(tmp_path, "echo started; sleep 60", name="ctrlc")
    proc = cli.popen("submit", str(spec))
    out: list[str] = []
    err: list[str] = []
    readers = [threading.Thread(target=lambda s=s, acc=acc: acc.extend(s), daemon=True)
               for s, acc in ((proc.stdout, out), (proc.stderr, err))]
    for r in readers:
        r.start()
    job_id = None
    try:
        deadline = time.monotonic() + 30
        while "started\n" not in out:  # the job runs and its log is being streamed
            assert proc.poll() is None and time.monotonic() < deadline, ("".join(out), "".join(err))
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        proc.wait(15)
        for r in readers:
            r.join(5)
        text = "".join(err)
        job_id = re.search(r"submitted job (\S+)", text).group(1)
        assert f"offload-jobs logs -f {job_id}" in text
        assert "Traceback" not in text
        assert proc.returncode == 130
        time.sleep(0.5)
        assert api.get(job_id)["status"] == "RUNNING"  # detached, not cancelled
    finally:
        if proc.poll() is None:
            proc.kill()
        if job_id is not None:
            api.cancel(job_id)
            wait_status(api, job_id, TERMINAL)


# ------------------------------------------------------------------ logs


def test_logs_follow_ends_when_the_job_ends(cli: CLI, api: JobsClient, tmp_path: Path) -> None:
    spec = write_spec(tmp_path, "for i in $(seq 1 8); do echo tick-$i; sleep 0.2; done; echo final-line", name="follow")
    job_id = submit_detached(cli, spec)
    wait_status(api, job_id, {"RUNNING"} | TERMINAL)
    res = cli("logs", "-f", job_id, timeout=60)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    ticks = [lines.index(f"tick-{i}") for i in range(1, 9)]
    assert ticks == sorted(ticks) and lines.index("final-line") > ticks[-1]  # all of it, in order, to the end
    assert f"job {job_id} SUCCEEDED" in res.stderr
    assert api.get(job_id)["status"] == "SUCCEEDED"


def test_logs_tail(cli: CLI, api: JobsClient, tmp_path: Path) -> None:
    spec = write_spec(tmp_path, "for i in $(seq 1 20); do echo row-$i; done", name="tail")
    job_id = submit_detached(cli, spec)
    wait_status(api, job_id, TERMINAL)
    full = cli("logs", job_id)
    assert full.returncode == 0 and "row-1\n" in full.stdout and "row-20\n" in full.stdout
    res = cli("logs", job_id, "--tail", "3")
    assert res.returncode == 0
    assert res.stdout.splitlines() == full.stdout.splitlines()[-3:]
    assert cli("logs", job_id, "--tail", "0").stdout == ""


# ------------------------------------------------------------------ cancel / retry


def test_cancel_a_running_job(cli: CLI, api: JobsClient, tmp_path: Path) -> None:
    spec = write_spec(tmp_path, "echo up; sleep 60", name="cancel-me")
    job_id = submit_detached(cli, spec)
    wait_status(api, job_id, {"RUNNING"})
    res = cli("cancel", job_id[:6])
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(job_id)
    job = wait_status(api, job_id, TERMINAL, timeout=20)
    assert (job["status"], job["reason"]) == ("CANCELLED", "cancelled")


def test_retry_runs_a_new_attempt(cli: CLI, api: JobsClient, tmp_path: Path) -> None:
    marker = tmp_path / "second-time"
    spec = write_spec(tmp_path, f'if [ -f "{marker}" ]; then echo second-attempt; else touch "{marker}"; exit 1; fi',
                      name="retry-me")
    job_id = submit_detached(cli, spec)
    assert wait_status(api, job_id, TERMINAL)["status"] == "FAILED"
    res = cli("retry", job_id)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(job_id)
    # It was FAILED; only a new attempt can make it SUCCEEDED (it may already have, it is quick).
    job = wait_status(api, job_id, {"SUCCEEDED", "CANCELLED"}, timeout=30)
    assert (job["status"], job["attempt"]) == ("SUCCEEDED", 2)
    assert "second-attempt" in cli("logs", job_id).stdout


# ------------------------------------------------------------------ ps / show / validate / errors


def test_ps_and_show_json(cli: CLI, api: JobsClient, tmp_path: Path) -> None:
    spec = write_spec(tmp_path, "sleep 30", name="listed", priority=4)
    job_id = submit_detached(cli, spec)
    wait_status(api, job_id, {"RUNNING"})
    try:
        res = cli("ps", "--json")
        assert res.returncode == 0, res.stderr
        jobs = json.loads(res.stdout)
        mine = [j for j in jobs if j["id"] == job_id]
        assert len(mine) == 1 and all(j["status"] not in TERMINAL for j in jobs)
        assert {k: mine[0][k] for k in ("name", "kind", "status", "priority")} == {
            "name": "listed", "kind": "command", "status": "RUNNING", "priority": 4}

        res = cli("show", job_id[:8], "--json")
        assert res.returncode == 0, res.stderr
        shown = json.loads(res.stdout)
        assert {"id", "name", "kind", "status", "reason", "attempt"} <= set(shown)
        assert (shown["id"], shown["name"], shown["status"], shown["reason"], shown["attempt"]) == (
            job_id, "listed", "RUNNING", None, 1)

        table = cli("ps")
        assert table.returncode == 0 and job_id in table.stdout and "RUNNING" in table.stdout
        assert "listed" in cli("show", job_id).stdout
    finally:
        api.cancel(job_id)
    wait_status(api, job_id, TERMINAL)
    every = json.loads(cli("ps", "--json", "--all").stdout)
    assert any(j["id"] == job_id and j["status"] == "CANCELLED" for j in every)
    assert all(j["id"] != job_id for j in json.loads(cli("ps", "--json").stdout))


def test_ps_pages_the_newest_and_says_how_many_more(cli: CLI, api: JobsClient, tmp_path: Path) -> None:
    spec = write_spec(tmp_path, "true", name="paged")
    ids = [submit_detached(cli, spec) for _ in range(3)]
    for job_id in ids:
        wait_status(api, job_id, TERMINAL)
    total = len(api.list(summary=True))
    res = cli("ps", "--all", "--limit", "2")
    assert res.returncode == 0, res.stderr
    rows = res.stdout.strip().splitlines()
    assert rows[0].split()[:4] == ["ID", "NAME", "KIND", "STATUS"] and len(rows) == 3
    assert ids[-1] in rows[1] and ids[-2] in rows[2]  # newest first
    assert f"the newest 2 of {total} jobs" in res.stderr
    assert len(json.loads(cli("ps", "--all", "--json").stdout)) == total  # --all: no page limit


def test_delete_and_prune(cli: CLI, api: JobsClient, tmp_path: Path) -> None:
    done = [submit_detached(cli, write_spec(tmp_path, "true", name=f"old{i}")) for i in range(2)]
    for job_id in done:
        wait_status(api, job_id, TERMINAL)
    running = submit_detached(cli, write_spec(tmp_path, "sleep 60", name="busy"))
    wait_status(api, running, {"RUNNING"})
    try:
        run_dir = Path(api.get(done[0])["run_dir"])
        assert run_dir.is_dir()
        res = cli("delete", done[0][:8])
        assert res.returncode == 0 and f"{done[0]} deleted" in res.stdout, res.stderr
        assert not run_dir.exists()
        assert all(j["id"] != done[0] for j in api.list(summary=True))
        line = assert_one_error_line(cli("delete", running))
        assert "cancel it" in line
        line = assert_one_error_line(cli("delete", done[0]))
        assert done[0] in line  # gone already
        # prune: nothing is that old; then everything finished is
        res = cli("prune", "--older-than", "7d", "--json")
        assert json.loads(res.stdout)["deleted"] == []
        res = cli("prune", "--older-than", "0s", "--dry-run")
        assert res.returncode == 0 and done[1] in res.stdout and "would delete" in res.stdout
        assert api.get(done[1])["status"] == "SUCCEEDED"  # a dry run deletes nothing
        res = cli("prune", "--older-than", "0s", "--json")
        pruned = json.loads(res.stdout)["deleted"]
        assert done[1] in pruned and running not in pruned
        assert api.get(running)["status"] == "RUNNING"
        line = assert_one_error_line(cli("prune", "--older-than", "soon"))
        assert "--older-than" in line
    finally:
        api.cancel(running)


def test_validate_strict_checks_paths_on_the_worker(cli: CLI, tmp_path: Path) -> None:
    spec = write_spec(tmp_path, "true", name="strict", workdir=str(tmp_path / "not-made"))
    assert cli("validate", str(spec)).returncode == 0  # valid as a spec...
    line = assert_one_error_line(cli("validate", str(spec), "--strict"))
    assert "workdir" in line and "not-made" in line and "does not exist on the worker" in line
    assert str(spec) in line
    (tmp_path / "not-made").mkdir()
    res = cli("validate", str(spec), "--strict")
    assert (res.returncode, res.stdout) == (0, "ok\n"), res.stderr


def test_python_dash_m_jobs(worker: Any) -> None:
    res = subprocess.run([sys.executable, "-m", "jobs", "ps", "--json"], capture_output=True, text=True,
                         env=cli_env(worker.home), timeout=60, cwd=REPO)
    assert res.returncode == 0, res.stderr
    assert isinstance(json.loads(res.stdout), list)


def test_validate_through_the_console_script(cli: CLI, tmp_path: Path) -> None:
    good = write_spec(tmp_path, "echo ok", name="good")
    res = cli("validate", str(good))
    assert (res.returncode, res.stdout) == (0, "ok\n")
    bad = write_spec(tmp_path, "echo ok", name="bad", limits={"max_duration": "forever"})
    line = assert_one_error_line(cli("validate", str(bad)))
    assert "limits.max_duration" in line
    line = assert_one_error_line(cli("validate", str(tmp_path / "missing.yaml")))
    assert "missing.yaml" in line


def test_unknown_job_and_bad_token(cli: CLI) -> None:
    line = assert_one_error_line(cli("show", "no-such-job"))
    assert "no-such-job" in line
    line = assert_one_error_line(cli("ps", OFFLOAD_JOBS_TOKEN="not-the-token"))
    assert "token" in line


def test_up_local_on_a_busy_port(worker: Any, tmp_path: Path) -> None:
    cli = CLI(tmp_path / "other-home", tmp_path)
    line = assert_one_error_line(cli("up", "--local", "--port", str(worker.port), timeout=90))
    assert "address already in use" in line and "worker.log" in line


def test_no_worker_message(tmp_path: Path) -> None:
    cli = CLI(tmp_path / "empty-home", tmp_path)
    from jobs_helpers import free_port

    line = assert_one_error_line(cli("ps", OFFLOAD_JOBS_URL=f"http://127.0.0.1:{free_port()}"))
    assert "offload-jobs up --local" in line


# ------------------------------------------------------------------ up --local / down --local


def test_up_local_ps_down_local(tmp_path: Path) -> None:
    home = tmp_path / "local-home"
    cli = CLI(home, tmp_path)
    res = cli("up", "--local", "--port", "0", timeout=90)
    assert res.returncode == 0, res.stderr
    url = res.stdout.strip()
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+", url)
    pid = json.loads((home / "worker.json").read_text())["pid"]
    try:
        assert (home / "worker.log").exists()
        ps = cli("ps", "--json")
        assert ps.returncode == 0, ps.stderr
        assert json.loads(ps.stdout) == []
        again = cli("up", "--local", "--port", "0")
        assert again.returncode == 0 and again.stdout.strip() == url and "already running" in again.stderr
    finally:
        down = cli("down", "--local", timeout=60)
    assert down.returncode == 0, down.stderr
    assert f"pid {pid}" in down.stderr
    assert not process_alive(pid)
    # the address it had (not the default port: a developer's own worker may be listening there)
    line = assert_one_error_line(cli("ps", OFFLOAD_JOBS_URL=url))
    assert "up --local" in line


# ------------------------------------------------------------------ shard (once offload_core.shard exists)


def _tiny_flux_folder(path: Path) -> Path:
    """A tiny diffusers Flux transformer saved as a diffusers folder (RECIPES.md sizes)."""
    import torch
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    model = FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=2, num_single_layers=2,
                                   attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                   pooled_projection_dim=32, guidance_embeds=False, axes_dims_rope=(4, 4, 8))
    model.save_pretrained(path)
    return path


@pytest.fixture
def shard_support() -> None:
    import importlib.util

    if importlib.util.find_spec("offload_core.shard") is None:
        pytest.skip("offload_core.shard is not written yet")


def test_shard_verb_in_process(shard_support: None, tmp_path: Path) -> None:
    src = _tiny_flux_folder(tmp_path / "flux")
    cli = CLI(tmp_path / "home", tmp_path)
    res = cli("shard", str(src), str(tmp_path / "shards"), timeout=300)
    assert res.returncode == 0, res.stderr
    index = json.loads((tmp_path / "shards" / "index.json").read_text())
    assert index  # the engine's format; its own tests check the contents


def test_submit_shard_job(shard_support: None, cli: CLI, tmp_path: Path) -> None:
    src = _tiny_flux_folder(tmp_path / "flux")
    spec = tmp_path / "shard.yaml"
    spec.write_text(json.dumps({"kind": "shard", "name": "shard-e2e",
                                "shard": {"src": str(src), "dst": str(tmp_path / "shards")},
                                "limits": {"max_duration": "5m"}}))
    res = cli("submit", str(spec), timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCEEDED" in res.stderr
    index = json.loads((tmp_path / "shards" / "index.json").read_text())
    assert (index["format"], index["format_version"]) == ("offload-jobs-shards", 2)  # slabs the engine reads in one go
    # and the engine streams the model from what the job wrote
    import torch
    from diffusers import FluxTransformer2DModel

    from offload_core import enable_offload

    with torch.device("meta"):
        model = FluxTransformer2DModel.from_config(FluxTransformer2DModel.load_config(src)).requires_grad_(False)
    handle = enable_offload(model, target_device="cpu", lazy_load=True, shard_dir=str(tmp_path / "shards"), max_memory=0)
    ref = FluxTransformer2DModel.from_pretrained(src)
    g = torch.Generator().manual_seed(0)
    inputs = dict(hidden_states=torch.randn(1, 16, 4, generator=g), encoder_hidden_states=torch.randn(1, 4, 32, generator=g),
                  pooled_projections=torch.randn(1, 32, generator=g), timestep=torch.tensor([0.5]),
                  img_ids=torch.zeros(16, 3), txt_ids=torch.zeros(4, 3))
    with torch.no_grad():
        assert torch.equal(model(**inputs, return_dict=False)[0], ref(**inputs, return_dict=False)[0])
    assert handle.stats()["disk_reads"] > 0
    handle.remove()
