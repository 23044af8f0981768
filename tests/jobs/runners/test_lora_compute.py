"""LoRA layers compute in their input's dtype (jobs.runners.lora.compute_in_input_dtype): fp32 weights
cast to bf16 for the matmuls instead of every adapted activation cast to fp32 and back."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from jobs.runners.lora import compute_in_input_dtype


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(32, 48)
        self.o = nn.Linear(48, 32, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(F.gelu(self.q(x)))


def _lora_net(dtype: torch.dtype) -> nn.Module:
    # peft (and the transformers it imports) here, not at collection: every pytest process collects this file
    from peft import LoraConfig, inject_adapter_in_model

    torch.manual_seed(0)
    net = Net().to(dtype)
    net = inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8, target_modules=["q", "o"]), net)
    net.requires_grad_(False)
    for n, p in net.named_parameters():
        if "lora_" in n:  # as inject_lora leaves them: fp32 and trainable, B nonzero so it counts
            p.data = torch.randn(p.shape) * 0.1
            p.requires_grad_(True)
    return net


def _run(net: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    out = net(x)
    out.float().pow(2).mean().backward()
    return out, {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}


def test_an_fp32_model_computes_peft_arithmetic_bitwise() -> None:
    peft_net = _lora_net(torch.float32)
    ours = copy.deepcopy(peft_net)
    assert compute_in_input_dtype(ours) == 2
    x = torch.randn(3, 7, 32)
    ref, ref_grads = _run(peft_net, x)
    got, grads = _run(ours, x)
    assert torch.equal(ref, got)
    assert grads.keys() == ref_grads.keys() and len(grads) == 4
    assert all(torch.equal(grads[n], ref_grads[n]) for n in grads)


def test_a_bf16_model_casts_the_weights_not_the_activations() -> None:
    net = _lora_net(torch.bfloat16)
    compute_in_input_dtype(net)
    x = torch.randn(3, 7, 32).to(torch.bfloat16)
    seen: list[torch.dtype] = []
    hooks = [m.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
             for n, m in net.named_modules() if n.endswith(("lora_A", "lora_B"))]
    got, grads = _run(net, x)
    for h in hooks:
        h.remove()
    assert got.dtype == torch.bfloat16 and seen == []  # peft's lora_A/lora_B modules are not called: F.linear is
    # the reference: the same arithmetic written out, the fp32 weights cast to bf16 inside autograd
    ref_net = copy.deepcopy(net)
    q, o = ref_net.q, ref_net.o

    def lora(m: nn.Module, h: torch.Tensor) -> torch.Tensor:
        a, b = m.lora_A["default"].weight, m.lora_B["default"].weight
        return m.base_layer(h) + F.linear(F.linear(h, a.to(h.dtype)), b.to(h.dtype)) * m.scaling["default"]

    ref = lora(o, F.gelu(lora(q, x)))
    ref.float().pow(2).mean().backward()
    assert torch.equal(ref, got)
    for n, p in ref_net.named_parameters():
        if p.grad is not None:
            assert p.dtype == torch.float32 and grads[n].dtype == torch.float32  # fp32 masters, fp32 grads
            assert torch.equal(p.grad, grads[n]), n
    # and peft's own forward (fp32 activations) differs only by bf16 rounding
    peft_net = _lora_net(torch.bfloat16)
    peft_out = peft_net(x)
    assert torch.allclose(peft_out.float(), got.float(), rtol=2e-2, atol=2e-2)


def test_merged_or_disabled_adapters_run_pefts_forward() -> None:
    net = _lora_net(torch.float32)
    compute_in_input_dtype(net)
    x = torch.randn(2, 32)
    base = Net()
    base.load_state_dict({k.replace("base_layer.", ""): v for k, v in net.state_dict().items() if "lora_" not in k})
    for m in (net.q, net.o):
        m.enable_adapters(False)
    assert torch.equal(net(x), base(x))  # disabled: the base layers alone


def test_dora_runs_pefts_forward() -> None:
    from peft import LoraConfig, inject_adapter_in_model

    torch.manual_seed(0)
    net = inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8, target_modules=["q", "o"], use_dora=True), Net())
    with torch.no_grad():
        for n, p in net.named_parameters():
            if "lora_" in n:  # B nonzero and a magnitude off its init: DoRA's output is not plain LoRA's
                p.copy_(torch.randn(p.shape) * 0.3)
    ref = copy.deepcopy(net)
    compute_in_input_dtype(net)
    x = torch.randn(2, 32)
    assert torch.equal(net(x), ref(x))
