"""Submitting runner jobs to the real worker and reading what they wrote."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

from jobs.client import JobsClient

FAMILY_DATA = {"flux": "images", "qwen-image": "images", "wan": "clips", "sd3": "images"}
# Tiny matrices: one thread each beats two threads fighting over two shared cores (10x on a busy box).
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def train_spec(tiny: dict[str, Path], family: str = "flux", **train: Any) -> dict[str, Any]:
    t = {"dataset": str(tiny[FAMILY_DATA[family]]), "steps": 30, "learning_rate": 1e-2, "lora_rank": 4,
         "max_sequence_length": 32, "max_pixels": 1024, "num_frames": 5, "save_every": 10, "keep_last": 2}
    t.update(train)
    return {"kind": "train", "name": f"test-{family}", "model": {"path": str(tiny[family])},
            "offload": {"target_device": "cpu", "offload_granularity": "block"}, "train": t,
            "resources": {"gpus": 0}, "limits": {"max_duration": "5m"}, "env": dict(ONE_THREAD)}


def infer_spec(tiny: dict[str, Path], family: str = "flux", **infer: Any) -> dict[str, Any]:
    i = {"prompt": ["a red square on a blue background", "a green circle --w 48 --h 32 --seed 7"], "steps": 3,
         "width": 32, "height": 32, "num_frames": 5, "max_sequence_length": 32, "negative_prompt": "blurry"}
    i.update(infer)
    return {"kind": "infer", "name": f"test-infer-{family}", "model": {"path": str(tiny[family])},
            "offload": {"target_device": "cpu", "offload_granularity": "block"}, "infer": i,
            "resources": {"gpus": 0}, "limits": {"max_duration": "5m"}, "env": dict(ONE_THREAD)}


def run_job(client: JobsClient, spec: dict[str, Any], timeout: float = 240) -> dict[str, Any]:
    job = client.submit(spec)
    return client.wait(job["id"], timeout=timeout)


def strict_lines(path: Path) -> list[dict[str, Any]]:
    """JSON lines parsed strictly: NaN or Infinity in a file is a failure, not a float."""
    def no_constants(name: str) -> Any:
        raise AssertionError(f"{path.name} holds a non-JSON number: {name}")

    return [json.loads(line, parse_constant=no_constants) for line in path.read_text().splitlines() if line.strip()]


def written_lines(path: Path) -> list[dict[str, Any]]:
    """The JSON lines a running job has finished writing: none while the file is absent, and not a last
    line still without its newline (read while it was being appended)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines() if line.strip()]


def run_dir(job: dict[str, Any]) -> Path:
    return Path(job["run_dir"])


def pictures(job: dict[str, Any]) -> dict[str, bytes]:
    """The job's images (and Wan's GIFs), by path under outputs/: compared byte for byte between jobs."""
    out = run_dir(job) / "outputs"
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*")) if p.suffix in (".png", ".gif")}


def step_records(job: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in strict_lines(run_dir(job) / "metrics.jsonl") if "loss" in r]


def events(job: dict[str, Any], type: str | None = None) -> list[dict[str, Any]]:
    evs = strict_lines(run_dir(job) / "events.jsonl")
    return [e for e in evs if type is None or e.get("type") == type]


def log(job: dict[str, Any]) -> str:
    return (run_dir(job) / "output.log").read_text(errors="replace")


def wait_for(predicate, timeout: float = 60, poll: float = 0.02) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = predicate()
        if got:
            return got
        time.sleep(poll)
    raise TimeoutError("condition not met in time")


def copy_dataset(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst
