"""The job spec: kinds, defaults, errors that name the field (and line), overrides, schema, templates."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jobs.errors import SpecError
from jobs.spec import KINDS, JobSpec, apply_overrides, json_schema, load_spec, parse_spec, template

REPO = Path(__file__).resolve().parents[2]


def test_minimal_specs_per_kind() -> None:
    assert parse_spec({"kind": "command", "command": "echo hi"}).gpus == 0
    assert parse_spec({"kind": "command", "command": ["echo", 1]}).command == ["echo", "1"]
    assert parse_spec({"kind": "shard", "shard": {"src": "a", "dst": "b"}}).gpus == 0
    t = parse_spec({"kind": "train", "model": {"path": "/m"}})
    assert t.gpus == 1 and t.train.steps == 1000 and t.retry.on == ["worker_lost"] and t.retry.max_attempts == 3
    assert parse_spec({"kind": "infer", "model": {"path": "/m"}, "resources": {"gpus": 0}}).gpus == 0


@pytest.mark.parametrize("data, field", [
    ({"kind": "command"}, "command"),
    ({"kind": "command", "command": "  "}, "command"),
    ({"kind": "command", "command": []}, "command"),
    ({"kind": "shard"}, "shard.src"),
    ({"kind": "shard", "shard": {"src": "a"}}, "shard.dst"),
    ({"kind": "train"}, "model.path"),
    ({"kind": "infer", "model": {}}, "model.path"),
    ({}, "kind"),
    ({"kind": "command", "command": "x", "retry": {"on": ["cancelled"]}}, "retry.on"),
])
def test_what_a_kind_needs(data: dict, field: str) -> None:
    with pytest.raises(SpecError) as e:
        parse_spec(data)
    assert e.value.field == field
    assert field.split(".")[0] in str(e.value)


def test_sizes_and_durations_are_normalised() -> None:
    s = parse_spec({"kind": "command", "command": "x", "offload": {"vram_budget": "7.5GiB", "max_memory": "512MB"},
                    "resources": {"shm_size": 1024}, "limits": {"max_duration": "1h30m", "stop_grace": "500ms"}})
    assert s.offload.vram_budget == int(7.5 * 1024**3) and s.offload.max_memory == 512 * 10**6
    assert s.resources.shm_size == 1024
    assert (s.limits.max_duration, s.limits.stop_grace) == (5400.0, 0.5)
    assert parse_spec({"kind": "command", "command": "x", "limits": {"max_duration": 90}}).limits.max_duration == 90.0
    assert parse_spec({"kind": "command", "command": "x", "limits": {"max_duration": "90"}}).limits.max_duration == 90.0
    with pytest.raises(SpecError, match="not a duration"):
        parse_spec({"kind": "command", "command": "x", "limits": {"max_duration": "1h30"}})
    assert s.offload.engine_kwargs() == {"vram_budget": int(7.5 * 1024**3), "max_memory": 512 * 10**6}


def test_env_values_become_strings() -> None:
    assert parse_spec({"kind": "command", "command": "x", "env": {"A": 1, "B": True, "C": "c"}}).env == {"A": "1", "B": "1", "C": "c"}


def test_yaml_errors_name_the_line_and_field(tmp_path: Path) -> None:
    f = tmp_path / "job.yaml"
    f.write_text("kind: train\nmodel:\n  path: /m\ntrain:\n  steps: 10\n  learning_rate: -1\n")
    with pytest.raises(SpecError) as e:
        load_spec(f)
    assert (e.value.field, e.value.line, e.value.file) == ("train.learning_rate", 6, str(f))
    assert str(e.value).startswith(f"{f}:6: train.learning_rate:")

    f.write_text("kind: command\ncommand: x\noffload:\n  offload_granularty: block\n")
    with pytest.raises(SpecError) as e:
        load_spec(f)
    assert e.value.field == "offload.offload_granularty" and e.value.line == 4
    assert "did you mean `offload_granularity`" in str(e.value)

    f.write_text("kind: command\ncommand: [unclosed\n")
    with pytest.raises(SpecError) as e:
        load_spec(f)
    assert e.value.field is None and e.value.line is not None and "malformed YAML" in str(e.value)

    with pytest.raises(SpecError, match="cannot read"):
        load_spec(tmp_path / "missing.yaml")


def test_retry_on_key_is_not_a_yaml_boolean() -> None:
    s = parse_spec("kind: command\ncommand: x\nretry:\n  on: [worker_lost, exit_nonzero]\n")
    assert s.retry.on == ["worker_lost", "exit_nonzero"]


def test_overrides(tmp_path: Path) -> None:
    data = {"kind": "train", "model": {"path": "/m"}, "train": {"learning_rate": 1e-4}}
    out = apply_overrides(data, ["train.learning_rate=5e-5", "offload.vram_budget=7.5GiB", "train.gradient_checkpointing=false",
                                 "name=my run", "env.X=on", "outputs=[a, b]"])
    assert data["train"] == {"learning_rate": 1e-4}  # the input is not modified
    s = parse_spec(out)
    assert s.train.learning_rate == 5e-5 and s.offload.vram_budget == int(7.5 * 2**30) and s.train.gradient_checkpointing is False
    assert s.name == "my run" and s.env == {"X": "on"} and s.outputs == ["a", "b"]
    f = tmp_path / "t.yaml"
    f.write_text("kind: train\nmodel: {path: /m}\n")
    assert load_spec(f, ["train.steps=7"]).train.steps == 7
    with pytest.raises(SpecError) as e:
        load_spec(f, ["train.steps=0"])
    assert e.value.field == "train.steps"
    for bad in ["novalue", "=3", "a..b=1"]:
        with pytest.raises(SpecError, match="key.sub=value"):
            apply_overrides({}, [bad])
    with pytest.raises(SpecError) as e:
        apply_overrides({"model": "str"}, ["model.path=x"])
    assert e.value.field == "model"


def test_json_schema_forbids_unknown_fields() -> None:
    schema = json_schema()
    assert schema["additionalProperties"] is False
    assert set(schema["properties"]) >= {"kind", "name", "model", "offload", "train", "infer", "shard", "command",
                                         "resources", "retry", "limits", "env", "outputs", "priority", "executor", "image"}
    offload = schema["$defs"]["OffloadSpec"]
    assert offload["additionalProperties"] is False
    assert set(offload["properties"]) >= {"target_device", "cpu_offload", "offload_granularity", "offload_ratio",
                                          "vram_budget", "prefetch", "lazy_load", "offload_to_disk", "shard_dir",
                                          "num_disk_workers", "max_memory", "enable_optimizer_cpu_offload", "weight_dtype"}


@pytest.mark.parametrize("kind", KINDS)
def test_templates_are_valid_and_say_how_to_run(kind: str) -> None:
    text = template(kind)
    head = text.splitlines()[0]
    assert head.startswith("#")
    assert "offload-jobs submit" in text.split("kind:")[0] and "--set" in text.split("kind:")[0]
    assert parse_spec(text).kind == kind


def test_unknown_template_kind() -> None:
    with pytest.raises(SpecError) as e:
        template("bake")
    assert e.value.field == "kind"


def test_example_command_spec() -> None:
    s = load_spec(REPO / "examples" / "command.yaml")
    assert s.kind == "command" and "OFFLOAD_JOBS_METRICS" in s.command


def test_spec_and_client_imports_stay_light() -> None:
    code = ("import sys, jobs, jobs.client, jobs.spec, jobs.errors; "
            "print(sorted(m for m in ('torch','fastapi','sqlalchemy','uvicorn','docker','diffusers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True).stdout
    assert out.strip() == "[]"


# ------------------------------------------------------------------ generated bad specs

_BAD: dict[str, st.SearchStrategy] = {
    "kind": st.text(min_size=1, max_size=8).filter(lambda s: s not in KINDS),
    "name": st.integers() | st.text(min_size=201, max_size=240),
    "priority": st.floats(allow_nan=False, allow_infinity=False).filter(lambda f: f != int(f)) | st.just("high"),
    "executor": st.sampled_from(["kubernetes", "proc", "", "Docker"]),
    "train.learning_rate": st.floats(max_value=0, allow_nan=False) | st.just("fast"),
    "train.steps": st.integers(max_value=0),
    "train.gradient_checkpointing": st.sampled_from(["maybe", [1], {"a": 1}]),
    "infer.height": st.integers(max_value=7),
    "infer.guidance": st.floats(max_value=-0.001, allow_nan=False, allow_infinity=False),
    "offload.offload_granularity": st.text(max_size=6).filter(lambda s: s not in ("leaf", "block", "phase", "auto")),
    "offload.offload_ratio": st.floats(min_value=1.0001, allow_nan=False) | st.floats(max_value=-0.0001, allow_nan=False),
    "offload.vram_budget": st.sampled_from(["7.5Gx", "lots", "-1GiB", "", True]) | st.integers(max_value=-1),
    "offload.prefetch": st.integers(max_value=-1),
    "offload.num_disk_workers": st.integers(max_value=0),
    "resources.gpus": st.integers(max_value=-1),
    "resources.shm_size": st.sampled_from(["big", "1Qb", False]),
    "limits.max_duration": st.sampled_from(["soon", "10 parsecs", "1h30", 0, -5]),
    "limits.stop_grace": st.integers(max_value=-1) | st.just("later"),
    "retry.max_attempts": st.integers(max_value=0),
    "retry.on": st.lists(st.sampled_from(["oops", "oom", "murdered"]), min_size=1, max_size=3),
    "env": st.sampled_from([["A=1"], "A=1", 5]),
    "env.X": st.sampled_from([[1], {"a": 1}, None]),
    "model": st.sampled_from(["flux", 3, ["a"]]),
    "command": st.sampled_from([5, {"a": 1}, [["nested"]], True]),
}
_SECTIONS = ["", "model", "offload", "train", "infer", "shard", "resources", "retry", "limits"]


def _set(data: dict, path: str, value: object) -> dict:
    out = apply_overrides(data, [])
    cur = out
    parts = path.split(".")
    for p in parts[:-1]:
        cur = cur.setdefault(p, {})
    cur[parts[-1]] = value
    return out


@st.composite
def bad_specs(draw: st.DrawFn) -> tuple[dict, str]:
    base = draw(st.sampled_from([
        {"kind": "command", "command": "echo hi"},
        {"kind": "train", "model": {"path": "/m"}},
        {"kind": "infer", "model": {"path": "/m"}},
        {"kind": "shard", "shard": {"src": "a", "dst": "b"}},
    ]))
    if draw(st.booleans()):
        path = draw(st.sampled_from(sorted(_BAD)))
        return _set(base, path, draw(_BAD[path])), path
    section = draw(st.sampled_from(_SECTIONS))
    key = draw(st.from_regex(r"[a-z][a-z_]{0,12}", fullmatch=True))
    allowed = JobSpec.model_fields if not section else JobSpec.model_fields[section].annotation.model_fields
    if key in allowed:
        key += "_x"
    path = f"{section}.{key}" if section else key
    return _set(base, path, draw(st.integers() | st.text(max_size=5))), path


@settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(bad_specs())
def test_200_generated_bad_specs_name_their_field(case: tuple[dict, str]) -> None:
    data, path = case
    with pytest.raises(SpecError) as e:
        parse_spec(data)
    assert e.value.field is not None and (e.value.field == path or e.value.field.startswith(path + "[")), (
        path, str(e.value))
    assert path.split(".")[-1] in str(e.value)
    assert "Traceback" not in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("train, field", [
    ({"optimizer": "sgd"}, "train.optimizer"),
    ({"caption_dropout": 1.5}, "train.caption_dropout"),
    ({"ema": 1.0}, "train.ema"),
    ({"validation": {"items": 0}}, "train.validation.items"),
    ({"validation": {"timesteps": [0.0]}}, "train.validation.timesteps[0]"),
    ({"log_to": "mlflow"}, "train.log_to[0]"),
])
def test_trainer_options_name_the_field(train: dict, field: str) -> None:
    with pytest.raises(SpecError) as e:
        parse_spec({"kind": "train", "model": {"path": "m"}, "train": train})
    assert e.value.field == field


def test_trainer_options_parse() -> None:
    t = parse_spec({"kind": "train", "model": {"path": "m"}, "train": {
        "trigger_word": "sks", "default_caption": "a photo", "caption_dropout": 0.1, "optimizer": "adafactor",
        "ema": 0.999, "validation": {"items": ["a.png"], "every": 10}, "log_to": "tensorboard"}}).train
    assert (t.optimizer, t.ema, t.log_to, t.validation.items, t.validation.timesteps) == (
        "adafactor", 0.999, ["tensorboard"], ["a.png"], [0.25, 0.5, 0.75])
