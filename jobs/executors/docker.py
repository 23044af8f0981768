"""The `docker` executor (opt-in): one container per attempt through the Docker SDK.

The run dir is bind-mounted at the same path, and the container appends its own stdout and
stderr to output.log (a `sh -c 'exec ... >>output.log'` wrapper), so, as with the process
executor, no line passes through the worker and none is lost if the worker dies.
GPUs go through `device_requests`; cancel is SIGTERM to the container, SIGKILL after the grace.

Exactly once: the container is created (not started) in `prepare`, its id recorded, and started
in `release`. dockerd keeps an exited container, with its exit code and OOM flag, until the
worker has recorded the completion and removes it, so a job that ends while the worker is down
is recorded as it ended; a container still "created" after a crash never ran.

The container can write anything into its run dir, planted symlinks included; the worker opens
those files only through `RunDir` (O_NOFOLLOW, regular files only). The container gets no
CAP_MKNOD (no device nodes in the run dir) and no new privileges.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from jobs.executors.base import Executor, Exit, Handle, Launch, Recovered, SetupFailed
from jobs.rundir import RunDir

__all__ = ["DockerExecutor", "container_kwargs", "container_name"]

_WRAP = 'exec "$@" >>"$OFFLOAD_JOBS_RUN_DIR/output.log" 2>&1'
POLL_EVERY_S = 0.25  # each poll is a round trip to dockerd


def container_name(job_id: str, attempt: int) -> str:
    return f"offload-jobs-{job_id}-{attempt}"


def container_kwargs(launch: Launch, image: str) -> dict[str, Any]:
    """Arguments of `containers.create` for one attempt (pure: tested without a daemon)."""
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
        "name": container_name(launch.job_id, launch.attempt),
        "detach": True,
        "init": True,  # tini as PID 1: signals reach the job, zombies are reaped
        "user": f"{os.getuid()}:{os.getgid()}",  # files in the run dir stay the worker's
        "cap_drop": ["MKNOD"],  # no device nodes planted in the (host-visible) run dir
        "security_opt": ["no-new-privileges"],
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

    def has_image(self, image: str) -> bool:
        import docker.errors

        try:
            self._docker().images.get(image)
            return True
        except docker.errors.ImageNotFound:
            return False

    # ------------------------------------------------------------ start
    def prepare(self, launch: Launch) -> Handle:
        import docker.errors

        image = launch.image or os.environ.get("OFFLOAD_JOBS_DOCKER_IMAGE")
        if not image:
            raise SetupFailed("executor: docker needs `image` in the spec (or OFFLOAD_JOBS_DOCKER_IMAGE on the worker)")
        client = self._docker()
        kwargs = container_kwargs(launch, image)
        kwargs.pop("detach")
        try:
            stale = client.containers.get(kwargs["name"])  # created, never started, by a crashed worker
            stale.remove(force=True)
        except docker.errors.NotFound:
            pass
        if not self.has_image(image):
            # No pull here: it can take minutes and the scheduler would stall behind it.
            raise SetupFailed(f"image {image} is not on the worker's Docker host; `docker pull {image}` first")
        try:
            container = client.containers.create(**kwargs)
        except docker.errors.ImageNotFound:
            raise SetupFailed(f"image {image} is not on the worker's Docker host") from None
        except docker.errors.APIError as exc:
            raise SetupFailed(f"docker could not create the container: {exc.explanation or exc}") from None
        info = {"container_id": container.id, "name": kwargs["name"], "image": image, "gpus": list(launch.gpus),
                "run_dir": str(launch.run_dir.path), "attempt": launch.attempt}
        return Handle(pid=None, pgid=None, info=info, obj={"container": container, "next_poll": 0.0})

    def release(self, handle: Handle) -> None:
        import docker.errors

        try:
            handle.obj["container"].start()
        except docker.errors.APIError as exc:
            handle.obj["start_error"] = f"docker could not start the container: {exc.explanation or exc}"

    def abort(self, handle: Handle) -> None:
        handle.obj["aborted"] = True
        self.cleanup(handle)

    # ------------------------------------------------------------ watch
    def poll(self, handle: Handle) -> Exit | None:
        import docker.errors

        state = handle.obj
        if state.get("aborted"):
            return Exit(exit_code=None, ran=False)
        if state.get("start_error"):
            return Exit(exit_code=None, setup_error=state["start_error"])
        now = time.monotonic()
        if now < state["next_poll"]:
            return None
        state["next_poll"] = now + POLL_EVERY_S
        try:
            state["container"].reload()
        except docker.errors.NotFound:
            return Exit(exit_code=None, signal=signal.SIGKILL, oom=False)  # removed behind our back
        except docker.errors.APIError:
            return None  # dockerd busy or restarting; ask again
        return _exit_of(state["container"].attrs.get("State", {}), handle.info)

    # ------------------------------------------------------------ stop
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

    # ------------------------------------------------------------ after a crash
    def recover(self, job_id: str, attempt: int, info: dict[str, Any] | None, run_dir: RunDir) -> Recovered:
        import docker.errors

        info = dict(info or {})
        ref = info.get("container_id") or container_name(job_id, attempt)
        try:
            container = self._docker().containers.get(ref)
        except docker.errors.NotFound:
            if info.get("container_id"):
                return Recovered("lost", message="its container was removed while no worker watched")
            return Recovered("never_ran", message="the worker died before the container was created")
        except (docker.errors.APIError, SetupFailed) as exc:
            return Recovered("lost", message=f"cannot ask dockerd about its container: {exc}")
        state = container.attrs.get("State", {})
        info.setdefault("run_dir", str(run_dir.path))
        info.setdefault("attempt", attempt)
        if state.get("Status") == "created":
            container.remove(force=True)
            return Recovered("never_ran", message="its container was created but never started")
        ex = _exit_of(state, info)
        if ex is None:
            handle = Handle(info={**info, "container_id": container.id},
                            obj={"container": container, "next_poll": 0.0})
            return Recovered("running", handle=handle)
        return Recovered("ended", exit=ex)

    def reap(self, job_id: str, attempt: int, info: dict[str, Any] | None, run_dir: RunDir) -> int:
        import docker.errors

        ref = (info or {}).get("container_id") or container_name(job_id, attempt)
        try:
            self._docker().containers.get(ref).remove(force=True)
            return 1
        except (docker.errors.APIError, SetupFailed):
            return 0


def _exit_of(state: dict[str, Any], info: dict[str, Any]) -> Exit | None:
    if state.get("Status") not in ("exited", "dead"):
        return None
    report = RunDir(info["run_dir"]).read_report() if info.get("run_dir") else None
    code = int(state.get("ExitCode", -1))
    oom = bool(state.get("OOMKilled"))
    if oom:
        return Exit(exit_code=None, signal=signal.SIGKILL, oom=True, report=report)
    return Exit(exit_code=code, oom=False, report=report)
