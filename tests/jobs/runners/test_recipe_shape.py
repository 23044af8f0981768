"""The train runner is a recipe class (torchtune's shape) and no function in jobs/runners/ passes 80 lines."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_no_function_in_the_runners_is_over_80_lines() -> None:
    long = []
    for path in sorted((REPO / "jobs" / "runners").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > 80:
                    long.append(f"{path.name}:{node.name} ({lines} lines)")
    assert long == []


def test_the_train_recipe_has_the_recipe_steps() -> None:
    from jobs.runners.train import TrainRecipe

    for name in ("setup", "train_step", "save_checkpoint", "sample", "log", "run"):
        assert callable(getattr(TrainRecipe, name, None)), name
