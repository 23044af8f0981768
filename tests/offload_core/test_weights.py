"""enable_offload(meta_model, weights=PATH): the checkpoint read straight into the arena (CPU).

Compared exactly with diffusers' from_pretrained and then enable_offload, for the tiny Flux, SD3, Wan
and Qwen-Image transformers (Wan's rope tables are non-persistent buffers, Qwen-Image's are plain
tensor attributes: neither is in a checkpoint). Host RSS is measured in a fresh process.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from offload_core import CheckpointMismatchError, OffloadConfigError, ShardError, enable_offload
from offload_core_test_models import CASES

FAMILIES = ["flux", "sd3", "wan", "qwen"]
REPO = Path(__file__).resolve().parents[2]


def _saved(name: str, root: Path, **save: Any) -> tuple[nn.Module, Path]:
    model = CASES[name].build("frozen")
    model.save_pretrained(root / name, **save)
    return model, root / name


def _meta(cls: type, folder: Path, how: str) -> nn.Module:
    config = cls.load_config(folder)
    if how == "meta":
        with torch.device("meta"):
            model = cls.from_config(config)
    else:
        from accelerate import init_empty_weights

        with init_empty_weights():
            model = cls.from_config(config)
    return model.requires_grad_(False).eval()


def _same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k].cpu(), sb[k].cpu()), k


@pytest.mark.parametrize("how", ["meta", "init_empty_weights"])
@pytest.mark.parametrize("name", FAMILIES)
def test_weights_are_bitwise_from_pretrained_then_offload(tmp_path: Path, name: str, how: str) -> None:
    case = CASES[name]
    _, folder = _saved(name, tmp_path, max_shard_size="40KB")  # several files and an index
    assert (folder / "diffusion_pytorch_model.safetensors.index.json").is_file()
    cls = type(case.build("frozen"))
    ref = cls.from_pretrained(folder).requires_grad_(False)
    ref_handle = enable_offload(ref, target_device="cpu")
    model = _meta(cls, folder, how)
    handle = enable_offload(model, target_device="cpu", weights=str(folder))
    assert handle.stats()["streamed_bytes"] == ref_handle.stats()["streamed_bytes"] > 0
    assert not any(t.device.type == "meta" for t in [*model.parameters(), *model.buffers()])
    inputs = case.make_inputs(3)
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(case.forward(model, inputs), case.forward(ref, inputs))
    _same_state(model, ref)  # the masters while offloaded
    if name == "wan":  # a non-persistent buffer, computed at init, not in the files
        assert torch.equal(model.rope.freqs_cos, ref.rope.freqs_cos)
    if name == "qwen":  # a plain tensor attribute
        assert model.pos_embed.pos_freqs.device.type == "cpu"
        assert torch.equal(model.pos_embed.pos_freqs, ref.pos_embed.pos_freqs)
    handle.remove()
    ref_handle.remove()
    _same_state(model, ref)
    with torch.no_grad():
        assert torch.equal(case.forward(model, inputs), case.forward(ref, inputs))


def test_one_safetensors_file_in_another_dtype_with_fp8_storage(tmp_path: Path) -> None:
    """A single file, converted to the meta model's dtype (bf16) as it is read; weight_dtype rounds it
    into fp8 slabs as the packing path does."""
    case = CASES["flux"]
    _, folder = _saved("flux", tmp_path)
    single = folder / "diffusion_pytorch_model.safetensors"
    cls = type(case.build("frozen"))
    ref = cls.from_pretrained(folder, torch_dtype=torch.bfloat16).requires_grad_(False)
    ref_handle = enable_offload(ref, target_device="cpu", weight_dtype="float8_e4m3fn")
    model = _meta(cls, folder, "meta").to(torch.bfloat16)
    handle = enable_offload(model, target_device="cpu", weights=single, weight_dtype="float8_e4m3fn")
    inputs = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in case.make_inputs(4).items()}
    with torch.no_grad():
        assert torch.equal(case.forward(model, inputs), case.forward(ref, inputs))
    _same_state(model, ref)
    assert handle.stats()["pinned_used_bytes"] == ref_handle.stats()["pinned_used_bytes"]
    for h in (handle, ref_handle):
        with pytest.warns(UserWarning, match="rounded"):
            h.remove()


def test_lora_training_from_weights_is_bitwise(tmp_path: Path) -> None:
    """LoRA injected on the meta model and given its values by the caller: kept as given (a tensor the
    checkpoint lacks), trained resident, while the base streams from the arena filled from the files."""
    from peft import LoraConfig

    case = CASES["flux"]
    _, folder = _saved("flux", tmp_path)
    cls = type(case.build("frozen"))
    cfg = LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian", target_modules=["to_q", "to_k", "to_v"])
    torch.manual_seed(1)
    ref = cls.from_pretrained(folder).requires_grad_(False)
    ref.add_adapter(cfg)
    lora = {k: v.clone() for k, v in ref.state_dict().items() if "lora" in k}
    model = _meta(cls, folder, "meta")
    model.add_adapter(cfg)
    model.load_state_dict(lora, strict=False, assign=True)
    from offload_core import OffloadTrainingManager

    managers = [OffloadTrainingManager(m, target_device="cpu", **kw) for m, kw in
                ((ref, {}), (model, {"weights": str(folder)}))]

    def train(m: nn.Module) -> list[torch.Tensor]:
        opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3)
        m.train()
        losses = []
        for step in range(3):
            loss = case.forward(m, case.make_inputs(step)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        return losses

    assert torch.equal(torch.stack(train(model)), torch.stack(train(ref)))
    _same_state(model, ref)
    for m in managers:
        m.remove()


def test_bad_checkpoints_are_named(tmp_path: Path) -> None:
    case = CASES["flux"]
    _, folder = _saved("flux", tmp_path)
    cls = type(case.build("frozen"))
    state = load_file(str(folder / "diffusion_pytorch_model.safetensors"))
    with pytest.raises(ShardError, match="no such file or directory"):
        enable_offload(_meta(cls, folder, "meta"), target_device="cpu", weights=str(tmp_path / "nowhere"))
    gone = dict(state)
    del gone["transformer_blocks.1.attn.to_q.weight"]
    save_file(gone, str(tmp_path / "gone.safetensors"))
    model = _meta(cls, folder, "meta")
    with pytest.raises(CheckpointMismatchError, match=r"no value for 1 parameters of the model \(transformer_blocks\.1\.attn\.to_q\.weight\)"):
        enable_offload(model, target_device="cpu", weights=str(tmp_path / "gone.safetensors"))
    assert all(p.device.type == "meta" for p in model.parameters())  # a failed load leaves no engine behind
    enable_offload(model, target_device="cpu", weights=str(folder)).remove()  # and the model can still load
    wrong = dict(state)
    wrong["proj_out.weight"] = torch.zeros(3, 3)
    save_file(wrong, str(tmp_path / "wrong.safetensors"))
    with pytest.raises(CheckpointMismatchError, match=r"wrong.safetensors: tensor proj_out.weight has shape \[3, 3\]"):
        enable_offload(_meta(cls, folder, "meta"), target_device="cpu", weights=str(tmp_path / "wrong.safetensors"))
    (tmp_path / "cut.safetensors").write_bytes((folder / "diffusion_pytorch_model.safetensors").read_bytes()[:-1000])
    with pytest.raises(ShardError, match="cut.safetensors: truncated"):
        enable_offload(_meta(cls, folder, "meta"), target_device="cpu", weights=str(tmp_path / "cut.safetensors"))
    with pytest.raises(OffloadConfigError, match="weights: streams from host RAM"):
        enable_offload(_meta(cls, folder, "meta"), target_device="cpu", weights=str(folder), lazy_load=True,
                       shard_dir=str(tmp_path))


class _Rotary(nn.Module):
    """A computed table as a non-persistent buffer, in a model that cannot be built again from a config."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.register_buffer("table", torch.arange(8.0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) + self.table


def test_a_computed_table_of_a_model_without_a_config_is_refused_by_name(tmp_path: Path) -> None:
    save_file(_Rotary().state_dict(), str(tmp_path / "r.safetensors"))
    with torch.device("meta"):
        model = _Rotary()
    with pytest.raises(CheckpointMismatchError, match=r"\(table\); they are computed when the model is built"):
        enable_offload(model, target_device="cpu", weights=str(tmp_path / "r.safetensors"), offload_granularity="leaf")


_MEASURE = textwrap.dedent("""
    import json, os, sys, torch
    from torch import nn
    torch.set_num_threads(1)
    path, mode, blocks = sys.argv[1], sys.argv[2], int(sys.argv[3])

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024)) for _ in range(blocks)])
            self.head = nn.Linear(1024, 8)

    def status(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

    from offload_core import enable_offload
    with torch.device("meta"):
        model = Stack()
    model.requires_grad_(False)
    before = status("VmRSS")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak starts here
    except OSError:
        pass
    if mode == "ram":  # the model in RAM first (what from_pretrained gives), then the engine packs it
        from safetensors.torch import load_file
        state = load_file(path)
        model.load_state_dict(state, assign=True)
        del state
        handle = enable_offload(model, target_device="cpu", offload_granularity="block")
    else:
        handle = enable_offload(model, target_device="cpu", offload_granularity="block", weights=path)
    weight = handle.stats()["weight_bytes"]
    print(json.dumps({"before": before, "peak": status("VmHWM"), "after": status("VmRSS"), "weight": weight}))
""")


@pytest.mark.parametrize("blocks", [16, pytest.param(40, marks=pytest.mark.slow)])
def test_host_rss_peaks_at_the_weight_bytes_in_a_fresh_process(tmp_path: Path, blocks: int) -> None:
    """135 MB of weights (336 MB under -m slow): reading them into the arena adds <= 1.1x their bytes to the process's peak RSS.
    The same model loaded into RAM and then packed (what from_pretrained and enable_offload do) holds
    them twice, which this measure sees."""
    torch.manual_seed(0)
    state = {}
    for i in range(blocks):
        for j in range(2):
            state[f"blocks.{i}.{j}.weight"] = torch.randn(1024, 1024)
            state[f"blocks.{i}.{j}.bias"] = torch.randn(1024)
    state["head.weight"], state["head.bias"] = torch.randn(8, 1024), torch.randn(8)
    path = tmp_path / "stack.safetensors"
    save_file(state, str(path))
    del state
    script = tmp_path / "measure.py"
    script.write_text(_MEASURE)

    def measure(mode: str) -> dict[str, int]:
        out = subprocess.run([sys.executable, str(script), str(path), mode, str(blocks)], capture_output=True, text=True,
                             cwd=REPO, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    ours = measure("weights")
    added = (ours["peak"] - ours["before"]) / ours["weight"]
    assert ours["weight"] > blocks * 8.3e6
    assert added <= 1.1, f"loading added {added:.2f}x the weight bytes to the peak RSS"
    ram = measure("ram")
    print(f"peak RSS added: weights= {added:.3f}x, in RAM then packed {(ram['peak'] - ram['before']) / ram['weight']:.3f}x "
          f"of {ours['weight'] / 1e6:.0f} MB")
    assert (ram["peak"] - ram["before"]) / ram["weight"] > 1.5  # the measure sees a second copy


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["flux", "wan"])
def test_cuda_weights_are_pinned_and_bitwise(tmp_path: Path, name: str) -> None:
    """On a card: the arena filled from the files is registered (pinned) and streams; the residents were
    read onto the device; bitwise from_pretrained + enable_offload."""
    case = CASES[name]
    _, folder = _saved(name, tmp_path, max_shard_size="40KB")
    cls = type(case.build("frozen"))
    ref = cls.from_pretrained(folder).requires_grad_(False)
    ref_handle = enable_offload(ref, target_device="cuda")
    model = _meta(cls, folder, "meta")
    handle = enable_offload(model, target_device="cuda", weights=str(folder))
    s = handle.stats()
    assert s["pinned"] is True and s["streamed_bytes"] > 0
    assert all(t.device.type == "cuda" for t in [*model.parameters(), *model.buffers()])
    inputs = {k: v.to("cuda") if isinstance(v, torch.Tensor) else v for k, v in case.make_inputs(5).items()}
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(case.forward(model, inputs), case.forward(ref, inputs))
    handle.remove()
    ref_handle.remove()
    _same_state(model, ref)


def test_native_fp8_weights_are_read_as_stored_with_their_scale(tmp_path: Path) -> None:
    """A model holding fp8 weights (a ComfyUI checkpoint) built on meta: enable_offload(weights=...)
    puts the file's fp8 bytes in the arena unchanged (not widened and quantized again with a fresh
    scale), and the module's scale_weight widens them: the output is the widened model's, bitwise."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    ref = nn.Sequential(*[nn.Linear(16, 16) for _ in range(3)])
    w8 = {f"{i}.weight": (ref[i].weight.detach() * 37.0).to(torch.float8_e4m3fn) for i in range(3)}
    scale = torch.tensor(1 / 37.0)
    state = {**{k: v.detach() for k, v in ref.state_dict().items()}, **w8}
    save_file(state, str(tmp_path / "m.safetensors"))
    with torch.no_grad():
        for i in range(3):
            ref[i].weight.copy_(w8[f"{i}.weight"].float() * scale)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(3)]).to("meta")
    for i in range(3):
        model[i].weight = nn.Parameter(torch.empty(16, 16, dtype=torch.float8_e4m3fn, device="meta"))
        model[i].register_buffer("scale_weight", scale.clone(), persistent=False)
    handle = enable_offload(model, target_device="cpu", offload_granularity="leaf", weights=str(tmp_path / "m.safetensors"))
    x = torch.randn(2, 16)
    try:
        with torch.no_grad():
            assert torch.equal(model(x), ref(x))
        native = [(u, i) for u in handle.engine.streamed for i, ts in enumerate(u.tensors) if ts.native_dtype is not None]
        assert len(native) == 3 and all(u.tensors[i].scale == float(scale) for u, i in native)  # the file's scale
        stored = [handle.engine.store.view(u, i) for u, i in native]
        assert all(t.dtype == torch.float8_e4m3fn for t in stored)
        assert {t.view(torch.uint8).numpy().tobytes() for t in stored} == {v.view(torch.uint8).numpy().tobytes() for v in w8.values()}
    finally:
        handle.remove()
