"""Prompts with inline options, as in musubi-tuner's and kohya's sample files (no torch here):

    a red fox in snow --w 768 --h 512 --seed 3 --steps 20 --guidance 4 --n blurry, low quality --f 17

Sizes are bounded as the spec's own fields are (``--w``/``--h`` 8..MAX_SIDE, ``--f`` 1..MAX_FRAMES):
a prompt cannot ask for what `infer.width` may not.
"""

from __future__ import annotations

import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from jobs.spec_runners import MAX_FRAMES, MAX_SIDE
from jobs.runners.errors import PromptError  # on the tree drawn in jobs.errors

__all__ = ["PromptError", "PromptSpec", "parse_prompt", "read_prompts"]

_FLAGS = {"--w": "width", "--h": "height", "--seed": "seed", "--steps": "steps", "--guidance": "guidance",
          "--n": "negative", "--f": "frames"}
_BOUNDS = {"width": (8, MAX_SIDE), "height": (8, MAX_SIDE), "frames": (1, MAX_FRAMES), "steps": (1, 10**9),
           "seed": (0, 2**63 - 1)}


@dataclass
class PromptSpec:
    prompt: str
    width: int = 1024
    height: int = 1024
    seed: int = 0
    steps: int = 28
    guidance: float = 3.5
    negative: str = ""
    frames: int = 1
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("extra")
        return d


def parse_prompt(text: str, defaults: PromptSpec) -> PromptSpec:
    """`a cat --w 512 --seed 3` -> PromptSpec; unknown `--x` words stay in the prompt."""
    spec = PromptSpec(**{k: v for k, v in defaults.as_dict().items()})
    parts = text.split(" --")
    spec.prompt = parts[0].strip()
    for part in parts[1:]:
        flag, _, value = part.partition(" ")
        attr = _FLAGS.get("--" + flag.strip())
        if attr is None:
            spec.prompt += " --" + part
            continue
        value = value.strip()
        try:
            if attr in ("width", "height", "seed", "steps", "frames"):
                setattr(spec, attr, int(value))
            elif attr == "guidance":
                spec.guidance = float(value)
            else:
                spec.negative = " ".join(shlex.split(value)) if value.startswith(("'", '"')) else value
        except ValueError:
            raise PromptError(f"prompt {text!r}: --{flag.strip()} needs a number, got {value!r}") from None
        lo, hi = _BOUNDS.get(attr, (None, None))
        if lo is not None and not lo <= getattr(spec, attr) <= hi:
            raise PromptError(f"prompt {text[:200]!r}: --{flag.strip()} {getattr(spec, attr)} is outside {lo}..{hi}")
    return spec


def read_prompts(source: str | list[str] | None, base_dir: Path | None = None) -> list[str]:
    """A list of prompts, or a file of them (one per line; # comments and blank lines skipped)."""
    if source is None:
        return []
    if isinstance(source, list):
        return [p for p in source if p.strip()]
    path = Path(source).expanduser()
    if not path.is_absolute() and base_dir is not None and (base_dir / path).is_file():
        path = base_dir / path
    if path.is_file():
        from jobs.runners.data import read_text

        lines = read_text(path, PromptError).splitlines()
        return [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
    return [source]
