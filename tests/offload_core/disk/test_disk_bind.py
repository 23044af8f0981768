"""A model built on the meta device, filled from shards only: bitwise equal to the model the shards came from.

The engine is not wired to the disk store yet (that needs offload_core part 3's host-store seam), so
these tests do by hand what it will do per use: acquire a unit's slab, bind its tensors to views of
it (widened where stored narrower), release. What they check is the data path the engine will
take: checkpoint -> shards -> slab -> tensors, bit for bit.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from offload_core.disk.bind import base_name, bind_units, materialize
from offload_core.disk.errors import ShardMismatchError
from offload_core.disk.format import load_index
from offload_core.disk.diskstore import DiskStore
from offload_core.quant import fake_quantize
from offload_core.shard import shard_checkpoint
from offload_core.units import discover_units
from offload_core_disk_helpers import bind_from_store, flux_inputs, tiny_flux


def _meta_flux(src: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    from diffusers import FluxTransformer2DModel

    with torch.device("meta"):
        model = FluxTransformer2DModel.from_config(FluxTransformer2DModel.load_config(src))
    return model.to(dtype).requires_grad_(False)


def _from_shards(shards: Path, src: Path, dtype: torch.dtype = torch.float32, granularity: str = "block",
                 max_memory: int = 0) -> torch.nn.Module:
    model = _meta_flux(src, dtype)
    index = load_index(shards)
    plan = discover_units(model, granularity)
    streamed = [u for u in plan.units if not u.stray]
    entries = bind_units(streamed, index, model)
    materialize(model, index, streamed, "cpu")  # strays and tied tensors: read; streamed: placeholders
    store = DiskStore(streamed, index, entries, cache_bytes=max_memory, num_disk_workers=2)
    try:
        store.follow_trace([u.uid for u in streamed])
        bind_from_store(store, streamed)
    finally:
        store.close()
    assert not any(t.device.type == "meta" for t in [*model.parameters(), *model.buffers()])
    return model


@pytest.fixture(scope="module")
def flux(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    torch.manual_seed(0)
    model = tiny_flux().requires_grad_(False)
    src = tmp_path_factory.mktemp("flux") / "transformer"
    model.save_pretrained(src, max_shard_size="200KB")  # a sharded diffusers checkpoint
    return src, model


def _out(model: torch.nn.Module, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    with torch.no_grad():
        return model(**flux_inputs(dtype), return_dict=False)[0]


@pytest.mark.parametrize("granularity", ["block", "phase", "leaf"])
def test_meta_model_from_shards_is_bitwise(flux: tuple, tmp_path: Path, granularity: str) -> None:
    src, ref = flux
    shard_checkpoint(src, tmp_path / "shards", granularity=granularity, progress=False)
    model = _from_shards(tmp_path / "shards", src, granularity=granularity, max_memory=50_000)
    assert torch.equal(_out(model), _out(ref))
    for (k, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(a, b), k


def test_single_file_checkpoint_with_config_is_bitwise(flux: tuple, tmp_path: Path) -> None:
    src, ref = flux
    single = tmp_path / "flux.safetensors"
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(single))
    shard_checkpoint(single, tmp_path / "shards", config=src, progress=False)
    assert torch.equal(_out(_from_shards(tmp_path / "shards", src)), _out(ref))


def test_single_file_without_config_binds_too(flux: tuple, tmp_path: Path) -> None:
    """Grouped by a skeleton of the names: weight before bias, as the model registers them."""
    src, ref = flux
    single = tmp_path / "flux.safetensors"
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(single))
    shard_checkpoint(single, tmp_path / "shards", progress=False)
    assert load_index(tmp_path / "shards").meta["grouping"] == "names"
    assert torch.equal(_out(_from_shards(tmp_path / "shards", src)), _out(ref))


def test_bf16_shards_into_a_bf16_model_and_an_fp32_one(flux: tuple, tmp_path: Path) -> None:
    src, ref = flux
    shard_checkpoint(src, tmp_path / "shards", dtype="bfloat16", progress=False)
    want = _out(copy.deepcopy(ref).to(torch.bfloat16), torch.bfloat16)
    assert torch.equal(_out(_from_shards(tmp_path / "shards", src, torch.bfloat16), torch.bfloat16), want)
    # An fp32 model streams them as bf16 storage and widens: the fp32 model holding bf16-rounded weights.
    wide = _from_shards(tmp_path / "shards", src, torch.float32)
    rounded = tiny_flux().requires_grad_(False)
    rounded.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in ref.state_dict().items()})
    assert torch.equal(_out(wide), _out(rounded))


def test_fp8_shards_equal_fake_quantize(flux: tuple, tmp_path: Path) -> None:
    src, ref = flux
    # one scale a tensor, as every fp8 shard was before row/block (test_disk_fp8_scales.py has those)
    shard_checkpoint(src, tmp_path / "shards", dtype="float8_e4m3fn", fp8_scaling="tensor", progress=False)
    model = _from_shards(tmp_path / "shards", src)
    want = tiny_flux().requires_grad_(False)
    want.load_state_dict(ref.state_dict())
    fake_quantize(want, "float8_e4m3fn", "tensor")
    assert torch.equal(_out(model), _out(want))


def test_peft_base_layer_names_bind_to_the_base_model_shards(flux: tuple, tmp_path: Path) -> None:
    from peft import LoraConfig

    src, ref = flux
    shard_checkpoint(src, tmp_path / "shards", progress=False)
    model = tiny_flux().requires_grad_(False)
    model.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k"]))
    assert any(".base_layer." in n for n, _ in model.named_parameters())
    plan = discover_units(model, "block")
    entries = bind_units([u for u in plan.units if not u.stray], load_index(tmp_path / "shards"), model)
    assert "transformer_blocks.0" in {e.name for e in entries.values()}
    assert base_name("a.to_q.base_layer.weight") == "a.to_q.weight"


# ------------------------------------------------------------------ what does not match is named


def _bind(shards: Path, model: torch.nn.Module, granularity: str = "block") -> Any:
    plan = discover_units(model, granularity)
    return bind_units([u for u in plan.units if not u.stray], load_index(shards), model)


def test_other_granularity_is_a_mismatch(flux: tuple, tmp_path: Path) -> None:
    src, _ = flux
    shard_checkpoint(src, tmp_path / "shards", granularity="leaf", progress=False)
    with pytest.raises(ShardMismatchError, match="unit transformer_blocks.0 is not in the index") as info:
        _bind(tmp_path / "shards", _meta_flux(src))
    assert str(info.value).startswith(str(tmp_path / "shards" / "index.json") + ":")


def test_other_model_is_a_mismatch(flux: tuple, tmp_path: Path) -> None:
    src, _ = flux
    shard_checkpoint(src, tmp_path / "shards", progress=False)
    with torch.device("meta"):
        wider = tiny_flux(num_attention_heads=4)
    with pytest.raises(ShardMismatchError, match="shape"):
        _bind(tmp_path / "shards", wider.requires_grad_(False))


def test_renamed_tensor_is_a_mismatch(flux: tuple, tmp_path: Path) -> None:
    src, _ = flux
    shard_checkpoint(src, tmp_path / "shards", progress=False)
    index = json.loads((tmp_path / "shards" / "index.json").read_text())
    t = index["units"]["transformer_blocks.0"]["tensors"]
    index["units"]["transformer_blocks.0"]["tensors"] = {("x." + k if i == 0 else k): v for i, (k, v) in enumerate(t.items())}
    (tmp_path / "shards" / "index.json").write_text(json.dumps(index))
    with pytest.raises(ShardMismatchError, match="where the index has x.transformer_blocks.0"):
        _bind(tmp_path / "shards", _meta_flux(src))


def test_fp8_shards_laid_out_for_another_compute_dtype(flux: tuple, tmp_path: Path) -> None:
    """fp8 slabs put the narrow tensors first, proportionally to the compute dtype: a bf16 model's layout differs."""
    src, _ = flux
    shard_checkpoint(src, tmp_path / "shards", dtype="float8_e4m3fn", progress=False)
    with pytest.raises(ShardMismatchError, match="lays out differently.*float32.*bfloat16|float32"):
        _bind(tmp_path / "shards", _meta_flux(src, torch.bfloat16))


def test_meta_buffer_missing_from_the_shards_is_named(tmp_path: Path) -> None:
    """Wan's rope tables are non-persistent buffers: not in any checkpoint, so a meta model has no value for them."""
    from diffusers import WanTransformer3DModel

    cfg = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
               text_dim=16, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
               qk_norm="rms_norm_across_heads", rope_max_seq_len=32)
    WanTransformer3DModel(**cfg).save_pretrained(tmp_path / "wan")
    shard_checkpoint(tmp_path / "wan", tmp_path / "shards", progress=False)
    index = load_index(tmp_path / "shards")
    assert "rope" not in index.units  # a unit the checkpoint holds only part of is not a slab
    with torch.device("meta"):
        model = WanTransformer3DModel(**cfg).requires_grad_(False)
    streamed = [u for u in discover_units(model, "block").units if u.name in index.units]
    with pytest.raises(ShardMismatchError, match="rope.freqs_cos is on the meta device and not in the shards"):
        materialize(model, index, streamed)


def test_index_tampered_unit_size_is_refused_at_load(flux: tuple, tmp_path: Path) -> None:
    src, _ = flux
    shutil.rmtree(tmp_path / "shards", ignore_errors=True)
    shard_checkpoint(src, tmp_path / "shards", progress=False)
    index = json.loads((tmp_path / "shards" / "index.json").read_text())
    index["units"]["transformer_blocks.1"]["offset"] += 1  # not 4096-aligned
    (tmp_path / "shards" / "index.json").write_text(json.dumps(index))
    from offload_core.disk.errors import ShardFormatError

    with pytest.raises(ShardFormatError, match="bad byte range"):
        load_index(tmp_path / "shards")
