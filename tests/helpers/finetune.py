"""For the fine-tuning tests: tiny trainer options, reading a run's metrics, killing a run and comparing
its resumed weights, fixed-draw evaluation losses, and tiny pipelines whose attention matters."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch


def wan_values(pretrained: Path, data: Path, output: Path, **overrides) -> dict[str, Any]:
    """The values of :func:`wan_options` as a plain dict (for a YAML ``--config`` file)."""
    values = dict(
        pretrained_model=str(pretrained),
        data_dir=str(data),
        output_dir=str(output),
        height=32,
        width=32,
        num_frames=9,
        mhla={"layout": [1, 2, 2]},
        mixed_precision="no",
        train_batch_size=2,
        max_train_steps=4,
        learning_rate=1e-3,
        lr_warmup_steps=0,
        checkpointing_steps=0,
        max_sequence_length=16,
        report_to="jsonl",
    )
    values.update(overrides)
    return values


def wan_options(pretrained: Path, data: Path, output: Path, **overrides):
    """Tiny, fast, validated text-to-video options (32x32, 9 frames, fp32, layout 1x2x2)."""
    from mhla_diffusion.finetune.options import WanTrainOptions, options_from_dict

    return options_from_dict(WanTrainOptions, wan_values(pretrained, data, output, **overrides))


#: What every tiny class-to-image run shares: 16 px images, fp32, batches of 4, no EMA, metrics to JSONL.
_DIT_VALUES = dict(
    resolution=16,
    mixed_precision="no",
    train_batch_size=4,
    learning_rate=1e-3,
    checkpointing_steps=0,
    report_to="jsonl",
    ema_decay=0.0,
)


def dit_options(pretrained: Path, data: Path, output: Path, **overrides):
    """Tiny class-to-image options (16 px images -> 8x8 latents, fp32, 4 steps)."""
    from mhla_diffusion.finetune.options import DiTTrainOptions, options_from_dict

    values = dict(
        _DIT_VALUES, pretrained_model=str(pretrained), data_dir=str(data), output_dir=str(output), max_train_steps=4
    )
    return options_from_dict(DiTTrainOptions, {**values, **overrides})


#: A DiT-S/2-shaped model at toy width for from-scratch runs (2 blocks, 2 heads of 8 channels).
TINY_DIT_OVERRIDES = {"num_layers": 2, "num_attention_heads": 2, "attention_head_dim": 8}


def dit_scratch_options(vae: Path, data: Path, output: Path, **overrides):
    """Tiny from-scratch class-to-image options: ``DiT-S/2`` at toy width (:data:`TINY_DIT_OVERRIDES`) on
    16 px images (the tiny VAE x2 -> 8x8 latents, 4x4 tokens), fp32."""
    from mhla_diffusion.finetune.options import DiTTrainOptions, options_from_dict

    values = dict(
        _DIT_VALUES,
        model_size="DiT-S/2",
        model_overrides=dict(TINY_DIT_OVERRIDES),
        vae_model=str(vae),
        data_dir=str(data),
        output_dir=str(output),
        max_train_steps=3,
    )
    return options_from_dict(DiTTrainOptions, {**values, **overrides})


def metrics(output: Path) -> list[dict]:
    """The metric records a run with ``report_to="jsonl"`` wrote under ``output/logs``."""
    from mhla_diffusion.finetune.tracking import read_metrics

    return read_metrics(Path(output) / "logs")


class Interrupted(Exception):
    """A run stopped by :func:`crash_at`, as a kill would stop it."""


def crash_at(step: int) -> Callable[[int, dict], None]:
    """An ``on_step_end`` callback that stops the run with :class:`Interrupted` after its step ``step``."""

    def crash(done: int, logs: dict) -> None:
        if done == step:
            raise Interrupted

    return crash


def killed_and_resumed(train: Callable, options: Callable[..., Any], output: Path, at: int) -> Any:
    """``train(options(output))`` stopped after step ``at`` (:func:`crash_at`), then resumed with
    ``options(output, resume="latest")``; what the resumed run returns."""
    with pytest.raises(Interrupted):
        train(options(output), on_step_end=crash_at(at))
    return train(options(output, resume="latest"))


def assert_same_final_weights(a: Path, b: Path, folders=("final", "final-no-ema")) -> dict[str, dict]:
    """Check that runs ``a`` and ``b`` saved the same tensors (names and values) in each of ``folders``;
    ``{folder: a's tensors}``."""
    from safetensors.torch import load_file

    saved = {}
    for folder in folders:
        first = load_file(str(Path(a) / folder / "diffusion_pytorch_model.safetensors"))
        second = load_file(str(Path(b) / folder / "diffusion_pytorch_model.safetensors"))
        assert first.keys() == second.keys(), folder
        for key in first:
            assert torch.equal(first[key], second[key]), (folder, key)
        saved[folder] = first
    return saved


def base_wan_transformer(pipeline_dir: Path, layout=(1, 2, 2), **mhla):
    """The model a run starts from: the pipeline's transformer converted with the tiny options' MHLA config
    (``mhla``: more MHLAConfig fields, e.g. ``causal=True``)."""
    from mhla_diffusion import MHLAConfig, convert_to_mhla, load_transformer

    transformer = load_transformer(str(pipeline_dir))
    convert_to_mhla(transformer, MHLAConfig(layout=layout, **mhla))
    return transformer


def subprocess_env() -> dict:
    """The environment for a training subprocess: one thread, offline, unbuffered output."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    return env


class WanEvaluator:
    """End-to-end flow-matching loss of a transformer on a video set, with fixed draws (posterior means).

    ``chunk_frames``: a block-causal model's loss as a stream sees it, the clip's last chunk of ``chunk_frames``
    latent frames noisy after clean earlier chunks (per-token timesteps; the loss on that chunk alone)."""

    def __init__(
        self, pipeline_dir: Path, data: Path, draws: int = 6, size: int = 32, chunk_frames: int | None = None
    ) -> None:
        from mhla_diffusion.finetune.components import load_component
        from mhla_diffusion.finetune.latents import encode_posterior, wan_latent_normalization
        from mhla_diffusion.finetune.text import encode_prompts, pad_prompt_embeds
        from mhla_diffusion.finetune.video_data import VideoTextDataset, index_video_folder

        vae = load_component(str(pipeline_dir), "vae")
        tokenizer = load_component(str(pipeline_dir), "tokenizer")
        text_encoder = load_component(str(pipeline_dir), "text_encoder")
        samples, _ = index_video_folder(data, [(size, size)], [9])
        dataset = VideoTextDataset(samples)
        shift, scale = wan_latent_normalization(vae, 16)
        self.items = []
        for i, sample in enumerate(samples):
            params = encode_posterior(vae, dataset.load(i, 0)["pixels"][None], shift, scale)
            text = pad_prompt_embeds(encode_prompts(tokenizer, text_encoder, [sample.caption], 16), 16)
            self.items.append((params[:, :16], text))
        self.draws = draws
        self.chunk_frames = chunk_frames

    @torch.no_grad()
    def __call__(self, transformer) -> float:
        from mhla_diffusion.finetune.objectives import diffusion_forcing_inputs, flow_match_inputs, flow_match_loss

        transformer.eval()
        losses = []
        for i, (latents, text) in enumerate(self.items):
            generator = torch.Generator().manual_seed(1000 + i)
            for _ in range(self.draws):
                if self.chunk_frames is None:
                    inputs = flow_match_inputs(latents, generator)
                else:
                    tokens = latents.shape[3] * latents.shape[4] // 4  # Wan's 2 x 2 patches
                    inputs = diffusion_forcing_inputs(latents, generator, self.chunk_frames, tokens, clean_chunks=1.0)
                out = transformer(
                    hidden_states=inputs.noisy, timestep=inputs.timesteps, encoder_hidden_states=text
                ).sample
                losses.append(flow_match_loss(out, inputs.target, inputs.weight).item())
        return float(np.mean(losses))


class DiTEvaluator:
    """Epsilon MSE of a DiT transformer on class folders, with fixed draws (posterior means, no flips)."""

    def __init__(self, pipeline_dir: Path, data: Path, draws: int = 6) -> None:
        from diffusers import DDPMScheduler

        from mhla_diffusion.finetune.components import load_component
        from mhla_diffusion.finetune.image_data import ClassImageDataset, index_class_folder
        from mhla_diffusion.finetune.latents import dit_latent_normalization, encode_posterior
        from mhla_diffusion.finetune.objectives import DiffusionObjective

        vae = load_component(str(pipeline_dir), "vae")
        samples, _, _ = index_class_folder(data, num_classes=1000)
        dataset = ClassImageDataset(samples, resolution=16, random_flip=False)
        shift, scale = dit_latent_normalization(vae)
        self.items = [
            (encode_posterior(vae, dataset.load(i, 0)["pixels"][None], shift, scale)[:, :4], torch.tensor([s.label]))
            for i, s in enumerate(samples)
        ]
        scheduler = DDPMScheduler(num_train_timesteps=1000, beta_schedule="linear", beta_start=1e-4, beta_end=0.02)
        self.objective = DiffusionObjective(scheduler, learned_sigma=True, vb=False)
        self.draws = draws

    @torch.no_grad()
    def __call__(self, transformer) -> float:
        transformer.eval()
        losses = []
        for i, (latents, label) in enumerate(self.items):
            generator = torch.Generator().manual_seed(2000 + i)
            for _ in range(self.draws):
                noisy, t, noise = self.objective.sample_inputs(latents, generator)
                out = transformer(hidden_states=noisy, timestep=t, class_labels=label).sample
                losses.append(self.objective.loss(out, latents, noisy, t, noise)[0].item())
        return float(np.mean(losses))


def attention_reliant_wan(folder: Path, data: Path, size: int, pretrain_steps: int, seed: int = 0) -> Path:
    """A tiny Wan pipeline whose softmax self-attention matters, saved to ``folder``.

    The random tiny VAE's latents are tiny next to the real Wan normalisation statistics, so its
    normalised latents are almost constant and a model can ignore attention. Here the statistics
    are fitted to the VAE (unit-variance latents, as on a real VAE), and the transformer is
    pretrained with softmax attention on ``data`` for ``pretrain_steps``: on clips of one colour
    each, denoising a token gains from every other token, which only attention provides.
    """
    from mhla_diffusion.finetune.objectives import flow_match_inputs, flow_match_loss
    from mhla_diffusion.finetune.video_data import VideoTextDataset, index_video_folder
    from mhla_diffusion.models.tiny import tiny_wan_pipeline, tiny_wan_transformer

    pipe = tiny_wan_pipeline(seed=seed)
    pipe.transformer = tiny_wan_transformer(num_layers=2, ffn_dim=64, seed=seed).train()
    samples, _ = index_video_folder(data, [(size, size)], [9])
    clips = VideoTextDataset(samples)
    with torch.no_grad():
        posterior = [pipe.vae.encode(clips.load(i, 0)["pixels"][None]).latent_dist.mean for i in range(len(samples))]
        stacked = torch.cat(posterior)
        mean, std = stacked.mean(dim=(0, 2, 3, 4)), stacked.std(dim=(0, 2, 3, 4))
        pipe.vae.register_to_config(latents_mean=mean.tolist(), latents_std=std.tolist())
        text = pipe.encode_prompt("a video", do_classifier_free_guidance=False, max_sequence_length=16, device="cpu")[0]
    latents = [(p - mean.view(1, -1, 1, 1, 1)) / std.view(1, -1, 1, 1, 1) for p in posterior]
    optimizer = torch.optim.AdamW(pipe.transformer.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(seed)
    for step in range(pretrain_steps):
        inputs = flow_match_inputs(latents[step % len(latents)], generator)
        out = pipe.transformer(hidden_states=inputs.noisy, timestep=inputs.timesteps, encoder_hidden_states=text).sample
        flow_match_loss(out, inputs.target).backward()
        optimizer.step()
        optimizer.zero_grad()
    pipe.transformer.eval()
    pipe.save_pretrained(folder)
    return folder
