"""Trainer options: one dataclass per trainer, read from a YAML file with ``--key value`` overrides.

``WanTrainOptions`` and ``DiTTrainOptions`` share :class:`TrainOptions`. Defaults follow the MHLA
reference recipes (Wan: flow matching, AdamW 2e-5, clip 0.1, bf16; DiT: epsilon + VB, AdamW 1e-4,
EMA 0.9999). Every value can come from the YAML file and be overridden on the command line:

    python -m mhla_diffusion.finetune.train_wan --config wan.yaml --max_train_steps 2000 --mhla.layers hybrid

Keys may be spelled with ``_`` or ``-``; nested ``mhla`` options use a dot. Values are parsed as
YAML (``true``, ``3``, ``[480, 832]``), then checked against the field's type.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence, TypeVar

import yaml

__all__ = ["DEFAULT_DIT_VAE", "DiTTrainOptions", "TrainOptions", "WanTrainOptions", "load_options", "options_from_dict", "parse_cli",
           "read_yaml", "unknown_name"]

T = TypeVar("T", bound="TrainOptions")

_TRAINABLE = ("all", "mhla", "attention", "lora")
_ATTENTION = ("mhla", "softmax")
_PRECISIONS = ("no", "fp16", "bf16")
_DTYPES = ("auto", "float32", "bfloat16", "float16")
DEFAULT_DIT_VAE = "stabilityai/sd-vae-ft-ema"  # the released DiT recipe's VAE (a model_size run's default vae_model)


@dataclass
class TrainOptions:
    """Options shared by both trainers (see the field comments; ``--help`` lists every option with its default)."""

    # --- model
    pretrained_model: str = ""  # Diffusers pipeline folder or hub id (required; DiT: or `model_size` instead)
    revision: str | None = None  # hub revision of pretrained_model
    attention: str = "mhla"  # mhla (convert the model, then train) | softmax (train the model's own attention as it is)
    mhla: dict = field(default_factory=dict)  # MHLAConfig fields, e.g. {layers: hybrid, layout: [3, 5, 10], gate: true}
    mhla_preset: str | None = None  # "released-wan" / "released-dit": MHLAConfig.released_wan() / .released_dit(), `mhla` overrides
    mhla_weights: str | None = None  # start from a save_mhla folder instead of a fresh conversion
    trainable: str = "all"  # all | mhla (new MHLA parameters) | attention (MHLA + its self-attention) | lora
    # --- run folder
    output_dir: str = ""  # required; never reused for a new run unless overwrite_output_dir
    overwrite_output_dir: bool = False
    resume: str | None = None  # "latest" or a checkpoint folder
    seed: int = 1
    # --- data
    data_dir: str = ""  # required
    cache_latents: bool = False  # pre-pass: encode latents (and text) once to disk, then train from the cache
    cache_dir: str | None = None  # default <output_dir>/cache; share it between runs with the same data settings
    cache_dtype: str = "float32"  # float32 | bfloat16 | float16 for cached tensors
    latent_sampling: str = "sample"  # sample (posterior sample each step) | mode (posterior mean) | DiT: presampled
    dataloader_num_workers: int = 0
    # --- optimisation
    learning_rate: float = 2e-5
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-10
    weight_decay: float = 0.0
    lr_scheduler: str = "constant_with_warmup"  # any name of diffusers.optimization.get_scheduler
    lr_warmup_steps: int = 1000  # optimizer steps
    max_grad_norm: float = 0.1  # 0 turns clipping off
    train_batch_size: int = 4  # per process
    gradient_accumulation_steps: int = 1
    max_train_steps: int = 1000  # end-to-end optimizer steps (after the attention-transfer stage)
    mixed_precision: str | None = "bf16"  # no | fp16 | bf16 | null (use accelerate's config)
    frozen_dtype: str = "auto"  # dtype of frozen weights; auto = the mixed-precision dtype (float32 under FSDP)
    gradient_checkpointing: bool = True
    allow_tf32: bool = True
    # --- attention transfer (stage 1, optional)
    attention_transfer_steps: int = 0  # 0 = off
    attention_transfer_lr: float = 1e-3
    attention_transfer_params: str = "auto"  # attention (MHLA + the layer's q/k/v/o, norms) | mhla (new parameters
    # only; far weaker) | auto (attention, or mhla when trainable is mhla / lora, whose outputs keep only those)
    attention_transfer_teacher_forcing: bool = True  # later layers see the softmax output, not the student's
    # --- EMA of the trained weights (saved as `final` and in the pipeline; raw weights as `final-no-ema`)
    ema_decay: float = 0.0  # 0 turns EMA off
    ema_warmup: bool = False  # False: constant decay from the first step (DiT's reference); True: Diffusers' warmup
    # --- checkpoints and outputs
    checkpointing_steps: int = 500
    checkpoints_total_limit: int | None = 3
    save_pipeline: bool = False  # also write a full pipeline folder (<output_dir>/pipeline) at the end
    # --- logging and validation
    report_to: str = "auto"  # auto (tensorboard if installed, else jsonl) | tensorboard | wandb | jsonl | none
    tracker_project_name: str = "mhla-finetune"
    validation_steps: int = 0  # 0 = only at the end (when validation inputs are given)
    validation_num_inference_steps: int = 20
    validation_guidance_scale: float = 3.0
    validation_seed: int = 0
    # --- validation FID (off unless validation_fid_reference is set; see mhla_diffusion/finetune/validation_fid.py)
    validation_fid_reference: str | None = None  # ADM .npz with mu, sigma, mu_s, sigma_s (`mhla eval-ref`)
    validation_fid_steps: int = 1000  # FID/sFID every N optimizer steps, and at the end
    validation_fid_samples: int = 1000  # samples over all processes (Wan: clips, every frame an image)
    validation_fid_batch_size: int = 8  # samples per pipeline call per process (DiT; Wan samples clip by clip)
    inception_weights: str | None = None  # FID Inception-v3 weights file; default $MHLA_INCEPTION_WEIGHTS

    # ------------------------------------------------------------------ checks

    def validate(self) -> None:
        """Raise ``ValueError`` naming the bad option and how to fix it (no file or model access)."""
        _check_finite(self)
        for name in self._required_options():
            if not getattr(self, name):
                raise ValueError(f"`{name}` is required: set it in the YAML file or pass --{name} VALUE")
        _choice("attention", self.attention, _ATTENTION)
        _choice("trainable", self.trainable, self._trainable_choices())
        if self.attention == "softmax":
            self._check_softmax()
        if self.mixed_precision is not None:
            _choice("mixed_precision", self.mixed_precision, _PRECISIONS)
        _choice("frozen_dtype", self.frozen_dtype, _DTYPES)
        _choice("cache_dtype", self.cache_dtype, _DTYPES[1:])
        _choice("latent_sampling", self.latent_sampling, self._latent_sampling_choices())
        _choice("attention_transfer_params", self.attention_transfer_params, ("auto", "mhla", "attention"))
        _choice("report_to", self.report_to, ("auto", "tensorboard", "wandb", "jsonl", "none"))
        if self.mhla_preset is not None:
            _choice("mhla_preset", self.mhla_preset, ("released-wan", "released-dit"))
        if self.mhla_weights is not None and (self.mhla or self.mhla_preset):
            raise ValueError("`mhla_weights` brings its own MHLA config: drop `mhla` / `mhla_preset`")
        if self.resume is not None and self.overwrite_output_dir:
            raise ValueError("`resume` continues the run in output_dir, `overwrite_output_dir` deletes it: choose one")
        for name in ("train_batch_size", "gradient_accumulation_steps", "max_train_steps"):
            _at_least(name, getattr(self, name), 1)
        for name in ("lr_warmup_steps", "attention_transfer_steps", "dataloader_num_workers", "validation_steps",
                     "checkpointing_steps"):
            _at_least(name, getattr(self, name), 0)
        for name in ("validation_fid_steps", "validation_fid_samples", "validation_fid_batch_size"):
            _at_least(name, getattr(self, name), 1)
        if self.inception_weights is not None and not self.validation_fid_reference:
            raise ValueError("`inception_weights` is used by validation FID: set `validation_fid_reference` too, or drop it")
        if self.checkpoints_total_limit is not None:
            _at_least("checkpoints_total_limit", self.checkpoints_total_limit, 1)
        for name in ("learning_rate", "attention_transfer_lr", "adam_epsilon"):
            if not getattr(self, name) > 0:
                raise ValueError(f"`{name}` must be > 0, got {getattr(self, name)}")
        if not 0 <= self.ema_decay < 1:
            raise ValueError(f"`ema_decay` must be in [0, 1) (0 = no EMA), got {self.ema_decay}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"`{name}` must be in [0, 1), got {getattr(self, name)}")
        if self.weight_decay < 0 or self.max_grad_norm < 0:
            raise ValueError("`weight_decay` and `max_grad_norm` must be >= 0 (max_grad_norm 0 = no clipping)")
        if self.trainable in ("mhla", "lora") and self.attention_transfer_params == "attention":
            raise ValueError(
                f"attention_transfer_params: attention trains the layers' projections, but trainable: {self.trainable} "
                "saves only MHLA (and LoRA) weights, so they would be lost: use attention_transfer_params: mhla, or "
                "trainable: attention / all"
            )
        from diffusers.optimization import SchedulerType

        _choice("lr_scheduler", self.lr_scheduler, [s.value for s in SchedulerType])

    def _trainable_choices(self) -> Sequence[str]:
        return _TRAINABLE

    def _required_options(self) -> Sequence[str]:
        return ("pretrained_model", "output_dir", "data_dir")

    def _latent_sampling_choices(self) -> Sequence[str]:
        return ("sample", "mode")

    def _softmax_trainable(self) -> Sequence[str]:
        return ("all", "lora")

    def _check_softmax(self) -> None:
        """``attention: softmax`` trains the model as it is: no MHLA option may be set."""
        set_options = [name for name in ("mhla", "mhla_preset", "mhla_weights") if getattr(self, name)]
        if set_options:
            names, verb = ", ".join(f"`{n}`" for n in set_options), "are" if len(set_options) > 1 else "is"
            raise ValueError(f"attention: softmax trains the model without MHLA, but {names} {verb} set: drop "
                             f"{'them' if len(set_options) > 1 else 'it'}, or use attention: mhla")
        if self.attention_transfer_steps:
            raise ValueError("attention: softmax has no MHLA layers to distil into: set attention_transfer_steps: 0, "
                             "or use attention: mhla")
        allowed = self._softmax_trainable()
        if self.trainable not in allowed:
            raise ValueError(f"attention: softmax trains `trainable: {' or '.join(allowed)}` (`{self.trainable}` selects "
                             "MHLA parameters, which a softmax model does not have)")

    def transfer_params(self) -> str:
        """``attention_transfer_params`` with ``auto`` resolved."""
        if self.attention_transfer_params != "auto":
            return self.attention_transfer_params
        return "mhla" if self.trainable in ("mhla", "lora") else "attention"

    # ------------------------------------------------------------------ I/O

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def save_yaml(self, path: str | Path) -> None:
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))

    def resolved_cache_dir(self) -> Path:
        return Path(self.cache_dir) if self.cache_dir else Path(self.output_dir) / "cache"


@dataclass
class WanTrainOptions(TrainOptions):
    """Text-to-video (Wan2.1 + MHLA): reference recipe of the MHLA paper's Wan fine-tune."""

    height: int = 480
    width: int = 832
    num_frames: int = 81  # a count the model's VAE accepts (see mhla_diffusion.utils.geometry)
    resolution_buckets: list[list[int]] | None = None  # [[h, w], ...]; default [[height, width]]
    frame_buckets: list[int] | None = None  # frame counts videos may train at (as num_frames); default [num_frames]
    frame_stride: int = 1  # take every n-th frame
    frame_sampling: str = "start"  # start (first frames, as the reference) | random (random clip start)
    max_sequence_length: int = 512
    caption_dropout: float = 0.1  # probability of training on the empty prompt
    caption_column: str | None = None  # metadata column with the caption; default: text, caption or prompt
    file_column: str | None = None  # metadata column with the file path; default: file_name, video, image or path
    logit_mean: float = 0.0
    logit_std: float = 1.0
    flow_shift: float = 3.0
    lora_rank: int = 64
    lora_alpha: int = 64
    lora_target_modules: list[str] = field(default_factory=lambda: ["to_q", "to_k", "to_v", "to_out.0"])
    text_encoder_dtype: str = "auto"  # auto = the mixed-precision dtype
    vae_dtype: str = "auto"
    validation_prompts: list[str] = field(default_factory=list)
    validation_negative_prompt: str = ""
    validation_height: int | None = None  # default: height
    validation_width: int | None = None
    validation_num_frames: int | None = None
    validation_fps: int = 16
    # split each clip's tokens across this many processes (sequence parallelism; data parallelism across the
    # groups: 4 processes with 2 = a 2 x 2 mesh); every bucket's token count must be a multiple of it
    context_parallel_degree: int = 1
    # Output distillation of an MHLA student (attention: mhla) from its softmax original (pretrained_model's own
    # transformer, frozen): the end-to-end loss becomes (1 - w) * MSE(prediction, noise - x0)
    # + w * MSE(prediction, the original's prediction for the same noisy latents, timestep and text).
    distillation_weight: float = 0.0  # w in [0, 1]; 0 = off

    def validate(self) -> None:
        super().validate()
        if not 0 <= self.distillation_weight <= 1:
            raise ValueError(f"`distillation_weight` must be in [0, 1] (0 = off), got {self.distillation_weight}")
        if self.distillation_weight and self.attention == "softmax":
            raise ValueError("distillation_weight distils an MHLA student from its softmax original, but attention: "
                             "softmax trains the original itself: set distillation_weight: 0, or use attention: mhla")
        _at_least("context_parallel_degree", self.context_parallel_degree, 1)
        if self.context_parallel_degree > 1:
            if self.attention_transfer_steps:
                raise ValueError("attention transfer's per-layer losses are not split across a context-parallel group: "
                                 "set attention_transfer_steps: 0 with context_parallel_degree > 1 (run a transfer stage "
                                 "on its own with context_parallel_degree: 1)")
            if self.validation_fid_reference:
                raise ValueError("validation FID samples different clips on every process, which a context-parallel "
                                 "group can not split: drop validation_fid_reference, or set context_parallel_degree: 1")
        # Frame counts and sizes must also suit the model (frames k * VAE temporal scale + 1, sizes
        # multiples of VAE scale x patch size): the trainer checks them against the model's configs at
        # setup, before any work (mhla_diffusion.utils.geometry.VideoGeometry).
        for name in ("height", "width", "num_frames"):
            _at_least(name, getattr(self, name), 1)
        for h, w in self.bucket_sizes():
            if h < 1 or w < 1:
                raise ValueError(f"resolution bucket {[h, w]} must be [height, width], positive")
        for frames in self.frame_counts():
            _at_least("frame_buckets entry", frames, 1)
        _at_least("frame_stride", self.frame_stride, 1)
        _at_least("max_sequence_length", self.max_sequence_length, 1)
        _choice("frame_sampling", self.frame_sampling, ("start", "random"))
        _choice("text_encoder_dtype", self.text_encoder_dtype, _DTYPES)
        _choice("vae_dtype", self.vae_dtype, _DTYPES)
        if not 0 <= self.caption_dropout <= 1:
            raise ValueError(f"`caption_dropout` must be in [0, 1], got {self.caption_dropout}")
        if self.logit_std <= 0 or self.flow_shift <= 0:
            raise ValueError("`logit_std` and `flow_shift` must be > 0")
        if self.trainable == "lora":
            _at_least("lora_rank", self.lora_rank, 1)
            if not self.lora_target_modules:
                raise ValueError("`lora_target_modules` is empty: list module names such as to_q, to_k, to_v, to_out.0")
        if self.cache_latents and self.frame_sampling == "random":
            raise ValueError("cached latents fix each clip once: use frame_sampling: start with cache_latents")
        if any(not str(p).strip() for p in self.validation_prompts):
            raise ValueError("`validation_prompts` has an empty prompt")
        if self.validation_fid_reference:
            if not self.validation_prompts:
                raise ValueError("validation FID samples clips for the `validation_prompts` (cycled): set "
                                 "validation_prompts, or drop validation_fid_reference")
            if self.validation_fid_samples * (self.validation_num_frames or self.num_frames) < 2:
                raise ValueError("validation FID needs at least 2 images (frames): raise validation_fid_samples")

    def bucket_sizes(self) -> list[tuple[int, int]]:
        """Resolution buckets ``(height, width)``; the first is the main size."""
        if self.resolution_buckets is None:
            return [(self.height, self.width)]
        sizes = []
        for bucket in self.resolution_buckets:
            if len(bucket) != 2:
                raise ValueError(f"resolution bucket {bucket} must be [height, width]")
            sizes.append((int(bucket[0]), int(bucket[1])))
        if not sizes:
            raise ValueError("`resolution_buckets` is empty: give at least one [height, width] or leave it unset")
        return sizes

    def frame_counts(self) -> list[int]:
        """Frame buckets for videos, ascending."""
        counts = sorted({int(f) for f in (self.frame_buckets or [self.num_frames])})
        if not counts:
            raise ValueError("`frame_buckets` is empty: give frame counts such as [17, 49, 81] or leave it unset")
        return counts


@dataclass
class DiTTrainOptions(TrainOptions):
    """Class-to-image (DiT + MHLA): reference recipe of the MHLA paper's DiT training."""

    seed: int = 0
    learning_rate: float = 1e-4
    lr_scheduler: str = "constant"
    lr_warmup_steps: int = 0
    max_grad_norm: float = 0.0
    adam_epsilon: float = 1e-8
    train_batch_size: int = 32
    mixed_precision: str | None = None  # the reference trains in fp32 (+TF32) unless accelerate is configured
    gradient_checkpointing: bool = False
    resolution: int = 256
    class_dropout: float = 0.1  # labels replaced by the null class (num_classes) for classifier-free guidance
    random_flip: bool = True
    flip_coin_per_batch: bool = False  # with random_flip: one coin per batch (all flipped or none), as released DiT
    ema_decay: float = 0.9999  # the reference's EMA
    clamp_mixing: bool = True  # clamp mixing coefficients to [0, 1] after every step, as the reference
    learned_sigma_loss: str = "vb"  # vb (MSE + variational bound, as DiT) | none; used when the model predicts sigma
    class_map: dict | None = None  # folder name -> class id; default: numeric folder names, else sorted order
    validation_classes: list = field(default_factory=list)
    validation_guidance_scale: float = 4.0
    validation_num_inference_steps: int = 50
    # --- a DiT from random initialisation (instead of pretrained_model)
    model_size: str | None = None  # DiT-S/2 .. DiT-XL/8 (the DiT table, mhla_diffusion/loaders/original_dit.py): train from scratch
    model_overrides: dict = field(default_factory=dict)  # DiTTransformer2DModel config over the size's, e.g. {num_layers: 2}
    num_classes: int | str = 1000  # classes of a model_size model: a count, or "data" (the data's class count)
    vae_model: str = DEFAULT_DIT_VAE  # model_size: VAE folder, hub id or pipeline folder (its vae/)
    share_embedder: bool = True  # model_size: one timestep + class embedder for all blocks, as DiT

    def _required_options(self) -> Sequence[str]:
        return ("output_dir", "data_dir") if self.model_size is not None else super()._required_options()

    def _latent_sampling_choices(self) -> Sequence[str]:
        return ("sample", "mode", "presampled")  # presampled: one posterior sample per image, drawn by the cache pre-pass

    def validate(self) -> None:
        if self.model_size is None and not self.pretrained_model:
            raise ValueError("`pretrained_model` is required (a DiT pipeline folder or hub id), or `model_size` "
                             "(e.g. DiT-S/2) to train a DiT from random initialisation")
        super().validate()
        _at_least("resolution", self.resolution, 1)  # a multiple of the model's VAE scale x patch: checked at setup
        self._check_model_size()
        if self.flip_coin_per_batch and not self.random_flip:
            raise ValueError("`flip_coin_per_batch` chooses how `random_flip` flips: set random_flip: true, or drop it")
        if self.latent_sampling == "presampled" and not self.cache_latents:
            raise ValueError("latent_sampling: presampled draws one posterior sample per image in the cache pre-pass: "
                             "set cache_latents: true")
        if not 0 <= self.class_dropout <= 1:
            raise ValueError(f"`class_dropout` must be in [0, 1], got {self.class_dropout}")
        _choice("learned_sigma_loss", self.learned_sigma_loss, ("vb", "none"))
        if self.validation_fid_reference and self.validation_fid_samples < 2:
            raise ValueError(f"`validation_fid_samples` must be >= 2 (FID takes a covariance), got {self.validation_fid_samples}")

    def _check_model_size(self) -> None:
        """``model_size`` (a DiT from scratch) against the options that need or exclude it."""
        from ..utils.dit_sizes import dit_model_size

        if self.model_size is None:
            set_options = [f"`{name}`" for name, unset in (
                ("model_overrides", not self.model_overrides), ("num_classes", self.num_classes == 1000),
                ("vae_model", self.vae_model == DEFAULT_DIT_VAE)) if not unset]
            if set_options:
                verb = "describes" if len(set_options) == 1 else "describe"
                raise ValueError(f"{', '.join(set_options)} {verb} a DiT trained from scratch: set `model_size` "
                                 "(pretrained_model brings its own model, classes and VAE), or drop them")
            return
        if self.pretrained_model:
            raise ValueError(f"`pretrained_model` and `model_size` are both set: start from {self.pretrained_model} "
                             f"or train a {self.model_size} from random initialisation, not both")
        dit_model_size(self.model_size)
        if self.mhla_weights is not None:
            raise ValueError("`mhla_weights` loads into a pretrained model: drop it with `model_size`")
        if self.trainable != "all":
            raise ValueError(f"a model trained from scratch trains every parameter: trainable: all (not {self.trainable})")
        if self.attention_transfer_steps:
            raise ValueError("a model trained from scratch has no pretrained softmax attention to distil: "
                             "set attention_transfer_steps: 0")
        if not self.vae_model:
            raise ValueError("`vae_model` is required with `model_size` (default stabilityai/sd-vae-ft-ema)")
        if isinstance(self.num_classes, str) and self.num_classes != "data":
            raise ValueError(f"`num_classes` must be a count or \"data\", got {self.num_classes!r}")
        if isinstance(self.num_classes, int):
            _at_least("num_classes", self.num_classes, 1)

    def _trainable_choices(self) -> Sequence[str]:
        return ("all", "mhla", "attention")  # Diffusers has no LoRA loader for DiTPipeline

    def _softmax_trainable(self) -> Sequence[str]:
        return ("all",)


# ---------------------------------------------------------------------- parsing


def parse_cli(argv: Sequence[str] | None, cls: type[TrainOptions] | None = None) -> tuple[str | None, dict[str, Any]]:
    """``--config PATH`` and ``--key value`` / ``--key=value`` pairs -> (config path, raw overrides).

    ``--help`` prints the options of ``cls`` with their defaults and exits.
    """
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--config")
    parser.add_argument("-h", "--help", action="store_true")
    known, rest = parser.parse_known_args(argv)
    if known.help:
        print(_help_text(cls))
        raise SystemExit(0)
    overrides: dict[str, Any] = {}
    i = 0
    while i < len(rest):
        token = rest[i]
        if not token.startswith("--") or len(token) < 3:
            raise ValueError(f"unexpected argument {token!r}: options are --key value (e.g. --max_train_steps 100)")
        key, eq, value = token[2:].partition("=")
        if not eq:
            if i + 1 >= len(rest) or rest[i + 1].startswith("--"):
                raise ValueError(f"--{key} needs a value (booleans too: --{key} true)")
            value = rest[i + 1]
            i += 1
        overrides[key.replace("-", "_")] = read_yaml(value, f"--{key} {value!r}") if value != "" else ""
        i += 1
    return known.config, overrides


def read_yaml(text: str, where: str) -> Any:
    """``yaml.safe_load(text)``; a syntax error is a one-line ``ValueError`` naming ``where`` (a file, an option),
    the line and the column."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        at = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        context, start = getattr(error, "context", None), getattr(error, "context_mark", None)
        opened = f" ({context} opened at line {start.line + 1}, column {start.column + 1})" if context and start else ""
        raise ValueError(f"{where}{at}: not valid YAML: {problem}{opened}") from None


def _help_text(cls: type[TrainOptions] | None) -> str:
    lines = [
        "usage: python finetune/train_wan.py|train_dit.py (or python -m mhla_diffusion.finetune.train_wan|train_dit) --config CONFIG.yaml [--key value ...]",
        "Every option of the YAML file can be overridden as --key value (YAML syntax for lists: '[480, 832]');",
        "MHLA options as --mhla.KEY value (any MHLAConfig field). Example configs: finetune/configs/ (see finetune/README.md).",
    ]
    if cls is not None:
        lines.append("\noptions (default):")
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            lines.append(f"  --{f.name} ({default!r})")
    return "\n".join(lines)


def unknown_name(kind: str, name: str, names: Iterable[str], lookup: str | None = None) -> ValueError:
    """The error for a name that is not among ``names``: "unknown option `learnin_rate` (did you mean
    `learning_rate`?); `--help` lists every option" (``kind``: option, setting, ...; ``lookup``: the spelling
    to match, default ``name``)."""
    close = difflib.get_close_matches(lookup or name, list(names), n=1)
    hint = f" (did you mean `{close[0]}`?)" if close else ""
    return ValueError(f"unknown {kind} `{name}`{hint}; `--help` lists every {kind}")


def options_from_dict(cls: type[T], values: dict[str, Any]) -> T:
    """Build and validate ``cls`` from a flat dict whose ``mhla.X`` keys go into the ``mhla`` dict."""
    names = {f.name for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    mhla: dict[str, Any] = {}
    for raw_key, value in values.items():
        key = raw_key.replace("-", "_")
        if key.startswith("mhla."):
            mhla[key[5:]] = value
            continue
        if key not in names:
            raise unknown_name("option", raw_key, names, key)
        kwargs[key] = _coerce(key, value, hints[key])
    if mhla:
        kwargs["mhla"] = {**kwargs.get("mhla", {}), **mhla}
    options = cls(**kwargs)
    options.validate()
    return options


def load_options(cls: type[T], argv: Sequence[str] | None = None) -> T:
    """Options of a trainer from ``--config`` (YAML) and command-line overrides."""
    config_path, overrides = parse_cli(argv, cls)
    values: dict[str, Any] = {}
    if config_path is not None:
        path = Path(config_path)
        if not path.is_file():
            raise FileNotFoundError(f"--config {path} does not exist")
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            raise ValueError(f"--config {path} is not a text file: give a YAML file of option: value") from None
        loaded = read_yaml(text, str(path)) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"{path} must hold a mapping of option: value")
        values.update(loaded)
    for key, value in overrides.items():
        if key.startswith("mhla.") and isinstance(values.get("mhla"), dict):
            values["mhla"] = {**values["mhla"], key[5:]: value}
        else:
            values[key] = value
    return options_from_dict(cls, values)


def _coerce(name: str, value: Any, hint: Any) -> Any:
    """Check ``value`` against the annotation ``hint`` (ints are accepted for floats)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(name, value, arg)
            except ValueError as err:
                errors.append(str(err))
        raise ValueError(errors[0])
    if hint is Any:
        return value
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ValueError(f"`{name}` must be true or false, got {value!r}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ValueError(f"`{name}` must be an integer, got {value!r}")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-4" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ValueError(f"`{name}` must be a number, got {value!r}")
    if hint is str:
        if isinstance(value, bool):  # YAML 1.1 reads a bare `no` (mixed_precision: no) as false
            return "no" if value is False else "yes"
        if isinstance(value, (str, int, float)):
            return str(value)
        raise ValueError(f"`{name}` must be a string, got {value!r}")
    if origin is list or hint is list:
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"`{name}` must be a list (YAML: [a, b]), got {value!r}")
        (item,) = typing.get_args(hint) or (Any,)
        return [_coerce(name, v, item) for v in value]
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise ValueError(f"`{name}` must be a mapping (YAML: {{key: value}}), got {value!r}")
        return dict(value)
    return value


def _check_finite(options: TrainOptions) -> None:
    """Every number (also inside lists and the ``mhla`` / ``model_overrides`` dicts) must be finite."""
    import math

    def bad(value: Any) -> bool:
        if isinstance(value, float):
            return not math.isfinite(value)
        if isinstance(value, (list, tuple)):
            return any(bad(v) for v in value)
        if isinstance(value, dict):
            return any(bad(v) for v in value.values())
        return False

    for f in dataclasses.fields(options):
        value = getattr(options, f.name)
        if bad(value):
            raise ValueError(f"`{f.name}` must be a finite number, got {value!r} (nan and inf are not accepted)")


def _choice(name: str, value: Any, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"`{name}` must be one of {', '.join(map(str, choices))}; got {value!r}")


def _at_least(name: str, value: int, low: int) -> None:
    if value < low:
        raise ValueError(f"`{name}` must be >= {low}, got {value}")
