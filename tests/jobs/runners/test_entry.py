"""The runners' shared start-up (jobs/runners/_entry.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]

_CHILD = """
import importlib.util, sys
from jobs.runners._entry import load_job
load_job([sys.argv[1]])
visible = importlib.util.find_spec("bitsandbytes") is not None  # how peft and diffusers ask whether it is installed
if not visible:
    import peft  # what a runner imports next; it imports bitsandbytes eagerly where it may
    visible = "bitsandbytes" in sys.modules and sys.modules["bitsandbytes"] is not None
print(visible)
"""


@pytest.mark.parametrize("optimizer,loaded", [("adamw", False), ("adamw8bit", True)])
def test_bitsandbytes_is_imported_only_by_a_job_that_trains_with_it(tmp_path: Path, optimizer: str, loaded: bool) -> None:
    """A job that does not train with adamw8bit never imports bitsandbytes, not even through peft; one that does
    still finds it (the libraries' own find_spec check; importing peft there would only add its 2 s of imports)."""
    pytest.importorskip("bitsandbytes")
    (tmp_path / "spec.yaml").write_text(
        f"kind: train\nmodel: {{path: /m}}\ntrain: {{dataset: /d, optimizer: {optimizer}}}\n")
    res = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path)], capture_output=True, text=True, cwd=REPO,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().splitlines()[-1] == str(loaded)


_IMPORTS = """
import gc
from jobs.runners._entry import import_family, imports_without_gc
runs = []
gc.callbacks.append(lambda phase, info: phase == "start" and runs.append(info["generation"]))
with imports_without_gc():
    import_family("flux")  # torch, diffusers, transformers, the engine: ~450k objects
print(len(runs), gc.isenabled(), gc.get_freeze_count())
"""


def test_a_runners_heavy_imports_run_without_the_collector_and_stay_frozen_after() -> None:
    """The collector never runs while a job imports its libraries (about 1 s of a job's start), is on
    again afterwards, and skips the imported objects from then on."""
    res = subprocess.run([sys.executable, "-c", _IMPORTS], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    collections, enabled, frozen = res.stdout.split()[-3:]
    assert (collections, enabled) == ("0", "True")
    assert int(frozen) > 100_000


_EXIT = """
import atexit, gc, sys
atexit.register(lambda: print("frozen at exit:", gc.get_freeze_count(), flush=True))  # runs last (LIFO)
from jobs.runners._entry import load_job
load_job([sys.argv[1]])
made = [[i] for i in range(50_000)]  # what a job holds when it ends (a train job: ~700k objects)
print("frozen before exit:", gc.get_freeze_count(), flush=True)
"""


def test_a_jobs_child_exits_without_collecting_what_it_made(tmp_path: Path) -> None:
    """At exit a job's child freezes its objects: the interpreter's shutdown collections skip them (about
    1.5 s of CPU after a train job's last line)."""
    (tmp_path / "spec.yaml").write_text("kind: train\nmodel: {path: /m}\ntrain: {dataset: /d}\n")
    res = subprocess.run([sys.executable, "-c", _EXIT, str(tmp_path)], capture_output=True, text=True, cwd=REPO,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    before, at_exit = (int(line.split(":")[1]) for line in res.stdout.splitlines()[-2:])
    assert before == 0 and at_exit > 50_000
