"""The runners' shared start-up (jobs/runners/_entry.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]

_CHILD = """
import sys
from jobs.runners._entry import load_job
load_job([sys.argv[1]])
import peft  # what a runner imports next; it imports bitsandbytes eagerly where it may
print("bitsandbytes" in sys.modules and sys.modules["bitsandbytes"] is not None)
"""


@pytest.mark.parametrize("optimizer,loaded", [("adamw", False), ("adamw8bit", True)])
def test_bitsandbytes_is_imported_only_by_a_job_that_trains_with_it(tmp_path: Path, optimizer: str, loaded: bool) -> None:
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
