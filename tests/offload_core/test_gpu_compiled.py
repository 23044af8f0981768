"""compile=True on CUDA (``pytest -m gpu``): the CPU suite's compiled-block checks with Triton kernels.

A tiny Flux transformer with a peft LoRA and checkpointing, offloaded with ``compile=True`` and a
two-slot ring (every step rebinds every block to another slot), against the same model resident
with ``compile_blocks``. Bitwise: the conftest's ``use_deterministic_algorithms(True)`` makes
inductor pick one reduction config instead of benchmarking several, so both compiles emit the same
kernels. The engine compiles first (a later model may reuse its graphs, but not the reverse).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from offload_core import enable_offload
from offload_core.compiled import compile_blocks
from offload_core.quant import fake_quantize
from offload_core_test_models import CASES, make_optimizer

pytestmark = pytest.mark.gpu
CUDA = "cuda"
CASE = CASES["flux"]


def _on(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(CUDA)
    return {k: _on(v) for k, v in x.items()} if isinstance(x, dict) else x


def _train(model: torch.nn.Module, steps: int, record: Any = None) -> list[tuple[torch.Tensor, dict]]:
    opt = make_optimizer(model)
    out = []
    for step in range(steps):
        inputs = _on(CASE.make_inputs(1000 + step))
        loss = CASE.forward(model, inputs).float().pow(2).mean()
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        opt.step()
        opt.zero_grad()
        out.append((loss.detach().clone(), grads))
        if record is not None:
            record()
    return out


def _assert_same(ref: list, got: list) -> None:
    for step, ((lr, gr), (lo, go)) in enumerate(zip(ref, got)):
        assert torch.equal(lr, lo), f"step {step}: loss {lr.item()} != {lo.item()}"
        for name, g in gr.items():
            assert torch.equal(g, go[name]), f"step {step}: grad of {name} differs"


@pytest.mark.parametrize("weight_dtype", [None, "float8_e4m3fn"], ids=["fp32", "fp8"])
def test_compiled_offload_matches_compiled_resident_on_cuda(weight_dtype: str | None) -> None:
    torch._dynamo.reset()
    base = CASE.build("adapter", checkpointing=True)
    ref, off = copy.deepcopy(base), copy.deepcopy(base)
    if weight_dtype is not None:
        fake_quantize(ref, weight_dtype)
    opt_keys = {} if weight_dtype is None else {"weight_dtype": weight_dtype}
    h = enable_offload(off, target_device=CUDA, offload_granularity="block", prefetch=1, compile=True, **opt_keys)
    frames: list[int] = []
    rows: list[dict] = []

    def record() -> None:
        frames.append(int(torch._dynamo.utils.counters["frames"]["total"]))
        rows.append(h.stats())

    got = _train(off, 20, record)
    ref.to(CUDA)
    compile_blocks(ref)
    _assert_same(_train(ref, 20), got)
    assert frames[-1] == frames[0], f"dynamo compiled {frames[-1] - frames[0]} frames after the first step"
    assert rows[0]["compile_graphs"] >= 2 and rows[-1]["recompiles"] == 0
    assert rows[-1]["cache_evictions"] > rows[0]["cache_evictions"] and rows[-1]["slot_count"] == 2
    h.remove()
    torch._dynamo.reset()
