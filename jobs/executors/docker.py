"""The `docker` executor (opt-in): one container per attempt through the Docker SDK.

The run dir is bind-mounted at the same path, and the container appends its own stdout and
stderr to output.log (a `sh -c 'exec ... >>output.log'` wrapper), so, as with the process
executor, no line passes through the worker and none is lost if the worker dies.
GPUs go through `device_requests`; cancel is SIGTERM to the container, SIGKILL after the grace.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from jobs.executors.base import Executor, Exit, Handle, Launch, SetupFailed

__all__ = ["DockerExecutor", "container_kwargs"]

_WRAP = 'exec "$@" >>"$OFFLOAD_JOBS_RUN_DIR/output.log" 2>&1'
POLL_EVERY_S = 0.25  # each poll is a round trip to dockerd


def container_kwargs(launch: Launch, image: str) -> dict[str, Any]:
    """Arguments of `containers.run` for one attempt (pure: tested without a daemon)."""
    from docker.types import DeviceRequest

    rd = str(launch.run_dir.path)
    env = dict(launch.job_env)  # not the worker's PATH, HOME, ...: the image has its own
    kwargs: dict[str, Any] = {
        "image": image,
        "command": ["/bin/sh", "-c", _WRAP, "sh", *launch.argv],
        "environment": env,
        "working_dir": launch.cwd,
        "volumes": {rd: {"bind": rd, "mode": "rw"}},
        "labels": {"offload-jobs.job": launch.job_id, "offload-jobs.attempt": str(launch.attempt)},
        "name": f"offload-jobs-{launch.job_id}-{launch.attempt}",
        "detach": True,
        "init": True,  # tini as PID 1: signals reach the job, zombies are reaped
        "user": f"{os.getuid()}:{os.getgid()}",  # files in the run dir stay the worker's
    }
    if launch.gpus:
        kwargs["device_requests"] = [DeviceRequest(device_ids=[str(g) for g in launch.gpus], capabilities=[["gpu"]])]
        env.setdefault("NVIDIA_VISIBLE_DEVICES", ",".join(str(g) for g in launch.gpus))
    if launch.shm_size:
        kwargs["shm_size"] = int(launch.shm_size)
    return kwargs


class DockerExecutor(Executor):
    name = "docker"

    def __init__(self) -> None:
        self._client: Any = None

    def _docker(self) -> Any:
        if self._client is None:
            try:
                import docker

                client = docker.from_env()
                client.ping()
            except Exception as exc:  # ImportError, DockerException, connection errors
                raise SetupFailed(f"no Docker daemon reachable for executor: docker ({exc})") from None
            self._client = client
        return self._client

    def start(self, launch: Launch) -> Handle:
        import docker.errors

        image = launch.image or os.environ.get("OFFLOAD_JOBS_DOCKER_IMAGE")
        if not image:
            raise SetupFailed("executor: docker needs `image` in the spec (or OFFLOAD_JOBS_DOCKER_IMAGE on the worker)")
        client = self._docker()
        kwargs = container_kwargs(launch, image)
        try:
            stale = client.containers.get(kwargs["name"])  # left by a crash between start and record
            stale.remove(force=True)
        except docker.errors.NotFound:
            pass
        try:
            client.images.get(image)
        except docker.errors.ImageNotFound:
            # No pull here: it can take minutes and the scheduler would stall behind it.
            raise SetupFailed(f"image {image} is not on the worker's Docker host; `docker pull {image}` first") from None
        try:
            container = client.containers.run(**kwargs)
        except docker.errors.ImageNotFound:
            raise SetupFailed(f"image {image} is not on the worker's Docker host") from None
        except docker.errors.APIError as exc:
            raise SetupFailed(f"docker could not start the container: {exc.explanation or exc}") from None
        info = {"container_id": container.id, "name": kwargs["name"], "image": image}
        return Handle(pid=None, pgid=None, info=info, obj={"container": container, "next_poll": 0.0})

    def poll(self, handle: Handle) -> Exit | None:
        import docker.errors

        state = handle.obj
        now = time.monotonic()
        if now < state["next_poll"]:
            return None
        state["next_poll"] = now + POLL_EVERY_S
        try:
            state["container"].reload()
        except docker.errors.NotFound:
            return Exit(exit_code=None, signal=signal.SIGKILL)  # removed behind our back
        s = state["container"].attrs.get("State", {})
        if s.get("Status") not in ("exited", "dead"):
            return None
        if s.get("OOMKilled"):
            return Exit(exit_code=None, signal=signal.SIGKILL)
        return Exit(exit_code=int(s.get("ExitCode", -1)))

    def terminate(self, handle: Handle) -> None:
        self._signal(handle, "SIGTERM")

    def kill(self, handle: Handle) -> None:
        self._signal(handle, "SIGKILL")

    def _signal(self, handle: Handle, sig: str) -> None:
        import docker.errors

        try:
            handle.obj["container"].kill(signal=sig)
        except docker.errors.APIError:
            pass  # already stopped
        handle.obj["next_poll"] = 0.0

    def cleanup(self, handle: Handle) -> None:
        import docker.errors

        try:
            handle.obj["container"].remove(force=True)
        except docker.errors.APIError:
            pass

    def kill_orphan(self, info: dict[str, Any], pid: int | None, pgid: int | None) -> bool:
        import docker.errors

        cid = info.get("container_id")
        if not cid:
            return False
        try:
            self._docker().containers.get(cid).remove(force=True)
            return True
        except (docker.errors.APIError, SetupFailed):
            return False
