"""DiskStore with CUDA (pytest -m gpu): O_DIRECT into pinned slabs, async H2D, slabs reused only after the copy's event."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from offload_core.hostmem import clear_cuda_error
from offload_core_disk_helpers import block_units, open_store, sharded_stack, typed

pytestmark = pytest.mark.gpu

_ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered


def _registered_with_cuda(t: torch.Tensor) -> bool:
    """Whether CUDA holds t's bytes as registered (pinned) host memory: registering them again fails so.

    (Tensor.is_pinned() is no witness: on torch 2.11 it answers False for memory that
    cudaHostRegister pinned, as the disk tier's slabs are; it knows torch's own pinned allocations.)"""
    err = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0))
    if err == 0:
        torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
        return False
    clear_cuda_error()
    return err == _ALREADY_REGISTERED


@pytest.mark.parametrize("f", [0.0, 0.5])
def test_async_copies_out_of_pinned_slabs_are_exact(tmp_path: Path, f: float) -> None:
    model, plan, index = sharded_stack(tmp_path, n=24, d=256)
    units = block_units(plan)
    store = open_store(model, units, index, f, num_disk_workers=3, pin=True, stream_slots=3)
    copy = torch.cuda.Stream()
    try:
        assert store.pinned
        store.follow_trace([u.uid for u in units])
        for _ in range(4):
            outs = []
            for u in units:
                slab = store.acquire(u.uid)
                assert _registered_with_cuda(slab)
                dst = torch.empty(u.store_nbytes, dtype=torch.uint8, device="cuda")
                with torch.cuda.stream(copy):
                    dst.copy_(slab, non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record(copy)
                store.release(u.uid, after=ev)  # the slab may be refilled only once this copy is done
                outs.append((u, dst))
            torch.cuda.synchronize()
            for u, dst in outs:
                for i, ts in enumerate(u.tensors):
                    assert torch.equal(typed(dst, u, i).cpu(), ts.tensor()), u.name
        s = store.stats()
        assert s["disk_direct_reads"] == s["disk_reads"] > 0  # local disk: every read O_DIRECT
        assert abs(s["disk_cache_hit_rate"] - 0.75 * f) < 0.1  # 3 of 4 passes warm
    finally:
        store.close()
