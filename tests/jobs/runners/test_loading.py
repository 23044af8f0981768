"""load_transformer: the transformer built on the meta device and read straight into the engine's arena.

Against what the runner did before (diffusers' from_pretrained, the LoRA fused in RAM, then the
engine), exactly, on the tiny pipelines of every family; a LoRA injected for training gets peft's
init on a meta model; lazy_load reads shards; offload_to_disk still loads into RAM first.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_train_jobs import _transformer_inputs

from jobs.runners.families import get_adapter
from jobs.runners.lora import base_weights_on_host, export_lora, inject_lora
from jobs.runners.load import load_transformer, meta_transformer, module_bytes

FAMILIES = ["flux", "qwen-image", "wan", "sd3"]
CPU = torch.device("cpu")


def _reference(tiny: dict[str, Path], family: str, dtype: torch.dtype, lora: Path | None = None) -> torch.nn.Module:
    """The old path: from_pretrained, the LoRA fused on the CPU (diffusers' fuse_lora), then the engine."""
    from offload_core import enable_offload

    _, cls = get_adapter(family).classes()
    model = cls.from_pretrained(str(tiny[family]), subfolder="transformer", torch_dtype=dtype).requires_grad_(False)
    if lora is not None:
        _fuse(family, lora)(model)
    model._test_handle = enable_offload(model, target_device="cpu", offload_granularity="block")
    return model


def _fuse(family: str, lora: Path):
    from jobs.runners.infer import _fuse_lora

    return _fuse_lora(get_adapter(family), lora, 0.7)


def _out(family: str, model: torch.nn.Module, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    inputs = _transformer_inputs(family, model)
    inputs = {k: (v.to(device, dtype) if v.is_floating_point() else v.to(device)) if isinstance(v, torch.Tensor) else v
              for k, v in inputs.items()}
    with torch.no_grad():
        return model(**inputs)[0]


def _lora_file(tiny: dict[str, Path], family: str, tmp: Path) -> Path:
    adapter = get_adapter(family)
    _, cls = adapter.classes()
    model = cls.from_pretrained(str(tiny[family]), subfolder="transformer")
    torch.manual_seed(0)
    inject_lora(model, 4, 8.0, list(adapter.default_targets))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.normal_(0, 0.05)
    export_lora(model, adapter, tmp / "lora.safetensors", rank=4, alpha=8.0)
    return tmp / "lora.safetensors"


@pytest.mark.parametrize("family", FAMILIES)
def test_meta_then_weights_is_the_old_path_exactly(tiny: dict[str, Path], family: str, tmp_path: Path) -> None:
    adapter = get_adapter(family)
    lora = _lora_file(tiny, family, tmp_path)
    for dtype in (torch.bfloat16, torch.float32):
        ref = _reference(tiny, family, dtype, lora)
        new = load_transformer(tiny[family], adapter, dtype, CPU, offload={"offload_granularity": "block"},
                               with_weights=_fuse(family, lora))
        _, cls = adapter.classes()
        assert new.weight_bytes == module_bytes(cls.from_pretrained(str(tiny[family]), subfolder="transformer",
                                                                    torch_dtype=dtype))
        assert not any(".lora_" in n for n, _ in new.model.named_parameters())  # fused, then unloaded
        sa, sb = ref.state_dict(), new.model.state_dict()
        assert sa.keys() == sb.keys()
        for k in sa:
            assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), (family, dtype, k)
        assert torch.equal(_out(family, new.model, dtype), _out(family, ref, dtype)), (family, dtype)
        stats = new.stats()
        assert stats["streamed_bytes"] > 0 and stats["h2d_bytes"] > 0
        new.handle.remove()
        ref._test_handle.remove()


def test_the_fused_lora_lands_in_the_host_masters_and_the_device_copies_follow(tiny: dict[str, Path],
                                                                                tmp_path: Path) -> None:
    """A forward before the fuse leaves device copies (the ring) of the unfused weights: they are dropped."""
    family = "flux"
    adapter = get_adapter(family)
    lora = _lora_file(tiny, family, tmp_path)
    new = load_transformer(tiny[family], adapter, torch.float32, CPU, offload={"offload_granularity": "block"})
    before = _out(family, new.model, torch.float32)
    _fuse(family, lora)(new.model)
    after = _out(family, new.model, torch.float32)
    ref = _reference(tiny, family, torch.float32, lora)
    assert not torch.equal(before, after) and torch.equal(after, _out(family, ref, torch.float32))
    new.handle.remove()
    ref._test_handle.remove()


def test_a_lora_injected_on_the_meta_model_gets_peft_init_and_trains(tiny: dict[str, Path]) -> None:
    family = "flux"
    adapter = get_adapter(family)
    _, cls = adapter.classes()
    model = meta_transformer(cls, tiny[family] / "transformer", torch.bfloat16)
    torch.manual_seed(0)
    inject_lora(model, 4, 8.0, list(adapter.default_targets))
    lora = {n: p for n, p in model.named_parameters() if ".lora_" in n}
    assert lora and all(p.device.type == "cpu" and p.dtype == torch.float32 and p.requires_grad for p in lora.values())
    assert all(not p.any() for n, p in lora.items() if ".lora_B." in n)  # B starts at zero, as peft inits it
    a = [p for n, p in lora.items() if ".lora_A." in n]
    assert all(p.abs().sum() > 0 for p in a) and a[0].abs().max() <= 1 / a[0].shape[1] ** 0.5 + 1e-6  # kaiming, a=sqrt(5)

    loaded = load_transformer(tiny[family], adapter, torch.float32, CPU, offload={"offload_granularity": "block"},
                              training=True, prepare=lambda m: inject_lora(m, 4, 8.0, list(adapter.default_targets)),
                              make_optimizer=lambda m: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad]))
    m = loaded.model
    m.train()
    for _ in range(2):
        inputs = _transformer_inputs(family, m)
        loss = m(**inputs)[0].pow(2).mean()
        loss.backward()
        loaded.handle.after_backward()
        loaded.optimizer.step()
        loaded.optimizer.zero_grad()
    assert any(p.any() for n, p in m.named_parameters() if ".lora_B." in n)  # trained
    assert loaded.stats()["h2d_bytes"] > 0
    loaded.handle.remove()


def test_lazy_load_and_offload_to_disk_through_the_runner(tiny: dict[str, Path], tmp_path: Path) -> None:
    from offload_core.shard import shard_checkpoint

    family = "wan"  # rope tables no shard carries
    adapter = get_adapter(family)
    ref = _reference(tiny, family, torch.float32)
    want = _out(family, ref, torch.float32)
    shard_checkpoint(tiny[family] / "transformer", tmp_path / "shards", progress=False)
    lazy = load_transformer(tiny[family], adapter, torch.float32, CPU,
                            offload={"offload_granularity": "block", "lazy_load": True, "shard_dir": str(tmp_path / "shards"),
                                     "max_memory": 0})
    assert torch.equal(_out(family, lazy.model, torch.float32), want)
    assert lazy.stats()["disk_reads"] > 0
    lazy.handle.remove()
    otd = load_transformer(tiny[family], adapter, torch.float32, CPU,
                           offload={"offload_granularity": "block", "offload_to_disk": True,
                                    "shard_dir": str(tmp_path / "written")})
    assert (tmp_path / "written" / "index.json").is_file()
    assert torch.equal(_out(family, otd.model, torch.float32), want)
    otd.handle.remove()
    ref._test_handle.remove()


def test_base_weights_on_host_without_the_engine_is_plain_fuse(tiny: dict[str, Path], tmp_path: Path) -> None:
    """On a model in RAM (no engine) the context changes nothing: fuse_lora as diffusers does it."""
    family = "sd3"
    lora = _lora_file(tiny, family, tmp_path)
    _, cls = get_adapter(family).classes()
    a = cls.from_pretrained(str(tiny[family]), subfolder="transformer")
    b = cls.from_pretrained(str(tiny[family]), subfolder="transformer")
    for m in (a, b):
        m.load_lora_adapter(str(lora), weight_name="lora.safetensors", prefix="transformer", adapter_name="x")
    with base_weights_on_host(a):
        a.fuse_lora(lora_scale=0.5)
    b.fuse_lora(lora_scale=0.5)
    for k, v in b.state_dict().items():
        assert torch.equal(a.state_dict()[k], v), k
