"""Test matrices that run whole under `pytest -m slow` and as a pairwise cover by default.

A parametrized equality test over, say, families x checkpointing x accumulation multiplies its cost
by every axis. Bugs come from one value or from two interacting; so the default run keeps a set of
combinations in which every pair of values of any two axes meets at least once (checked here, at
collection), and the rest carry the `slow` marker.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import pytest


def matrix(axes: Sequence[Sequence[Any]], default: set[tuple[Any, ...]], ident: Callable[..., str]) -> list[Any]:
    """pytest params for the product of `axes`; those not in `default` are marked slow."""
    combos = list(itertools.product(*axes))
    unknown = default - set(combos)
    assert not unknown, f"default combinations not in the matrix: {sorted(unknown)}"
    for i, j in itertools.combinations(range(len(axes)), 2):
        need = {(a, b) for a in axes[i] for b in axes[j]}
        have = {(c[i], c[j]) for c in default}
        assert need <= have, f"the default combinations miss the pairs {sorted(need - have)} of axes {i} and {j}"
    return [pytest.param(*c, id=ident(*c), marks=() if c in default else pytest.mark.slow) for c in combos]


def ckpt_id(checkpointing: bool) -> str:
    return "ckpt" if checkpointing else "no_ckpt"
