"""The checks a train or infer job passes before torch is even imported.

A missing image, a metadata file without the caption column, an unreadable image, an empty
dataset, a model folder of the wrong family, a LoRA of another family, a malformed prompt option,
a size (resolution x frames x batch) this machine's memory cannot hold: each fails the job at once
with reason setup_failed and a line naming the file or field.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from jobs.runners.data import Item, scan_dataset
from jobs.runners.errors import CheckpointError, PromptError
from jobs.runners.folders import LoraError, SetupError, check_lora_family, detect_family
from jobs.runners.prompts import PromptSpec, parse_prompt, read_prompts
from jobs.spec import JobSpec

__all__ = ["Checked", "check_train", "check_infer", "infer_prompts", "resolve_lora", "host_memory", "check_size", "HOST_BYTES_PER_PIXEL"]

# Host bytes that one pixel of one frame can take at once while a job renders or trains on it: the
# float32 RGB image (12), its latents, and the VAE's activations at full resolution. An estimate
# on the safe side: it refuses only what could not fit, not what is merely slow.
HOST_BYTES_PER_PIXEL = 64


@dataclass
class Checked:
    family: str
    model_dir: Path
    items: list[Item] = field(default_factory=list)
    lora: Path | None = None
    transformer: Path | None = None  # model.transformer: a checkpoint converted at load (jobs.runners.convert)
    parts: dict[str, Path] = field(default_factory=dict)  # model.text_encoders / model.vae: pipeline attribute -> file
    prompts: list[str] = field(default_factory=list)  # infer: infer.prompt, then infer.prompt_file's lines


def _model(spec: JobSpec) -> tuple[str, Path, Path | None, dict[str, Path]]:
    """(family, the diffusers folder, the model.transformer checkpoint or None, the text encoder and VAE files)."""
    from jobs.hub import resolve_model_path
    from jobs.runners.component_files import check_parts

    m = spec.model
    field = "model.base" if m.base else "model.path"
    skip = ("transformer",) if m.transformer is not None else ()  # its weights come from model.transformer
    skip += _given_as_files(m.text_encoders or [], m.vae)  # and theirs from their files: a hub base fetches configs
    # a hub id: fetched here
    path = resolve_model_path(m.base or m.path, os.environ.get("OFFLOAD_JOBS_RUN_DIR"), configs_only=skip)
    model_dir = Path(path or "").expanduser().resolve()  # relative paths: from the job's workdir
    family = detect_family(model_dir, m.family, field=field)
    files = [Path(f).expanduser().resolve() for f in m.text_encoders or []]
    vae = Path(m.vae).expanduser().resolve() if m.vae else None
    for f, name in [*((f, "model.text_encoders") for f in files), *([(vae, "model.vae")] if vae else [])]:
        if not f.is_file():
            raise CheckpointError(f"{name}: {f} is not a file")
    parts = check_parts(family, model_dir, files, vae)
    if m.transformer is None:
        return family, model_dir, None, parts
    from jobs.runners.single_file import detect_checkpoint

    found = detect_checkpoint(Path(m.transformer).expanduser().resolve())
    if found.family != family:
        raise CheckpointError(f"model.transformer: {found.path} is a {found.family} transformer; {field} {model_dir} "
                              f"is a {family} model")
    return family, model_dir, found.path, parts


def _given_as_files(text_encoders: list[str], vae: str | None) -> tuple[str, ...]:
    """The pipeline parts whose weights come from files (what a hub base need not fetch but the config of)."""
    from jobs.runners.component_files import ROLES, identify

    roles = [identify(Path(f).expanduser()).role for f in text_encoders]
    return tuple(ROLES[r][1] for r in roles if r in ROLES) + (("vae",) if vae else ())


def host_memory() -> int:
    """This machine's memory, or the job's cgroup limit (a container, a systemd scope) when lower."""
    import psutil

    total = int(psutil.virtual_memory().total)
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            total = min(total, int(limit))
    except (OSError, ValueError):
        pass
    return total


def _gib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB"


def check_size(what: str, shape: str, pixels: int, frames: int = 1, batch: int = 1, memory: int | None = None) -> None:
    """Refuse a size whose pixels alone would take more than this machine's memory (SetupError naming ``what``)."""
    memory = host_memory() if memory is None else memory
    need = pixels * frames * batch * HOST_BYTES_PER_PIXEL
    if need > memory:
        shape += (f" x {frames} frames" if frames > 1 else "") + (f", {batch} at once" if batch > 1 else "")
        raise SetupError(f"{what}: {shape} needs about {_gib(need)} of host memory; this machine has {_gib(memory)}")


def _prompts_parse(texts: list[str], defaults: PromptSpec | None = None, where: str = "") -> list[PromptSpec]:
    out = []
    for t in texts:
        p = parse_prompt(t, defaults or PromptSpec(prompt=""))
        if where and p.width > 0 and p.height > 0:
            check_size(f"{where} {t[:80]!r}", f"{p.width}x{p.height}", p.width * p.height, p.frames)
        out.append(p)
    return out


def check_train(spec: JobSpec) -> Checked:
    t = spec.train
    family, model_dir, transformer, parts = _model(spec)
    if not t.dataset:
        raise SetupError("train.dataset: a train job needs a dataset folder")
    dataset = Path(t.dataset).expanduser().resolve()
    video = family == "wan"
    check_size("train.max_pixels" + (" x train.num_frames" if video else "") + " x train.batch_size",
               f"{t.max_pixels:,} pixels", t.max_pixels, t.num_frames if video else 1, t.batch_size)
    items = scan_dataset(dataset, image_column=t.image_column, caption_column=t.caption_column,
                         allow_clips=video, default_caption=t.default_caption)
    if t.init_lora:
        init = Path(t.init_lora).expanduser()
        if not init.is_file():
            raise LoraError(f"train.init_lora: {t.init_lora} is not a file")
        check_lora_family(init, family, "train.init_lora", model_dir)
    _prompts_parse(read_prompts(t.sample_prompts, dataset),
                   PromptSpec(prompt="", width=t.sample_width or 0, height=t.sample_height or 0,
                              frames=t.num_frames if video else 1), "train.sample_prompts")
    return Checked(family=family, model_dir=model_dir, items=items, transformer=transformer, parts=parts)


def resolve_lora(ref: str, home: Path) -> Path:
    """A .safetensors path, a folder holding one, or a job id (its outputs/ folder)."""
    p = Path(ref).expanduser()
    if not p.exists() and (home / "runs" / ref).is_dir():
        p = home / "runs" / ref / "outputs"
        if not p.is_dir():
            raise LoraError(f"infer.lora: job {ref} has no outputs/ folder")
    if p.is_dir():
        files = sorted(p.glob("*.safetensors"))
        preferred = [f for f in files if f.name == "lora.safetensors"]
        if not files:
            raise LoraError(f"infer.lora: no .safetensors file in {p} (did the train job finish?)")
        if len(files) > 1 and not preferred:
            raise LoraError(f"infer.lora: {p} holds {len(files)} .safetensors files; name one")
        return (preferred or files)[0]
    if not p.is_file():
        raise LoraError(f"infer.lora: {ref} is neither a file, a folder, nor a job id with outputs")
    return p.resolve()


def check_infer(spec: JobSpec, home: Path) -> Checked:
    family, model_dir, transformer, parts = _model(spec)
    lora = None
    if spec.infer.lora:
        lora = resolve_lora(spec.infer.lora, home)
        check_lora_family(lora, family, "infer.lora", model_dir)
    i = spec.infer
    frames = i.num_frames if family == "wan" else 1
    check_size("infer.width x infer.height" + (" x infer.num_frames" if frames > 1 else ""), f"{i.width}x{i.height}",
               i.width * i.height, frames)
    prompts = infer_prompts(spec)
    _prompts_parse(prompts, PromptSpec(prompt="", width=i.width, height=i.height, frames=frames), "infer.prompt")
    return Checked(family=family, model_dir=model_dir, lora=lora, transformer=transformer, parts=parts,
                   prompts=prompts)


def infer_prompts(spec: JobSpec) -> list[str]:
    """infer.prompt (a string or a list), then the lines of infer.prompt_file (relative to the workdir)."""
    i = spec.infer
    prompts = list(i.prompt) if isinstance(i.prompt, list) else [i.prompt]
    if not i.prompt_file:
        return prompts
    path = Path(i.prompt_file).expanduser()
    if not path.is_absolute() and spec.workdir:
        path = Path(spec.workdir).expanduser() / path
    if not path.is_file():
        raise PromptError(f"infer.prompt_file: {path}: no such file")
    lines = read_prompts(str(path))
    if not lines:
        raise PromptError(f"infer.prompt_file: {path} holds no prompt")
    return [p for p in prompts if p.strip()] + lines

