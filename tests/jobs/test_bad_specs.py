"""200 hypothesis-generated bad specs: `offload-jobs validate` exits 2 with ONE stderr line that
names the offending field, and never a traceback.

Each case starts from a valid spec and breaks exactly one thing, so the field the message must
name is known. The 200 run in-process through typer's CliRunner (fast); a handful more go
through the real console script.
"""

from __future__ import annotations

import json
import os
import string
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from jobs.cli import app

BASES: dict[str, dict[str, Any]] = {
    "command": {"kind": "command", "name": "ok", "command": "echo hi"},
    "shard": {"kind": "shard", "name": "ok", "shard": {"src": "/in", "dst": "/out"}},
    "train": {"kind": "train", "name": "ok", "model": {"path": "/m"}},
    "infer": {"kind": "infer", "name": "ok", "model": {"path": "/m"}, "infer": {"prompt": "a fox"}},
}
SECTIONS = ("model", "offload", "train", "infer", "shard", "resources", "retry", "limits")
KNOWN_TOP = {"kind", "name", "command", "workdir", "env", "outputs", "priority", "executor", "image", *SECTIONS}

identifiers = st.text(string.ascii_lowercase + "_", min_size=1, max_size=12).filter(lambda s: s[0] != "_")
# Words that no int/float/size/duration parser accepts.
words = st.text(string.ascii_letters, min_size=1, max_size=10).filter(
    lambda s: s.lower() not in {"e", "inf", "nan", "infinity", "true", "false", "yes", "no", "on", "off", "null",
                                "y", "n", "none"})
non_dicts = st.one_of(st.integers(), words, st.lists(st.integers(), min_size=1, max_size=3))
negatives = st.integers(max_value=-1)

# (dotted field, strategy of a bad value) for fields with a rule.
BAD_VALUES: list[tuple[str, st.SearchStrategy[Any]]] = [
    ("priority", st.one_of(words, st.floats(min_value=0.1, max_value=9.9).filter(lambda f: f != int(f)))),
    ("name", st.text(string.ascii_letters, min_size=201, max_size=260)),
    ("executor", words.filter(lambda s: s not in ("process", "docker"))),
    ("kind", words.filter(lambda s: s not in ("train", "infer", "shard", "command"))),
    ("train.steps", st.one_of(st.integers(max_value=0), words)),
    ("train.learning_rate", st.one_of(st.floats(max_value=0.0, allow_nan=False, allow_infinity=False), words)),
    ("train.lora_rank", st.integers(max_value=0)),
    ("train.batch_size", st.integers(max_value=0)),
    ("train.gradient_accumulation_steps", st.integers(max_value=0)),
    ("train.max_pixels", st.integers(max_value=63)),
    ("infer.steps", st.integers(max_value=0)),
    ("infer.guidance", st.floats(max_value=-0.001, allow_nan=False, allow_infinity=False)),
    ("infer.height", st.integers(max_value=7)),
    ("infer.num_images", st.integers(max_value=0)),
    ("offload.offload_granularity", words.filter(lambda s: s not in ("leaf", "block", "phase", "auto"))),
    ("offload.offload_ratio", st.one_of(st.floats(min_value=1.001, max_value=1e6), st.floats(max_value=-0.001,
                                                                                              min_value=-1e6))),
    ("offload.prefetch", negatives),
    ("offload.num_disk_workers", st.integers(max_value=0)),
    ("offload.vram_budget", st.one_of(words, negatives)),
    ("offload.max_memory", st.one_of(words, negatives)),
    ("resources.gpus", negatives),
    ("resources.shm_size", words),
    ("retry.max_attempts", st.integers(max_value=0)),
    ("retry.on", st.one_of(st.lists(words, min_size=1, max_size=3), st.just(["cancelled"]))),
    ("limits.max_duration", st.one_of(words, st.integers(max_value=0))),
    ("limits.stop_grace", st.one_of(words, negatives)),
    *[(section, non_dicts) for section in SECTIONS],
]


def set_dotted(spec: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    cur = spec
    for p in parents:
        cur = cur.setdefault(p, {})
    cur[leaf] = value


@st.composite
def bad_specs(draw: st.DrawFn) -> tuple[dict[str, Any], str, list[str]]:
    """(spec, field the error must name, --set args); exactly one thing is wrong."""
    kind = draw(st.sampled_from(sorted(BASES)))
    spec = json.loads(json.dumps(BASES[kind]))
    how = draw(st.sampled_from(["bad_value", "bad_value", "bad_value", "unknown_top", "unknown_nested",
                                "missing_required", "bad_env"]))
    sets: list[str] = []
    if how == "bad_value":
        field, values = draw(st.sampled_from(BAD_VALUES))
        value = draw(values)
        if field in SECTIONS or field == "kind" or not draw(st.booleans()):
            set_dotted(spec, field, value)
        else:  # the same mistake made on the command line
            sets.append(f"{field}={json.dumps(value)}")
        return spec, field, sets
    if how == "unknown_top":
        key = draw(identifiers.filter(lambda k: k not in KNOWN_TOP))
        spec[key] = draw(st.one_of(st.integers(), words))
        return spec, key, sets
    if how == "unknown_nested":
        section = draw(st.sampled_from(SECTIONS))
        from jobs import spec as spec_mod

        model = spec_mod.JobSpec.model_fields[section].annotation
        key = draw(identifiers.filter(lambda k: k not in model.model_fields))
        set_dotted(spec, f"{section}.{key}", draw(st.integers()))
        return spec, f"{section}.{key}", sets
    if how == "missing_required":
        needed = {"command": ("command", ["command"]), "shard": ("shard.src", ["shard", "src"]),
                  "train": ("model.path", ["model", "path"]), "infer": ("model.path", ["model", "path"])}
        field, path = needed[kind]
        cur = spec
        for p in path[:-1]:
            cur = cur[p]
        del cur[path[-1]]
        if kind == "shard" and draw(st.booleans()):
            spec["shard"]["src"], field = "/in", "shard.dst"
            del spec["shard"]["dst"]
        return spec, field, sets
    key = draw(st.text(string.ascii_uppercase + "_", min_size=1, max_size=8))
    spec["env"] = {key: draw(st.one_of(st.lists(st.integers(), min_size=1, max_size=2),
                                       st.dictionaries(identifiers, st.integers(), min_size=1, max_size=2),
                                       st.none()))}
    return spec, f"env.{key}", sets


runner = CliRunner()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=bad_specs())
def test_200_bad_specs_exit_2_and_name_the_field(case: tuple[dict[str, Any], str, list[str]]) -> None:
    spec, field, sets = case
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "job.yaml"
        path.write_text(yaml.safe_dump(spec, sort_keys=False))
        args = ["validate", str(path)]
        for s in sets:
            args += ["--set", s]
        result = runner.invoke(app, args)
    assert result.exit_code == 2, (spec, sets, result.output, result.exception)
    assert isinstance(result.exception, SystemExit), result.exception  # handled, not crashed
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    assert field in lines[0], (field, lines[0])
    assert result.stdout == ""


# A handful through the real console script: the same guarantees outside the test runner.
SCRIPT_CASES = [
    ("train:\n  learning_rate: -1\nkind: train\nmodel: {path: /m}\n", [], "train.learning_rate"),
    ("kind: command\ncommand: echo\nlimits: {max_duration: forever}\n", [], "limits.max_duration"),
    ("kind: command\ncommand: echo\noffload: {prefetch: 2, warp: 9}\n", [], "offload.warp"),
    ("kind: shard\nshard: {src: /in}\n", [], "shard.dst"),
    ("kind: command\ncommand: echo\n", ["retry.max_attempts=0"], "retry.max_attempts"),
    ("kind: command\ncommand: echo\n", ["offload.offload_granularity=huge"], "offload.offload_granularity"),
]


@pytest.mark.parametrize(("text", "sets", "field"), SCRIPT_CASES)
def test_bad_specs_through_the_console_script(tmp_path: Path, text: str, sets: list[str], field: str) -> None:
    exe = Path(sys.executable).parent / "offload-jobs"
    if not exe.exists():
        pytest.fail("the offload-jobs console script is not installed; run: .venv/bin/pip install -e . --no-deps")
    path = tmp_path / "job.yaml"
    path.write_text(text)
    args = [str(exe), "validate", str(path)]
    for s in sets:
        args += ["--set", s]
    env = {k: v for k, v in os.environ.items() if not k.startswith("OFFLOAD_JOBS_")}
    res = subprocess.run(args, capture_output=True, text=True, timeout=60, env=env)
    assert res.returncode == 2, res
    assert "Traceback" not in res.stdout + res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and field in lines[0], res.stderr
    assert str(path) in lines[0]
