"""The worker container end to end, as on a GPU box but on the CPU: build the image, `docker compose
-f compose.yaml -f compose.cpu.yaml up -d --wait`, drive it from the host CLI, `down`, `up` again.

Needs a Docker daemon, Compose v2, the base image ($OFFLOAD_JOBS_TEST_BASE_IMAGE, default
`local/debian:bookworm`, built as in .ci/run) and, for a base without torch, the CPU torch wheel in
.ctx/wheels/ (`bash scripts/container_context.sh`); without them it skips. The image is built with
the build cache, so a rerun after a source change rebuilds only the project's layers.

One module-scoped stack; the tests run in order against it:
  build -> up (compose) -> `offload-jobs up` records it -> jobs -> down/up keeps them -> `offload-jobs down`.
To add a job, append a submission to `JOBS` (see the tiny train/infer note there).
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from containers_helpers import CLI, REPO, clean_env, compose_cmd, docker_daemon, free_port, image_exists, run

pytestmark = pytest.mark.docker

BASE_IMAGE = os.environ.get("OFFLOAD_JOBS_TEST_BASE_IMAGE", "local/debian:bookworm")
IMAGE = os.environ.get("OFFLOAD_JOBS_TEST_COMPOSE_IMAGE", "offload-jobs:e2e")
UID = 1000  # the image's user (compose.yaml's default)


def _why_not() -> str | None:
    why = docker_daemon()
    if why:
        return why
    if compose_cmd() is None:
        return "Docker Compose v2 (`docker compose`) is not installed"
    if not image_exists(BASE_IMAGE):
        return f"base image {BASE_IMAGE} is not present (.ci/run builds it with debootstrap)"
    has_torch = subprocess.run(["docker", "run", "--rm", "--entrypoint", "sh", BASE_IMAGE, "-c",
                                "python3 -c 'import torch' 2>/dev/null"], capture_output=True).returncode == 0
    if not has_torch and not list((REPO / ".ctx" / "wheels").glob("torch-*.whl")):
        return "no torch wheel in .ctx/wheels/ (run: bash scripts/container_context.sh)"
    return None


@dataclass
class Stack:
    """One compose project under a temp dir: its env for compose, and the host CLI's env."""

    root: Path
    data: Path                      # the one host folder (OFFLOAD_DIR)
    port: int
    token: str
    compose_env: dict[str, str]
    cli_env: dict[str, str]         # no URL or token: the CLI must find both in its state dir
    timings: dict[str, float] = field(default_factory=dict)
    jobs: dict[str, str] = field(default_factory=dict)  # label -> job id

    def compose(self, *args: str, timeout: float = 180, check: bool = True) -> subprocess.CompletedProcess[str]:
        cmd = compose_cmd()
        assert cmd is not None
        return run([*cmd, *args], self.compose_env, timeout=timeout, check=check)

    def cli(self, *args: str, timeout: float = 120, check: bool = True, cwd: Path | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return run([*CLI, *args], env or self.cli_env, cwd=cwd or self.root, timeout=timeout, check=check)

    def job(self, job_id: str) -> dict[str, Any]:
        return json.loads(self.cli("show", job_id, "--json").stdout)

    def wait(self, job_id: str, timeout: float = 180,
             until: tuple[str, ...] = ("SUCCEEDED", "FAILED", "CANCELLED")) -> dict[str, Any]:
        """Polls the worker's API (a host CLI call per poll cost ~0.3 s of CPU, twice a second), then
        returns the job as the host CLI's `show` reads it."""
        from jobs.client import JobsClient

        deadline = time.monotonic() + timeout
        with JobsClient(f"http://127.0.0.1:{self.port}", self.token, timeout=30.0) as api:
            while True:
                status = api.get(job_id)["status"]
                if status in until:
                    break
                assert time.monotonic() < deadline, f"job {job_id} still {status} after {timeout}s"
                time.sleep(0.5)
        return self.job(job_id)

    def container_id(self) -> str:
        return self.compose("ps", "-q", "worker").stdout.strip()

    def in_container(self, script: str) -> str:
        return self.compose("exec", "-T", "worker", "python", "-c", script).stdout


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    why = _why_not()
    if why:
        pytest.skip(why)
    root = tmp_path_factory.mktemp("compose")
    data = root / "offload-data"
    for name in ("state", "models", "data", "cache", "outputs"):
        (data / name).mkdir(parents=True)
    if os.getuid() == 0:  # as `offload-jobs up` does for root: the folders belong to the container's user
        for p in (data, *data.iterdir()):
            os.chown(p, UID, UID)
    if TINY:  # built on the host, offline, into the models folder: /models/tiny/{flux,data} inside
        run([sys.executable, str(REPO / "scripts" / "make_tiny_pipelines.py"), str(data / "models" / "tiny"),
             "--families", "flux"], clean_env(), timeout=600)
        if os.getuid() == 0:  # some files are saved 0600: give them to the container's user, as a user's own are
            for p in (data / "models" / "tiny").rglob("*"):
                os.chown(p, UID, UID)
    port, token = free_port(), secrets.token_urlsafe(24)
    project = f"oj-e2e-{os.getpid()}"
    compose_env = clean_env(
        COMPOSE_PROJECT_NAME=project, COMPOSE_FILE="compose.yaml:compose.cpu.yaml",
        OFFLOAD_DIR=str(data), OFFLOAD_PORT=str(port), OFFLOAD_JOBS_TOKEN=token,
        OFFLOAD_IMAGE=IMAGE, BASE_IMAGE=BASE_IMAGE, OFFLOAD_JOBS_HOME=str(root / "client"))
    cli_env = clean_env(OFFLOAD_JOBS_HOME=str(root / "client"))
    s = Stack(root, data, port, token, compose_env, cli_env)
    before = _image_id(IMAGE)
    try:
        t0 = time.monotonic()
        build = s.compose("--progress", "plain", "build", timeout=1200, check=False)
        s.timings["build_s"] = time.monotonic() - t0
        (root / "build.log").write_text(build.stdout + build.stderr)
        assert build.returncode == 0, f"image build failed:\n{(build.stdout + build.stderr)[-4000:]}"
        if before and before != _image_id(IMAGE):
            run(["docker", "image", "rm", before], compose_env, check=False)  # the last run's image, now untagged
        yield s
    finally:
        logs = s.compose("logs", "--no-color", "--tail", "200", check=False)
        (root / "worker.log").write_text(logs.stdout + logs.stderr)
        s.compose("down", "--remove-orphans", "--timeout", "10", check=False)
        print(f"\ncontainer e2e timings: {json.dumps({k: round(v, 1) for k, v in s.timings.items()})}")


# ------------------------------------------------------------------ the jobs

@dataclass
class Submission:
    label: str
    spec: str                      # a file under examples/, or a path
    sets: list[str]                # --set overrides; "{job:LABEL}" is an earlier submission's id
    check: Any                     # check(stack, job) -> None, on the SUCCEEDED job
    mark: Any = None


def check_toy(s: Stack, job: dict[str, Any]) -> None:
    log = s.cli("logs", job["id"]).stdout
    assert "device: cpu" in log
    m = re.search(r"final loss: resident ([\d.]+), offloaded ([\d.]+)", log)
    assert m and m.group(1) == m.group(2), log[-2000:]  # the real engine, offloaded == resident
    rows = [json.loads(x) for x in (s.data / "state" / "runs" / job["id"] / "metrics.jsonl").read_text().splitlines()]
    offloaded = [r for r in rows if r.get("phase") == "offloaded"]
    assert [r["step"] for r in offloaded] == [1, 2, 3, 4, 5]
    assert all(r["h2d_bytes"] > 0 and r["pinned_capacity_bytes"] > 0 for r in offloaded)
    assert job["last_metrics"]["step"] == 5


def check_outputs(s: Stack, job: dict[str, Any]) -> None:
    run_dir = s.data / "state" / "runs" / job["id"]
    assert (run_dir / "outputs" / "hello.txt").read_text() == f"{job['id']}\n"  # the run dir's outputs/
    shared = s.data / "outputs" / "shared" / "hello.txt"                      # and the outputs volume
    assert shared.read_text() == "uid 1000\n"
    assert shared.stat().st_uid == UID and (run_dir / "metrics.jsonl").stat().st_uid == UID
    assert json.loads((run_dir / "metrics.jsonl").read_text()) == {"step": 1, "loss": 0.5}


def check_train(s: Stack, job: dict[str, Any]) -> None:
    from safetensors import safe_open

    outputs = s.data / "state" / "runs" / job["id"] / "outputs"
    loras = sorted(outputs.rglob("*.safetensors"))
    assert loras, sorted(p.name for p in outputs.rglob("*"))
    with safe_open(str(loras[0]), "pt") as f:
        assert any("lora" in k for k in f.keys())
    rows = [json.loads(x) for x in (outputs.parent / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if isinstance(r.get("loss"), (int, float))]
    assert losses and all(math.isfinite(v) for v in losses)


def check_infer(s: Stack, job: dict[str, Any]) -> None:
    from PIL import Image

    outputs = s.data / "state" / "runs" / job["id"] / "outputs"
    images = sorted(outputs.glob("image_*.png"))
    assert len(images) == 2, sorted(p.name for p in outputs.iterdir())  # two prompts, one image each
    assert {Image.open(p).size for p in images} == {(32, 32), (48, 32)}  # the second prompt asks 48x32
    assert s.jobs["train"] in (outputs / "params.json").read_text()  # made with the train job's LoRA


# The main example, the real engine on the CPU: `workdir: .` names the host's examples/, and the
# image has its own copy at /app/examples (validate says so). Then the tiny train job and a tiny
# infer job that uses its LoRA (issue 15's runners, examples/tiny-*.yaml and
# scripts/make_tiny_pipelines.py; they skip until those are here). Job paths are container paths.
TINY = all((REPO / p).exists() for p in ("scripts/make_tiny_pipelines.py", "examples/tiny-train.yaml",
                                          "examples/tiny-infer.yaml"))
_tiny = pytest.mark.skipif(not TINY, reason="the tiny train/infer examples are not in this checkout yet")
JOBS = [
    Submission("toy", "toy.yaml", ["workdir=/app/examples", "env.TOY_STEPS=5", "env.TOY_BATCH=8"], check_toy),
    Submission("outputs", "command.yaml", [(
        'command=echo "$OFFLOAD_JOBS_RUN_DIR" | xargs basename > "$OFFLOAD_JOBS_OUTPUTS/hello.txt" && '
        'mkdir -p /outputs/shared && echo "uid $(id -u)" > /outputs/shared/hello.txt && '
        'echo \'{"step": 1, "loss": 0.5}\' >> "$OFFLOAD_JOBS_METRICS"')], check_outputs),
    Submission("train", "tiny-train.yaml", [
        "workdir=/app/examples", "model.path=/models/tiny/flux", "train.dataset=/models/tiny/data/images",
        "train.steps=4", "train.save_every=4", "train.sample_every=4"], check_train, _tiny),
    Submission("infer", "tiny-infer.yaml", [
        "workdir=/app/examples", "model.path=/models/tiny/flux", "infer.lora={job:train}", "infer.steps=2",
        "infer.num_images=1"], check_infer, _tiny),
]


# Run by the container's python: every process's uid and command, and the listening TCP sockets.
PROCS_AND_LISTENERS = """
import json, os, socket, struct
procs = {}
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        status = open(f"/proc/{pid}/status").read()
        cmd = open(f"/proc/{pid}/cmdline").read().replace(chr(0), " ").strip()
    except OSError:
        continue
    uid = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("Uid:"))
    procs[pid] = [uid, cmd]
listening = []
for path, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
    for line in open(path).read().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        if state == "0A":  # LISTEN
            addr, port = local.split(":")
            raw = bytes.fromhex(addr)
            raw = b"".join(struct.pack("<I", w) for w in struct.unpack(">%dI" % (len(raw) // 4), raw))
            listening.append([socket.inet_ntop(family, raw), int(port, 16)])
print(json.dumps({"procs": procs, "listening": sorted(listening)}))
"""


# ------------------------------------------------------------------ the tests, in order

def test_compose_up_waits_for_a_healthy_worker(stack: Stack) -> None:
    t0 = time.monotonic()
    stack.compose("up", "-d", "--wait", "--wait-timeout", "120", timeout=180)
    stack.timings["up_s"] = time.monotonic() - t0
    state = json.loads(run(["docker", "inspect", stack.container_id()], stack.compose_env).stdout)[0]["State"]
    assert state["Health"]["Status"] == "healthy"


def test_offload_jobs_up_records_the_running_worker(stack: Stack) -> None:
    before = stack.container_id()
    # from an unrelated folder: the CLI finds the checkout itself
    res = stack.cli("up", "--wait", "60", cwd=stack.root, env=stack.compose_env)  # compose's env, as a user's shell
    url = f"http://127.0.0.1:{stack.port}"
    assert res.stdout.strip() == url
    assert stack.container_id() == before  # the running worker was kept, not recreated
    home = Path(stack.cli_env["OFFLOAD_JOBS_HOME"])
    info = json.loads((home / "worker.json").read_text())
    assert info["url"] == url and info["compose"]["project_dir"] == str(REPO)
    assert {m["target"] for m in info["compose"]["mounts"]} == {"/state", "/models", "/data", "/cache", "/outputs"}
    assert (home / "token").read_text().strip() == stack.token
    assert (home / "token").stat().st_mode & 0o077 == 0
    # ps finds it with neither OFFLOAD_JOBS_URL nor OFFLOAD_JOBS_TOKEN set
    assert json.loads(stack.cli("ps", "--json").stdout) == []


def test_port_on_loopback_only_and_worker_not_root(stack: Stack) -> None:
    ss = run(["ss", "-ltnH"], stack.compose_env).stdout
    listening = [line.split()[3] for line in ss.splitlines() if line.split()[3].rsplit(":", 1)[-1] == str(stack.port)]
    assert listening == [f"127.0.0.1:{stack.port}"], ss
    inside = json.loads(stack.in_container(PROCS_AND_LISTENERS))
    # the worker binds only what compose publishes (Docker's embedded DNS at 127.0.0.11 aside)
    assert [port for addr, port in inside["listening"] if addr != "127.0.0.11"] == [8765], inside["listening"]
    workers = [cmd for uid, cmd in inside["procs"].values() if "offload-jobs worker" in cmd]
    assert workers, inside["procs"]
    # nothing runs as root. A process Docker is starting in the container (a health check's exec, before it
    # drops to the image's user) can show uid 0 for an instant: only one seen in three reads counts
    offenders = {pid: p for pid, p in inside["procs"].items() if p[0] != UID}
    for _ in range(2):
        if not offenders:
            break
        time.sleep(0.5)
        again = json.loads(stack.in_container(PROCS_AND_LISTENERS))["procs"]
        offenders = {pid: p for pid, p in offenders.items() if again.get(pid) == p}
    assert not offenders, offenders


@pytest.mark.parametrize("sub", [pytest.param(j, id=j.label, marks=[j.mark] if j.mark else []) for j in JOBS])
def test_jobs_from_the_host_cli(stack: Stack, sub: Submission) -> None:
    spec = str(REPO / "examples" / sub.spec) if "/" not in sub.spec else sub.spec
    sets = [a for kv in sub.sets for a in ("--set", re.sub(r"\{job:(\w+)\}", lambda m: stack.jobs[m[1]], kv))]
    t0 = time.monotonic()
    job_id = stack.cli("submit", spec, "-d", *sets).stdout.strip()
    job = stack.wait(job_id)
    stack.timings[f"job_{sub.label}_s"] = time.monotonic() - t0
    assert job["status"] == "SUCCEEDED", stack.cli("logs", job_id).stdout[-3000:]
    stack.jobs[sub.label] = job_id
    sub.check(stack, job)


def test_jobs_survive_down_and_up(stack: Stack) -> None:
    # a GPU job holds the one GPU slot (a CPU worker runs GPU jobs one at a time), the next one queues
    hold = stack.cli("submit", str(REPO / "examples" / "command.yaml"), "-d", "--set", "command=sleep 300",
                     "--set", "resources.gpus=1", "--set", "name=holder").stdout.strip()
    stack.wait(hold, until=("RUNNING",))
    queued = stack.cli("submit", str(REPO / "examples" / "command.yaml"), "-d", "--set", "resources.gpus=1",
                       "--set", "env.STEPS=2", "--set", "name=queued").stdout.strip()
    time.sleep(1.0)
    assert stack.job(queued)["status"] == "PENDING"

    stack.compose("down", "--timeout", "30")
    assert stack.container_id() == ""
    assert stack.cli("ps", check=False).returncode == 2  # nothing answers now: one line, exit 2
    t0 = time.monotonic()
    stack.compose("up", "-d", "--wait", "--wait-timeout", "120", timeout=180)
    stack.timings["up_again_s"] = time.monotonic() - t0

    jobs = {j["id"]: j for j in json.loads(stack.cli("ps", "--all", "--json").stdout)}
    for label, job_id in stack.jobs.items():  # the finished ones, with their files
        assert jobs[job_id]["status"] == "SUCCEEDED", label
    assert jobs[queued]["status"] == "PENDING"
    assert jobs[hold]["status"] in ("PENDING", "STARTING", "RUNNING")  # worker_lost, retried per its policy
    assert stack.job(hold)["attempt"] >= 2  # the job the stopped worker was running is retried
    check_outputs(stack, stack.job(stack.jobs["outputs"]))

    stack.cli("cancel", hold)
    assert stack.wait(hold)["status"] == "CANCELLED"
    assert stack.wait(queued)["status"] == "SUCCEEDED"


def test_docker_executor_is_opt_in_through_compose_docker_yaml(stack: Stack) -> None:
    """With compose.docker.yaml the worker starts one container per `executor: docker` job on the
    host's daemon (the socket is mounted; run dirs live at their host path); without it, it cannot."""
    # Without the socket the worker refuses the job at submit: one line naming the field, exit 2.
    res = stack.cli("submit", str(REPO / "examples" / "command.yaml"), "-d", "--set", "executor=docker",
                    "--set", f"image={BASE_IMAGE}", "--set", "retry.max_attempts=1", check=False)
    assert res.returncode == 2, res
    assert "executor" in res.stderr and "no Docker daemon reachable" in res.stderr and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr

    sock_gid = str(os.stat("/var/run/docker.sock").st_gid)
    stack.compose_env.update(COMPOSE_FILE="compose.yaml:compose.cpu.yaml:compose.docker.yaml", DOCKER_GID=sock_gid)
    stack.compose("up", "-d", "--wait", "--wait-timeout", "120", timeout=180)
    where = "command=echo uid $(id -u) on $(cat /etc/debian_version) > $OFFLOAD_JOBS_OUTPUTS/where.txt"
    job = stack.cli("submit", str(REPO / "examples" / "command.yaml"), "-d", "--set", "executor=docker",
                    "--set", f"image={BASE_IMAGE}", "--set", where).stdout.strip()
    done = stack.wait(job)
    assert done["status"] == "SUCCEEDED", stack.cli("logs", job).stdout[-2000:]
    run_dir = stack.data / "state" / "runs" / job
    assert done["run_dir"] == str(run_dir)  # the host path, as the daemon needs
    assert re.fullmatch(r"uid 1000 on 12\.\d+\n", (run_dir / "outputs" / "where.txt").read_text())
    # the jobs from before the switch still read (their run dirs under /state)
    assert "final loss" in stack.cli("logs", stack.jobs["toy"]).stdout


def test_offload_jobs_down_stops_it(stack: Stack) -> None:
    env = {**stack.compose_env, "OFFLOAD_JOBS_HOME": stack.cli_env["OFFLOAD_JOBS_HOME"]}
    stack.cli("down", cwd=Path("/"), env={k: v for k, v in env.items() if k != "COMPOSE_PROJECT_NAME"})
    assert stack.container_id() == ""
    assert not (Path(stack.cli_env["OFFLOAD_JOBS_HOME"]) / "worker.json").exists()
    assert (stack.data / "state" / "jobs.db").exists()  # the state stays on the host


def test_rebuild_after_a_source_change_reuses_the_dependency_layer(stack: Stack, tmp_path: Path) -> None:
    """A copy of the build context with one changed source file: every layer up to the venv is the
    same as the first image's, and only the project's layers differ."""
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    for name in ("Dockerfile", ".dockerignore", "pyproject.toml", "README.md", "compose.yaml", "compose.cpu.yaml",
                 "byte_sizes.py"):
        shutil.copy2(REPO / name, ctx / name)
    for name in ("offload_core", "jobs", "tui", "examples", "scripts"):
        shutil.copytree(REPO / name, ctx / name, ignore=shutil.ignore_patterns("__pycache__"))
    if (REPO / ".ctx").exists():
        shutil.copytree(REPO / ".ctx", ctx / ".ctx", copy_function=_link_or_copy)
    with open(ctx / "jobs" / "__init__.py", "a") as f:
        f.write(f"\n# a source change {secrets.token_hex(8)}\n")  # new each run: never in the build cache
    tag = f"{IMAGE}-rebuilt"
    env = {**stack.compose_env, "OFFLOAD_IMAGE": tag, "COMPOSE_FILE": "compose.yaml:compose.cpu.yaml"}
    cmd = compose_cmd()
    assert cmd is not None
    t0 = time.monotonic()
    res = run([*cmd, "--progress", "plain", "build"], env, cwd=ctx, timeout=900)
    stack.timings["rebuild_after_source_change_s"] = time.monotonic() - t0
    try:
        first, second = _layers(IMAGE), _layers(tag)
        shared = len(os.path.commonprefix([first, second]))
        # the base image's layers, then python, the user and the deps venv: all shared
        assert shared >= len(_layers(BASE_IMAGE)) + 3, (shared, len(first))
        assert 0 < len(second) - shared <= 8  # only the project's layers were rebuilt
        log = res.stdout + res.stderr
        for step in (r"\[\w+ deps \d/\d\] RUN", r"COPY --from=deps /opt/venv /opt/venv"):
            assert re.search(step + r"[^\n]*\n#\d+ CACHED", log), f"{step} was not cached:\n{log[-3000:]}"
        assert not re.search(r"\[\w+ stage-2 \d/\d\] COPY jobs[^\n]*\n#\d+ CACHED", log)  # the change was seen
        size = int(run(["docker", "image", "inspect", "--format", "{{.Size}}", IMAGE], env).stdout)
        stack.timings["image_size_gb"] = size / 1e9
    finally:
        run(["docker", "image", "rm", tag], env, check=False)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _image_id(image: str) -> str:
    res = run(["docker", "image", "inspect", "--format", "{{.Id}}", image], os.environ.copy(), check=False)
    return res.stdout.strip()


def _layers(image: str) -> list[str]:
    out = run(["docker", "image", "inspect", "--format", "{{json .RootFS.Layers}}", image], os.environ.copy()).stdout
    return json.loads(out)
