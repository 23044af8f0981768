"""offload_core.shard (offload_core.disk): the checkpoint shard preprocessor, on tiny diffusers models (CPU)."""

from __future__ import annotations

import errno
import json
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from safetensors import safe_open

import offload_core.disk.source as source_mod
import offload_core.disk.write as write_mod
from offload_core.disk.errors import ShardChecksumError, ShardFormatError, ShardReadError, ShardWriteError
from offload_core.disk.grouping import skeleton
from offload_core.disk.source import SafetensorsSource
from offload_core.errors import ShardError
from offload_core.quant import quantize
from offload_core.shard import shard_checkpoint, verify_shards
from offload_core.units import discover_units


def _flux() -> torch.nn.Module:
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=2, num_single_layers=2,
                                  attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                  pooled_projection_dim=32, guidance_embeds=False, axes_dims_rope=(4, 4, 8))


def _sd3() -> torch.nn.Module:
    from diffusers import SD3Transformer2DModel

    return SD3Transformer2DModel(sample_size=32, patch_size=1, in_channels=4, num_layers=2, attention_head_dim=8,
                                 num_attention_heads=4, joint_attention_dim=32, caption_projection_dim=32,
                                 pooled_projection_dim=64, out_channels=4, pos_embed_max_size=96)


def _wan() -> torch.nn.Module:
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4,
                                 out_channels=4, text_dim=16, freq_dim=256, ffn_dim=32, num_layers=2,
                                 cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32)


BUILDERS: dict[str, Callable[[], torch.nn.Module]] = {"flux": _flux, "sd3": _sd3, "wan": _wan}


def _save(name: str, path: Path, **kwargs: Any) -> tuple[Path, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = BUILDERS[name]()
    model.save_pretrained(path, **kwargs)
    return path, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def flux(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    return _save("flux", tmp_path_factory.mktemp("flux") / "transformer")


def _engine_units(name: str, granularity: str, state: dict[str, torch.Tensor]) -> list[str]:
    """The units discover_units finds on the model, keeping those with a tensor in the checkpoint."""
    model = BUILDERS[name]().requires_grad_(False)
    names = {id(t): n for n, t in [*model.named_parameters(), *model.named_buffers()]}
    plan = discover_units(model, granularity)
    return [u.name for u in plan.units if any(names.get(id(s.tensor())) in state for s in u.tensors)]


def _load_all(dst: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(dst.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                if k.startswith("__pad__."):  # alignment padding, indexed so that safetensors reads the file
                    continue
                assert k not in out, f"{k} is in two shard files"
                out[k] = h.get_tensor(k)
    return out


def _index(dst: Path) -> dict[str, Any]:
    return json.loads((dst / "index.json").read_text())


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


# ------------------------------------------------------------------ unit names and layout


@pytest.mark.parametrize("name", ["flux", "sd3", "wan"])
def test_unit_names_match_discover_units(name: str, tmp_path: Path) -> None:
    src, state = _save(name, tmp_path / name)
    summary = shard_checkpoint(src, tmp_path / "out", progress=False)
    index = _index(tmp_path / "out")
    assert list(index["units"]) == _engine_units(name, "block", state)
    assert index["format"] == "offload-jobs-shards" and index["format_version"] == 2
    assert index["granularity"] == "block" and index["grouping"] == "model"
    # One file per block and one for the rest; every unit names a file that exists.
    blocks = [u for u in index["units"] if any(u.startswith(bl + ".") for bl in index["block_lists"])]
    assert blocks, "the model has blocks"
    for u in blocks:
        assert index["units"][u]["file"] == f"{u}.safetensors"
    assert {e["file"] for u, e in index["units"].items() if u not in blocks} == {"non_block.safetensors"}
    assert sorted(p.name for p in (tmp_path / "out").glob("*.safetensors")) == sorted(index["files"])
    assert summary["units"] == len(index["units"]) and summary["tensors"] == len(state)


def test_round_trip_is_bit_exact_from_a_sharded_checkpoint(tmp_path: Path) -> None:
    src, state = _save("flux", tmp_path / "flux", max_shard_size="100KB")
    assert len(list(src.glob("*.safetensors"))) > 1 and (src / "diffusion_pytorch_model.safetensors.index.json").exists()
    summary = shard_checkpoint(src, tmp_path / "out", progress=False)
    loaded = _load_all(tmp_path / "out")
    assert loaded.keys() == state.keys()
    for k, v in state.items():
        assert loaded[k].dtype == v.dtype and torch.equal(_bits(loaded[k]), _bits(v)), k
    # Every unit is one 4096-aligned byte range of its file (its slab), and every tensor's entry
    # (offset in the slab, size) describes its bytes there; the slab's sha256 is the range's.
    index = _index(tmp_path / "out")
    import hashlib

    for unit, entry in index["units"].items():
        raw = (tmp_path / "out" / entry["file"]).read_bytes()
        assert entry["offset"] % 4096 == 0 and len(raw) % 4096 == 0
        slab = raw[entry["offset"]:entry["offset"] + entry["nbytes"]]
        assert hashlib.sha256(slab).hexdigest() == entry["sha256"]
        for k, meta in entry["tensors"].items():
            assert meta["offset"] % 64 == 0
            assert slab[meta["offset"]:meta["offset"] + meta["nbytes"]] == _bits(state[k]).numpy().tobytes(), k
            assert meta["shape"] == list(state[k].shape) and meta["dtype"] == "float32"
    assert summary["bytes"] == sum(f.stat().st_size for f in (tmp_path / "out").glob("*.safetensors"))
    verify_shards(tmp_path / "out")


def test_progress_bar_goes_to_stderr(flux: tuple[Path, dict], tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    shard_checkpoint(flux[0], tmp_path / "out", progress=True)
    out, err = capsys.readouterr()
    assert out == "" and "12/12" in err


@pytest.mark.parametrize("dtype", [None, "float8_e4m3fn"])
def test_streams_one_tensor_at_a_time(flux: tuple[Path, dict], tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch, dtype: str | None) -> None:
    import weakref

    real_read = SafetensorsSource.read_into
    alive: list[weakref.ref] = []

    def read_into(self: Any, name: str, out: torch.Tensor) -> torch.Tensor:
        assert all(r() is None for r in alive), "a tensor read from the source outlived its write"
        alive.append(weakref.ref(out))
        return real_read(self, name, out)

    monkeypatch.setattr(SafetensorsSource, "read_into", read_into)
    summary = shard_checkpoint(flux[0], tmp_path / "out", dtype=dtype, progress=False)
    assert len(alive) == summary["tensors"] == len(flux[1])


# ------------------------------------------------------------------ dtypes


def test_bf16_conversion(flux: tuple[Path, dict], tmp_path: Path) -> None:
    src, state = flux
    shard_checkpoint(src, tmp_path / "out", dtype="bfloat16", progress=False, verify=True)
    loaded = _load_all(tmp_path / "out")
    for k, v in state.items():
        assert loaded[k].dtype == torch.bfloat16 and torch.equal(loaded[k], v.to(torch.bfloat16)), k
    index = _index(tmp_path / "out")
    assert index["dtype"] == "bfloat16"
    meta = index["units"]["transformer_blocks.0"]["tensors"]["transformer_blocks.0.attn.to_q.weight"]
    assert meta["dtype"] == "bfloat16" and meta["source_dtype"] == "float32" and "scale" not in meta
    # the slabs halve; the files add at most a page per unit and a header page per file
    fp32 = sum(v.numel() * 4 for v in state.values())
    assert sum(e["nbytes"] for e in index["units"].values()) < 0.55 * fp32
    assert sum(f.stat().st_size for f in (tmp_path / "out").glob("*.safetensors")) < (
        0.55 * fp32 + 4096 * (len(index["units"]) + 2 * len(index["files"])))


@pytest.mark.parametrize("scaling", ["tensor", None])  # None: the engine's default, row
def test_fp8_stores_quantize_data_and_scales(flux: tuple[Path, dict], tmp_path: Path, scaling: str | None) -> None:
    src, state = flux
    shard_checkpoint(src, tmp_path / "out", dtype="float8_e4m3fn", progress=False, verify=True, fp8_scaling=scaling)
    loaded = _load_all(tmp_path / "out")
    index = _index(tmp_path / "out")
    metas = {k: m for e in index["units"].values() for k, m in e["tensors"].items()}
    matrices = [k for k, v in state.items() if v.dim() >= 2]
    assert matrices and index["fp8_scaling"] == (scaling or "row")
    for k, v in state.items():
        if v.dim() >= 2:
            want, scale = quantize(v, torch.float8_e4m3fn, scaling=scaling or "row")
            assert loaded[k].dtype == torch.float8_e4m3fn
            assert torch.equal(_bits(loaded[k]), _bits(want)), k
            assert metas[k]["dtype"] == "float8_e4m3fn"
            if scaling == "tensor":
                assert metas[k]["scale"] == scale and "scale_shape" not in metas[k]
            else:  # fp32 scales in the slab, named in the safetensors header
                assert "scale" not in metas[k] and torch.equal(loaded["__scale__." + k], scale)
        else:  # norms and biases stay as they were, as quant.eligible does
            assert loaded[k].dtype == v.dtype and torch.equal(loaded[k], v) and "scale" not in metas[k], k


def test_bad_dtype_and_granularity_name_the_field(flux: tuple[Path, dict], tmp_path: Path) -> None:
    with pytest.raises(ShardError, match="dtype"):
        shard_checkpoint(flux[0], tmp_path / "out", dtype="int4", progress=False)
    with pytest.raises(ShardError, match="granularity"):
        shard_checkpoint(flux[0], tmp_path / "out", granularity="layer", progress=False)


# ------------------------------------------------------------------ resume and interruption


def test_resume_skips_finished_files_and_redoes_damaged_ones(flux: tuple[Path, dict], tmp_path: Path) -> None:
    src, state = flux
    dst = tmp_path / "out"
    first = shard_checkpoint(src, dst, progress=False)
    assert (first["written"], first["resumed"]) == (first["units"], 0)
    again = shard_checkpoint(src, dst, progress=False)
    assert (again["written"], again["resumed"], again["written_bytes"]) == (0, first["units"], 0)
    # A damaged file (same size, one byte flipped) is rewritten; the others are not.
    damaged = dst / "transformer_blocks.1.safetensors"
    entry = _index(dst)["units"]["transformer_blocks.1"]
    raw = bytearray(damaged.read_bytes())
    raw[entry["offset"] + entry["nbytes"] // 2] ^= 0xFF  # inside the slab
    damaged.write_bytes(bytes(raw))
    third = shard_checkpoint(src, dst, progress=False)
    assert (third["written"], third["resumed"]) == (1, first["units"] - 1)
    verify_shards(dst)
    # Another dtype is another job: nothing is reused.
    fourth = shard_checkpoint(src, dst, dtype="bfloat16", progress=False)
    assert fourth["resumed"] == 0


def test_interrupted_run_leaves_no_partial_files_and_a_rerun_completes(
        flux: tuple[Path, dict], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src, state = flux
    dst = tmp_path / "out"
    real_read = SafetensorsSource.read_into
    calls = {"n": 0}

    def read_then_die(self: Any, name: str, out: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 50:  # in the middle of the third block file
            raise KeyboardInterrupt
        return real_read(self, name, out)

    monkeypatch.setattr(SafetensorsSource, "read_into", read_then_die)
    with pytest.raises(KeyboardInterrupt):
        shard_checkpoint(src, dst, progress=False)
    assert not list(dst.glob("*.tmp")) and not (dst / "index.json").exists()
    done = sorted(p.name for p in dst.glob("*.safetensors"))
    assert 0 < len(done) < 5
    monkeypatch.setattr(SafetensorsSource, "read_into", real_read)
    summary = shard_checkpoint(src, dst, progress=False)
    assert summary["resumed"] == len(done) and summary["written"] == summary["units"] - len(done)
    loaded = _load_all(dst)
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    verify_shards(dst)


def test_disk_full_is_a_shard_error_and_removes_the_partial_file(
        flux: tuple[Path, dict], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dst = tmp_path / "out"
    opened: list[str] = []

    class FullDisk:  # the disk fills up 1000 bytes into the second shard file
        def __init__(self, f: Any, limit: float) -> None:
            self.f, self.left = f, limit

        def write(self, buf: Any) -> int:
            self.left -= memoryview(buf).nbytes
            if self.left < 0:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(buf)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.f, name)

        def __enter__(self) -> FullDisk:
            return self

        def __exit__(self, *exc: Any) -> None:
            self.f.close()

    def fake_open(path: Any, mode: str = "r") -> FullDisk:
        if str(path).endswith(".safetensors.tmp"):
            opened.append(str(path))
        return FullDisk(open(path, mode), 1000 if len(opened) >= 2 else float("inf"))

    monkeypatch.setattr(write_mod, "open", fake_open, raising=False)
    with pytest.raises(ShardWriteError, match="no space left") as info:
        shard_checkpoint(flux[0], dst, progress=False)
    assert str(info.value).startswith(opened[1].removesuffix(".tmp") + ":")
    assert not list(dst.glob("*.tmp")) and not (dst / "index.json").exists()
    monkeypatch.undo()
    summary = shard_checkpoint(flux[0], dst, progress=False)
    assert summary["resumed"] == 1 and summary["written"] == summary["units"] - 1
    verify_shards(dst)


# ------------------------------------------------------------------ errors a user can cause


def test_missing_src(tmp_path: Path) -> None:
    with pytest.raises(ShardError, match="no such file") as info:
        shard_checkpoint(tmp_path / "nope", tmp_path / "out", progress=False)
    assert str(tmp_path / "nope") in str(info.value)
    assert isinstance(info.value, FileNotFoundError)  # the shard runner reports it as setup_failed
    assert not (tmp_path / "out").exists()


def test_folder_without_safetensors(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "model_index.json").write_text("{}")
    with pytest.raises(ShardError, match="no .safetensors files") as info:
        shard_checkpoint(tmp_path / "empty", tmp_path / "out", progress=False)
    assert str(tmp_path / "empty") in str(info.value) and "transformer/" in str(info.value)


def test_truncated_source_names_the_file(flux: tuple[Path, dict], tmp_path: Path) -> None:
    import shutil

    src = tmp_path / "flux"
    shutil.copytree(flux[0], src)
    bad = src / "diffusion_pytorch_model.safetensors"
    with open(bad, "r+b") as f:
        f.truncate(bad.stat().st_size - 1000)
    with pytest.raises(ShardError) as info:
        shard_checkpoint(src, tmp_path / "out", progress=False)
    assert str(bad) in str(info.value) and "\n" not in str(info.value)
    assert not (tmp_path / "out" / "index.json").exists()


def test_failed_tensor_read_names_the_file(flux: tuple[Path, dict], tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    src = flux[0] / "diffusion_pytorch_model.safetensors"
    bad = SafetensorsSource.open(flux[0]).tensors["proj_out.weight"].start
    real = source_mod.os.preadv

    def preadv(fd: int, bufs: Any, offset: int) -> int:  # the header reads fine, one tensor's data does not
        if offset == bad:
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, bufs, offset)

    monkeypatch.setattr(source_mod.os, "preadv", preadv)
    with pytest.raises(ShardError, match="cannot read tensor proj_out.weight: Input/output error") as info:
        shard_checkpoint(flux[0], tmp_path / "out", progress=False)
    assert str(info.value).startswith(str(src) + ":")
    assert not list((tmp_path / "out").glob("*.tmp")) and not (tmp_path / "out" / "index.json").exists()


def test_unknown_model_class_names_the_config(flux: tuple[Path, dict], tmp_path: Path) -> None:
    import shutil

    src = tmp_path / "flux"
    shutil.copytree(flux[0], src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["_class_name"] = "NoSuchTransformer3000"
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ShardError, match="NoSuchTransformer3000") as info:
        shard_checkpoint(src, tmp_path / "out", progress=False)
    assert str(src / "config.json") in str(info.value)


def test_config_of_another_model_is_caught(flux: tuple[Path, dict], tmp_path: Path) -> None:
    import shutil

    src = tmp_path / "flux"
    shutil.copytree(flux[0], src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_attention_heads"] = 4  # the checkpoint's matrices no longer fit
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ShardError, match="shape"):
        shard_checkpoint(src, tmp_path / "out", progress=False)


def test_unwritable_dst(flux: tuple[Path, dict], tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(ShardError) as info:
        shard_checkpoint(flux[0], tmp_path / "a-file" / "out", progress=False)
    assert str(tmp_path / "a-file") in str(info.value)
    with pytest.raises(ShardError, match="must differ"):
        shard_checkpoint(flux[0], flux[0], progress=False)


def test_verify_catches_tampering(flux: tuple[Path, dict], tmp_path: Path) -> None:
    dst = tmp_path / "out"
    shard_checkpoint(flux[0], dst, progress=False)
    assert verify_shards(dst)["slabs"] == 12
    f = dst / "single_transformer_blocks.0.safetensors"
    entry = _index(dst)["units"]["single_transformer_blocks.0"]
    raw = bytearray(f.read_bytes())
    raw[entry["offset"] + entry["nbytes"] // 2] ^= 0x01
    f.write_bytes(bytes(raw))
    with pytest.raises(ShardChecksumError, match="sha256") as info:
        verify_shards(dst)
    assert str(info.value).startswith(str(f) + ":") and "single_transformer_blocks.0" in str(info.value)
    f.write_bytes(bytes(raw[:-8]))
    with pytest.raises(ShardReadError, match="bytes") as info:
        verify_shards(dst)
    assert str(f) in str(info.value)
    f.unlink()
    with pytest.raises(ShardReadError, match="missing") as info:
        verify_shards(dst)
    assert str(f) in str(info.value)
    index = _index(dst)
    del index["units"]
    (dst / "index.json").write_text(json.dumps(index))
    with pytest.raises(ShardFormatError, match="malformed"):
        verify_shards(dst)
    (dst / "index.json").unlink()
    with pytest.raises(ShardFormatError, match="index.json"):
        verify_shards(dst)


def test_header_is_checked_too(flux: tuple[Path, dict], tmp_path: Path) -> None:
    dst = tmp_path / "out"
    shard_checkpoint(flux[0], dst, progress=False)
    f = dst / "transformer_blocks.0.safetensors"
    raw = bytearray(f.read_bytes())
    at = raw.index(b"transformer_blocks.0.attn.to_q.weight")
    raw[at] = ord("X")  # a renamed tensor, same size
    f.write_bytes(bytes(raw))
    with pytest.raises(ShardChecksumError, match="header") as info:
        verify_shards(dst)
    assert str(f) in str(info.value)


@pytest.mark.parametrize("version, words", [(1, "Re-shard the checkpoint"), (99, "upgrade offload-jobs or re-shard"),
                                            ("2", "is not one this offload-jobs reads")])
def test_other_format_versions_are_refused_by_name(flux: tuple[Path, dict], tmp_path: Path, version: Any,
                                                   words: str) -> None:
    dst = tmp_path / "out"
    shard_checkpoint(flux[0], dst, progress=False)
    index = _index(dst)
    index["format_version"] = version
    (dst / "index.json").write_text(json.dumps(index))
    with pytest.raises(ShardFormatError, match=words) as info:
        verify_shards(dst)
    assert str(info.value).startswith(str(dst / "index.json") + ":") and "\n" not in str(info.value)


def test_a_v1_directory_is_rewritten_in_place(flux: tuple[Path, dict], tmp_path: Path) -> None:
    """A directory sharded by the v1 writer (same file names, other layout) re-shards cleanly."""
    dst = tmp_path / "out"
    shard_checkpoint(flux[0], dst, progress=False)
    index = _index(dst)
    index["format_version"] = 1
    (dst / "index.json").write_text(json.dumps(index))
    (dst / ".progress.json").write_text(json.dumps({"fingerprint": {"format_version": 1}, "files": {}}))
    summary = shard_checkpoint(flux[0], dst, progress=False)
    assert summary["resumed"] == 0 and _index(dst)["format_version"] == 2
    verify_shards(dst)


# ------------------------------------------------------------------ single-file checkpoints


@pytest.mark.parametrize("granularity", ["block", "phase", "leaf"])
def test_single_file_groups_like_the_engine(flux: tuple[Path, dict], tmp_path: Path, granularity: str) -> None:
    src, state = flux
    single = tmp_path / "flux.safetensors"
    single.write_bytes((src / "diffusion_pytorch_model.safetensors").read_bytes())
    shard_checkpoint(single, tmp_path / "out", granularity=granularity, progress=False)
    index = _index(tmp_path / "out")
    assert index["grouping"] == "names" and index["block_lists"] == ["single_transformer_blocks", "transformer_blocks"]
    assert set(index["units"]) == set(_engine_units("flux", granularity, state))
    assert sorted(index["files"]) == sorted(["non_block.safetensors", "transformer_blocks.0.safetensors",
                                             "transformer_blocks.1.safetensors",
                                             "single_transformer_blocks.0.safetensors",
                                             "single_transformer_blocks.1.safetensors"])
    loaded = _load_all(tmp_path / "out")
    assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], v) for k, v in state.items())


def test_single_file_with_a_config_uses_the_model(flux: tuple[Path, dict], tmp_path: Path) -> None:
    src, state = flux
    shard_checkpoint(src / "diffusion_pytorch_model.safetensors", tmp_path / "out", config=src, progress=False)
    index = _index(tmp_path / "out")
    assert index["grouping"] == "model" and list(index["units"]) == _engine_units("flux", "block", state)


def test_block_lists_from_names() -> None:
    """A checkpoint without a config: units.py finds the block lists on a skeleton made from the names."""
    names = ["blocks.0.a.weight", "blocks.1.a.weight", "proj.0.weight", "head.weight",
             "enc.layers.0.w", "enc.layers.1.w", "pos.0", "pos.1", "one.0.w", "blocks.10.a.weight"]
    tensors = {n: source_mod.SourceTensor(n, Path("x.safetensors"), torch.float32, [2, 2], 0, 16) for n in names}
    plan = discover_units(skeleton(tensors), "block")
    assert plan.block_lists == ["blocks", "enc.layers"]
    assert [u.name for u in plan.units][:4] == ["blocks.0", "blocks.1", "blocks.10", "enc.layers.0"]
