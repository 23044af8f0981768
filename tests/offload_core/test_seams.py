"""The engine's seams are typed: each collaborator takes a narrow Protocol (not the whole engine as
``Any``) and reaches no part of the engine its Protocol does not list; ``stats()`` is a typed record."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import typing
from typing import Any, Protocol

import pytest
import torch

from offload_core import OffloadTrainingManager, enable_offload
from offload_core import seams
from offload_core.binding import Binder
from offload_core.masters import Masters
from offload_core.optim_offload import OptimizerOffload
from offload_core.replan import Replanner
from offload_core.stats import EngineStats
from offload_core_test_models import CASES, make_optimizer, train

# each collaborator and the Protocol its __init__ takes
COLLABORATORS = [
    (Binder, seams.BinderHost),
    (Masters, seams.MastersHost),
    (Replanner, seams.ReplanHost),
    (OptimizerOffload, seams.OptimizerHost),
]
IDS = [c.__name__ for c, _ in COLLABORATORS]


def _members(proto: type) -> set[str]:
    return set(proto.__annotations__) | {
        n for n, v in vars(proto).items() if callable(v) and not n.startswith("_")}


def _engine_param(cls: type) -> str:
    params = list(inspect.signature(cls.__init__).parameters)
    return params[1]  # after self


@pytest.mark.parametrize(("cls", "proto"), COLLABORATORS, ids=IDS)
def test_collaborator_takes_a_protocol_not_any(cls: type, proto: type) -> None:
    hints = typing.get_type_hints(cls.__init__)
    engine_hint = hints[_engine_param(cls)]
    assert engine_hint is not Any
    assert engine_hint is proto
    assert issubclass(proto, Protocol)  # type: ignore[arg-type]


def _engine_attrs(cls: type, param: str) -> set[str]:
    """Every attribute the class's code reads off the engine: ``self.e.X``/``self.engine.X``, and
    ``X`` on a local bound to the engine (``e = self.e``, ``e, ts = self.e, ...``, the parameter)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    holder = {"e", "engine"}

    def is_engine(node: ast.AST, local: set[str]) -> bool:
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            return node.attr in holder
        return isinstance(node, ast.Name) and node.id in local

    found: set[str] = set()
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.Lambda)):
            continue
        local = {param} if isinstance(fn, ast.FunctionDef) and fn.name == "__init__" else set()
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                tgt, val = node.targets[0], node.value
                pairs = (zip(tgt.elts, val.elts) if isinstance(tgt, ast.Tuple) and isinstance(val, ast.Tuple)
                         else [(tgt, val)])
                for t, v in pairs:
                    if isinstance(t, ast.Name) and is_engine(v, local):
                        local.add(t.id)
        for node in ast.walk(fn):
            if isinstance(node, ast.Attribute) and is_engine(node.value, local):
                found.add(node.attr)
    return found


@pytest.mark.parametrize(("cls", "proto"), COLLABORATORS, ids=IDS)
def test_collaborator_reaches_only_what_its_protocol_lists(cls: type, proto: type) -> None:
    used = _engine_attrs(cls, _engine_param(cls))
    assert used, "the scan found no engine access: it no longer reads the class"
    listed = _members(proto)
    assert used <= listed, f"{cls.__name__} reaches {sorted(used - listed)}, which {proto.__name__} does not list"
    # narrow: the Protocol lists nothing the collaborator does not use
    assert listed <= used, f"{proto.__name__} lists {sorted(listed - used)}, which {cls.__name__} never uses"


def test_the_engine_satisfies_every_protocol() -> None:
    case = CASES["toy"]
    model = case.build("adapter")
    handle = enable_offload(model, target_device="cpu", enable_optimizer_cpu_offload=True)
    try:
        for _, proto in COLLABORATORS:
            assert isinstance(handle.engine, proto), proto.__name__
    finally:
        handle.remove()


def test_stats_is_the_engines_typed_record() -> None:
    case = CASES["toy"]
    model = case.build("adapter")
    optimizer = make_optimizer(model)
    manager = OffloadTrainingManager(model, target_device="cpu", enable_optimizer_cpu_offload=True)
    handle = manager.handle
    try:
        train(case, model, optimizer, steps=3, after_backward=manager.after_backward)
        record = handle.engine.stats()
        assert isinstance(record, EngineStats)
        out = handle.stats()
        named = [f.name for f in dataclasses.fields(EngineStats) if f.name not in EngineStats.MERGED]
        assert "measured_step_ms" in out  # a timed cycle was read: every field is in the dict
        # the dict's keys are the record's fields, with the store's and the optimizer's own keys merged in
        assert set(out) == set(named) | set(record.store_stats) | set(handle.trainer.stats())
        assert [k for k in out if k in named] == named  # in the record's order
        assert record.store_stats["host_store"] == out["host_store"] == "arena"
        assert out["optimizer_offload"] is True
        for name in named:
            if not name.endswith("_ms") and name not in ("h2d_gbps", "units"):  # timings are read again
                assert out[name] == getattr(record, name), name
    finally:
        handle.remove()


def test_stats_leaves_out_the_cycle_times_until_a_cycle_was_timed() -> None:
    handle = enable_offload(CASES["toy"].build("frozen"), target_device="cpu")
    try:
        out = handle.stats()
        assert handle.engine.stats().measured_step_ms is None
        assert "measured_step_ms" not in out and "predicted_step_ms" not in out
        assert "optimizer_offload" not in out
    finally:
        handle.remove()


def test_renamed_names_keep_their_old_aliases() -> None:
    from offload_core import planner, units

    # "plan" is the planner's decision only; "slot" a SlotRing buffer only
    assert units.UnitLayout is units.UnitPlan and units.UnitTensor is units.TensorSlot
    assert planner.RingPlan is planner.Plan
    handle = enable_offload(CASES["toy"].build("frozen"), target_device="cpu")
    try:
        assert isinstance(handle.engine.layout, units.UnitLayout)
        assert all(isinstance(t, units.UnitTensor) for u in handle.engine.units for t in u.tensors)
    finally:
        handle.remove()
