"""The engine streaming from shards: enable_offload(lazy_load=True / offload_to_disk=True), on the CPU."""

from __future__ import annotations

import copy
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from offload_core import OffloadConfigError, enable_offload
from offload_core.disk.errors import ShardFormatError, ShardMismatchError, ShardReadError
from offload_core.disk.format import load_index
from offload_core.disk.integrate import max_memory_for
from offload_core.shard import shard_checkpoint
from offload_core_disk_helpers import Stack, flux_inputs, sharded_stack, tiny_flux


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, torch.nn.Module]:
    torch.manual_seed(0)
    ref = tiny_flux().requires_grad_(False)
    root = tmp_path_factory.mktemp("engine")
    ref.save_pretrained(root / "src")
    shard_checkpoint(root / "src", root / "shards", progress=False)
    return root / "src", root / "shards", ref


def _budget(dst: Path, cache: float, workers: int = 2) -> int:
    """max_memory for a cache of ``cache`` of the streamed bytes, the staging slots on top."""
    index = load_index(dst)
    return max_memory_for(index, index.units, cache, workers)


def _meta(src: Path) -> torch.nn.Module:
    from diffusers import FluxTransformer2DModel

    with torch.device("meta"):
        model = FluxTransformer2DModel.from_config(FluxTransformer2DModel.load_config(src))
    return model.requires_grad_(False)


def _run(model: torch.nn.Module, device: str = "cpu") -> torch.Tensor:
    inputs = {k: v.to(device) for k, v in flux_inputs().items()}
    with torch.no_grad():
        return model(**inputs, return_dict=False)[0]


@pytest.mark.parametrize("policy", ["belady", "lru"])
def test_inference_from_shards_is_bitwise_and_keeps_state(shards: tuple, policy: str) -> None:
    src, dst, ref = shards
    model = _meta(src)
    handle = enable_offload(model, target_device="cpu", lazy_load=True, shard_dir=str(dst), max_memory=_budget(dst, 0.2),
                            num_disk_workers=2, offload_granularity="block", disk_cache_policy=policy)
    want = _run(ref)
    for _ in range(3):
        assert torch.equal(_run(model), want)
    s = handle.stats()
    assert s["disk_reads"] > 0 and s["disk_cache_hits"] + s["disk_cache_misses"] > 0
    assert s["pinned_capacity_bytes"] >= s["disk_cache_capacity_bytes"]
    assert s["host_store"] == "disk" and s["host_store_reason"].startswith(f"lazy_load: the shards in {dst}")
    sd = model.state_dict()  # real values while offloaded, read through the store
    assert all(torch.equal(sd[k], v) for k, v in ref.state_dict().items())
    handle.remove()
    assert torch.equal(_run(model), want)


@pytest.mark.parametrize("frozen", [True, False], ids=["frozen", "as_from_pretrained"])
def test_a_frozen_models_first_pass_reads_ahead_in_module_order(shards: tuple, frozen: bool) -> None:
    """No trace exists before the first pass: the disk reads ahead in the shards' (module) order, which is
    the forward's for the blocks, and nothing it read is wasted; the first traced cycle then plans the rest.
    Also for a model left as from_pretrained gives it (every parameter requires grad): the engine takes
    it as an inference model."""
    src, dst, ref = shards
    model = _meta(src) if frozen else _meta(src).requires_grad_(True)
    handle = enable_offload(model, target_device="cpu", lazy_load=True, shard_dir=str(dst), max_memory=_budget(dst, 0.2),
                            num_disk_workers=2, offload_granularity="block")
    deadline = time.monotonic() + 10
    while handle.stats()["disk_reads"] < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert handle.stats()["disk_reads"] >= 2  # before any use
    want = _run(ref)
    for _ in range(3):
        assert torch.equal(_run(model), want)
    assert handle.stats()["disk_wasted_reads"] == 0


def test_load_state_dict_while_streaming_from_shards_sticks(shards: tuple) -> None:
    """Written units are kept by the store (their files no longer hold their bytes): the new values stay."""
    src, dst, _ = shards
    torch.manual_seed(5)
    other = tiny_flux().requires_grad_(False)
    model = _meta(src)
    handle = enable_offload(model, target_device="cpu", lazy_load=True, shard_dir=str(dst), max_memory=_budget(dst, 0.2),
                            offload_granularity="block")
    _run(model)
    model.load_state_dict(other.state_dict())
    for _ in range(2):
        assert torch.equal(_run(model), _run(other))
    assert handle.stats()["disk_kept_bytes"] > 0
    handle.remove()


def test_offload_to_disk_writes_frees_and_streams(shards: tuple, tmp_path: Path) -> None:
    _, _, ref = shards
    model = copy.deepcopy(ref)
    want = _run(ref)
    handle = enable_offload(model, target_device="cpu", offload_to_disk=True, shard_dir=str(tmp_path / "otd"),
                            max_memory=0, offload_granularity="block")
    assert (tmp_path / "otd" / "index.json").is_file()
    for _ in range(2):
        assert torch.equal(_run(model), want)
    assert handle.stats()["disk_cache_hits"] == 0 and handle.stats()["disk_reads"] > 0
    assert handle.stats()["host_store"] == "disk" and "offload_to_disk" in handle.stats()["host_store_reason"]
    handle.remove()


def test_lora_training_from_shards_is_bitwise(shards: tuple) -> None:
    from peft import LoraConfig

    src, dst, base = shards
    cfg = LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian", target_modules=["to_q", "to_k", "to_v", "to_out.0"])
    torch.manual_seed(1)
    ref = copy.deepcopy(base)
    ref.add_adapter(cfg)
    lora = {k: v.clone() for k, v in ref.state_dict().items() if "lora" in k}
    model = _meta(src)
    model.add_adapter(cfg)
    model.load_state_dict(lora, strict=False, assign=True)  # LoRA weights made on the meta device get values
    for m in (ref, model):
        m.enable_gradient_checkpointing()
    handle = enable_offload(model, target_device="cpu", lazy_load=True, shard_dir=str(dst), max_memory=_budget(dst, 0.2),
                            offload_granularity="block")

    def train(m: torch.nn.Module) -> list[float]:
        opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3)
        m.train()
        losses = []
        for _ in range(3):
            loss = m(**flux_inputs(), return_dict=False)[0].pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    assert train(model) == train(ref)
    got = {k: v for k, v in model.state_dict().items() if "lora" in k}
    assert all(torch.equal(got[k], v) for k, v in ref.state_dict().items() if "lora" in k)
    handle.remove()


def test_offload_to_disk_of_a_peft_model_names_the_checkpoints_tensors_and_trains_bitwise(shards: tuple,
                                                                                          tmp_path: Path) -> None:
    """A LoRA-wrapped model's shards are indexed under the checkpoint's names (no base_layer step), so the
    engine binds them back (it refused its own shards with ShardMismatchError before)."""
    from peft import LoraConfig

    _, _, base = shards
    cfg = LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian", target_modules=["to_q", "to_k", "to_v", "to_out.0"])
    torch.manual_seed(1)
    ref = copy.deepcopy(base)
    ref.add_adapter(cfg)
    model = copy.deepcopy(ref)
    handle = enable_offload(model, target_device="cpu", offload_to_disk=True, shard_dir=str(tmp_path / "otd"),
                            max_memory=0, offload_granularity="block")
    names = {t.name for s in load_index(tmp_path / "otd").units.values() for t in s.tensors}
    assert names and not any("base_layer" in n for n in names)
    for m in (ref, model):
        loss = m(**flux_inputs(), return_dict=False)[0].pow(2).mean()
        loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads and all(torch.equal(grads[n], p.grad) for n, p in ref.named_parameters() if p.grad is not None)
    handle.remove()


def test_bad_shard_dirs_are_named(shards: tuple, tmp_path: Path) -> None:
    src, dst, _ = shards
    with pytest.raises(ShardFormatError, match="index.json: missing"):
        enable_offload(_meta(src), target_device="cpu", lazy_load=True, shard_dir=str(tmp_path / "none"))
    shard_checkpoint(src, tmp_path / "leaf", granularity="leaf", progress=False)
    with pytest.raises(ShardMismatchError, match="not in the index"):
        enable_offload(_meta(src), target_device="cpu", lazy_load=True, shard_dir=str(tmp_path / "leaf"),
                       offload_granularity="block")
    with pytest.raises(OffloadConfigError, match="weight_dtype"):
        enable_offload(_meta(src), target_device="cpu", lazy_load=True, shard_dir=str(dst),
                       weight_dtype="float8_e4m3fn")


def test_a_shard_deleted_mid_run_fails_the_forward_cleanly(shards: tuple, tmp_path: Path) -> None:
    import shutil

    src, dst, _ = shards
    shutil.copytree(dst, tmp_path / "shards")
    model = _meta(src)
    handle = enable_offload(model, target_device="cpu", lazy_load=True, shard_dir=str(tmp_path / "shards"),
                            max_memory=0, offload_granularity="block")
    _run(model)
    (tmp_path / "shards" / "single_transformer_blocks.1.safetensors").unlink()
    box: list[Any] = []

    def run() -> None:
        try:
            _run(model)
            _run(model)
        except BaseException as exc:  # noqa: BLE001
            box.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "the forward hung on a missing shard"
    assert isinstance(box[0], ShardReadError) and "single_transformer_blocks.1.safetensors: missing" in str(box[0])
    with pytest.raises(ShardReadError, match="missing"):  # remove() needs every unit's bytes back
        handle.remove()


@pytest.mark.gpu
def test_cuda_lazy_load_is_bitwise_and_pinned(shards: tuple) -> None:
    src, dst, ref = shards
    model = _meta(src)
    handle = enable_offload(model, target_device="cuda", lazy_load=True, shard_dir=str(dst), max_memory=_budget(dst, 0.2),
                            num_disk_workers=2, offload_granularity="block")
    want = _run(copy.deepcopy(ref).cuda(), "cuda")
    for _ in range(3):
        assert torch.equal(_run(model, "cuda"), want)
    s = handle.stats()
    assert s["pinned"] is True and s["disk_reads"] > 0
    handle.remove()


# ------------------------------------------------------------------ max_memory through the engine
@pytest.fixture(scope="module")
def stack_shards(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    root = tmp_path_factory.mktemp("stack")
    model, _, _ = sharded_stack(root)
    return root, model


def _meta_stack() -> torch.nn.Module:
    with torch.device("meta"):
        return Stack().requires_grad_(False)


@pytest.mark.parametrize("f", [0.25, 0.5, 0.75])
def test_max_memory_holds_the_staging_and_a_cache_whose_hit_rate_is_its_share(stack_shards: tuple, f: float) -> None:
    """max_memory is every pinned byte of the disk tier (staging slots + cache); the cache part's share
    of the streamed bytes is the hit rate over 20 passes through the engine (reads counted)."""
    root, ref = stack_shards
    index = load_index(root)
    blocks = [n for n in index.units if n.startswith("blocks.")]
    budget = max_memory_for(index, blocks, f, num_disk_workers=2)
    model = _meta_stack()
    handle = enable_offload(model, target_device="cpu", lazy_load=True, shard_dir=str(root), max_memory=budget,
                            num_disk_workers=2, offload_granularity="block", prefetch=2)
    x = torch.randn(3, 64)
    with torch.no_grad():
        want = ref(x)
        for _ in range(2):  # the first pass traces the order; the store plans from the second
            assert torch.equal(model(x), want)
        s0 = handle.stats()
        for _ in range(20):
            assert torch.equal(model(x), want)
    s = handle.stats()
    hits, misses = s["disk_cache_hits"] - s0["disk_cache_hits"], s["disk_cache_misses"] - s0["disk_cache_misses"]
    # one acquire per use (a prefetch without a slot asks for nothing); a call's last prefetches are the next
    # call's first units (prefetch=2), acquired then only if their reads are done (non-blocking): a snapshot
    # between calls falls on either side of them. With the fixed set (cache.py) the first units need not be
    # cached, so whether they are ready varies: calls of 38-42 acquires were seen, 40 a call in all
    assert abs(hits + misses - 20 * len(blocks)) <= 2
    streamed = sum(index.units[n].read_nbytes for n in blocks)
    assert abs(s["disk_cache_capacity_bytes"] / streamed - f) <= 0.02
    assert abs(hits / (hits + misses) - f) <= 0.02, hits / (hits + misses)
    assert s["disk_bytes"] - s0["disk_bytes"] == pytest.approx((1 - f) * 20 * streamed, rel=0.05)
    assert s["disk_cache_capacity_bytes"] + s["disk_stream_bytes"] <= budget  # what was asked, no more
    assert s["pinned_capacity_bytes"] <= budget
    for key in ("disk_gbps", "disk_stall_ms", "disk_cache_evictions", "disk_cache_hit_bytes", "disk_cache_used_bytes"):
        assert key in s
    handle.remove()
    assert torch.equal(model(x), want)


def test_max_memory_too_small_for_the_staging_is_named(stack_shards: tuple) -> None:
    root, _ = stack_shards
    with pytest.raises(OffloadConfigError, match=r"max_memory: 1000 bytes cannot hold the disk tier's staging slots"):
        enable_offload(_meta_stack(), target_device="cpu", lazy_load=True, shard_dir=str(root), max_memory=1000,
                       offload_granularity="block")
    model = _meta_stack()  # 0: no cache at all, the staging slots only
    handle = enable_offload(model, target_device="cpu", lazy_load=True, shard_dir=str(root), max_memory=0,
                            offload_granularity="block")
    assert handle.stats()["disk_cache_capacity_bytes"] == 0
    handle.remove()


def test_a_meta_model_without_weights_is_refused_by_name() -> None:
    with pytest.raises(OffloadConfigError, match=r"weights: the model has tensors on the meta device \(blocks\.0\.0\.weight"):
        enable_offload(_meta_stack(), target_device="cpu")


@pytest.mark.parametrize("name", ["wan", "qwen"])
def test_lazy_load_recomputes_the_tables_no_checkpoint_carries(tmp_path: Path, name: str) -> None:
    """Wan's rope tables are non-persistent buffers, Qwen-Image's plain tensor attributes: built on the
    meta device they have no value, and no shard has them; they come from the model built again."""
    from offload_core_test_models import CASES

    case = CASES[name]
    ref = case.build("frozen")
    ref.save_pretrained(tmp_path / "src")
    shard_checkpoint(tmp_path / "src", tmp_path / "shards", progress=False)
    cls = type(ref)
    with torch.device("meta"):
        model = cls.from_config(cls.load_config(tmp_path / "src")).requires_grad_(False).eval()
    handle = enable_offload(model, target_device="cpu", lazy_load=True, shard_dir=str(tmp_path / "shards"),
                            offload_granularity="block")
    inputs = case.make_inputs(2)
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(case.forward(model, inputs), case.forward(ref, inputs))
    handle.remove()
