"""enable_pipeline_offload on a tiny diffusers FluxPipeline built from configs (RECIPES.md), CPU and GPU."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from offload_core import OffloadConfigError
from offload_core.pipeline import ComponentOffload, enable_pipeline_offload


def _tokenizers(tmp: Path) -> tuple[Any, Any]:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import CLIPTokenizer, T5TokenizerFast

    letters = "abcdefghijklmnopqrstuvwxyz"
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for c in letters:
        vocab[c] = len(vocab)
        vocab[c + "</w>"] = len(vocab)
    (tmp / "vocab.json").write_text(json.dumps(vocab))
    (tmp / "merges.txt").write_text("#version: 0.2\n")
    clip = CLIPTokenizer(str(tmp / "vocab.json"), str(tmp / "merges.txt"), model_max_length=77)
    # T5's tokenizer without sentencepiece: a unigram model made with `tokenizers` directly
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -1.0)] + [(c, -1.0) for c in letters]
    tok = Tokenizer(models.Unigram(pieces, unk_id=2))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    t5 = T5TokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
                         model_max_length=64, extra_ids=0)
    return clip, t5


def _pipe(tmp: Path, seed: int = 0) -> Any:
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    clip_tok, t5_tok = _tokenizers(tmp)
    torch.manual_seed(seed)
    clip = CLIPTextModel(CLIPTextConfig(vocab_size=len(clip_tok), hidden_size=32, intermediate_size=37,
                                        num_hidden_layers=2, num_attention_heads=4, projection_dim=32,
                                        max_position_embeddings=77, bos_token_id=0, eos_token_id=1))
    t5 = T5EncoderModel(T5Config(vocab_size=len(t5_tok) + 10, d_model=32, d_ff=37, d_kv=8, num_layers=2, num_heads=4))
    transformer = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2,
                                         attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                         pooled_projection_dim=32, guidance_embeds=False, axes_dims_rope=(4, 4, 8))
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(32, 64), layers_per_block=1,
                        latent_channels=4, norm_num_groups=32, sample_size=32, shift_factor=0.0, scaling_factor=1.0)
    pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=clip, tokenizer=clip_tok,
                        text_encoder_2=t5, tokenizer_2=t5_tok, transformer=transformer)
    for m in (clip, t5, transformer, vae):
        m.eval()  # as from_pretrained leaves them (T5's dropout would make every run differ)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _image(pipe: Any, device: str = "cpu") -> torch.Tensor:
    with torch.no_grad():
        return pipe("a cat", num_inference_steps=2, height=32, width=32, max_sequence_length=16, output_type="pt",
                    generator=torch.Generator(device).manual_seed(0)).images


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, torch.Tensor]:
    pipe = _pipe(tmp_path_factory.mktemp("pipe"))
    return pipe, _image(pipe)


def test_everything_offloaded_is_bitwise_and_lets_go(built: tuple) -> None:
    pipe, want = built
    off = enable_pipeline_offload(pipe, target_device="cpu")
    try:
        assert set(off.engines) == {"transformer", "text_encoder", "text_encoder_2"} and set(off.hooks) == {"vae"}
        assert torch.equal(_image(pipe), want)
        assert torch.equal(_image(pipe), want)
        s = off.stats()
        for name in ("transformer", "text_encoder", "text_encoder_2"):
            assert s[name]["h2d_bytes"] > 0, name
        assert s["text_encoder_2"]["num_units"] >= 2  # T5 streamed block by block
        assert s["vae"]["onloads"] == 2  # one decode per image
        # between calls the streamed weights are let go
        block = pipe.text_encoder_2.encoder.block[1].layer[0].SelfAttention.q.weight
        assert block.numel() == 0
    finally:
        off.remove()
    assert pipe.text_encoder_2.encoder.block[1].layer[0].SelfAttention.q.weight.numel() > 0
    assert "decode" not in pipe.vae.__dict__
    assert torch.equal(_image(pipe), want)


@pytest.mark.parametrize("kwargs, placed", [
    ({"t5_cpu_offload": False}, {"text_encoder_2"}),
    ({"clip_cpu_offload": False}, {"text_encoder"}),
    ({"text_encoder_cpu_offload": False, "t5_cpu_offload": True}, {"text_encoder"}),
    ({"vae_cpu_offload": False}, {"vae"}),
    ({"cpu_offload": False}, {"transformer", "text_encoder", "text_encoder_2", "vae"}),
    ({"cpu_offload": False, "vae_cpu_offload": True}, {"transformer", "text_encoder", "text_encoder_2"}),
])
def test_which_component_is_offloaded_follows_the_keys(built: tuple, kwargs: dict, placed: set) -> None:
    pipe, want = built
    off = enable_pipeline_offload(pipe, target_device="cpu", **kwargs)
    try:
        assert set(off.placed) == placed
        assert set(off.engines) | set(off.hooks) | set(off.placed) == {"transformer", "text_encoder",
                                                                        "text_encoder_2", "vae"}
        assert torch.equal(_image(pipe), want)
    finally:
        off.remove()


def test_two_pipelines_in_one_process(tmp_path: Path, built: tuple) -> None:
    pipe, want = built
    other = _pipe(tmp_path, seed=1)
    other_want = _image(other)
    a = enable_pipeline_offload(pipe, target_device="cpu")
    b = enable_pipeline_offload(other, target_device="cpu", prefetch=1)
    try:
        assert torch.equal(_image(pipe), want) and torch.equal(_image(other), other_want)
    finally:
        a.remove()
        b.remove()


def test_bad_input_is_named(built: tuple) -> None:
    pipe, _ = built
    with pytest.raises(OffloadConfigError, match="pipe: expected a diffusers pipeline"):
        enable_pipeline_offload(object(), target_device="cpu")
    with pytest.raises(OffloadConfigError, match="encoder_config: lazy_load applies to the denoiser only"):
        enable_pipeline_offload(pipe, target_device="cpu", encoder_config={"lazy_load": True})
    with pytest.raises(OffloadConfigError, match="prefetch"):
        enable_pipeline_offload(pipe, target_device="cpu", prefetch=-1)
    # a failure half-way leaves nothing hooked
    assert all(p.numel() > 0 for p in pipe.transformer.parameters()) and "decode" not in pipe.vae.__dict__


class _Decoder(torch.nn.Module):
    """No weights: what its calls receive is what the test reads."""

    def decode(self, z: torch.Tensor, *, scale: torch.Tensor) -> tuple[torch.device, torch.device]:
        return z.device, scale.device

    def forward(self, z: torch.Tensor) -> torch.device:
        return z.device


def test_a_hooked_components_inputs_follow_it_to_the_device() -> None:
    """A pipeline may hand a component inputs where its weights sit between calls (diffusers 0.42's
    Flux moves the latents to the VAE's device, the host here): each call gets them on the device.
    The meta device stands in for the accelerator on a CPU machine."""
    dec = _Decoder()
    hook = ComponentOffload(dec, torch.device("meta"))
    try:
        assert dec.decode(torch.zeros(2), scale=torch.ones(1)) == (torch.device("meta"), torch.device("meta"))
        assert dec(torch.zeros(2)) == torch.device("meta")
        assert hook.onloads == 2
    finally:
        hook.remove()
    assert dec.decode(torch.zeros(2), scale=torch.ones(1)) == (torch.device("cpu"), torch.device("cpu"))


@pytest.mark.gpu
def test_cuda_pipeline_offload_is_bitwise(tmp_path: Path) -> None:
    pipe = _pipe(tmp_path)
    pipe.to("cuda")
    want = _image(pipe, "cuda")
    pipe.to("cpu")
    off = enable_pipeline_offload(pipe, target_device="cuda")
    try:
        assert pipe._execution_device.type == "cuda"
        assert torch.equal(_image(pipe, "cuda"), want)
        assert next(pipe.vae.parameters()).device.type == "cpu"  # back on the host between calls
        assert all(s.get("pinned", True) for s in off.stats().values() if "pinned" in s)
    finally:
        off.remove()
