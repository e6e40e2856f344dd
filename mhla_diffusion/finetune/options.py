"""Trainer options: one dataclass per trainer, read from a YAML file with ``--key value`` overrides.

``WanTrainOptions`` and ``DiTTrainOptions`` share :class:`TrainOptions`. Defaults follow the MHLA
reference recipes (Wan: flow matching, AdamW 2e-5, clip 0.1, bf16; DiT: epsilon + VB, AdamW 1e-4,
EMA 0.9999). Each field is defined once (type, default, help, choices; :mod:`mhla_diffusion.utils.options`):
``--help`` is built from those definitions. Every value can come from the YAML file and be overridden on the
command line:

    python -m mhla_diffusion.finetune.train_wan --config wan.yaml --max_train_steps 2000 --mhla.layers hybrid

Keys may be spelled with ``_`` or ``-``; nested ``mhla`` options use a dot and have the type of their
:class:`~mhla_diffusion.MHLAConfig` field. Command-line values are read as YAML (``true``, ``3``;
:func:`~mhla_diffusion.utils.options.parse_text`), lists by the option layer's one list rule (``1,6,6``,
``3x5x10`` or ``[1, 6, 6]``; sizes ``480x832,720x1280``), then checked against the field's type like the file's
(:func:`~mhla_diffusion.utils.options.coerce`). Every option, the ``mhla`` ones included, is checked here, before
the trainer imports torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence, TypeVar

import yaml

from ..config import MHLAConfig
from ..utils.choices import ATTENTIONS, WEIGHT_DTYPES
from ..utils.geometry import MAX_SEED
from ..utils.options import (
    ANY_NUMBER,
    above,
    add_field_arguments,
    at_least,
    between,
    check_choice,
    check_choices,
    check_ranges,
    coerce,
    describe,
    option,
    parse_text,
    read_yaml,
    unknown_name,
)

__all__ = [
    "DEFAULT_DIT_VAE",
    "DiTTrainOptions",
    "TrainOptions",
    "WanTrainOptions",
    "load_options",
    "mhla_config_from_options",
    "options_from_dict",
    "parse_cli",
]

T = TypeVar("T", bound="TrainOptions")

logger = logging.getLogger(__name__)

#: The type of each ``mhla.KEY`` option: the :class:`~mhla_diffusion.MHLAConfig` field's annotation.
MHLA_HINTS = typing.get_type_hints(MHLAConfig)
#: The valid range of each number field of :class:`~mhla_diffusion.MHLAConfig`, for its ``--mhla.KEY`` option
#: (checked at parse time; MHLAConfig checks its values again wherever it is built).
MHLA_RANGES = {
    "layers": at_least(0),  # block indices (or all / hybrid)
    "layout": at_least(1),
    "target_grid": at_least(1),
    "exp_sigma": above(0),
    "local_threshold": at_least(0),
    "eps": above(0),
    "output_dropout": between(0, 1, high_open=True, zero="no dropout"),
    "causal_window": at_least(0),
}

DEFAULT_DIT_VAE = "stabilityai/sd-vae-ft-ema"  # the released DiT recipe's VAE (a model_size run's default vae_model)


@dataclass
class TrainOptions:
    """Options shared by both trainers (``--help`` lists every option with its help and default)."""

    # --- model
    pretrained_model: str = option("", "Diffusers pipeline folder or hub id (required; DiT: or `model_size` instead)")
    revision: str | None = option(None, "hub revision of pretrained_model")
    attention: str = option(
        "mhla",
        "mhla: convert the model, then train; softmax: train the model's own attention as it is",
        choices=ATTENTIONS,
    )
    mhla: dict = option(
        help="MHLAConfig fields, e.g. {layers: hybrid, layout: [3, 5, 10], gate: true}; one at a time "
        "on the command line as --mhla.KEY VALUE",
        default_factory=dict,
    )
    mhla_preset: str | None = option(
        None,
        "released-wan / released-dit: MHLAConfig.released_wan() / .released_dit(), `mhla` overrides its fields",
        choices=("released-wan", "released-dit"),
    )
    mhla_weights: str | None = option(None, "start from a save_mhla folder instead of a fresh conversion")
    trainable: str = option(
        "all",
        "all | mhla (the new MHLA parameters) | attention (MHLA and its self-attention) | lora",
        choices=("all", "mhla", "attention", "lora"),
    )
    # --- run folder
    output_dir: str = option("", "the run folder (required); never reused for a new run unless overwrite_output_dir")
    overwrite_output_dir: bool = option(False, "delete output_dir and start a new run there")
    resume: str | None = option(None, "continue the run in output_dir: latest, or a checkpoint folder")
    seed: int = option(1, "random seed of the run", valid=between(0, MAX_SEED))
    # --- data
    data_dir: str = option("", "the training data folder (required)")
    cache_latents: bool = option(False, "pre-pass: encode latents (and text) once to disk, then train from the cache")
    cache_dir: str | None = option(
        None,
        "where cache_latents writes (default <output_dir>/cache); share it between runs with the same data settings",
    )
    cache_dtype: str = option("float32", "dtype of cached tensors", choices=WEIGHT_DTYPES)
    latent_sampling: str = option(
        "sample", "sample: a posterior sample each step; mode: the posterior mean", choices=("sample", "mode")
    )
    dataloader_num_workers: int = option(0, "data loading processes (0: in the training process)", valid=at_least(0))
    # --- optimisation
    learning_rate: float = option(2e-5, "AdamW learning rate of the end-to-end stage", valid=above(0))
    adam_beta1: float = option(0.9, "AdamW beta1", valid=between(0, 1, high_open=True))
    adam_beta2: float = option(0.999, "AdamW beta2", valid=between(0, 1, high_open=True))
    adam_epsilon: float = option(1e-10, "AdamW epsilon", valid=above(0))
    weight_decay: float = option(0.0, "AdamW weight decay", valid=at_least(0, zero="no weight decay"))
    lr_scheduler: str = option("constant_with_warmup", "any name of diffusers.optimization.get_scheduler")
    lr_warmup_steps: int = option(1000, "learning-rate warmup, in optimizer steps", valid=at_least(0, zero="no warmup"))
    max_grad_norm: float = option(0.1, "gradient clipping norm", valid=at_least(0, zero="no gradient clipping"))
    train_batch_size: int = option(4, "samples per process and step", valid=at_least(1))
    gradient_accumulation_steps: int = option(1, "batches accumulated into one optimizer step", valid=at_least(1))
    max_train_steps: int = option(
        1000, "end-to-end optimizer steps (after the attention-transfer stage)", valid=at_least(1)
    )
    mixed_precision: str | None = option(
        "bf16", "no | fp16 | bf16 | null (use accelerate's config)", choices=("no", "fp16", "bf16")
    )
    frozen_dtype: str = option(
        "auto",
        "dtype of frozen weights; auto: the mixed-precision dtype (float32 under FSDP)",
        choices=("auto", *WEIGHT_DTYPES),
    )
    gradient_checkpointing: bool = option(True, "recompute activations in the backward pass to save memory")
    allow_tf32: bool = option(True, "allow TF32 matrix multiplications on Ampere and later GPUs")
    # --- attention transfer (stage 1, optional)
    attention_transfer_steps: int = option(
        0,
        "steps of the attention-transfer stage before the end-to-end stage",
        valid=at_least(0, zero="no attention-transfer stage"),
    )
    attention_transfer_lr: float = option(1e-3, "learning rate of the attention-transfer stage", valid=above(0))
    attention_transfer_params: str = option(
        "auto",
        "attention: MHLA and the layer's q/k/v/o and norms | mhla: the new parameters only (far weaker) | "
        "auto: attention, or mhla when trainable is mhla / lora (whose outputs keep only those)",
        choices=("auto", "mhla", "attention"),
    )
    attention_transfer_teacher_forcing: bool = option(True, "later layers see the softmax output, not the student's")
    # --- EMA of the trained weights (saved as `final` and in the pipeline; raw weights as `final-no-ema`)
    ema_decay: float = option(
        0.0,
        "EMA decay of the trained weights (with EMA the averaged weights are saved as `final`, the raw ones as "
        "`final-no-ema`)",
        valid=between(0, 1, high_open=True, zero="no EMA"),
    )
    ema_warmup: bool = option(
        False, "false: constant decay from the first step (DiT's reference); true: Diffusers' warmup"
    )
    # --- checkpoints and outputs
    checkpointing_steps: int = option(
        500,
        "save a resumable checkpoint every N optimizer steps",
        valid=at_least(0, zero="never: no resumable checkpoints, not even at the end"),
    )
    checkpoints_total_limit: int | None = option(
        3, "checkpoints kept (the oldest are deleted); null keeps all", valid=at_least(1)
    )
    save_pipeline: bool = option(False, "also write a full pipeline folder (<output_dir>/pipeline) at the end")
    # --- logging and validation
    report_to: str = option(
        "auto",
        "where metrics go: auto (tensorboard if installed, else jsonl) | tensorboard | wandb | jsonl | none",
        choices=("auto", "tensorboard", "wandb", "jsonl", "none"),
    )
    tracker_project_name: str = option("mhla-finetune", "project name for the tracker")
    validation_steps: int = option(
        0,
        "sample the validation inputs every N optimizer steps (and at the end; when validation inputs are given)",
        valid=at_least(0, zero="validation samples only at the end"),
    )
    validation_num_inference_steps: int = option(20, "denoising steps of validation samples", valid=at_least(1))
    validation_guidance_scale: float | None = option(
        None,
        "classifier-free guidance scale of validation samples, recorded as the saved pipeline's default; "
        "default: pretrained_model's own (the embedded video model's 2.0; a recorded one; else Diffusers' 5.0)",
        valid=at_least(0),
    )
    validation_seed: int = option(0, "seed of validation samples", valid=between(0, MAX_SEED))
    # --- validation FID (off unless validation_fid_reference is set; see mhla_diffusion/finetune/validation_fid.py)
    validation_fid_reference: str | None = option(
        None, "ADM .npz with mu, sigma, mu_s, sigma_s (`mhla eval-ref`): turns validation FID / sFID on"
    )
    validation_fid_steps: int = option(1000, "FID/sFID every N optimizer steps, and at the end", valid=at_least(1))
    validation_fid_samples: int = option(
        1000, "FID samples over all processes (Wan: clips, every frame an image)", valid=at_least(1)
    )
    validation_fid_batch_size: int = option(
        8, "FID samples per pipeline call per process (DiT; Wan samples clip by clip)", valid=at_least(1)
    )
    inception_weights: str | None = option(None, "FID Inception-v3 weights file; default $MHLA_INCEPTION_WEIGHTS")

    # ------------------------------------------------------------------ checks

    def validate(self) -> None:
        """Raise ``ValueError`` naming the bad option and how to fix it (no file or model access)."""
        _check_finite(self)
        check_ranges(self)  # every number option against its stated range (`--help` shows it)
        for name in self._required_options():
            if not getattr(self, name):
                raise ValueError(f"`{name}` is required: set it in the YAML file or pass --{name} VALUE")
        check_choices(self)
        if self.attention == "softmax":
            self._check_softmax()
        if self.mhla_weights is not None and (self.mhla or self.mhla_preset):
            raise ValueError("`mhla_weights` brings its own MHLA config: drop `mhla` / `mhla_preset`")
        if self.resume is not None and self.overwrite_output_dir:
            raise ValueError("`resume` continues the run in output_dir, `overwrite_output_dir` deletes it: choose one")
        if self.attention == "mhla" and self.mhla_weights is None:
            self.mhla_config()  # MHLAConfig's own checks (layout, layers, ...), before any model loads
        if self.inception_weights is not None and not self.validation_fid_reference:
            raise ValueError(
                "`inception_weights` is used by validation FID: set `validation_fid_reference` too, or drop it"
            )
        if self.trainable in ("mhla", "lora") and self.attention_transfer_params == "attention":
            raise ValueError(
                f"attention_transfer_params: attention trains the layers' projections, but trainable: {self.trainable} "
                "saves only MHLA (and LoRA) weights, so they would be lost: use attention_transfer_params: mhla, or "
                "trainable: attention / all"
            )
        self._warn_long_warmup()
        from diffusers.optimization import SchedulerType  # last: every other check runs without torch

        check_choice("lr_scheduler", self.lr_scheduler, [s.value for s in SchedulerType])

    def hub_models(self) -> dict[str, str]:
        """``{model: option}`` of the models this run loads (a hub id is fetched, or found in the cache, before
        the trainer starts)."""
        return {self.pretrained_model: "pretrained_model"} if self.pretrained_model else {}

    def mhla_config(self) -> MHLAConfig:
        """The :class:`~mhla_diffusion.MHLAConfig` of ``mhla`` and ``mhla_preset``; ``ValueError`` naming the
        ``mhla`` field that MHLAConfig refuses."""
        try:
            return mhla_config_from_options(self.mhla, self.mhla_preset)
        except ValueError as error:
            raise ValueError(f"mhla: {error}") from None

    def _warn_long_warmup(self) -> None:
        """A warmup as long as the run keeps the learning rate below the one asked for throughout (the
        reference's 1,000 warmup steps in a 40-step run train at 4 % of ``learning_rate``): say so, with the
        fix. The schedule itself is left as asked."""
        if self.lr_scheduler == "constant" or self.lr_warmup_steps <= self.max_train_steps:
            return
        peak = self.learning_rate * self.max_train_steps / self.lr_warmup_steps
        logger.warning(
            "lr_warmup_steps (%d) is longer than the run (max_train_steps %d): the learning rate only reaches "
            "%.3g of the %.3g asked for; set --lr_warmup_steps to a part of the run (e.g. %d)",
            self.lr_warmup_steps,
            self.max_train_steps,
            peak,
            self.learning_rate,
            max(self.max_train_steps // 10, 0),
        )

    def _required_options(self) -> Sequence[str]:
        return ("pretrained_model", "output_dir", "data_dir")

    def _softmax_trainable(self) -> Sequence[str]:
        return ("all", "lora")

    def _check_softmax(self) -> None:
        """``attention: softmax`` trains the model as it is: no MHLA option may be set."""
        set_options = [name for name in ("mhla", "mhla_preset", "mhla_weights") if getattr(self, name)]
        if set_options:
            names, verb = ", ".join(f"`{n}`" for n in set_options), "are" if len(set_options) > 1 else "is"
            raise ValueError(
                f"attention: softmax trains the model without MHLA, but {names} {verb} set: drop "
                f"{'them' if len(set_options) > 1 else 'it'}, or use attention: mhla"
            )
        if self.attention_transfer_steps:
            raise ValueError(
                "attention: softmax has no MHLA layers to distil into: set attention_transfer_steps: 0, "
                "or use attention: mhla"
            )
        allowed = self._softmax_trainable()
        if self.trainable not in allowed:
            raise ValueError(
                f"attention: softmax trains `trainable: {' or '.join(allowed)}` (`{self.trainable}` selects "
                "MHLA parameters, which a softmax model does not have)"
            )

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

    height: int = option(480, "training height in pixels (a multiple of the VAE scale x patch size)", valid=at_least(1))
    width: int = option(832, "training width in pixels (a multiple of the VAE scale x patch size)", valid=at_least(1))
    num_frames: int = option(
        81, "frames per clip: a count the model's VAE accepts (see mhla_diffusion.utils.geometry)", valid=at_least(1)
    )
    resolution_buckets: list[list[int]] | None = option(
        None, "[[h, w], ...] sizes videos may train at; default [[height, width]]", valid=at_least(1)
    )
    frame_buckets: list[int] | None = option(
        None, "frame counts videos may train at (as num_frames); default [num_frames]", valid=at_least(1)
    )
    frame_stride: int = option(1, "take every n-th frame", valid=at_least(1))
    frame_sampling: str = option(
        "start", "start: the first frames, as the reference | random: a random clip start", choices=("start", "random")
    )
    max_sequence_length: int = option(512, "text tokens of a caption", valid=at_least(1))
    caption_dropout: float = option(
        0.1, "probability of training on the empty prompt", valid=between(0, 1, zero="no caption dropout")
    )
    caption_column: str | None = option(None, "metadata column with the caption; default: text, caption or prompt")
    file_column: str | None = option(
        None, "metadata column with the file path; default: file_name, video, image or path"
    )
    logit_mean: float = option(0.0, "mean of the logit-normal timestep density", valid=ANY_NUMBER)
    logit_std: float = option(1.0, "standard deviation of the logit-normal timestep density", valid=above(0))
    flow_shift: float = option(3.0, "flow-matching timestep shift", valid=above(0))
    causal_chunk_frames: int = option(
        1,
        "block-causal MHLA (mhla.causal: true): latent frames per chunk, each chunk trained at its own noise level "
        "(diffusion forcing); 1 .. the latent frames of num_frames; use the chunk size you will stream with",
        valid=at_least(1),
    )
    causal_clean_chunks: float = option(
        0.5,
        "block-causal MHLA: probability in [0, 1] that a chunk (never a clip's last) is clean context, timestep 0 "
        "and out of the loss, as a stream's earlier chunks; 0: every chunk noisy, 1: clean context + one noisy chunk",
        valid=between(0, 1),
    )
    causal_first_chunk_frames: int | None = option(
        None,
        "block-causal: latent frames of a clip's first chunk (default: causal_chunk_frames); e.g. 1 with chunks of "
        "4: the first latent frame alone, then chunks of 4, so 1 + 4k latent frames are whole chunks; stream with "
        "the same",
        valid=at_least(1),
    )
    causal_context_noise: float = option(
        0.0,
        "block-causal: a clean context chunk is noised instead to a level drawn uniformly from [0, this) in [0, 1), "
        "told by its timestep (still out of the loss), so the model reads a context with small errors in it; the "
        "saved pipeline re-noises each finished chunk to this level when it streams (context_noise)",
        valid=between(0, 1, high_open=True, zero="clean context"),
    )
    causal_objective: str = option(
        "diffusion_forcing",
        "block-causal: diffusion_forcing (a level per chunk, some chunks clean context) or teacher_forcing (the clip "
        "as a clean copy and a noisy copy in one pass: each noisy chunk sees the clean chunks before it and its own "
        "frames, as a stream denoises it; the loss is on the noisy copy; no gradient_checkpointing or distillation)",
        choices=("diffusion_forcing", "teacher_forcing"),
    )
    softmax_block_causal: bool = option(
        False,
        "attention: softmax: train softmax self-attention block-causal over latent frames (a frame sees itself and "
        "the frames before it), with the causal_* diffusion forcing of block-causal MHLA; the saved model streams "
        "with a KV cache",
    )
    lora_rank: int = option(64, "LoRA rank (trainable: lora)", valid=at_least(1))
    lora_alpha: int = option(64, "LoRA alpha (trainable: lora)", valid=above(0))
    lora_target_modules: list[str] = option(
        help="modules LoRA adapts (trainable: lora)", default_factory=lambda: ["to_q", "to_k", "to_v", "to_out.0"]
    )
    text_encoder_dtype: str = option(
        "auto", "dtype of the text encoder; auto: the mixed-precision dtype", choices=("auto", *WEIGHT_DTYPES)
    )
    vae_dtype: str = option(
        "auto", "dtype of the VAE; auto: the mixed-precision dtype", choices=("auto", *WEIGHT_DTYPES)
    )
    validation_prompts: list[str] = option(
        help="prompts sampled at validation (none: no validation samples)", default_factory=list
    )
    validation_negative_prompt: str = option("", "negative prompt of validation samples")
    validation_height: int | None = option(None, "height of validation samples; default: height", valid=at_least(1))
    validation_width: int | None = option(None, "width of validation samples; default: width", valid=at_least(1))
    validation_num_frames: int | None = option(
        None, "frames of validation samples; default: num_frames", valid=at_least(1)
    )
    validation_fps: int = option(16, "frame rate of the saved validation videos", valid=at_least(1))
    context_parallel_degree: int = option(
        1,
        "split each clip's tokens across this many processes (sequence parallelism; data parallelism across the "
        "groups: 4 processes with 2 = a 2 x 2 mesh); every bucket's token count must be a multiple of it",
        valid=at_least(1),
    )
    distillation_weight: float = option(
        0.0,
        "w: output distillation of an MHLA student (attention: mhla) from its softmax original "
        "(pretrained_model's own transformer, frozen); the end-to-end loss becomes "
        "(1 - w) * MSE(prediction, noise - x0) + w * MSE(prediction, the original's prediction for the same input)",
        valid=between(0, 1, zero="no output distillation"),
    )

    def validate(self) -> None:
        super().validate()
        if self.distillation_weight and self.attention == "softmax":
            raise ValueError(
                "distillation_weight distils an MHLA student from its softmax original, but attention: "
                "softmax trains the original itself: set distillation_weight: 0, or use attention: mhla"
            )
        if self.softmax_block_causal and self.attention != "softmax":
            raise ValueError(
                f"softmax_block_causal makes softmax self-attention block-causal, but attention: {self.attention} "
                "replaces it: set mhla: {causal: true} for block-causal MHLA, or attention: softmax"
            )
        self.check_causal(self._causal_asked())
        self._check_teacher_forcing()
        if self.context_parallel_degree > 1:
            if self.attention_transfer_steps:
                raise ValueError(
                    "attention transfer's per-layer losses are not split across a context-parallel group: "
                    "set attention_transfer_steps: 0 with context_parallel_degree > 1 (run a transfer stage "
                    "on its own with context_parallel_degree: 1)"
                )
            if self.validation_fid_reference:
                raise ValueError(
                    "validation FID samples different clips on every process, which a context-parallel "
                    "group can not split: drop validation_fid_reference, or set context_parallel_degree: 1"
                )
        # Frame counts and sizes must also suit the model (frames k * VAE temporal scale + 1, sizes
        # multiples of VAE scale x patch size): the trainer checks them against the model's configs at
        # setup, before any work (mhla_diffusion.utils.geometry.VideoGeometry).
        for h, w in self.bucket_sizes():
            if h < 1 or w < 1:
                raise ValueError(f"resolution bucket {[h, w]} must be [height, width], positive")
        for frames in self.frame_counts():
            _at_least("frame_buckets entry", frames, 1)
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
                raise ValueError(
                    "validation FID samples clips for the `validation_prompts` (cycled): set "
                    "validation_prompts, or drop validation_fid_reference"
                )
            if self.validation_fid_samples * (self.validation_num_frames or self.num_frames) < 2:
                raise ValueError("validation FID needs at least 2 images (frames): raise validation_fid_samples")

    def _causal_asked(self) -> bool | None:
        """Whether the options make the model block-causal: ``mhla.causal`` (conversion), ``softmax_block_causal``
        for ``attention: softmax``, ``None`` when only the model tells (``mhla_weights``, or a pretrained_model saved
        with MHLA, whose own config wins over ``mhla``): the trainer checks again with the model it loaded."""
        if self.attention == "softmax":
            return self.softmax_block_causal
        if self.mhla_weights is None and self.mhla_config().causal:
            return True
        return None

    def check_causal(self, causal: bool | None) -> None:
        """The ``causal_*`` options against whether the model is block-causal (``None``: not known yet; their
        ranges are their fields' ``valid`` rules)."""
        if causal and self.context_parallel_degree > 1:
            raise ValueError(
                f"context_parallel_degree {self.context_parallel_degree}: context parallelism has no block-causal "
                "MHLA or softmax, and this model is block-causal (mhla.causal or softmax_block_causal): set "
                "context_parallel_degree: 1, or train without causal"
            )
        defaults = {f.name: f.default for f in dataclasses.fields(self) if f.name.startswith("causal_")}
        changed = [f"`{name}`" for name, default in defaults.items() if getattr(self, name) != default]
        if changed and causal is False:
            raise ValueError(
                f"{', '.join(changed)} {'sets' if len(changed) == 1 else 'set'} how a block-causal model trains, but "
                "this model is not causal: set mhla: {causal: true} (attention: mhla) or softmax_block_causal: true "
                "(attention: softmax), or drop "
                f"{'it' if len(changed) == 1 else 'them'}"
            )

    def _check_teacher_forcing(self) -> None:
        """What ``causal_objective: teacher_forcing`` cannot run with, named with the fix."""
        if self.causal_objective != "teacher_forcing":
            return
        if self.gradient_checkpointing:
            raise ValueError(
                "causal_objective: teacher_forcing runs its [clean | noisy] view in the forward only, which "
                "gradient checkpointing would recompute without it: set gradient_checkpointing: false"
            )
        if self.distillation_weight:
            raise ValueError(
                "causal_objective: teacher_forcing has no distillation (the softmax original sees no clean copy): "
                "set distillation_weight: 0"
            )
        default = next(f.default for f in dataclasses.fields(self) if f.name == "causal_clean_chunks")
        if self.causal_clean_chunks != default:
            raise ValueError(
                "causal_clean_chunks is diffusion forcing's; under teacher_forcing every chunk's context is the clean "
                "copy: drop causal_clean_chunks"
            )

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

    # the DiT reference recipe's values of shared options (their help is TrainOptions')
    seed: int = 0
    learning_rate: float = 1e-4
    lr_scheduler: str = "constant"
    lr_warmup_steps: int = 0
    max_grad_norm: float = 0.0
    adam_epsilon: float = 1e-8
    train_batch_size: int = 32
    mixed_precision: str | None = None  # the reference trains in fp32 (+TF32) unless accelerate is configured
    gradient_checkpointing: bool = False
    ema_decay: float = 0.9999
    validation_guidance_scale: float = 4.0
    validation_num_inference_steps: int = 50
    trainable: str = option(
        "all",
        "all | mhla (the new MHLA parameters) | attention (MHLA and its self-attention); "
        "no lora: Diffusers has no LoRA loader for DiTPipeline",
        choices=("all", "mhla", "attention"),
    )
    latent_sampling: str = option(
        "sample",
        "sample: a posterior sample each step | mode: the posterior mean | "
        "presampled: one posterior sample per image, drawn by the cache pre-pass",
        choices=("sample", "mode", "presampled"),
    )
    # DiT's own options
    resolution: int = option(256, "image size in pixels (a multiple of the VAE scale x patch size)", valid=at_least(1))
    class_dropout: float = option(
        0.1,
        "probability of replacing the label by the null class (num_classes), for classifier-free guidance",
        valid=between(0, 1, zero="no class dropout (no unconditional training for guidance)"),
    )
    random_flip: bool = option(True, "flip images horizontally at random")
    flip_coin_per_batch: bool = option(
        False, "with random_flip: one coin per batch (all flipped or none), as released DiT"
    )
    clamp_mixing: bool = option(True, "clamp mixing coefficients to [0, 1] after every step, as the reference")
    learned_sigma_loss: str = option(
        "vb", "vb: MSE + variational bound, as DiT | none; used when the model predicts sigma", choices=("vb", "none")
    )
    class_map: dict | None = option(None, "folder name -> class id; default: numeric folder names, else sorted order")
    validation_classes: list = option(
        help="class ids (or names of class_map) sampled at validation", default_factory=list
    )
    # --- a DiT from random initialisation (instead of pretrained_model)
    model_size: str | None = option(
        None,
        "DiT-S/2 .. DiT-XL/8 (the DiT table, "
        "mhla_diffusion/loaders/original_dit.py): train a DiT of that size from random "
        "initialisation",
    )
    model_overrides: dict = option(
        help="model_size: DiTTransformer2DModel config over the size's, e.g. {num_layers: 2}", default_factory=dict
    )
    num_classes: int | str = option(
        1000, 'model_size: classes, a count or "data" (the data\'s class count)', valid=at_least(1)
    )
    vae_model: str = option(DEFAULT_DIT_VAE, "model_size: VAE folder, hub id or pipeline folder (its vae/)")
    share_embedder: bool = option(True, "model_size: one timestep + class embedder for all blocks, as DiT")

    def _required_options(self) -> Sequence[str]:
        return ("output_dir", "data_dir") if self.model_size is not None else super()._required_options()

    def hub_models(self) -> dict[str, str]:
        return {self.vae_model: "vae_model"} if self.model_size is not None else super().hub_models()

    def validate(self) -> None:
        if self.model_size is None and not self.pretrained_model:
            raise ValueError(
                "`pretrained_model` is required (a DiT pipeline folder or hub id), or `model_size` "
                "(e.g. DiT-S/2) to train a DiT from random initialisation"
            )
        super().validate()
        if self.attention == "mhla" and self.mhla_weights is None and self.mhla_config().causal:
            raise ValueError(
                "mhla.causal makes MHLA block-causal over video frames; images have no time axis: drop "
                "mhla.causal for the class-to-image trainer"
            )
        self._check_model_size()
        if self.flip_coin_per_batch and not self.random_flip:
            raise ValueError("`flip_coin_per_batch` chooses how `random_flip` flips: set random_flip: true, or drop it")
        if self.latent_sampling == "presampled" and not self.cache_latents:
            raise ValueError(
                "latent_sampling: presampled draws one posterior sample per image in the cache pre-pass: "
                "set cache_latents: true"
            )
        if self.validation_fid_reference and self.validation_fid_samples < 2:
            raise ValueError(
                f"`validation_fid_samples` must be >= 2 (FID takes a covariance), got {self.validation_fid_samples}"
            )

    def _check_model_size(self) -> None:
        """``model_size`` (a DiT from scratch) against the options that need or exclude it."""
        from ..utils.dit_sizes import dit_model_size

        if self.model_size is None:
            set_options = [
                f"`{name}`"
                for name, unset in (
                    ("model_overrides", not self.model_overrides),
                    ("num_classes", self.num_classes == 1000),
                    ("vae_model", self.vae_model == DEFAULT_DIT_VAE),
                )
                if not unset
            ]
            if set_options:
                verb = "describes" if len(set_options) == 1 else "describe"
                raise ValueError(
                    f"{', '.join(set_options)} {verb} a DiT trained from scratch: set `model_size` "
                    "(pretrained_model brings its own model, classes and VAE), or drop them"
                )
            return
        if self.pretrained_model:
            raise ValueError(
                f"`pretrained_model` and `model_size` are both set: start from {self.pretrained_model} "
                f"or train a {self.model_size} from random initialisation, not both"
            )
        dit_model_size(self.model_size)
        if self.mhla_weights is not None:
            raise ValueError("`mhla_weights` loads into a pretrained model: drop it with `model_size`")
        if self.trainable != "all":
            raise ValueError(
                f"a model trained from scratch trains every parameter: trainable: all (not {self.trainable})"
            )
        if self.attention_transfer_steps:
            raise ValueError(
                "a model trained from scratch has no pretrained softmax attention to distil: "
                "set attention_transfer_steps: 0"
            )
        if not self.vae_model:
            raise ValueError("`vae_model` is required with `model_size` (default stabilityai/sd-vae-ft-ema)")
        if isinstance(self.num_classes, str) and self.num_classes != "data":
            raise ValueError(f'`num_classes` must be a count or "data", got {self.num_classes!r}')
        if isinstance(self.num_classes, int):
            _at_least("num_classes", self.num_classes, 1)

    def _softmax_trainable(self) -> Sequence[str]:
        return ("all",)


def mhla_config_from_options(mhla: dict[str, Any], preset: str | None) -> MHLAConfig:
    """:class:`MHLAConfig` from the options' ``mhla`` mapping (and ``mhla_preset``)."""
    if preset == "released-wan":
        return MHLAConfig.released_wan(**mhla)
    if preset == "released-dit":
        return MHLAConfig.released_dit(**mhla)
    return MHLAConfig.from_dict(mhla)


# ---------------------------------------------------------------------- parsing


class _OptionParser(argparse.ArgumentParser):
    """A trainer's command line: a bad argument is a ``ValueError`` (one line, printed by ``run_main``)."""

    def error(self, message: str):  # type: ignore[override]
        if message.endswith("expected one argument"):  # "argument --x/--x-y: expected one argument"
            option = message.removeprefix("argument ").split(":")[0].split("/")[0]
            raise ValueError(f"{option} needs a value (booleans too: {option} true)")
        raise ValueError(message)


def _prog(script: str) -> str:
    """How the trainer was started, for its usage line: ``python finetune/train_wan.py`` (the script, as typed;
    also under ``accelerate launch``) or ``python -m mhla_diffusion.finetune.train_wan``."""
    launched = sys.argv[0] if sys.argv and sys.argv[0] else ""
    if launched.endswith(f"{script}.py"):
        package = Path(__file__).resolve().parent
        if Path(launched).resolve().parent == package:
            return f"python -m mhla_diffusion.finetune.{script}"
        return f"python {launched}"
    return f"python finetune/{script}.py"


def _trainer_parser(cls: type[TrainOptions]) -> argparse.ArgumentParser:
    """``--config``, one option per field of ``cls`` and one per :class:`~mhla_diffusion.MHLAConfig` field."""
    script = "train_dit" if issubclass(cls, DiTTrainOptions) else "train_wan"
    parser = _OptionParser(
        prog=_prog(script),
        allow_abbrev=False,
        usage="%(prog)s [--config CONFIG.yaml] [--OPTION VALUE ...]",
        description=f"{(cls.__doc__ or '').strip()} Every option can be set in the --config YAML file (without its "
        "--) and overridden here; values are YAML (true, 3), a list is written 1,6,6 or [1, 6, 6] (a list of "
        "numbers also 3x5x10; sizes 480x832,720x1280). Example configs: finetune/configs/.",
    )
    parser.add_argument("--config", metavar="CONFIG.yaml", help="YAML file of option: value")
    add_field_arguments(parser.add_argument_group("trainer options"), cls)
    mhla = parser.add_argument_group("MHLA options", "one field of `mhla` each (MHLAConfig; see its docstring)")
    for f in dataclasses.fields(MHLAConfig):
        names = [f"--mhla.{f.name}"] + ([f"--mhla.{f.name.replace('_', '-')}"] if "_" in f.name else [])
        mhla.add_argument(
            *names,
            dest=f"mhla.{f.name}",
            default=argparse.SUPPRESS,
            metavar="VALUE",
            help=f"MHLAConfig.{f.name}: {describe(MHLA_HINTS[f.name])} ({_range_words(f.name)}"
            f"default: {f.default!r})".replace("%", "%%"),
        )
    return parser


def parse_cli(argv: Sequence[str] | None, cls: type[TrainOptions]) -> tuple[str | None, dict[str, Any]]:
    """``--config PATH`` and ``--key value`` / ``--key=value`` pairs -> (config path, overrides read with
    :func:`~mhla_diffusion.utils.options.parse_text`; ``mhla.KEY`` for the MHLA fields).

    ``--help`` prints the options of ``cls`` with their help and defaults and exits.
    """
    parser = _trainer_parser(cls)
    known, rest = parser.parse_known_args(argv)
    if rest:
        token = rest[0]
        if not token.startswith("--") or len(token) < 3:
            raise ValueError(f"unexpected argument {token!r}: options are --key value (e.g. --max_train_steps 100)")
        name = token[2:].partition("=")[0]
        names = [a.dest for a in parser._actions if a.dest not in ("help", "config")]
        raise unknown_name("option", name, names, name.replace("-", "_"))
    texts = vars(known)
    config = texts.pop("config")
    hints = {**typing.get_type_hints(cls), **{f"mhla.{k}": v for k, v in MHLA_HINTS.items()}}
    overrides = {
        name: parse_text(name, text, hints.get(name, Any), where=f"--{name} {text!r}") for name, text in texts.items()
    }
    return config, overrides


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
        kwargs[key] = coerce(key, value, hints[key])
    mhla = {**kwargs.get("mhla", {}), **mhla}
    for key in mhla:  # the MHLA fields' types (a YAML file's `layout: 1,6,6` by the list rule too)
        if key not in MHLA_HINTS:
            raise unknown_name("option", f"mhla.{key}", [f"mhla.{k}" for k in MHLA_HINTS])
        mhla[key] = coerce(f"mhla.{key}", mhla[key], MHLA_HINTS[key])
        if key in MHLA_RANGES:
            MHLA_RANGES[key].check(f"mhla.{key}", mhla[key])
    if mhla:
        kwargs["mhla"] = mhla
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


def _range_words(name: str) -> str:
    """``"> 0; "`` for the help of ``--mhla.NAME`` (empty when the field is not a number)."""
    valid = MHLA_RANGES.get(name)
    return f"{valid.describe()}; " if valid is not None else ""


def _at_least(name: str, value: int, low: int) -> None:
    if value < low:
        raise ValueError(f"`{name}` must be >= {low}, got {value}")
