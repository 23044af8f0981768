"""Fixtures for the train/infer runner tests: the tiny pipelines, built once per session, offline."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


def load_builder():
    """scripts/make_tiny_pipelines.py as a module (scripts/ is not a package)."""
    path = REPO / "scripts" / "make_tiny_pipelines.py"
    spec = importlib.util.spec_from_file_location("make_tiny_pipelines", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("make_tiny_pipelines", mod)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> dict[str, Path]:
    """{'flux': ..., 'qwen-image': ..., 'wan': ..., 'images': ..., 'clips': ...} under one temp dir.

    Under xdist the workers share one build (about 6 s of CPU each otherwise): the first builds it
    under a lock, the others wait and read it. No test writes into it.
    """
    import fcntl
    import warnings

    warnings.filterwarnings("ignore")
    if worker_id == "master":
        return load_builder().build_all(tmp_path_factory.mktemp("tiny"))
    root = tmp_path_factory.getbasetemp().parent / "tiny"  # this run's, beside the workers' own temp dirs
    root.mkdir(exist_ok=True)
    with open(root.parent / "tiny.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return load_builder().build_all(root)  # builds what is missing; a finished build is left as it is


@pytest.fixture(autouse=True)
def one_torch_thread():
    """The tests' own tiny forward passes, one thread (restored after)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
