"""The checks a train or infer job passes before torch is even imported.

A missing image, a metadata file without the caption column, an unreadable image, an empty
dataset, a model folder of the wrong family, a LoRA of another family, a malformed prompt option:
each fails the job at once with reason setup_failed and a line naming the file or field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from jobs.runners.data import Item, scan_dataset
from jobs.runners.folders import LoraError, SetupError, detect_family, lora_family
from jobs.runners.prompts import PromptSpec, parse_prompt, read_prompts
from jobs.spec import JobSpec

__all__ = ["Checked", "check_train", "check_infer", "resolve_lora"]


@dataclass
class Checked:
    family: str
    model_dir: Path
    items: list[Item] = field(default_factory=list)
    lora: Path | None = None


def _model(spec: JobSpec) -> tuple[str, Path]:
    model_dir = Path(spec.model.path or "").expanduser().resolve()  # relative paths: from the job's workdir
    return detect_family(model_dir, spec.model.family), model_dir


def _prompts_parse(texts: list[str]) -> None:
    for t in texts:
        parse_prompt(t, PromptSpec(prompt=""))


def check_train(spec: JobSpec) -> Checked:
    t = spec.train
    family, model_dir = _model(spec)
    if not t.dataset:
        raise SetupError("train.dataset: a train job needs a dataset folder")
    dataset = Path(t.dataset).expanduser().resolve()
    items = scan_dataset(dataset, image_column=t.image_column, caption_column=t.caption_column,
                         allow_clips=family == "wan", default_caption=t.default_caption)
    if t.init_lora and not Path(t.init_lora).expanduser().is_file():
        raise LoraError(f"train.init_lora: {t.init_lora} is not a file")
    _prompts_parse(read_prompts(t.sample_prompts, dataset))
    return Checked(family=family, model_dir=model_dir, items=items)


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
    family, model_dir = _model(spec)
    lora = None
    if spec.infer.lora:
        lora = resolve_lora(spec.infer.lora, home)
        made_for = lora_family(lora)
        if made_for is not None and made_for != family:
            raise LoraError(f"infer.lora: {lora} is a {made_for} LoRA; {model_dir} is a {family} model")
    prompts = spec.infer.prompt if isinstance(spec.infer.prompt, list) else [spec.infer.prompt]
    _prompts_parse(prompts)
    return Checked(family=family, model_dir=model_dir, lora=lora)

