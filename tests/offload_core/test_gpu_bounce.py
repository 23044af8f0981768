"""GPU acceptance for the bounce store (``pytest -m gpu``): pageable weights through a pinned ring.

Outputs and LoRA training losses under ``pinned_limit`` equal the resident model's bit for bit
(bf16, and fp8 storage widened on the device by the issuer thread), every unit spans several
chunks of the ring, and the threads end with ``remove()``; with the Python ring and the native one
(``OFFLOAD_BOUNCE_RING=native``: the fills in pthreads, each chunk's copy queued through the driver
API on the engine's copy stream).
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch

import offload_core.bounce as bounce
from offload_core import enable_offload
from offload_core.quant import fake_quantize
from offload_core_test_models import CASES, DiT, add_dit_lora

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("no_cudnn_sdp", "ring_kind")]
CUDA = "cuda"



@pytest.fixture(autouse=True)
def _small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bounce, "DEFAULT_CHUNK", 64 << 10)  # 64 KiB chunks: a unit is many chunks
    monkeypatch.delenv(bounce.PINNED_LIMIT_ENV, raising=False)


@pytest.mark.parametrize("ckpt", [False, True], ids=["no_ckpt", "ckpt"])
def test_lora_training_through_the_ring_is_bitwise(ckpt: bool, ring_kind: str) -> None:
    from offload_core import OffloadTrainingManager

    torch.manual_seed(0)
    ref = DiT(128, 4, 4, ckpt)
    add_dit_lora(ref, 4)
    off = copy.deepcopy(ref)
    ref.to(CUDA)
    mgr = OffloadTrainingManager(off, CUDA, offload_granularity="block", pinned_limit="256KiB")
    assert mgr.stats()["host_store"] == "bounce"
    assert mgr.stats()["bounce_fill_copy"].endswith("native ring") == (ring_kind == "native")
    opt_r = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-3)
    opt_o = torch.optim.AdamW([p for p in off.parameters() if p.requires_grad], lr=1e-3)
    for step in range(10):
        g = torch.Generator(device=CUDA).manual_seed(step)
        x = torch.randn(2, 64, 128, device=CUDA, generator=g)
        t = torch.randn(2, 64, 128, device=CUDA, generator=g)
        losses = []
        for m, opt in ((ref, opt_r), (off, opt_o)):
            loss = torch.nn.functional.mse_loss(m(x), t)
            loss.backward()
            if m is off:
                mgr.after_backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        assert torch.equal(losses[0], losses[1]), f"step {step}: {losses[0].item()} != {losses[1].item()}"
    mgr.remove()


@pytest.mark.parametrize("use_streams", [True, False], ids=["streams", "no_streams"])
@pytest.mark.parametrize("weight_dtype", [None, "float8_e4m3fn"], ids=["bf16", "fp8"])
def test_inference_through_the_ring_is_bitwise(weight_dtype: str | None, use_streams: bool) -> None:
    case = CASES["flux"]
    ref = case.build("frozen")
    off = copy.deepcopy(ref)
    if weight_dtype:
        fake_quantize(ref, weight_dtype)
    ref.to(CUDA)
    # under the streamed bytes (fp8 halves them): a ring of four 16 KiB buffers
    h = enable_offload(off, target_device=CUDA, offload_granularity="block", pinned_limit="64KiB",
                       weight_dtype=weight_dtype, num_copy_threads=4, use_streams=use_streams)
    assert h.stats()["host_store"] == "bounce"
    with torch.no_grad():
        for seed in range(4):
            inputs = {k: v.to(CUDA) if isinstance(v, torch.Tensor) else v for k, v in case.make_inputs(seed).items()}
            assert torch.equal(case.forward(ref, inputs), case.forward(off, inputs)), f"pass {seed}"
    # the issuer thread fills the prefetch for the next call after the last output is read (h2d_bytes
    # counted it when it was asked for): let it be filled before reading (583,296 < 584,576 without)
    h.engine.synchronize()
    st = h.stats()
    assert st["bounce_pinned"] is True and st["bounce_fill_bytes"] >= st["h2d_bytes"] > 2 * st["bounce_ring_bytes"]
    h.remove()
    assert not [t for t in threading.enumerate() if t.name.startswith("bounce-")]
    assert not bounce.native_fill_threads()
