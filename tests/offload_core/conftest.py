"""Shared set-up for the offload_core CPU tests.

The models live in tests/_helpers/offload_core_test_models.py (on sys.path through pytest's
`pythonpath` option): a name no other folder's module shares.
"""

from __future__ import annotations

from typing import Iterator

import pytest
import torch

@pytest.fixture(scope="module", autouse=True)
def _one_intra_op_thread(request: pytest.FixtureRequest) -> Iterator[None]:
    # The models are tiny: with several OpenMP threads on a shared 2-core machine the threads spin at
    # barriers and the suite ran up to 9x slower (726 s vs 81 s). One thread is faster and steady.
    # The GPU modules pack gigabytes on the host: they keep every thread.
    if request.module.__name__.startswith("test_gpu"):
        yield
        return
    was = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(was)


@pytest.fixture(autouse=True)
def _deterministic() -> Iterator[None]:
    # Bitwise comparisons need the same kernels on both sides; float32 throughout.
    was = torch.are_deterministic_algorithms_enabled()
    dtype = torch.get_default_dtype()
    torch.use_deterministic_algorithms(True)
    torch.set_default_dtype(torch.float32)
    yield
    torch.use_deterministic_algorithms(was)
    torch.set_default_dtype(dtype)


@pytest.fixture
def no_cudnn_sdp() -> Iterator[None]:
    """GPU training tests: torch 2.11 + cuDNN 9.19 (the H200 image) break cuDNN's SDPA backward for
    bf16 head_dim 128 (torch issue 196678, resident too); flash and memory-efficient attention take over."""
    was = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)
    yield
    torch.backends.cuda.enable_cudnn_sdp(was)


@pytest.fixture(params=["python", "native"])
def ring_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The bounce store's two rings (bounce.py): the Python one and the native one, where it builds."""
    import offload_core.bounce as bounce
    from offload_core import streamcopy

    if request.param == "native" and streamcopy.load_ring()[0] is None:
        pytest.skip(f"the native ring does not build here: {streamcopy.load_ring()[1]}")
    monkeypatch.setenv(bounce.BOUNCE_RING_ENV, request.param)
    return request.param
