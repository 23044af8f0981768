"""The job environment does not depend on the caller's shell: jobs run under the worker's own
interpreter with its venv first on PATH, and `offload-jobs` works in a new shell the way the
README's quickstart says."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from jobs_helpers import REPO, WorkerProcess

VENV_BIN = Path(sys.executable).parent


def _impostor_python(tmp_path: Path) -> Path:
    """A `python` and `python3` without torch, first on PATH, as a stray interpreter would be."""
    bindir = tmp_path / "other-bin"
    bindir.mkdir()
    for name in ("python", "python3"):
        p = bindir / name
        p.write_text("#!/bin/sh\necho 'not the worker python' >&2\nexit 42\n")
        p.chmod(0o755)
    return bindir


def test_jobs_run_under_the_workers_interpreter(tmp_path: Path) -> None:
    impostor = _impostor_python(tmp_path)
    path = os.pathsep.join([str(impostor), "/usr/bin", "/bin"])
    w = WorkerProcess(tmp_path / "home", env={"PATH": path}).start()
    try:
        with w.client() as c:
            job = c.wait(c.submit({"kind": "command", "command":
                                   'python -c "import sys, torch; print(sys.executable, torch.__version__)"; '
                                   'echo "venv=$VIRTUAL_ENV"'})["id"], timeout=60)
            log = c.logs(job["id"])["data"]
        assert job["status"] == "SUCCEEDED", log
        assert str(VENV_BIN) in log and "not the worker python" not in log
        if sys.prefix != sys.base_prefix:
            assert f"venv={sys.prefix}" in log
    finally:
        w.stop()


def test_the_toy_example_runs_with_the_venvs_torch_whatever_python_is_on_path(tmp_path: Path) -> None:
    impostor = _impostor_python(tmp_path)
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OFFLOAD_JOBS_")}
    env.update(OFFLOAD_JOBS_HOME=str(home), PATH=os.pathsep.join([str(impostor), "/usr/bin", "/bin"]))
    exe = str(VENV_BIN / "offload-jobs")
    up = subprocess.run([exe, "up", "--local", "--port", "0"], capture_output=True, text=True, env=env, timeout=120)
    assert up.returncode == 0, up.stderr
    try:
        res = subprocess.run([exe, "submit", str(REPO / "examples" / "toy.yaml"), "--set", "env.TOY_STEPS=2",
                              "--set", "env.TOY_WIDTH=64", "--set", "env.TOY_BATCH=4"],
                             capture_output=True, text=True, env=env, timeout=300)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
        assert "SUCCEEDED" in res.stderr and "not the worker python" not in res.stdout + res.stderr
    finally:
        subprocess.run([exe, "down", "--local"], capture_output=True, env=env, timeout=60)


def test_a_new_shell_runs_offload_jobs_as_the_readme_says(worker) -> None:
    readme = (REPO / "README.md").read_text()
    line = "source .venv/bin/activate && offload-jobs ps"
    assert line in readme, "the README's instruction for a new shell changed; update this test with it"
    activate = REPO / ".venv" / "bin" / "activate"
    if not activate.exists() or Path(sys.executable).parent != activate.parent:
        pytest.skip("the tests do not run from the checkout's .venv")
    bash = shutil.which("bash")
    assert bash
    clean = {"HOME": os.environ.get("HOME", "/root"), "PATH": "/usr/bin:/bin", "OFFLOAD_JOBS_HOME": str(worker.home)}
    res = subprocess.run([bash, "--noprofile", "--norc", "-c", line], capture_output=True, text=True, env=clean,
                         cwd=REPO, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "no jobs" in res.stdout or "ID" in res.stdout
