"""A host path sent to a worker in a container: the error says which `--set` reaches the container's copy.

Stand-in for the container: a worker without root's read-anything capabilities (it cannot see into a
folder another uid keeps 0700, as a container cannot see an unmounted host folder), and the client's
worker.json carrying what `up` records for a compose worker (its mounts and /app/examples)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from worker_variants import NOBODY, NoDacWorker

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() != 0 or shutil.which("setpriv") is None,
                                reason="needs root and setpriv to hide a folder from the worker")


def test_an_example_submitted_to_a_container_worker_names_the_workdir_to_set(tmp_path: Path) -> None:
    project = tmp_path / "checkout"
    (project / "examples").mkdir(parents=True)
    shutil.copy(REPO / "examples" / "toy.yaml", project / "examples" / "toy.yaml")
    shutil.copy(REPO / "examples" / "offload_toy.py", project / "examples" / "offload_toy.py")
    w = NoDacWorker(tmp_path / "worker-state").start()
    os.chown(project, NOBODY, NOBODY)
    os.chmod(project, 0o700)  # the worker cannot see the checkout, as a container cannot
    client_home = tmp_path / "client"
    client_home.mkdir()
    (client_home / "worker.json").write_text(json.dumps({
        "url": w.url, "compose": {"mounts": [{"source": str(tmp_path / "data" / "state"), "target": "/state"},
                                             {"source": str(tmp_path / "data" / "models"), "target": "/models"}],
                                  "image_paths": {str(project / "examples"): "/app/examples"}}}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("OFFLOAD_JOBS_")}
    env.update(OFFLOAD_JOBS_URL=w.url, OFFLOAD_JOBS_TOKEN=w.token, OFFLOAD_JOBS_HOME=str(client_home))
    try:
        for verb in (["submit", "-d"], ["validate", "--strict"]):
            res = subprocess.run([sys.executable, "-m", "jobs.cli", *verb, str(project / "examples" / "toy.yaml")],
                                 capture_output=True, text=True, env=env, cwd=REPO, timeout=60)
            assert res.returncode == 2, (verb, res.stdout, res.stderr)
            assert "workdir" in res.stderr and "does not exist on the worker" in res.stderr
            assert "--set workdir=/app/examples" in res.stderr, res.stderr
            assert res.stderr.count("\n") == 1 and "Traceback" not in res.stderr
    finally:
        w.stop()
