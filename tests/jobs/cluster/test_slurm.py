"""`executor: slurm` on a real single-node Slurm (slurmctld + slurmd + munged, two fake GPUs; started by
.ci/run through scripts/cluster_services.sh). Skipped where no Slurm answers.

- a command job, with `--gres=gpu:1`: SUCCEEDED, its output in the run dir's log through Slurm;
- cancel reaches scancel: the job gets SIGTERM inside Slurm and ends CANCELLED;
- the tiny train job (examples/tiny-train.yaml on the tiny Flux pipeline) runs to its LoRA;
- a train job past its limit (max_duration 60 s -> --time=1 --signal=B:TERM@10) checkpoints on the
  signal and ends FAILED (timeout) with a complete checkpoint.
The long one is submitted first and checked last, so Slurm runs it beside the others.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from jobs_helpers import REPO, WorkerProcess, wait_until

from jobs._cli.specfile import read_spec_data


def _slurm_up() -> str | None:
    if not shutil.which("sinfo") or not shutil.which("sbatch"):
        return "Slurm's client commands are not installed"
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"sinfo failed: {exc}"
    states = set(out.stdout.split())
    if out.returncode != 0 or not states & {"idle", "mixed", "allocated"}:
        return f"no Slurm node is up ({out.stderr.strip() or ', '.join(states) or 'none'}); run scripts/cluster_services.sh"
    return None


_SLURM_DOWN = _slurm_up()  # once: where no slurmctld answers, each sinfo waits out its timeout
pytestmark = pytest.mark.skipif(_SLURM_DOWN is not None, reason=str(_SLURM_DOWN))


def _scontrol(sid: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", "-o", sid], capture_output=True, text=True, timeout=15)
    return dict(p.split("=", 1) for p in out.stdout.split() if "=" in p)


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory):
    w = WorkerProcess(tmp_path_factory.mktemp("slurm") / "home").start()
    yield w
    w.stop()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = importlib.util.spec_from_file_location("make_tiny_pipelines", REPO / "scripts" / "make_tiny_pipelines.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("make_tiny_pipelines", mod)
    spec.loader.exec_module(mod)
    root = tmp_path_factory.mktemp("tiny")
    mod.build_all(root, families=["flux"])
    return root


def _tiny_train(tiny: Path, *sets: str) -> dict:
    data, _ = read_spec_data(REPO / "examples" / "tiny-train.yaml", [
        f"model.path={tiny / 'flux'}", f"train.dataset={tiny / 'data' / 'images'}", "executor=slurm",
        "resources.gpus=1", *sets])
    return data


@pytest.fixture(scope="module")
def past_its_limit(worker: WorkerProcess, tiny: Path) -> str:
    """Submitted before the other tests run: steps it cannot finish in the 60 s Slurm gives it."""
    with worker.client() as c:
        job = c.submit(_tiny_train(tiny, "name=past-its-limit", "train.steps=100000", "train.save_every=100000",
                                   "train.sample_every=100000", "limits.max_duration=60", "limits.stop_grace=10",
                                   "retry.max_attempts=1"))
    return job["id"]


def test_a_command_job_runs_in_slurm(worker: WorkerProcess, past_its_limit: str) -> None:
    with worker.client() as c:
        job = c.submit({"kind": "command", "command": 'echo "slurm job $SLURM_JOB_ID gpus=$CUDA_VISIBLE_DEVICES"',
                        "executor": "slurm", "resources": {"gpus": 1}})
        done = c.wait(job["id"], timeout=90)
        assert done["status"] == "SUCCEEDED", c.logs(job["id"])["data"]
        (att,) = c.get(job["id"])["attempts"]
        sid = att["handle"]["slurm_job_id"]
        assert att["executor"] == "slurm" and sid.isdigit()
        log = c.logs(job["id"])["data"]
        assert f"slurm job {sid} gpus=" in log  # printed inside Slurm's allocation, one fake GPU given
        info = _scontrol(sid)
        assert info.get("JobState") == "COMPLETED" and "gpu:1" in (info.get("TresPerNode", "") + info.get("Gres", ""))
        failing = c.submit({"kind": "command", "command": "exit 3", "executor": "slurm", "retry": {"max_attempts": 1}})
        bad = c.wait(failing["id"], timeout=90)
        assert (bad["status"], bad["reason"], bad["exit_code"]) == ("FAILED", "exit_nonzero", 3)


def test_cancel_reaches_scancel(worker: WorkerProcess, past_its_limit: str) -> None:
    with worker.client() as c:
        job = c.submit({"kind": "command", "executor": "slurm", "limits": {"stop_grace": 15},
                        "command": "trap 'echo got SIGTERM in slurm; exit 5' TERM; echo up; sleep 300 & wait"})
        wait_until(lambda: "up" in c.logs(job["id"])["data"], 60, what="the job running in Slurm")
        sid = c.get(job["id"])["attempts"][0]["handle"]["slurm_job_id"]
        assert _scontrol(sid).get("JobState") == "RUNNING"
        c.cancel(job["id"])
        done = c.wait(job["id"], timeout=60)
        assert (done["status"], done["reason"]) == ("CANCELLED", "cancelled")
        assert "got SIGTERM in slurm" in c.logs(job["id"])["data"]
        assert _scontrol(sid).get("JobState") not in ("RUNNING", "PENDING", "COMPLETING")


def test_the_tiny_train_job_runs_through_slurm(worker: WorkerProcess, tiny: Path, past_its_limit: str) -> None:
    with worker.client() as c:
        job = c.submit(_tiny_train(tiny, "train.steps=10", "train.save_every=5", "train.sample_every=10"))
        done = c.wait(job["id"], timeout=240)
        log = c.logs(job["id"])["data"]
        assert done["status"] == "SUCCEEDED", log[-3000:]
        assert c.get(job["id"])["attempts"][0]["executor"] == "slurm"
        outputs = Path(done["run_dir"]) / "outputs"
        assert (outputs / "lora.safetensors").stat().st_size > 0
        assert "LoRA written to" in log


@pytest.mark.serial  # a time limit of seconds and Slurm's signal before it: failed once under four-way load
def test_a_train_job_past_its_limit_checkpoints_on_the_signal(worker: WorkerProcess, past_its_limit: str) -> None:
    with worker.client() as c:
        t0 = time.monotonic()
        done = c.wait(past_its_limit, timeout=150)
        log = c.logs(past_its_limit)["data"]
        assert (done["status"], done["reason"]) == ("FAILED", "timeout"), log[-3000:]
        run_dir = Path(done["run_dir"])
        ckpts = [p for p in (run_dir / "checkpoints").glob("step-*") if (p / "COMPLETE.json").exists()]
        assert ckpts, log[-3000:]  # saved on Slurm's SIGTERM, before the limit
        step = int(ckpts[0].name.split("-")[1])
        assert 0 < step < 100000
        exit_rec = (run_dir / "exit.json").read_text()
        assert '"signalled": "SIGTERM"' in exit_rec
        print(f"\n[slurm] past its limit: checkpoint at step {step}, ended {time.monotonic() - t0:.0f}s after the "
              "other tests")


def test_a_lost_workers_slurm_job_is_cancelled_by_the_reaper_that_retries_it(tmp_path: Path, pg_url: str) -> None:
    from cluster_helpers import ClusterWorker

    a = ClusterWorker(tmp_path / "wa", "wa", pg_url, timeout=6.0).start()
    b = None
    try:
        with a.client() as ca:
            job = ca.submit({"kind": "command", "executor": "slurm", "retry": {"max_attempts": 2, "on": ["worker_lost"]},
                             "command": "echo up $OFFLOAD_JOBS_ATTEMPT; sleep 300 & wait"})["id"]
            wait_until(lambda: "up 1" in ca.logs(job)["data"], 60, what="attempt 1 running in Slurm")
            first = ca.get(job)["attempts"][0]["handle"]["slurm_job_id"]
        b = ClusterWorker(tmp_path / "wb", "wb", pg_url, timeout=6.0).start()
        a.kill9()  # its Slurm job runs on without it
        with b.client() as cb:
            wait_until(lambda: cb.get(job)["attempt"] == 2 and cb.get(job)["status"] == "RUNNING", 40,
                       what="the retry in Slurm")
            second = cb.get(job)["attempts"][1]["handle"]["slurm_job_id"]
            assert second != first and cb.get(job)["worker_id"] == "wb"
            wait_until(lambda: _scontrol(first).get("JobState") not in ("RUNNING", "PENDING", "COMPLETING"), 30,
                       what="the lost attempt's Slurm job cancelled")
            att = cb.get(job)["attempts"][0]
            assert (att["status"], att["reason"]) == ("FAILED", "worker_lost")
            cb.cancel(job)
            assert cb.wait(job, timeout=60)["status"] == "CANCELLED"
    finally:
        a.stop()
        if b is not None:
            b.stop()
