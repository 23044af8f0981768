"""SafetensorsSource: tensor-by-tensor reads into the caller's memory, without doubling host RAM (CPU)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from offload_core.disk.errors import ShardError, ShardSourceNotFound
from offload_core.disk.source import SafetensorsSource


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A sharded diffusers-style folder: two safetensors files and their index json, mixed dtypes."""
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("ckpt")
    a = {"blocks.0.w": torch.randn(64, 33), "blocks.0.b": torch.randn(33).to(torch.bfloat16)}
    b = {"blocks.1.w": torch.randn(64, 33).to(torch.float16), "step": torch.tensor([3], dtype=torch.int64)}
    save_file(a, str(root / "m-00001.safetensors"))
    save_file(b, str(root / "m-00002.safetensors"))
    weight_map = {**{k: "m-00001.safetensors" for k in a}, **{k: "m-00002.safetensors" for k in b}}
    (root / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return root, {**a, **b}


def test_reads_every_tensor_of_a_sharded_folder(folder: tuple) -> None:
    root, want = folder
    with SafetensorsSource.open(root) as src:
        assert set(src.tensors) == set(want)
        for name, t in want.items():
            got = src.read(name)
            assert got.dtype == t.dtype and torch.equal(got, t), name
        assert src.bytes_read == sum(t.numel() * t.element_size() for t in want.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_read_into_converts_through_a_bounded_temporary(folder: tuple, dtype: torch.dtype) -> None:
    """A 64 x 33 tensor through a 100-byte temporary: pieces that end mid-row, converted as .to() would."""
    root, want = folder
    with SafetensorsSource.open(root, chunk_bytes=100) as src:
        for name in ("blocks.0.w", "blocks.0.b", "blocks.1.w"):
            out = torch.full(want[name].shape, float("nan"), dtype=dtype)
            src.read_into(name, out)
            assert torch.equal(out, want[name].to(dtype)), name


def test_read_into_a_slab_view(folder: tuple) -> None:
    """The destination can be a typed view into a bigger buffer (an arena slab)."""
    root, want = folder
    slab = torch.zeros(64 * 33 * 4 + 128, dtype=torch.uint8)
    view = slab[64: 64 + 64 * 33 * 4].view(torch.float32).view(64, 33)
    with SafetensorsSource.open(root) as src:
        src.read_into("blocks.0.w", view)
    assert torch.equal(view, want["blocks.0.w"]) and not slab[:64].any() and not slab[-64:].any()


def test_shape_mismatch_and_bad_files_are_named(folder: tuple, tmp_path: Path) -> None:
    root, want = folder
    with SafetensorsSource.open(root) as src, pytest.raises(ShardError, match="shape"):
        src.read_into("blocks.0.w", torch.empty(33, 64))
    with pytest.raises(ShardSourceNotFound, match="no such file"):
        SafetensorsSource.open(tmp_path / "nope")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(ShardError, match="not a readable safetensors file") as info:
        SafetensorsSource.open(bad)
    assert str(info.value).startswith(str(bad) + ":")
    short = tmp_path / "short.safetensors"
    short.write_bytes((root / "m-00001.safetensors").read_bytes()[:-100])
    with pytest.raises(ShardError, match="truncated") as info:
        SafetensorsSource.open(short)
    assert str(info.value).startswith(str(short) + ":")


_RSS_PROBE = textwrap.dedent("""
    import json, sys, threading, time
    import psutil, torch
    from offload_core.disk.source import SafetensorsSource

    path, mode = sys.argv[1], sys.argv[2]
    proc = psutil.Process()
    peak = [0]
    def watch():
        while True:
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.002)
    threading.Thread(target=watch, daemon=True).start()
    src = SafetensorsSource.open(path)
    names = sorted(src.tensors)
    dtype = torch.float32 if mode == "same" else torch.bfloat16
    total = sum(src.tensors[n].numel for n in names) * dtype.itemsize
    dest = torch.empty(total, dtype=torch.uint8)
    dest.fill_(0)  # touched: its pages are resident before the load starts
    time.sleep(0.05)
    base = proc.memory_info().rss
    off = 0
    for n in names:
        t = src.tensors[n]
        view = dest[off: off + t.numel * dtype.itemsize].view(dtype).view(t.shape)
        src.read_into(n, view)
        off += t.numel * dtype.itemsize
    src.close()
    time.sleep(0.05)
    loaded_peak = peak[0]  # before the checksum below makes its own fp32 copy
    print(json.dumps({"base": base, "peak": loaded_peak, "dest": total, "sum": float(dest.view(dtype).double().sum())}))
""")


@pytest.mark.parametrize("mode", ["same", "convert"])
def test_peak_rss_stays_near_the_destination(tmp_path: Path, mode: str) -> None:
    """Loading 96 MB of tensors into a 96 MB destination (or 48 MB, converting to bf16) grows RSS by a
    few MB at most: no mmap of the file, no whole-tensor temporary. (safe_open's mmap makes every page
    it touched count as RSS, then load_file copies: about 2x.)"""
    torch.manual_seed(0)
    tensors = {f"blocks.{i}.w": torch.randn(1024, 1024 * 3) for i in range(8)}  # 8 x 12 MB fp32
    path = tmp_path / "big.safetensors"
    save_file(tensors, str(path))
    del tensors
    proc = subprocess.run([sys.executable, "-c", _RSS_PROBE, str(path), mode], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    grew = r["peak"] - r["base"]
    assert grew < 24e6, f"RSS grew {grew / 1e6:.1f} MB over a {r['dest'] / 1e6:.0f} MB destination"
    want = sum(float(t.to(torch.bfloat16 if mode == "convert" else torch.float32).double().sum())
               for t in load_file(str(path)).values())
    assert abs(r["sum"] - want) <= 1e-3 * abs(want) + 1.0
