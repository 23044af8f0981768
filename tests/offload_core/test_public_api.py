"""offload_core's public names are complete and importable (httpx-style)."""

from __future__ import annotations

import __future__
import inspect

import offload_core
import offload_core.errors
from offload_core_test_models import CASES

REQUIRED = {"enable_offload", "enable_pipeline_offload", "OffloadConfig", "OffloadHandle", "OffloadTrainingManager"}


def test_all_names_importable() -> None:
    assert isinstance(offload_core.__all__, (list, tuple))
    assert len(set(offload_core.__all__)) == len(offload_core.__all__), "duplicates in __all__"
    for name in offload_core.__all__:
        assert hasattr(offload_core, name), f"offload_core.__all__ lists {name}, which is not importable"


def test_all_includes_the_api_and_every_error() -> None:
    missing = (REQUIRED | set(offload_core.errors.__all__)) - set(offload_core.__all__)
    assert not missing, f"missing from offload_core.__all__: {sorted(missing)}"


def test_every_public_attribute_is_in_all() -> None:
    public = {
        n for n in dir(offload_core)
        if not n.startswith("_")
        and not inspect.ismodule(getattr(offload_core, n))
        and not isinstance(getattr(offload_core, n), __future__._Feature)  # `annotations`
    }
    extra = public - set(offload_core.__all__)
    assert not extra, f"public names not in __all__: {sorted(extra)}"


def test_errors_share_one_base() -> None:
    for name in offload_core.errors.__all__:
        assert issubclass(getattr(offload_core, name), offload_core.OffloadError), name


def test_signatures() -> None:
    params = inspect.signature(offload_core.enable_offload).parameters
    assert list(params)[:2] == ["model", "config"]
    assert any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()), "no **overrides"
    mgr = inspect.signature(offload_core.OffloadTrainingManager).parameters
    for name in ("model", "target_device", "enable_optimizer_cpu_offload", "cpu_offload_split_threshold"):
        assert name in mgr, f"OffloadTrainingManager lacks {name}"
    assert mgr["enable_optimizer_cpu_offload"].default is False
    assert mgr["cpu_offload_split_threshold"].default is None


def test_enable_offload_returns_a_handle() -> None:
    case = CASES["toy"]
    model = case.build("frozen")
    handle = offload_core.enable_offload(model, target_device="cpu")
    assert isinstance(handle, offload_core.OffloadHandle)
    assert callable(handle.stats) and callable(handle.remove)
    handle.remove()
