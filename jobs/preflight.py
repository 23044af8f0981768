"""Checks a spec against the worker's machine at submit: the paths it names and its image exist.

A spec can be valid and still unable to run here: a model folder that is not on this disk, a
workdir that was never made, an image dockerd does not have. Those fail at submit (and in
`offload-jobs validate --strict`) with the field named, not minutes later as setup_failed.
Paths of `executor: docker` jobs live inside the container, so only the image is checked there.
A `model.path` that is a hub id (`org/name[@rev]`, not on disk) is fetched by the job; a local one
must be a diffusers folder of a family we run (a single-file checkpoint is refused there: it goes in
`model.transformer`, whose header says its family and layout here, with `model.base` or `model.path`
for the rest).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jobs.errors import SpecError
from jobs.spec import JobSpec

__all__ = ["spec_paths", "preflight"]


def _get(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


# (field, what it must be, kinds it applies to). Runner modules with other fields add theirs here.
PATH_FIELDS: list[tuple[str, str, tuple[str, ...]]] = [
    ("workdir", "dir", ("train", "infer", "shard", "command")),
    ("shard.src", "any", ("shard",)),
    ("model.path", "any", ("train", "infer")),
    ("model.base", "any", ("train", "infer")),
    ("model.transformer", "any", ("train", "infer")),
    ("model.vae", "any", ("train", "infer")),
    ("model.text_encoders", "any", ("train", "infer")),  # a list: each item
    ("train.dataset", "dir", ("train",)),
    ("infer.prompt_file", "any", ("infer",)),
]


def spec_paths(spec: JobSpec) -> list[tuple[str, str, str]]:
    """(field, path, "dir" | "any") for each path the spec names that must exist before it runs.

    A relative path is where the job will find it: under its workdir (the job's cwd)."""
    base = os.path.expanduser(spec.workdir) if isinstance(spec.workdir, str) and spec.workdir else None
    out = []
    for field, what, kinds in PATH_FIELDS:
        if spec.kind not in kinds:
            continue
        value = _get(spec, field)
        if field in ("model.path", "model.base") and _hub_id(value, base):
            continue  # fetched from the hub by the job
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, str) and item:
                path = os.path.expanduser(item)
                if field != "workdir" and base and not os.path.isabs(path):
                    path = os.path.normpath(os.path.join(base, path))
                out.append((field, path, what))
    return out


def _hub_id(value: Any, base: str | None) -> bool:
    from jobs.hub import parse_hub_id

    return isinstance(value, str) and parse_hub_id(value, base if base and not os.path.isabs(value) else None) is not None


def model_layout_error(path: str, field: str = "model.path") -> str | None:
    """Why `path` (which exists) is not a diffusers folder of a family we run; None when it is."""
    from jobs.runners.folders import FamilyError, detect_family  # stdlib only: json and struct

    if os.path.isfile(path):
        kind = "a single-file checkpoint" if path.endswith((".safetensors", ".ckpt", ".pt", ".bin", ".gguf")) else "a file"
        hint = "; a transformer file goes in model.transformer, with model.base a diffusers folder for the rest" \
            if path.endswith(".safetensors") else ""
        return (f"{path} is {kind}; a diffusers model folder (model_index.json, transformer/, vae/, ...) "
                f"or a hub id (org/name) is expected{hint}")
    try:
        detect_family(path, field=field)
    except FamilyError as exc:
        return str(exc).removeprefix(f"{field}: ")
    return None


def transformer_error(spec: JobSpec, path: str, base: str | None) -> str | None:
    """Why the `model.transformer` checkpoint at `path` cannot run (its header alone is read); None when it can."""
    from jobs.runners.errors import RunnerInputError
    from jobs.runners.folders import detect_family
    from jobs.runners.single_file import detect_checkpoint

    try:
        found = detect_checkpoint(path)
        if base is not None:  # a local base: the families must agree (a hub base is checked by the job)
            family = detect_family(base, spec.model.family)
            if found.family != family:
                return f"{path} is a {found.family} transformer; the base {base} is a {family} model"
        elif spec.model.family and spec.model.family != found.family:
            return f"{path} is a {found.family} transformer; model.family says {spec.model.family}"
    except RunnerInputError as exc:
        return str(exc).removeprefix("model.transformer: ")
    return None


def preflight(spec: JobSpec, *, has_image: Callable[[str], bool] | None = None) -> None:
    """Raise SpecError naming the first field whose path or image is not on this machine.

    `has_image(image)` asks the Docker host; it may raise SetupFailed when there is no daemon.
    """
    if spec.executor == "docker":
        image = spec.image or os.environ.get("OFFLOAD_JOBS_DOCKER_IMAGE")
        if not image:
            raise SpecError("image", "executor: docker needs `image` (or OFFLOAD_JOBS_DOCKER_IMAGE on the worker)")
        if has_image is not None:
            try:
                present = has_image(image)
            except Exception as exc:  # no daemon: the same words the executor would use
                raise SpecError("executor", str(exc)) from None
            if not present:
                raise SpecError("image", f"{image} is not on the worker's Docker host; `docker pull {image}` first")
        return
    for field, path, what in spec_paths(spec):
        if what == "dir" and not os.path.isdir(path):
            why = "is not a directory" if os.path.exists(path) else "does not exist"
            raise SpecError(field, f"{path} {why} on the worker")
        if what == "any" and not os.path.exists(path):
            raise SpecError(field, f"{path} does not exist on the worker")
    listed = spec_paths(spec)
    paths = {field: path for field, path, _ in listed}
    for field, path in paths.items():  # every path is there: is the model one we can load?
        if field in ("model.path", "model.base"):
            why = model_layout_error(path, field)
            if why:
                raise SpecError(field, why)
    if "model.transformer" in paths:
        why = transformer_error(spec, paths["model.transformer"], paths.get("model.base") or paths.get("model.path"))
        if why:
            raise SpecError("model.transformer", why)
    encoders = [path for field, path, _ in listed if field == "model.text_encoders"]
    base = paths.get("model.base") or paths.get("model.path")
    if (encoders or "model.vae" in paths) and base is not None:  # a hub base: checked by the job
        from jobs.runners.component_files import check_parts
        from jobs.runners.errors import RunnerInputError
        from jobs.runners.folders import detect_family

        try:
            vae = paths.get("model.vae")
            check_parts(detect_family(base, spec.model.family), base, [Path(p) for p in encoders],
                        Path(vae) if vae else None)
        except RunnerInputError as exc:
            field, _, why = str(exc).partition(": ")
            raise SpecError(field, why) from None
