"""The train recipe's option parts: held-out items, trigger words, the optimizer by name, extra loggers.

Each is small and read by `TrainRecipe` (jobs/runners/train.py); none holds the recipe's state.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from jobs.runners.data import Item
from jobs.runners.errors import OptimizerError, SetupError
from jobs.spec import JobSpec
from jobs.spec_runners import LOGGERS, OPTIMIZERS, ValidationSpec

__all__ = ["hold_out", "with_trigger", "make_optimizer", "StepLoggers"]

TRIGGER = "[trigger]"


def hold_out(items: list[Item], validation: ValidationSpec | None) -> tuple[list[Item], list[Item]]:
    """(items to train on, held-out items): the last N items, or the named ones."""
    if validation is None:
        return items, []
    if isinstance(validation.items, int):
        if validation.items >= len(items):
            raise SetupError(f"train.validation.items: holds out {validation.items} of the dataset's {len(items)} "
                             "items; leave at least one to train on")
        return items[:-validation.items], items[-validation.items:]
    names = set(validation.items)
    unknown = sorted(names - {it.name for it in items})
    if unknown:
        raise SetupError(f"train.validation.items: {unknown[0]} is not an item of the dataset")
    kept = [it for it in items if it.name not in names]
    if not kept:
        raise SetupError("train.validation.items: holds out every item; leave at least one to train on")
    return kept, [it for it in items if it.name in names]


def with_trigger(caption: str, trigger: str | None) -> str:
    """The caption with the trigger word: in place of [trigger], else in front."""
    if not trigger:
        return caption
    if TRIGGER in caption:
        return caption.replace(TRIGGER, trigger)
    return f"{trigger}, {caption}" if caption else trigger


def make_optimizer(name: str, params: list[torch.nn.Parameter], *, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """train.optimizer by name; a missing library is named with the extra that installs it."""
    module, extra = OPTIMIZERS[name]
    try:
        if name == "adamw8bit":
            import bitsandbytes as bnb

            return bnb.optim.AdamW8bit(params, lr=lr, weight_decay=weight_decay)
        if name == "adafactor":
            from transformers.optimization import Adafactor

            # a fixed learning rate (train.learning_rate and its schedule), not Adafactor's own
            return Adafactor(params, lr=lr, weight_decay=weight_decay, scale_parameter=False, relative_step=False,
                             warmup_init=False)
        if name == "prodigy":
            from prodigyopt import Prodigy

            return Prodigy(params, lr=lr, weight_decay=weight_decay)
    except ImportError:
        raise OptimizerError(f"train.optimizer: {name} needs {module}, not installed on this worker: "
                             f"pip install 'offload-jobs[{extra}]'") from None
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)


class StepLoggers:
    """train.log_to: the step values to tensorboard (event files in <run dir>/tensorboard) and wandb,
    in addition to metrics.jsonl."""

    def __init__(self, names: list[str], run_dir: Path, spec: JobSpec) -> None:
        self.tensorboard: Any = None
        self.wandb: Any = None
        try:
            if "tensorboard" in names:
                from torch.utils.tensorboard import SummaryWriter

                self.tensorboard = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
            if "wandb" in names:
                import wandb

                self.wandb = wandb.init(project="offload-jobs", name=spec.display_name(), dir=str(run_dir),
                                        config=spec.model_dump(mode="json", exclude_unset=True))
        except ImportError as exc:
            missing = next(n for n in names if LOGGERS[n][0] in str(exc) or n in str(exc))
            raise SetupError(f"train.log_to: {missing} is not installed on this worker: "
                             f"pip install 'offload-jobs[{LOGGERS[missing][1]}]'") from None

    def write(self, step: int, values: dict[str, float]) -> None:
        if self.tensorboard is not None:
            for key, value in values.items():
                self.tensorboard.add_scalar(f"train/{key}", value, step)
        if self.wandb is not None:
            self.wandb.log({f"train/{k}": v for k, v in values.items()}, step=step)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()
        self.tensorboard = self.wandb = None
