"""GPU acceptance for the engine (``pytest -m gpu``); skipped cleanly without CUDA."""

from __future__ import annotations

import copy
import gc
import json
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from offload_core import OffloadTrainingManager, enable_offload
from offload_core_test_models import DiT
from offload_core_test_models import add_dit_lora as _lora

pytestmark = pytest.mark.gpu
CUDA = "cuda"


def _frozen_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)


def _train_step(model, x, target, opt, mgr=None) -> torch.Tensor:
    loss = F.mse_loss(model(x).float(), target)
    loss.backward()
    if mgr is not None:
        mgr.after_backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach().clone()  # mse_loss's scalar keeps its whole elementwise buffer as storage


def _fresh() -> None:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


@pytest.mark.parametrize("ckpt", [True, "reentrant", False])
@pytest.mark.parametrize("granularity", ["block", "leaf"])
def test_small_dit_lora_bitwise_on_cuda(ckpt: bool | str, granularity: str) -> None:
    torch.manual_seed(0)
    ref = DiT(128, 4, 4, ckpt)
    _lora(ref, 4)
    off = copy.deepcopy(ref)
    ref.to(CUDA)
    mgr = OffloadTrainingManager(off, CUDA, offload_granularity=granularity)
    opt_r = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-3)
    opt_o = torch.optim.AdamW([p for p in off.parameters() if p.requires_grad], lr=1e-3)
    for step in range(20):
        g = torch.Generator(device=CUDA).manual_seed(step)
        x = torch.randn(2, 64, 128, device=CUDA, generator=g)
        t = torch.randn(2, 64, 128, device=CUDA, generator=g)
        lr_ = _train_step(ref, x, t, opt_r)
        lo = _train_step(off, x, t, opt_o, mgr)
        assert torch.equal(lr_, lo), f"step {step}: {lr_.item()} != {lo.item()}"
    with torch.no_grad():
        assert torch.equal(ref(x), off(x))
    streamed = [p for p in off.parameters() if not p.requires_grad]
    assert all(p.data.numel() == 0 for p in streamed)
    mgr.remove()


def test_reentrant_checkpoint_over_batchnorm_bitwise_on_cuda() -> None:
    # The recompute of a reentrant checkpoint saves the block's frozen Linear weight; the BatchNorm after it,
    # in the same slot, updates its running stats in place. Both must come out as resident's, bitwise.
    from offload_core_test_models import BatchNormTree

    torch.manual_seed(0)
    ref = BatchNormTree(256)
    ref.requires_grad_(False)
    ref.adapter_in.requires_grad_(True)
    ref.gradient_checkpointing = ref.checkpoint_reentrant = True
    off = copy.deepcopy(ref)
    ref.to(CUDA)
    h = enable_offload(off, target_device=CUDA)
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3) for m in (ref, off)]
    for step in range(6):
        g = torch.Generator(device=CUDA).manual_seed(step)
        x, t = torch.randn(64, 256, device=CUDA, generator=g), torch.randn(64, 256, device=CUDA, generator=g)
        lr_, lo = (_train_step(m, x, t, o) for m, o in zip((ref, off), opts))
        assert torch.equal(lr_, lo), f"step {step}: {lr_.item()} != {lo.item()}"
    sd_r, sd_o = ref.state_dict(), off.state_dict()
    for k, v in sd_r.items():
        assert torch.equal(v.cpu(), sd_o[k].cpu()), f"{k} differs from resident after training"
    h.remove()


def _tiny_flux() -> tuple[nn.Module, dict]:
    """The RECIPES tiny Flux (every parameter requires grad, as from_pretrained leaves it) and inputs."""
    from diffusers import FluxTransformer2DModel

    model = FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=2, num_single_layers=2, attention_head_dim=16,
                                   num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
                                   guidance_embeds=False, axes_dims_rope=(4, 4, 8)).eval()
    inputs = dict(hidden_states=torch.randn(1, 64, 4), encoder_hidden_states=torch.randn(1, 12, 32),
                  pooled_projections=torch.randn(1, 32), timestep=torch.tensor([0.5]),
                  img_ids=torch.randn(64, 3), txt_ids=torch.zeros(12, 3))
    return model, inputs


def test_flux_inference_bitwise_on_cuda() -> None:
    torch.manual_seed(0)
    ref, inputs = _tiny_flux()
    off = copy.deepcopy(ref)
    ref.to(CUDA)
    h = enable_offload(off, target_device=CUDA, offload_granularity="block")
    inputs = {k: v.to(CUDA) for k, v in inputs.items()}
    with torch.no_grad():
        want = ref(**inputs, return_dict=False)[0]
        for _ in range(3):
            assert torch.equal(off(**inputs, return_dict=False)[0], want)
    s = h.stats()
    # Every parameter requires grad (as from_pretrained leaves them): streamed as an inference model.
    assert s["pinned"] is True and s["streamed_bytes"] > 0 and s["resident_bytes"] == 0
    assert all(p.numel() == 0 for p in off.parameters())
    h.remove()


def _build_big_dit(ckpt: bool) -> DiT:
    torch.manual_seed(0)
    with torch.device("meta"):
        m = DiT(3072, 24, 24, ckpt)
    m = m.to_empty(device="cpu").to(torch.bfloat16)
    # Tile one random pool over every weight: values need not be independent here, and it is
    # much faster than normal_ over 2.7B parameters.
    pool = (torch.randn(1 << 24) * 0.02).to(torch.bfloat16)
    with torch.no_grad():
        for p in m.parameters():
            flat = p.data.view(-1)
            for i in range(0, flat.numel(), pool.numel()):
                n = min(pool.numel(), flat.numel() - i)
                flat[i: i + n].copy_(pool[:n])
    _lora(m, 32)
    return m


def test_lora_dit_bytes_and_vram() -> None:
    """24 blocks x 3072, bf16, rank-32 LoRA: bytes per step and peak VRAM against resident."""
    import psutil

    torch.cuda.init()
    x = torch.randn(1, 4096, 3072, device=CUDA, dtype=torch.bfloat16)
    t = torch.randn(1, 4096, 3072, device=CUDA)
    report: dict = {}
    for ckpt in (True, False):
        _fresh()
        ref = _build_big_dit(ckpt).to(CUDA)
        frozen = _frozen_bytes(ref)
        opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-4)
        _train_step(ref, x, t, opt)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        _train_step(ref, x, t, opt)
        torch.cuda.synchronize()
        peak_resident = torch.cuda.max_memory_allocated()
        del ref, opt
        _fresh()

        rss0 = psutil.Process().memory_info().rss
        off = _build_big_dit(ckpt)
        trainable = sum(p.numel() * p.element_size() for p in off.parameters() if p.requires_grad)
        rss_model = psutil.Process().memory_info().rss
        # the depth pinned: this measures what the smallest ring keeps on the device (at the
        # default the ring grows into the H200's free memory, keeping weights there on purpose)
        mgr = OffloadTrainingManager(off, CUDA, offload_granularity="block", prefetch=2)
        rss_after = psutil.Process().memory_info().rss
        opt = torch.optim.AdamW([p for p in off.parameters() if p.requires_grad], lr=1e-4)
        _train_step(off, x, t, opt, mgr)
        _train_step(off, x, t, opt, mgr)
        torch.cuda.synchronize()
        s0 = mgr.stats()
        torch.cuda.reset_peak_memory_stats()
        _train_step(off, x, t, opt, mgr)
        torch.cuda.synchronize()
        s1 = mgr.stats()
        peak_off = torch.cuda.max_memory_allocated()
        h2d_step = s1["h2d_bytes"] - s0["h2d_bytes"]
        largest = s1["slot_bytes"]
        in_flight = s1["slot_count"]
        row = dict(frozen_gb=frozen / 1e9, h2d_per_step_x_frozen=h2d_step / frozen,
                   peak_resident_gb=peak_resident / 1e9, peak_offload_gb=peak_off / 1e9,
                   saved_x_frozen=(peak_resident - peak_off) / frozen, slots=in_flight, slot_gb=largest / 1e9,
                   pinned_x_streamed=s1["pinned_capacity_bytes"] / s1["streamed_bytes"],
                   rss_x_weights=(rss_after - rss0) / (frozen + trainable),
                   rss_model_x_weights=(rss_model - rss0) / (frozen + trainable),
                   stall_ms=s1["stall_ms"], setup_s_per_gb=s1["setup_seconds"] / (frozen / 1e9))
        report["ckpt" if ckpt else "no_ckpt"] = row
        print(json.dumps({("ckpt" if ckpt else "no_ckpt"): row}))
        assert s1["pinned"] is True
        assert s1["pinned_capacity_bytes"] <= 1.01 * s1["streamed_bytes"]
        assert rss_after - rss0 <= 1.01 * (frozen + trainable) + 256 * 2**20
        if ckpt:
            assert h2d_step <= 2.05 * frozen
            # Weights on the device: the slots in flight plus the trainable parameters.
            assert peak_off <= peak_resident - frozen + in_flight * largest + trainable
        else:
            assert peak_resident - peak_off >= 0.70 * frozen
        mgr.remove()
        del off, opt, mgr
        _fresh()
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "gpu_lora_dit.json"), "w") as f:
            json.dump(report, f, indent=2)


def test_byte_counters_match_profiler(tmp_path) -> None:
    torch.manual_seed(0)
    m = DiT(512, 8, 6, ckpt=True).to(torch.bfloat16)
    _lora(m, 4)
    h = OffloadTrainingManager(m, CUDA, offload_granularity="block").handle
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4)
    x = torch.randn(1, 256, 512, device=CUDA, dtype=torch.bfloat16)
    t = torch.randn(1, 256, 512, device=CUDA)
    _train_step(m, x, t, opt)
    torch.cuda.synchronize()
    s0 = h.stats()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            _train_step(m, x, t, opt)
        torch.cuda.synchronize()
    s1 = h.stats()
    trace = tmp_path / "trace.json"
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    htod = sum(int(e.get("args", {}).get("bytes", 0)) for e in events
               if e.get("cat") == "gpu_memcpy" and "HtoD" in e.get("name", "") and "Pinned" in e.get("name", ""))
    ours = s1["h2d_bytes"] - s0["h2d_bytes"]
    print(json.dumps({"engine_h2d_bytes": ours, "profiler_pinned_htod_bytes": htod}))
    assert ours > 0
    assert abs(htod - ours) <= 0.01 * ours
    h.remove()


def test_copy_clock_brackets_the_dma_on_an_idle_stream(tmp_path) -> None:
    """The engine's H2D event pairs time the DMA, not the host's submission of a just-in-time copy."""
    import time

    from torch.profiler import ProfilerActivity, profile

    from offload_core.stats import CopyClock, TimingLog

    n = 8 << 20  # small enough that tens of microseconds of submission would show (~150 us of DMA)
    src = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(n, dtype=torch.uint8, device=CUDA)
    stream = torch.cuda.Stream()
    clock = CopyClock(TimingLog(), stream)
    pairs = []
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(30):
            torch.cuda.synchronize()
            time.sleep(0.001)  # the copy stream is idle: the copy is issued just in time
            with torch.cuda.stream(stream):
                a = clock.start(stream)
                dst.copy_(src, non_blocking=True)
                clock.submitted()
                b = torch.cuda.Event(enable_timing=True)
                b.record(stream)
            pairs.append((a, b))
        torch.cuda.synchronize()
    trace = tmp_path / "trace.json"
    prof.export_chrome_trace(str(trace))
    dma = sorted((e for e in json.loads(trace.read_text())["traceEvents"]
                  if e.get("cat") == "gpu_memcpy" and "HtoD" in e.get("name", "")), key=lambda e: e["ts"])
    assert len(dma) == len(pairs)
    # the first copy teaches the clock how long submitting takes; the rest are held
    events_ms = sum(a.elapsed_time(b) for a, b in pairs[1:])
    dma_ms = sum(e["dur"] for e in dma[1:]) / 1e3
    print(json.dumps({"events_ms": events_ms, "dma_ms": dma_ms, "holds": clock.holds, "submit_us": clock.submit_us}))
    assert clock.holds == len(pairs) - 1
    assert dst.cpu().equal(src)
    assert events_ms <= 1.10 * dma_ms


def test_stress_random_host_delays() -> None:
    """Races show up as mismatches when the host is slowed at random inside the hooks."""
    torch.manual_seed(0)
    ref = DiT(64, 4, 6, ckpt=True)
    _lora(ref, 4)
    off = copy.deepcopy(ref)
    ref.to(CUDA)
    mgr = OffloadTrainingManager(off, CUDA, offload_granularity="leaf", prefetch=2, debug_host_delay_ms=0.3)
    mismatches = 0
    with torch.no_grad():
        for i in range(1000):
            x = torch.randn(1, 32, 64, device=CUDA)
            mismatches += int(not torch.equal(ref(x), off(x)))
    opt_r = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-3)
    opt_o = torch.optim.AdamW([p for p in off.parameters() if p.requires_grad], lr=1e-3)
    for i in range(200):
        x = torch.randn(1, 32, 64, device=CUDA)
        t = torch.randn(1, 32, 64, device=CUDA)
        mismatches += int(not torch.equal(_train_step(ref, x, t, opt_r), _train_step(off, x, t, opt_o, mgr)))
    print(json.dumps({"stress_mismatches": mismatches, "prefetch_misses": mgr.stats()["prefetch_misses"]}))
    assert mismatches == 0
    mgr.remove()


def test_optimizer_offload_accumulation_on_cuda() -> None:
    """Full fine-tune with optimizer offload; reference: the same model resident, grads stepped on the CPU."""
    torch.manual_seed(0)
    ref = nn.Sequential(*[nn.Linear(256, 256) for _ in range(6)])
    off = copy.deepcopy(ref)
    # Reference keeps weights on the GPU but steps a CPU copy, as the offloaded path does.
    opt_o = torch.optim.AdamW(off.parameters(), lr=1e-3)
    # the optimizer's own kernel: bitwise the plain AdamW the reference steps on the CPU
    mgr = OffloadTrainingManager(off, CUDA, enable_optimizer_cpu_offload=True, optimizer=opt_o, fused_cpu_optimizer=False)
    cpu_ref = copy.deepcopy(ref)
    opt_r = torch.optim.AdamW(cpu_ref.parameters(), lr=1e-3)
    for step in range(5):
        ref_gpu = copy.deepcopy(cpu_ref).to(CUDA)
        for k in range(4):
            g = torch.Generator(device=CUDA).manual_seed(step * 10 + k)
            x = torch.randn(8, 256, device=CUDA, generator=g)
            lr_ = ref_gpu(x).pow(2).mean()
            lr_.backward()
            lo = off(x).pow(2).mean()
            lo.backward()
            mgr.after_backward()
            assert torch.equal(lr_, lo)
        for pc, pg in zip(cpu_ref.parameters(), ref_gpu.parameters()):
            pc.grad = pg.grad.cpu()
        opt_r.step()
        opt_r.zero_grad()
        opt_o.step()
        opt_o.zero_grad()
    mgr.remove()
    for a, b in zip(cpu_ref.parameters(), off.parameters()):
        assert torch.equal(a, b)


def test_fp8_storage_bitwise_to_fake_quantized_resident() -> None:
    from offload_core.quant import fake_quantize

    torch.manual_seed(0)
    ref, inputs = _tiny_flux()
    ref = ref.to(torch.bfloat16)
    off = copy.deepcopy(ref)
    fake_quantize(ref, "float8_e4m3fn").to(CUDA)
    h = enable_offload(off, target_device=CUDA, offload_granularity="block", weight_dtype="float8_e4m3fn")
    inputs = {k: v.to(CUDA, torch.bfloat16 if v.is_floating_point() and k not in ("img_ids", "txt_ids") else v.dtype)
              for k, v in inputs.items()}
    with torch.no_grad():
        want = ref(**inputs, return_dict=False)[0]
        for _ in range(3):
            assert torch.equal(off(**inputs, return_dict=False)[0], want)
    s = h.stats()
    assert s["streamed_bytes"] > 0
    assert s["pinned_used_bytes"] < 0.6 * s["streamed_bytes"]  # fp8 matrices: about half of bf16
    # Three forwards in fp8, plus the wrap-around prefetch of the next cycle's first units.
    assert s["h2d_bytes"] <= 4 * s["pinned_capacity_bytes"]
    h.remove()


def test_overlapped_optimizer_step_on_cuda() -> None:
    torch.manual_seed(0)
    cpu_ref = nn.Sequential(*[nn.Linear(256, 256) for _ in range(6)])
    off = copy.deepcopy(cpu_ref)
    opt_o = torch.optim.AdamW(off.parameters(), lr=1e-3)
    mgr = OffloadTrainingManager(off, CUDA, enable_optimizer_cpu_offload=True, optimizer=opt_o,
                                 overlap_optimizer_step=True, gradient_accumulation_steps=2)
    # the default fused CPU kernel: bitwise AdamW(fused=True) on the CPU
    opt_r = torch.optim.AdamW(cpu_ref.parameters(), lr=1e-3, fused=True)
    for step in range(5):
        ref_gpu = copy.deepcopy(cpu_ref).to(CUDA)
        for k in range(2):
            g = torch.Generator(device=CUDA).manual_seed(step * 10 + k)
            x = torch.randn(8, 256, device=CUDA, generator=g)
            ref_gpu(x).pow(2).mean().backward()
            off(x).pow(2).mean().backward()
            mgr.after_backward()
        for pc, pg in zip(cpu_ref.parameters(), ref_gpu.parameters()):
            pc.grad = pg.grad.cpu()
        opt_r.step()
        opt_r.zero_grad()
        opt_o.step()
        opt_o.zero_grad()
    mgr.remove()
    for a, b in zip(cpu_ref.parameters(), off.parameters()):
        assert torch.equal(a, b)
