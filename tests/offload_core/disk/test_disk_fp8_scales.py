"""fp8 row and block scales in the shard format: written in the slab after the unit's tensors (as the
arena's slab holds them), streamed by the disk tier, bitwise the arena engine with the same scaling.

Old shards (one scale a tensor, format_version 2) still load."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from offload_core import OffloadConfigError, enable_offload
from offload_core.disk.errors import ShardFormatError
from offload_core.disk.format import load_index
from offload_core.quant import fake_quantize, quantize
from offload_core.shard import shard_checkpoint, verify_shards
from offload_core_disk_helpers import flux_inputs, tiny_flux

FP8 = "float8_e4m3fn"


@pytest.fixture(scope="module")
def flux(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    torch.manual_seed(0)
    ref = tiny_flux().requires_grad_(False)
    with torch.no_grad():  # an outlier output channel: the case row and block scales exist for
        ref.transformer_blocks[0].attn.to_q.weight[3].mul_(20)
    root = tmp_path_factory.mktemp("fp8scales")
    ref.save_pretrained(root / "src")
    return root / "src", ref


def _meta(src: Path) -> torch.nn.Module:
    from diffusers import FluxTransformer2DModel

    with torch.device("meta"):
        model = FluxTransformer2DModel.from_config(FluxTransformer2DModel.load_config(src))
    return model.requires_grad_(False)


def _run(model: torch.nn.Module, device: str = "cpu") -> torch.Tensor:
    with torch.no_grad():
        return model(**{k: v.to(device) for k, v in flux_inputs().items()}, return_dict=False)[0]


def _arena(ref: torch.nn.Module, scaling: str) -> tuple[torch.nn.Module, object]:
    model = copy.deepcopy(ref)
    return model, enable_offload(model, target_device="cpu", offload_granularity="block", weight_dtype=FP8,
                                 fp8_scaling=scaling)


@pytest.mark.parametrize("scaling", ["row", "block"])
def test_the_shards_hold_the_fp8_bytes_and_their_scales_in_the_slab(flux: tuple, tmp_path: Path, scaling: str) -> None:
    src, ref = flux
    dst = tmp_path / "shards"
    shard_checkpoint(src, dst, dtype=FP8, fp8_scaling=scaling, progress=False, verify=True)
    index = json.loads((dst / "index.json").read_text())
    assert (index["format_version"], index["fp8_scaling"], index["dtype"]) == (3, scaling, FP8)
    state = ref.state_dict()
    seen = 0
    for entry in index["units"].values():
        tensors_end = max(t["offset"] + t["nbytes"] for t in entry["tensors"].values())
        with safe_open(str(dst / entry["file"]), "pt") as f:
            for name, t in entry["tensors"].items():
                if t["dtype"] != FP8:
                    assert "scale_shape" not in t and "scale" not in t, name
                    continue
                want_q, want_s = quantize(state[name], torch.float8_e4m3fn, scaling=scaling)
                assert "scale" not in t and t["scale_shape"] == list(want_s.shape), name
                assert tensors_end <= t["scale_offset"] < entry["nbytes"]  # after the tensors, inside the slab
                assert torch.equal(f.get_tensor(name).view(torch.uint8), want_q.view(torch.uint8)), name
                assert torch.equal(f.get_tensor(f"__scale__.{name}"), want_s), name
                seen += 1
    assert seen
    assert verify_shards(dst)["slabs"] == len(index["units"]) + bool(index.get("resident"))
    again = shard_checkpoint(src, dst, dtype=FP8, fp8_scaling=scaling, progress=False)  # a rerun resumes, scales and all
    assert (again["written"], again["resumed"]) == (0, len(index["units"]))
    assert json.loads((dst / "index.json").read_text())["units"] == index["units"]
    other = "block" if scaling == "row" else "row"  # another scaling lays the slabs out anew
    assert shard_checkpoint(src, dst, dtype=FP8, fp8_scaling=other, progress=False)["resumed"] == 0


@pytest.mark.parametrize("scaling", ["row", "block"])
def test_lazy_load_from_row_and_block_shards_is_bitwise_the_arena(flux: tuple, tmp_path: Path, scaling: str) -> None:
    src, ref = flux
    shard_checkpoint(src, tmp_path / "shards", dtype=FP8, fp8_scaling=scaling, progress=False)
    arena, arena_handle = _arena(ref, scaling)
    want = _run(arena)
    resident = fake_quantize(copy.deepcopy(ref), FP8, scaling)  # the arena equals it; so must the disk
    assert torch.equal(want, _run(resident))
    model = _meta(src)
    handle = enable_offload(model, target_device="cpu", offload_granularity="block", lazy_load=True,
                            shard_dir=str(tmp_path / "shards"), max_memory=0, weight_dtype=FP8, fp8_scaling=scaling)
    for _ in range(2):  # every unit read from disk each pass (no cache)
        assert torch.equal(_run(model), want)
    s = handle.stats()
    assert s["host_store"] == "disk" and s["disk_reads"] > 0
    # state_dict while offloaded: the widened values, scales read without keeping the units
    sd = model.state_dict()
    assert all(torch.equal(sd[k], v) for k, v in resident.state_dict().items())
    assert handle.stats()["disk_kept_bytes"] == 0  # master() would have kept every unit in RAM
    handle.remove()
    arena_handle.remove()


@pytest.mark.gpu
@pytest.mark.parametrize("scaling", ["row", "block"])
def test_cuda_lazy_load_from_scaled_shards_is_bitwise_the_cuda_arena(flux: tuple, tmp_path: Path, scaling: str) -> None:
    src, ref = flux
    shard_checkpoint(src, tmp_path / "shards", dtype=FP8, fp8_scaling=scaling, progress=False)
    arena = copy.deepcopy(ref)
    arena_handle = enable_offload(arena, target_device="cuda", offload_granularity="block", weight_dtype=FP8,
                                  fp8_scaling=scaling)
    want = _run(arena, "cuda")
    model = _meta(src)
    handle = enable_offload(model, target_device="cuda", offload_granularity="block", lazy_load=True,
                            shard_dir=str(tmp_path / "shards"), max_memory=0, num_disk_workers=2)
    for _ in range(3):
        assert torch.equal(_run(model, "cuda"), want)
    s = handle.stats()
    assert s["pinned"] is True and s["disk_reads"] > 0
    handle.remove()
    arena_handle.remove()


def test_a_unit_kept_resident_from_row_shards_is_widened_with_its_scales(flux: tuple, tmp_path: Path) -> None:
    src, ref = flux
    shard_checkpoint(src, tmp_path / "shards", dtype=FP8, progress=False)  # the default: row
    assert load_index(tmp_path / "shards").meta["fp8_scaling"] == "row"
    model = _meta(src)
    # the embedders and heads resident: read from their fp8 slabs once, widened with their row scales
    handle = enable_offload(model, target_device="cpu", offload_granularity="block", lazy_load=True,
                            shard_dir=str(tmp_path / "shards"), max_memory=0, stray_resident_fraction=1.0)
    assert handle.stats()["plan"]["resident_units"] > 0
    assert torch.equal(_run(model), _run(fake_quantize(copy.deepcopy(ref), FP8, "row")))
    handle.remove()


def test_offload_to_disk_with_row_scales_is_bitwise_the_arena(flux: tuple, tmp_path: Path) -> None:
    _, ref = flux
    arena, arena_handle = _arena(ref, "row")
    model = copy.deepcopy(ref)
    handle = enable_offload(model, target_device="cpu", offload_granularity="block", offload_to_disk=True,
                            shard_dir=str(tmp_path / "written"), weight_dtype=FP8, fp8_scaling="row", max_memory=0)
    assert load_index(tmp_path / "written").meta["format_version"] == 3
    assert torch.equal(_run(model), _run(arena))
    handle.remove()
    arena_handle.remove()


def test_old_tensor_scaled_shards_still_load(flux: tuple, tmp_path: Path) -> None:
    src, ref = flux
    shard_checkpoint(src, tmp_path / "shards", dtype=FP8, fp8_scaling="tensor", progress=False)
    index = json.loads((tmp_path / "shards" / "index.json").read_text())
    assert index["format_version"] == 2  # the layout an older offload-jobs wrote and reads
    index.pop("fp8_scaling")  # as it wrote it
    assert not any("scale_shape" in t for e in index["units"].values() for t in e["tensors"].values())
    (tmp_path / "shards" / "index.json").write_text(json.dumps(index))
    model = _meta(src)
    handle = enable_offload(model, target_device="cpu", offload_granularity="block", lazy_load=True,
                            shard_dir=str(tmp_path / "shards"), max_memory=0)
    arena, arena_handle = _arena(ref, "tensor")
    assert torch.equal(_run(model), _run(arena))
    handle.remove()
    arena_handle.remove()
    with pytest.raises(OffloadConfigError, match=r"^fp8_scaling: the shards in .* hold tensor fp8 scales; .*"
                                                 r"--fp8-scaling row"):
        enable_offload(_meta(src), target_device="cpu", lazy_load=True, shard_dir=str(tmp_path / "shards"),
                       weight_dtype=FP8, fp8_scaling="row")


def test_scales_that_do_not_fit_their_tensor_are_a_format_error(flux: tuple, tmp_path: Path) -> None:
    src, _ = flux
    shard_checkpoint(src, tmp_path / "shards", dtype=FP8, fp8_scaling="row", progress=False)
    path = tmp_path / "shards" / "index.json"
    good = path.read_text()
    index = json.loads(good)
    name, t = next((n, t) for n, t in index["units"]["transformer_blocks.0"]["tensors"].items() if "scale_shape" in t)
    t["scale_shape"] = [t["scale_shape"][0] + 1]
    path.write_text(json.dumps(index))
    with pytest.raises(ShardFormatError, match=f"tensor {name}: scale_shape"):
        load_index(tmp_path / "shards")
    index = json.loads(good)
    index["units"]["transformer_blocks.0"]["tensors"][name]["scale_offset"] = 0  # over the tensors' bytes
    path.write_text(json.dumps(index))
    with pytest.raises(ShardFormatError, match=f"tensor {name}: its scales lie outside"):
        load_index(tmp_path / "shards")


def test_a_bad_fp8_scaling_is_named(flux: tuple, tmp_path: Path) -> None:
    from offload_core.errors import ShardError

    src, _ = flux
    with pytest.raises(ShardError, match=r"^fp8_scaling: 'channel' is not one of tensor, row, block$"):
        shard_checkpoint(src, tmp_path / "a", dtype=FP8, fp8_scaling="channel", progress=False)
    with pytest.raises(ShardError, match=r"^fp8_scaling: applies to dtype float8_e4m3fn only \(dtype is bfloat16\)$"):
        shard_checkpoint(src, tmp_path / "b", dtype="bfloat16", fp8_scaling="row", progress=False)
