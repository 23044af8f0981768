"""Hypothesis-generated bad specs, 400 and more: `offload-jobs validate` (and `submit`, against a real
worker) exits 2 with ONE stderr line that names the offending field, file or --set, and never a
traceback.

- 200 structured cases: a valid spec with exactly one field broken, so the field to name is known.
- 160 raw files as a careless user or a fuzzer writes them: non-UTF-8 and binary bytes, nesting
  deep enough to blow a recursive parser, integers past int64, NaN and infinities, duplicate keys,
  bad and reserved env names, NUL bytes, infinite sizes and durations, oversized commands, alias
  bombs, and the same mistakes made through --set.
- 40 of those through `submit` to a real worker, whose own validation must point back into the
  file just the same.
They run in-process through typer's CliRunner (fast); a handful more go through the real console
script.
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
    ("executor", words.filter(lambda s: s not in ("process", "docker", "slurm"))),
    ("kind", words.filter(lambda s: s not in ("train", "infer", "shard", "command"))),
    ("train.steps", st.one_of(st.integers(max_value=0), words)),
    ("train.learning_rate", st.one_of(st.floats(max_value=0.0, allow_nan=False, allow_infinity=False), words)),
    ("train.lora_rank", st.integers(max_value=0)),
    ("train.batch_size", st.integers(max_value=0)),
    ("train.gradient_accumulation_steps", st.integers(max_value=0)),
    ("train.accumulation_order", words.filter(lambda s: s not in ("micro", "layer"))),
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
    ("resources.min_vram", st.one_of(words, negatives)),
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


# ------------------------------------------------------------------ raw files

GOOD = "kind: command\nname: ok\ncommand: echo hi\n"
NUMERIC_INT = ["priority", "train.steps", "retry.max_attempts", "resources.gpus", "offload.prefetch", "infer.seed"]
NUMERIC_FLOAT = ["train.lr", "offload.offload_ratio", "infer.guidance"]
SIZES = ["offload.vram_budget", "offload.max_memory", "resources.shm_size", "resources.ram"]
DURATIONS = ["limits.max_duration", "limits.stop_grace"]


def nested_yaml(dotted: str, value: str) -> str:
    """`a.b: v` as block YAML under the good spec's keys."""
    *parents, leaf = dotted.split(".")
    out, indent = "", ""
    for p in parents:
        out += f"{indent}{p}:\n"
        indent += "  "
    return out + f"{indent}{leaf}: {value}\n"


@st.composite
def raw_bad_files(draw: st.DrawFn) -> tuple[bytes, list[str], list[str]]:
    """(file bytes, --set args, words the error line must hold; "{file}" is the file's path)."""
    how = draw(st.sampled_from([
        "non_utf8", "binary", "deep_flow", "deep_block", "huge_int", "nan_inf", "duplicate_top", "duplicate_nested",
        "env_name", "env_reserved", "nul_escape", "inf_size", "inf_duration", "big_command", "alias_bomb",
        "set_huge_int", "set_env_name", "set_nan", "date_value", "binary_tag",
    ]))
    if how == "non_utf8":
        bad = draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xa0\xa1", b"\xe2\x28\xa1", b"\xf0\x28\x8c\xbc", b"\x80"]))
        at = draw(st.integers(0, len(GOOD)))
        return GOOD.encode()[:at] + bad + GOOD.encode()[at:], [], ["{file}", "not UTF-8"]
    if how == "binary":
        junk = draw(st.binary(min_size=1, max_size=200))
        at = draw(st.integers(0, len(junk)))
        return junk[:at] + b"\0" + junk[at:], [], ["{file}", "binary"]
    if how == "deep_flow":
        depth = draw(st.sampled_from([33, 40, 100, 999, 1500, 5000]))
        where = draw(st.sampled_from(["outputs", "command", "env"]))
        return (GOOD.replace("command: echo hi\n", "") + ("command: echo hi\n" if where != "command" else "")
                + f"{where}: " + "[" * depth + "]" * depth + "\n").encode(), [], ["{file}", "nested"]
    if how == "deep_block":
        depth = draw(st.integers(33, 60))
        body = "".join("  " * i + f"k{i}:\n" for i in range(depth)) + "  " * depth + "v: 1\n"
        return (GOOD + "env:\n" + "".join("  " + ln + "\n" for ln in body.splitlines())).encode(), [], ["{file}", "nested"]
    if how == "huge_int":
        field = draw(st.sampled_from(NUMERIC_INT))
        value = draw(st.integers(2**63, 10**60)) * draw(st.sampled_from([1, -1]))
        return (GOOD + nested_yaml(field, str(value))).encode(), [], [field]
    if how == "nan_inf":
        field = draw(st.sampled_from(NUMERIC_FLOAT + NUMERIC_INT + SIZES + DURATIONS + ["env.X"]))
        value = draw(st.sampled_from([".nan", ".NaN", ".inf", "-.inf", ".Inf", "+.inf"]))
        return (GOOD + nested_yaml(field, value)).encode(), [], [field]
    if how == "duplicate_top":
        key, value = draw(st.sampled_from([("name", "again"), ("command", "echo twice"), ("priority", "1"),
                                           ("kind", "command")]))
        extra = "priority: 2\n" if key == "priority" else ""
        return (GOOD + "priority: 0\n" + f"{key}: {value}\n" + extra).encode(), [], [key, "duplicate"]
    if how == "duplicate_nested":
        section, key = draw(st.sampled_from([("limits", "stop_grace"), ("retry", "max_attempts"), ("env", "A"),
                                             ("resources", "gpus")]))
        return (GOOD + f"{section}:\n  {key}: 1\n  {key}: 2\n").encode(), [], [f"{section}.{key}", "duplicate"]
    if how == "env_name":
        name = draw(st.sampled_from(["1BAD", "A-B", "A B", "A.B", "é", "X=Y", "-", "9", "A$"]))
        quoted = name.replace('"', '\\"')
        return (GOOD + f'env:\n  "{quoted}": x\n').encode(), [], [f"env.{name}", "environment variable name"]
    if how == "env_reserved":
        name = "OFFLOAD_JOBS_" + draw(st.sampled_from(["RUN_DIR", "METRICS", "X", "JOB_ID"]))
        return (GOOD + f"env:\n  {name}: x\n").encode(), [], [f"env.{name}", "set by the worker"]
    if how == "nul_escape":
        field = draw(st.sampled_from(["name", "workdir", "env.A", "image", "command"]))
        text = GOOD.replace("command: echo hi\n", "command: echo ok\n") if field == "command" else GOOD
        if field == "command":
            text = text.replace("command: echo ok\n", 'command: "echo \\0 hi"\n')
        elif field == "name":
            text = text.replace("name: ok\n", 'name: "o\\0k"\n')
        else:
            text += nested_yaml(field, '"a\\0b"')
        return text.encode(), [], [field, "NUL"]
    if how == "inf_size":
        field = draw(st.sampled_from(SIZES))
        value = draw(st.sampled_from(["1e999GiB", "1e400", "9e999MB", "1e19EiB", "2e18GiB"]))
        return (GOOD + nested_yaml(field, f'"{value}"')).encode(), [], [field]
    if how == "inf_duration":
        field = draw(st.sampled_from(DURATIONS))
        value = draw(st.sampled_from(['"1e999s"', "1e999", '"1e400h"', "99999999999", '"400d"']))
        return (GOOD + nested_yaml(field, value)).encode(), [], [field]
    if how == "big_command":
        n = draw(st.integers(131_072, 140_000))
        return (GOOD.replace("command: echo hi", "command: echo " + "x" * n)).encode(), [], ["command"]
    if how == "alias_bomb":
        levels = draw(st.integers(6, 9))
        lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
        lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, levels)]
        return (GOOD + "outputs:\n" + "".join("  - " + ln.split(": ", 1)[1] + "\n" for ln in lines)).encode(), [], \
            ["{file}", "values"]
    if how == "set_huge_int":
        field = draw(st.sampled_from(NUMERIC_INT))
        item = f"{field}={draw(st.integers(2**63, 10**40))}"
        return GOOD.encode(), [item], [field, f"--set {item}"]
    if how == "set_env_name":
        name = draw(st.sampled_from(["1X", "A-B", "OFFLOAD_JOBS_RUN_DIR"]))
        item = f"env.{name}=v"
        return GOOD.encode(), [item], [f"env.{name}", f"--set {item}"]
    if how == "set_nan":
        field = draw(st.sampled_from(NUMERIC_FLOAT + DURATIONS))
        item = f"{field}={draw(st.sampled_from(['.nan', '.inf', '-.inf']))}"
        return GOOD.encode(), [item], [field, f"--set {item}"]
    if how == "date_value":
        field = draw(st.sampled_from(["name", "workdir", "env.WHEN"]))
        text = GOOD.replace("name: ok\n", "") if field == "name" else GOOD
        return (text + nested_yaml(field, "2024-01-02")).encode(), [], [field, "date"]
    field = draw(st.sampled_from(["name", "env.BLOB", "workdir"]))
    text = GOOD.replace("name: ok\n", "") if field == "name" else GOOD
    return (text + nested_yaml(field, "!!binary aGVsbG8=")).encode(), [], [field, "binary"]


def _check_one_line(result: Any, must: list[str], path: Path) -> None:
    assert result.exit_code == 2, (result.exit_code, result.output[-500:], result.exception)
    assert isinstance(result.exception, SystemExit), result.exception  # handled, not crashed
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr[-1000:]
    assert lines[0].startswith("error: ")
    for word in must:
        word = word.replace("{file}", str(path))
        assert word in lines[0], (word, lines[0][:400])


@settings(max_examples=160, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example])
@given(case=raw_bad_files())
def test_160_raw_bad_files_exit_2_naming_field_file_or_set(case: tuple[bytes, list[str], list[str]]) -> None:
    data, sets, must = case
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "job.yaml"
        path.write_bytes(data)
        args = ["validate", str(path)]
        for s in sets:
            args += ["--set", s]
        _check_one_line(runner.invoke(app, args), must, path)


@pytest.fixture(scope="module")
def worker_env(worker) -> Any:
    """The environment a user's shell would have for the module's real worker."""
    return {"OFFLOAD_JOBS_HOME": str(worker.home), "OFFLOAD_JOBS_URL": None, "OFFLOAD_JOBS_TOKEN": None}


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example,
                                 HealthCheck.function_scoped_fixture])
@given(case=raw_bad_files())
def test_40_raw_bad_files_through_submit_to_a_real_worker(worker_env: Any, worker: Any,
                                                          case: tuple[bytes, list[str], list[str]]) -> None:
    data, sets, must = case
    before = len(worker.client().list(summary=True))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "job.yaml"
        path.write_bytes(data)
        args = ["submit", str(path), "-d"]
        for s in sets:
            args += ["--set", s]
        _check_one_line(runner.invoke(app, args, env=worker_env), must, path)
    assert len(worker.client().list(summary=True)) == before, "a refused spec left no job behind"


RAW_SCRIPT_CASES = [
    (b"kind: command\ncommand: echo \xff\n", [], ["{file}", "not UTF-8"]),
    (b"\x7fELF\x02\x01\x01\0\0\0", [], ["{file}", "binary"]),
    (b"kind: command\ncommand: echo\noutputs: " + b"[" * 3000 + b"]" * 3000 + b"\n", [], ["{file}", "nested"]),
    (b"kind: command\ncommand: echo\nname: a\nname: b\n", [], ["name", "duplicate"]),
    (b"kind: command\ncommand: echo\nlimits:\n  stop_grace: .inf\n", [], ["limits.stop_grace"]),
    (b"kind: command\ncommand: echo\n", ["priority=99999999999999999999999"], ["priority", "--set priority="]),
]


@pytest.mark.parametrize(("data", "sets", "must"), RAW_SCRIPT_CASES,
                         ids=["non-utf8", "binary", "deep-flow", "duplicate-key", "stop-grace-inf", "set-huge-int"])
@pytest.mark.parametrize("verb", ["validate", "submit"])
def test_raw_bad_files_through_the_console_script(tmp_path: Path, worker: Any, verb: str, data: bytes,
                                                  sets: list[str], must: list[str]) -> None:
    exe = Path(sys.executable).parent / "offload-jobs"
    path = tmp_path / "job.yaml"
    path.write_bytes(data)
    args = [str(exe), verb, str(path)] + (["-d"] if verb == "submit" else [])
    for s in sets:
        args += ["--set", s]
    env = {k: v for k, v in os.environ.items() if not k.startswith("OFFLOAD_JOBS_")}
    env["OFFLOAD_JOBS_HOME"] = str(worker.home)
    res = subprocess.run(args, capture_output=True, text=True, timeout=60, env=env)
    assert res.returncode == 2, res
    assert "Traceback" not in res.stdout + res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    for word in must:
        assert word.replace("{file}", str(path)) in lines[0], (word, lines[0])
