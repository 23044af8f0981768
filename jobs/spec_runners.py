"""The `model`, `train` and `infer` sections of a job spec (pydantic only, no torch).

Field names follow the trainers users know (DiffSynth-Studio's and diffusers' LoRA scripts, and the
seed workflow): `learning_rate`, `lora_rank`, `lora_target_modules`, ... (offload settings live in
`jobs.spec.OffloadSpec` only)
`jobs.spec` re-exports these classes; the runners in `jobs.runners` read them.
"""

from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.json_schema import SkipJsonSchema

from jobs.spec_yaml import MAX_INT

__all__ = ["FAMILIES", "MOVED_TO_OFFLOAD", "OPTIMIZERS", "LOGGERS", "ModelSpec", "ValidationSpec", "TrainSpec",
           "InferSpec", "MAX_SIDE", "MAX_FRAMES"]

# Sizes a spec (or a prompt's inline --w/--h/--f) may ask for. 8192 a side is 4x the largest size
# these families are trained at; a larger one only ever asked the host for tens of GB and failed.
# What the machine's memory allows within these is checked at setup (jobs.runners.inputs).
MAX_SIDE = 8192
MAX_FRAMES = 10_000

# train.* keys that moved to the offload section: old name -> offload.<new name>
MOVED_TO_OFFLOAD = {"enable_model_cpu_offload": "enabled", "enable_optimizer_cpu_offload": "enable_optimizer_cpu_offload",
                    "cpu_offload_split_threshold": "split_threshold_mb"}

FAMILIES = ("flux", "qwen-image", "wan", "sd3")
Family = Literal["flux", "qwen-image", "wan", "sd3"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=False, allow_inf_nan=False)


def _inline_options(value: object) -> object:
    """A prompt's inline --w/--h/--f/... checked at submit, as the runner will read them."""
    from jobs.runners.prompts import PromptError, PromptSpec, parse_prompt  # import here: jobs.runners imports jobs.spec

    for text in [value] if isinstance(value, str) else value if isinstance(value, list) else []:
        try:
            parse_prompt(text, PromptSpec(prompt=""))
        except PromptError as exc:
            raise ValueError(str(exc)) from None
    return value


def _names(value: object) -> object:
    """`to_q,to_k` (as the seed workflow writes it) or a list -> a list of module names."""
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    return value


class ModelSpec(_Strict):
    path: Optional[str] = Field(None, description="A diffusers model folder (model_index.json, transformer/, vae/, ...) "
                                                  "or a hub id; may be null when `transformer` and `base` are set.")
    transformer: Optional[str] = Field(
        None, description="The transformer as a single .safetensors file (or a folder of them) in the BFL/original, "
                          "ComfyUI (any prefix) or diffusers layout; converted once into the model cache.")
    base: Optional[str] = Field(
        None, description="With `transformer`, `text_encoders` or `vae`: a diffusers folder or hub id for the rest "
                          "(text encoders, VAE, tokenizers, configs); default `path`.")
    text_encoders: Optional[list[str]] = Field(
        None, description="Text encoders as single .safetensors files, in place of the base's: Flux `clip_l` and/or "
                          "`t5xxl`, Wan `umt5_xxl`, Qwen-Image `qwen_2.5_vl_7b` (bf16/fp16/fp8, plain or scaled); told "
                          "apart by their tensors.")
    vae: Optional[str] = Field(None, description="The VAE as a single .safetensors file (BFL/LDM, Wan native or diffusers "
                                                 "names; Qwen-Image's is Wan 2.1's), in place of the base's.")
    family: Optional[Family] = Field(None, description="flux, qwen-image, wan or sd3; read from model_index.json when unset.")
    dtype: Optional[Literal["bfloat16", "float16", "float32"]] = Field(
        None, description="Compute dtype; default bfloat16 on a GPU, float32 on the CPU.")


# train.optimizer -> (module it needs, the extra that installs it); adamw is torch's own
OPTIMIZERS = {"adamw": (None, None), "adamw8bit": ("bitsandbytes", "adamw8bit"),
              "adafactor": ("transformers", "adafactor"), "prodigy": ("prodigyopt", "prodigy")}
LOGGERS = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb")}


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _one_or_list(value: object) -> object:
    return [value] if isinstance(value, str) else value


class ValidationSpec(_Strict):
    """A validation loss on held-out items at fixed noise levels, every N steps."""

    items: Union[int, list[str]] = Field(
        1, description="Held out of training: the last N items of the dataset, or a list of their file names.")
    every: int = Field(50, ge=1, le=10**9, description="Steps between validation losses (and one after the last step).")
    timesteps: list[Annotated[float, Field(gt=0.0, lt=1.0)]] = Field(
        default_factory=lambda: [0.25, 0.5, 0.75], min_length=1, max_length=1000,
        description="The noise levels (sigma) each held-out item is scored at, with the same noise every time.")
    seed: int = Field(0, ge=0, le=MAX_INT, description="Seed of the fixed validation noise.")

    @field_validator("items", mode="before")
    @classmethod
    def _some_items(cls, value: object) -> object:
        if isinstance(value, bool):
            raise ValueError("expected a number of items or a list of file names")
        if isinstance(value, int) and not 1 <= value <= 100_000:
            raise ValueError("hold out between 1 and 100000 items")
        if isinstance(value, list) and not 1 <= len(value) <= 100_000:
            raise ValueError("name between 1 and 100000 items")
        return value


class TrainSpec(_Strict):
    """LoRA training of the model's transformer with a flow-matching loss."""

    dataset: Optional[str] = Field(None, description="Folder of images (clips for Wan) with .txt captions or a metadata.jsonl/.csv.")
    caption_column: str = Field("text", description="Caption column of metadata.jsonl / .csv.")
    image_column: str = Field("file_name", description="File column of metadata.jsonl / .csv.")
    repeats: int = Field(1, ge=1, le=10_000, description="Times each item appears per epoch.")
    max_pixels: int = Field(1024 * 1024, ge=64, le=MAX_SIDE * MAX_SIDE, description="Largest bucket area (width x height) in pixels.")
    num_frames: int = Field(1, ge=1, le=MAX_FRAMES, description="Wan: frames taken from each clip (4k+1 for the real VAE).")
    steps: int = Field(1000, ge=1, le=10**9, description="Optimizer steps (unless num_epochs is set).")
    num_epochs: Optional[int] = Field(None, ge=1, le=10**6, description="Passes over the dataset (instead of steps).")
    batch_size: int = Field(1, ge=1, le=65536, description="Items per micro-batch, all from one aspect bucket.")
    gradient_accumulation_steps: int = Field(1, ge=1, le=65536)
    accumulation_order: Literal["micro", "layer"] = Field(
        "micro", description="With gradient_accumulation_steps > 1: micro runs each micro-batch's forward and backward "
                             "in turn (the weights stream once per micro-batch); layer runs all of them through each "
                             "block before the next, so the weights stream once per optimizer step, with the same "
                             "gradients bitwise (not with offload.enable_optimizer_cpu_offload, nor dropout).")
    learning_rate: float = Field(1e-4, gt=0.0, le=1e32)
    lr_scheduler: Literal["constant", "linear", "cosine"] = "constant"
    lr_warmup_steps: int = Field(0, ge=0, le=10**9)
    weight_decay: float = Field(0.0, ge=0.0, le=1e3)
    max_grad_norm: Optional[float] = Field(1.0, gt=0.0, le=1e6, description="Clip gradients to this norm; null turns clipping off.")
    lora_rank: int = Field(32, ge=1, le=65536)
    lora_alpha: Optional[float] = Field(None, gt=0.0, le=1e6, description="Default: lora_rank (scale 1).")
    lora_target_modules: Optional[list[str]] = Field(
        None, description="Module names (a list, or comma-separated); default: the family's attention and MLP projections.")
    gradient_checkpointing: bool = True
    seed: int = Field(0, ge=0, le=MAX_INT)
    timestep_sampling: Literal["shift", "uniform", "logit_normal"] = Field(
        "shift", description="How sigma is drawn: uniform, logit-normal, or uniform then shifted by discrete_flow_shift.")
    discrete_flow_shift: float = Field(3.0, gt=0.0, le=1e3)
    guidance_scale: float = Field(1.0, ge=0.0, le=1e4, description="Guidance fed to guidance-distilled models (Flux-dev) while training.")
    max_sequence_length: Optional[int] = Field(None, ge=1, le=65536, description="Text tokens; default the family's.")
    # Deprecated: moved to offload.* (MOVED_TO_OFFLOAD); accepted for one release, left out of the schema.
    enable_model_cpu_offload: SkipJsonSchema[Optional[bool]] = None
    enable_optimizer_cpu_offload: SkipJsonSchema[Optional[bool]] = None
    cpu_offload_split_threshold: SkipJsonSchema[Optional[float]] = Field(None, gt=0.0, le=1e9)
    save_every: Optional[int] = Field(250, ge=1, le=10**9, description="Checkpoint every N steps (null: only at the end).")
    save_every_minutes: Optional[float] = Field(None, gt=0.0, le=1e7, description="Also checkpoint every N minutes.")
    keep_last: int = Field(3, ge=1, le=10_000, description="Checkpoints kept; older ones are deleted.")
    sample_every: Optional[int] = Field(None, ge=0, le=10**9, description="Render sample_prompts every N steps (0 or null: off).")
    sample_prompts: Optional[Union[str, list[str]]] = Field(
        None, description="Prompts (a list, or a file with one per line), each optionally with --w --h --seed --steps --guidance --n.")
    sample_steps: int = Field(20, ge=1, le=100_000)
    sample_guidance: Optional[float] = Field(None, ge=0.0, le=1e4, description="Default: the family's.")
    sample_width: Optional[int] = Field(None, ge=8, le=MAX_SIDE)
    sample_height: Optional[int] = Field(None, ge=8, le=MAX_SIDE)
    cache_dir: Optional[str] = Field(None, description="Latent and text-embedding cache; default <state dir>/cache.")
    output_name: str = Field("lora", description="Base name of the LoRA file written to outputs/.")
    lora_format: Literal["comfy", "diffusers", "kohya"] = Field(
        "comfy", description="Key names of the LoRA file. comfy (the default, the names this trainer has always written; "
                             "ComfyUI and diffusers both load them): Flux transformer.<diffusers module>, Qwen-Image "
                             "diffusion_model.<diffusers module>, Wan diffusion_model.<native module, e.g. "
                             "blocks.0.self_attn.q>; lora_A/lora_B with alpha/rank folded into B. diffusers: "
                             "transformer.<diffusers module> for every family, alpha folded. kohya: lora_unet_<module>"
                             ".lora_down/.lora_up with .alpha, as kohya's sd-scripts and musubi-tuner write them (Flux in "
                             "BFL names with fused qkv/linear1; Wan and Qwen-Image as musubi-tuner names them).")
    trigger_word: Optional[str] = Field(
        None, max_length=1000, description="Put in every caption: replaces [trigger] where a caption has it, else leads it.")
    default_caption: Optional[str] = Field(
        None, max_length=10_000, description="The caption of an image that has none (uncaptioned images are an error without it).")
    caption_dropout: float = Field(0.0, ge=0.0, le=1.0, description="Chance a sample trains with the empty caption.")
    optimizer: Literal["adamw", "adamw8bit", "adafactor", "prodigy"] = Field(
        "adamw", description="adamw (torch), adamw8bit (bitsandbytes), adafactor (transformers) or prodigy (prodigyopt); "
                             "the last three are the optional extras of the same names.")
    ema: Optional[float] = Field(
        None, gt=0.0, lt=1.0, description="EMA decay of the LoRA weights (e.g. 0.999); the EMA LoRA is written beside "
                                          "the raw one as <output_name>_ema.safetensors.")
    validation: Optional[ValidationSpec] = Field(None, description="A validation loss on held-out items, every N steps.")
    log_to: list[Literal["tensorboard", "wandb"]] = Field(
        default_factory=list, description="Also log to tensorboard (event files in the run dir's tensorboard/) or wandb.")
    init_lora: Optional[str] = Field(
        None, description="Start from this LoRA file, of the same family and lora_rank, in any format infer.lora reads "
                          "(comfy, diffusers/peft, kohya, musubi-tuner); every module it holds must be a trained one.")

    _split = field_validator("lora_target_modules", mode="before")(_names)
    _sample_options = field_validator("sample_prompts")(
        lambda v: _inline_options(v) if isinstance(v, list) else v)  # a file is read at setup

    @field_validator("sample_every")
    @classmethod
    def _zero_is_off(cls, value: Optional[int]) -> Optional[int]:
        return value or None  # 0 reads as "off", as null does: one value for the runner to test

    _loggers = field_validator("log_to", mode="before")(_one_or_list)

    @field_validator("optimizer")
    @classmethod
    def _optimizer_installed(cls, value: str) -> str:
        module, extra = OPTIMIZERS[value]
        if module is not None and not _installed(module):
            raise ValueError(f"{value} needs the {module} library, not installed here: "
                             f"pip install 'offload-jobs[{extra}]'")
        return value

    @field_validator("log_to")
    @classmethod
    def _loggers_installed(cls, value: list[str]) -> list[str]:
        for name in value:
            module, extra = LOGGERS[name]
            if not _installed(module):
                raise ValueError(f"{name} needs the {module} library, not installed here: pip install 'offload-jobs[{extra}]'")
        return value

    @model_validator(mode="after")
    def _one_length(self) -> "TrainSpec":
        if "steps" in self.model_fields_set and self.num_epochs is not None:
            raise ValueError("set `steps` or `num_epochs`, not both")
        return self


class InferSpec(_Strict):
    """Generation with the family's diffusers pipeline, the engine on its transformer."""

    prompt: Union[str, list[str]] = Field("", description="A prompt or a list; each optionally with inline --w --h --seed --steps --guidance --n.")
    negative_prompt: Optional[str] = None
    steps: int = Field(28, ge=1, le=10**9)
    guidance: Optional[float] = Field(None, ge=0.0, le=1e4, description="Flux: distilled guidance; Qwen-Image: true CFG; Wan: CFG. Default: the family's.")
    height: int = Field(1024, ge=8, le=MAX_SIDE)
    width: int = Field(1024, ge=8, le=MAX_SIDE)
    num_frames: int = Field(17, ge=1, le=MAX_FRAMES, description="Wan: frames per video (4k+1).")
    fps: int = Field(16, ge=1, le=1000, description="Wan: frames per second of the written video.")
    seed: int = Field(0, ge=0, le=MAX_INT)
    seeds: Optional[list[Annotated[int, Field(ge=0, le=MAX_INT)]]] = Field(None, max_length=10_000, description="One image per seed (overrides seed and num_images).")
    num_images: int = Field(1, ge=1, le=10_000, description="Images per prompt (seeds seed, seed+1, ...).")
    lora: Optional[str] = Field(
        None, description="A LoRA .safetensors path, or the id of a train job whose LoRA to use. Read in diffusers/peft, "
                          "ComfyUI, kohya (lora_unet_..., lora_down/lora_up, .alpha) and musubi-tuner names; a file "
                          "of another family, or one that applies to no module of the model, is refused by name.")
    lora_scale: float = Field(1.0, ge=-1e3, le=1e3)
    max_sequence_length: Optional[int] = Field(None, ge=1, le=65536)
    prompt_file: Optional[str] = Field(None, max_length=4096, description="A text file of prompts, one a line (# comments and blank lines skipped), each with inline options; rendered after `prompt`.")
    share_stream: bool = Field(True, description="Let the worker run this job in one batch with queued infer jobs of the same model, LoRA and settings (one stream of weights for all).")
    max_batch: Optional[int] = Field(None, ge=1, le=1024, description="The most jobs one co-scheduled batch takes, and images one pass renders. Default: an estimate of what the VRAM cap leaves for activations (jobs/runners/cosched.py).")

    _prompt_options = field_validator("prompt")(_inline_options)
