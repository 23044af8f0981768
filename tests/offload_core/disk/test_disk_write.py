"""shard_model (offload_to_disk's writer), a full disk on a real tmpfs, and reads where O_DIRECT is refused."""

from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path
from typing import Iterator

import pytest
import torch
from torch import nn

from offload_core.disk.bind import bind_units
from offload_core.disk.errors import ShardWriteError
from offload_core.disk.format import load_index
from offload_core.disk.diskstore import DiskStore
from offload_core.disk.verify import verify_shards
from offload_core.disk.write import free_host_copies, shard_model
from offload_core.quant import quantize, storage_dtype, widen
from offload_core.shard import shard_checkpoint
from offload_core.units import discover_units
from offload_core_disk_helpers import Stack, bind_from_store, block_units, one_pass, open_store, sharded_stack


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 32)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(32, 32), nn.LayerNorm(32)) for _ in range(3)])
        self.out = nn.Linear(32, 16, bias=False)
        self.out.weight = self.embed.weight  # tied: kept resident, written once as a resident tensor
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for b in self.blocks:
            x = x + b(x)
        return self.out(x * self.scale)


@pytest.mark.parametrize("weight_dtype", [None, "float8_e4m3fn"])
def test_a_model_in_ram_written_freed_and_read_back(tmp_path: Path, weight_dtype: str | None) -> None:
    torch.manual_seed(0)
    model = Tied().requires_grad_(False)
    ids = torch.randint(0, 16, (2, 5))
    ref = Tied().requires_grad_(False)
    ref.load_state_dict(model.state_dict())
    if weight_dtype:  # the blocks' matrices rounded through fp8, as the engine stores them (residents are not)
        for name, p in ref.named_parameters():
            if name.startswith("blocks.") and p.dim() >= 2:
                q, s = quantize(p.data, storage_dtype(weight_dtype))
                p.data.copy_(widen(q, s, p.dtype))
    with torch.no_grad():
        want = ref(ids)
    plan = discover_units(model, "block")
    units = block_units(plan)
    store = storage_dtype(weight_dtype)
    for u in units:  # what the engine does for weight_dtype
        for ts in u.tensors:
            if store is not None and ts.is_param and ts.tensor().dim() >= 2:
                ts.store_dtype = store
        u.layout()
    index = shard_model(model, units, tmp_path / "shards", plan.block_lists)
    assert set(index.units) == {"blocks.0", "blocks.1", "blocks.2"}
    assert {t.name for t in index.resident.tensors} >= {"embed.weight", "scale"}  # tied + the stray units
    if weight_dtype:
        assert all(ts.scale is not None for u in units for ts in u.tensors if ts.store_dtype is not None)
    freed = free_host_copies(units)
    assert freed == sum(ts.nbytes for u in units for ts in u.tensors)
    assert all(ts.tensor().numel() == 0 for u in units for ts in u.tensors)
    verify_shards(tmp_path / "shards")

    # Read back into the same model object, as the engine will after offload_to_disk.
    loaded = load_index(tmp_path / "shards")
    entries = bind_units(units, loaded, model)
    disk = DiskStore(units, loaded, entries, cache_bytes=0, num_disk_workers=1)
    try:
        bind_from_store(disk, units)
    finally:
        disk.close()
    with torch.no_grad():
        assert torch.equal(model(ids), want)


def test_meta_tensors_cannot_be_written(tmp_path: Path) -> None:
    with torch.device("meta"):
        model = Stack(3, 16)
    plan = discover_units(model.requires_grad_(False), "block")
    with pytest.raises(Exception, match="meta device"):
        shard_model(model, block_units(plan), tmp_path / "out", plan.block_lists, resident=False)


@contextlib.contextmanager
def _tmpfs(path: Path, size: str) -> Iterator[Path]:
    path.mkdir(parents=True, exist_ok=True)
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mount.stderr.decode().strip() or 'not permitted'})")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _checkpoint(path: Path, mb: int = 12) -> Path:
    from safetensors.torch import save_file

    torch.manual_seed(0)
    n = mb * (1 << 20) // (4 * 256 * 256)
    save_file({f"blocks.{i}.w": torch.randn(256, 256) for i in range(n)}, str(path))
    return path


def test_full_disk_while_sharding_is_named_and_resumes(tmp_path: Path) -> None:
    """A real 8 MB tmpfs and a 12 MB checkpoint: the error names the file, nothing half-written stays,
    and after the disk grows a rerun keeps the finished files."""
    src = _checkpoint(tmp_path / "ckpt.safetensors")
    with _tmpfs(tmp_path / "small", "8m") as dst:
        with pytest.raises(ShardWriteError, match="no space left on device") as info:
            shard_checkpoint(src, dst, progress=False)
        assert str(info.value).startswith(str(dst / "blocks.")) and "\n" not in str(info.value)
        assert not list(dst.glob("*.tmp")) and not (dst / "index.json").exists()
        finished = len(list(dst.glob("blocks.*.safetensors")))
        assert finished > 0
        subprocess.run(["mount", "-o", "remount,size=32m", str(dst)], check=True)
        summary = shard_checkpoint(src, dst, progress=False)
        assert summary["resumed"] == finished and summary["written"] == summary["units"] - finished
        verify_shards(dst)


def test_full_disk_while_writing_a_model_is_named(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Stack(12, 256).requires_grad_(False)  # 12 x 0.5 MB
    plan = discover_units(model, "block")
    with _tmpfs(tmp_path / "small", "2m") as dst:
        with pytest.raises(ShardWriteError, match="no space left on device") as info:
            shard_model(model, block_units(plan), dst, plan.block_lists)
        assert str(info.value).startswith(str(dst) + "/")
        assert not list(dst.glob("*.tmp")) and not (dst / "index.json").exists()


def test_reads_on_a_tmpfs(tmp_path: Path) -> None:
    """tmpfs takes O_DIRECT on recent kernels (6.6+) and refuses it on older ones: the slabs are right either way."""
    with _tmpfs(tmp_path / "fs", "16m") as dst:
        model, plan, index = sharded_stack(dst, n=8)
        units = block_units(plan)
        store = open_store(model, units, index, 0.5, num_disk_workers=2, verify=True)
        try:
            store.follow_trace([u.uid for u in units])
            for _ in range(3):
                one_pass(store, units)
            assert store.stats()["disk_reads"] > 0
        finally:
            store.close()


def test_reads_fall_back_to_buffered_where_o_direct_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A filesystem that refuses O_DIRECT (EINVAL at open, as older tmpfs and some network filesystems do):
    buffered reads, then fadvise(DONTNEED), with the same bytes."""
    import errno
    import os

    import offload_core.disk.read as read_mod

    model, plan, index = sharded_stack(tmp_path / "shards", n=8)
    units = block_units(plan)
    real_open = os.open
    refused: list[str] = []

    def no_direct(path: object, flags: int, *args: object) -> int:
        if flags & getattr(os, "O_DIRECT", 0):
            refused.append(str(path))
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(read_mod.os, "open", no_direct)
    store = open_store(model, units, index, 0.0, num_disk_workers=2, verify=True)
    try:
        store.follow_trace([u.uid for u in units])
        for _ in range(2):
            one_pass(store, units)
        s = store.stats()
        assert s["disk_reads"] >= 2 * len(units) and s["disk_direct_reads"] == 0
        assert len(refused) == len(units)  # asked once per file, then remembered
    finally:
        store.close()
