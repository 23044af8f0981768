"""Issue 28's papercuts, through the real CLI and a real worker: `delete` and `prune` ask before
removing a job with outputs (and refuse without a terminal unless --yes), `report` writes into the
job's run dir with step axes, one copy of each sample and no "None", and `sample_every: 0` is off."""

from __future__ import annotations

import json
import os
import pty
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from jobs_helpers import WorkerProcess, wait_until

from jobs.client import JobsClient
from jobs.errors import JobNotFound

# A job that leaves a file under outputs/ (as a trained LoRA would), and one that leaves nothing.
WITH_OUTPUTS = 'mkdir -p "$OFFLOAD_JOBS_RUN_DIR/outputs" && echo weights > "$OFFLOAD_JOBS_RUN_DIR/outputs/lora.safetensors"'

# Metrics rows with steps (after a load row without one), then a sample written the train runner's
# way (each image, and a contact sheet of the same images), then it waits for a flag file.
REPORT_JOB = r'''
import json, os, sys, time
from pathlib import Path
rd = Path(os.environ["OFFLOAD_JOBS_RUN_DIR"])
with open(os.environ["OFFLOAD_JOBS_METRICS"], "a") as f:
    f.write(json.dumps({"phase": "load", "weight_bytes": 1000}) + "\n")
    for step in (5, 10, 15, 20):
        f.write(json.dumps({"step": step, "total_steps": 20, "loss": 1.0 / step, "h2d_gbps": 1.5}) + "\n")
samples = rd / "outputs" / "samples"
samples.mkdir(parents=True)
png = b"\x89PNG\r\n\x1a\n" + bytes(64)
(samples / "step000020_00.png").write_bytes(png)
(samples / "step000020_sheet.png").write_bytes(png)
flag = Path(sys.argv[1])
while not flag.exists():
    time.sleep(0.05)
'''


class CLI:
    """`offload-jobs ...` as a child process against one state dir, its stdin not a terminal
    (/dev/null: as from a script, whatever terminal pytest itself runs in)."""

    def __init__(self, home: Path, cwd: Path) -> None:
        self.exe = str(Path(sys.executable).parent / "offload-jobs")
        self.home, self.cwd = home, cwd

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OFFLOAD_JOBS_")}
        return {**env, "OFFLOAD_JOBS_HOME": str(self.home)}

    def __call__(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([self.exe, *args], capture_output=True, text=True, timeout=60, env=self.env(),
                              cwd=self.cwd, stdin=subprocess.DEVNULL)


def assert_one_error_line(res: subprocess.CompletedProcess[str]) -> str:
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    assert "Traceback" not in res.stdout + res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    return lines[0]


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    w = WorkerProcess(tmp_path_factory.mktemp("papercuts") / "home").start()
    yield w
    w.stop()


@pytest.fixture
def cli(worker: WorkerProcess, tmp_path: Path) -> CLI:
    return CLI(worker.home, tmp_path)


@pytest.fixture
def api(worker: WorkerProcess) -> Iterator[JobsClient]:
    with worker.client() as c:
        yield c


def _finished(api: JobsClient, command: str, name: str) -> str:
    job_id = api.submit({"kind": "command", "name": name, "command": command})["id"]
    assert api.wait(job_id, timeout=60)["status"] == "SUCCEEDED"
    return job_id


def _exists(api: JobsClient, job_id: str) -> bool:
    try:
        api.get(job_id)
        return True
    except JobNotFound:
        return False


def _on_a_terminal(cli: CLI, answer: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run `offload-jobs ARGS` with a pseudo-terminal as stdin, typing `answer` at the question."""
    master, slave = pty.openpty()
    try:
        p = subprocess.Popen([cli.exe, *args], stdin=slave, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=cli.env(), cwd=cli.cwd)
        os.write(master, answer.encode() + b"\n")
        out, err = p.communicate(timeout=60)
    finally:
        os.close(slave)
        os.close(master)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def test_delete_asks_before_deleting_outputs(cli: CLI, api: JobsClient) -> None:
    lora = _finished(api, WITH_OUTPUTS, "has-lora")
    empty = _finished(api, "true", "nothing-kept")
    # No terminal, no --yes: one line naming the job and the way out; nothing deleted.
    line = assert_one_error_line(cli("delete", lora, empty))
    assert lora in line and "--yes" in line and "1 files" in line and empty not in line
    assert _exists(api, lora) and _exists(api, empty)
    # A job without outputs goes without a question.
    res = cli("delete", empty)
    assert res.returncode == 0 and f"{empty} deleted" in res.stdout, res.stderr
    # On a terminal: "n" keeps it, "y" deletes it.
    res = _on_a_terminal(cli, "n", "delete", lora[:8])
    assert res.returncode == 1 and "nothing deleted" in res.stderr and lora in res.stderr, res.stderr
    assert _exists(api, lora)
    res = _on_a_terminal(cli, "y", "delete", lora[:8])
    assert res.returncode == 0 and f"{lora} deleted" in res.stdout, res.stderr
    assert not _exists(api, lora)
    # --yes: no question.
    again = _finished(api, WITH_OUTPUTS, "has-lora-2")
    res = cli("delete", "--yes", again)
    assert res.returncode == 0 and f"{again} deleted" in res.stdout, res.stderr
    assert not _exists(api, again)


def test_prune_asks_before_deleting_outputs(cli: CLI, api: JobsClient) -> None:
    lora = _finished(api, WITH_OUTPUTS, "prune-lora")
    empty = _finished(api, "true", "prune-empty")
    line = assert_one_error_line(cli("prune", "--older-than", "0s"))
    assert lora in line and "--yes" in line and "prune-lora" in line
    assert _exists(api, lora) and _exists(api, empty)  # all or nothing: nothing
    res = cli("prune", "--older-than", "0s", "--dry-run")  # a dry run deletes nothing: no question
    assert res.returncode == 0 and lora in res.stdout and empty in res.stdout, res.stderr
    res = _on_a_terminal(cli, "n", "prune", "--older-than", "0s")
    assert res.returncode == 1 and "nothing deleted" in res.stderr, res.stderr
    assert _exists(api, lora) and _exists(api, empty)
    res = cli("prune", "--older-than", "0s", "--yes", "--json")
    assert res.returncode == 0, res.stderr
    assert {lora, empty} <= set(json.loads(res.stdout)["deleted"])
    assert not _exists(api, lora) and not _exists(api, empty)


def _report_text(path: Path) -> str:
    html = path.read_text()
    # What a reader sees: the page without its inlined images and the spec (a YAML `null` is fine there).
    return re.sub(r"<pre>.*?</pre>", "", re.sub(r'src="data:[^"]*"', "", html), flags=re.S)


def test_report_in_the_run_dir_with_step_axes_one_copy_and_no_none(cli: CLI, api: JobsClient,
                                                                   tmp_path: Path) -> None:
    script = tmp_path / "report_job.py"
    script.write_text(REPORT_JOB)
    flag = tmp_path / "finish"
    job_id = api.submit({"kind": "command", "name": "report-me",
                         "command": [sys.executable, str(script), str(flag)]})["id"]
    wait_until(lambda: len(api.metrics(job_id, 0).get("records") or []) >= 5
               and len(api.outputs(job_id)) == 2, timeout=60, what="the job's metrics and samples")
    job = api.get(job_id)
    assert job["status"] == "RUNNING"
    run_dir = Path(job["run_dir"])

    res = cli("report", job_id[:8])  # while it runs
    assert res.returncode == 0, res.stderr
    written = Path(res.stdout.strip())
    assert written == run_dir / "report.html" and written.is_file()
    assert not list(Path(cli.cwd).glob("report*.html"))  # not in the current directory
    html = written.read_text()
    text = _report_text(written)
    assert "None" not in text
    assert "- (not finished)" in text  # the exit code of a running job
    assert html.count("data:image/png;base64,") == 1  # the image, not also its one-image sheet
    assert "step000020_00.png" in text and "step000020_sheet.png" not in text
    # x-axes in steps (the load row without one starts at the first step), never "row N"
    assert ">step 5</text>" in html and ">step 20</text>" in html and ">row " not in html

    flag.write_text("")
    assert api.wait(job_id, timeout=60)["status"] == "SUCCEEDED"
    out = tmp_path / "elsewhere" / "r.html"
    out.parent.mkdir()
    res = cli("report", job_id, "-o", str(out))
    assert res.returncode == 0 and res.stdout.strip() == str(out), res.stderr
    text = _report_text(out)
    assert "None" not in text and "<th>exit code</th><td>0</td>" in text


def test_sample_every_zero_means_off(cli: CLI, tmp_path: Path) -> None:
    from jobs.spec import parse_spec

    def spec(every: Any) -> dict[str, Any]:
        return {"kind": "train", "model": {"path": str(tmp_path)},
                "train": {"dataset": str(tmp_path), "steps": 10, "sample_every": every}}

    for off in (0, None):
        assert parse_spec(spec(off)).train.sample_every is None  # one "off" for the runner to test
    assert parse_spec(spec(5)).train.sample_every == 5
    path = tmp_path / "job.yaml"
    path.write_text(json.dumps(spec(-1)))
    line = assert_one_error_line(cli("validate", str(path)))
    assert "sample_every" in line
    path.write_text(json.dumps(spec(0)))
    res = cli("validate", str(path))
    assert res.returncode == 0, res.stderr


def test_report_path_when_the_run_dir_is_elsewhere(capsys: pytest.CaptureFixture[str]) -> None:
    from jobs._cli.report import default_path

    assert default_path({"id": "abc123", "run_dir": "/nowhere/runs/abc123"}) == Path("report-abc123.html")
    err = capsys.readouterr().err
    assert "/nowhere/runs/abc123 is not on this machine" in err and "-o PATH" in err
