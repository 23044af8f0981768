"""preflight resolves a spec's relative paths where the job will: under its workdir (the job's cwd)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from jobs.errors import SpecError
from jobs.preflight import preflight
from jobs.spec import parse_spec


def _train(workdir: Path) -> dict:
    return {"kind": "train", "name": "rel", "workdir": str(workdir), "model": {"path": "../models/flux"},
            "train": {"dataset": "data/images", "steps": 1}}


def test_relative_paths_are_checked_under_the_workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    work = tmp_path / "examples"
    (work / "data" / "images").mkdir(parents=True)
    (tmp_path / "models" / "flux").mkdir(parents=True)
    (tmp_path / "models" / "flux" / "model_index.json").write_text('{"_class_name": "FluxPipeline"}')
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # the worker's own cwd is not where the job runs
    preflight(parse_spec(_train(work)))  # both found under the workdir


def test_a_missing_relative_path_is_named_with_where_it_was_looked_for(tmp_path: Path) -> None:
    work = tmp_path / "examples"
    (work / "data" / "images").mkdir(parents=True)
    with pytest.raises(SpecError) as exc:
        preflight(parse_spec(_train(work)))
    assert "model.path" in str(exc.value) and os.path.join(str(tmp_path), "models", "flux") in str(exc.value)
