"""The docker executor: container arguments (no daemon needed) and a real command job (daemon + image).

The end-to-end test needs a reachable Docker daemon and a local image with /bin/sh, named by
$OFFLOAD_JOBS_TEST_IMAGE (default `local/debian:bookworm`, built as in RECIPES.md "Docker on
these machines"); without them it skips.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from jobs_helpers import read_json_lines, wait_until

from jobs.errors import SpecError

from jobs.executors import Launch
from jobs.executors.docker import container_kwargs
from jobs.rundir import RunDir

IMAGE = os.environ.get("OFFLOAD_JOBS_TEST_IMAGE", "local/debian:bookworm")


def _docker_ready() -> str | None:
    """None when a daemon answers and has IMAGE, else why not."""
    try:
        import docker

        client = docker.from_env()
        client.ping()
    except Exception as exc:
        return f"no Docker daemon reachable ({type(exc).__name__})"
    try:
        client.images.get(IMAGE)
    except Exception:
        return f"image {IMAGE} not present locally"
    return None


def test_container_kwargs(tmp_path: Path) -> None:
    rd = RunDir(tmp_path / "run").create({})
    launch = Launch(job_id="abc", attempt=2, argv=["python", "-c", "print(1)"], env={"PATH": "/host/bin", "A": "1"},
                    cwd=str(rd.path), run_dir=rd, gpus=[1, 3], shm_size=2**30, job_env={"A": "1"})
    kw = container_kwargs(launch, "img:tag")
    assert kw["image"] == "img:tag" and kw["name"] == "offload-jobs-abc-2" and kw["detach"] is True
    assert kw["command"][-3:] == ["python", "-c", "print(1)"] and "output.log" in kw["command"][2]
    assert kw["volumes"] == {str(rd.path): {"bind": str(rd.path), "mode": "rw"}}
    assert kw["environment"]["A"] == "1" and "PATH" not in kw["environment"]  # not the host's PATH
    (req,) = kw["device_requests"]
    assert req["DeviceIDs"] == ["1", "3"] and req["Capabilities"] == [["gpu"]]
    assert kw["shm_size"] == 2**30
    launch.gpus = []
    assert "device_requests" not in container_kwargs(launch, "img")


@pytest.mark.docker
def test_docker_command_job_end_to_end(worker_factory) -> None:
    why = _docker_ready()
    if why:
        pytest.skip(why)
    w = worker_factory()
    c = w.client()
    cmd = 'echo "in container $(cat /etc/debian_version)"; echo "{\\"step\\": 1}" >> "$OFFLOAD_JOBS_METRICS"; echo $A'
    job = c.submit({"kind": "command", "command": cmd, "executor": "docker", "image": IMAGE, "env": {"A": "from-spec"}})
    done = c.wait(job["id"], timeout=120)
    log = c.logs(job["id"])["data"]
    assert done["status"] == "SUCCEEDED", log
    assert "in container 12." in log and "from-spec" in log
    assert read_json_lines(Path(done["run_dir"]) / "metrics.jsonl") == [{"step": 1}]

    # cancel stops the container; it is removed afterwards
    import docker

    job = c.submit({"kind": "command", "command": "echo up; sleep 100", "executor": "docker", "image": IMAGE,
                    "limits": {"stop_grace": 2}})
    while "up" not in c.logs(job["id"])["data"]:
        time.sleep(0.1)
    name = f"offload-jobs-{job['id']}-1"
    assert docker.from_env().containers.get(name).status == "running"
    c.cancel(job["id"])
    assert c.wait(job["id"], timeout=30)["status"] == "CANCELLED"

    def gone() -> bool:  # removed once the completion is recorded (kept until then: it is the record)
        try:
            docker.from_env().containers.get(name)
            return False
        except docker.errors.NotFound:
            return True

    wait_until(gone, 15, what=f"container {name} removed")


@pytest.mark.docker
def test_docker_missing_image_is_refused_at_submit(worker_factory) -> None:
    why = _docker_ready()
    if why and "daemon" in why:
        pytest.skip(why)
    c = worker_factory().client()
    with pytest.raises(SpecError) as e:
        c.submit({"kind": "command", "command": "true", "executor": "docker", "image": "local/nope:missing"})
    assert e.value.field == "image" and "local/nope:missing" in str(e.value) and "docker pull" in str(e.value)
