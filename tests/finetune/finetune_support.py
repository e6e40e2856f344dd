"""Helpers and fixtures for the fine-tuning tests: tiny synthetic video / image data sets written to
disk, tiny trainer options, and an evaluation loss with fixed random draws.

Not a ``conftest.py``: pytest imports every ``conftest.py`` as the module ``conftest``, and one here
would shadow ``tests/conftest.py`` for the top-level tests' ``from conftest import ...``. Test modules
import what they need from here (importing a fixture registers it for that module).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

COLORS = {"red": (230, 30, 30), "green": (30, 200, 60), "blue": (40, 60, 230), "yellow": (230, 220, 40)}


@pytest.fixture(autouse=True)
def _one_thread_and_fresh_accelerate():
    """Tiny models run fastest on one thread (two threads thrash on a busy 2-core machine); each test
    gets fresh Accelerate singletons so runs with different settings can follow each other."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def write_video(path: Path, frames: int, height: int, width: int, color=(230, 30, 30), direction: str = "right") -> Path:
    """An mp4 of a coloured square moving across a dark background (H.264, 8 fps)."""
    import imageio

    images = []
    for t in range(frames):
        image = np.full((height, width, 3), 20, np.uint8)
        size = max(4, min(height, width) // 3)
        x = (2 + 2 * t) % (width - size) if direction == "right" else (width - size - 2 - 2 * t) % (width - size)
        top = (height - size) // 2
        image[top: top + size, x: x + size] = color
        images.append(image)
    with imageio.get_writer(path, format="FFMPEG", mode="I", fps=8, codec="libx264", macro_block_size=1,
                            ffmpeg_log_level="error", output_params=["-pix_fmt", "yuv420p"]) as writer:
        for image in images:
            writer.append_data(image)
    return path


def write_image(path: Path, height: int, width: int, color=(200, 200, 200)) -> Path:
    from PIL import Image

    image = np.full((height, width, 3), 20, np.uint8)
    image[height // 4: 3 * height // 4, width // 4: 3 * width // 4] = color
    Image.fromarray(image).save(path)
    return path


def make_video_set(folder: Path, frames: int = 10, height: int = 32, width: int = 32, with_image: bool = True) -> Path:
    """8 captioned clips (4 colours x 2 directions) and, optionally, one captioned image."""
    folder.mkdir(parents=True, exist_ok=True)
    for i, (name, color) in enumerate(COLORS.items()):
        for j, direction in enumerate(("left", "right")):
            stem = f"clip{2 * i + j}"
            write_video(folder / f"{stem}.mp4", frames, height, width, color, direction)
            (folder / f"{stem}.txt").write_text(f"a {name} square moving {direction}")
    if with_image:
        write_image(folder / "still.png", height, width)
        (folder / "still.txt").write_text("a white square")
    return folder


@pytest.fixture(scope="session")
def video_set(tmp_path_factory) -> Path:
    """Read-only synthetic text-to-video set (copy it before changing anything)."""
    return make_video_set(tmp_path_factory.mktemp("videos"))


@pytest.fixture(scope="session")
def image_classes(tmp_path_factory) -> Path:
    """Read-only class folders 0, 1, 2 of 20x24 noisy colour images."""
    from PIL import Image

    root = tmp_path_factory.mktemp("classes")
    rng = np.random.default_rng(0)
    for label in range(3):
        (root / str(label)).mkdir()
        for i in range(4):
            image = np.zeros((20, 24, 3), np.uint8)
            image[..., label] = 190
            image += rng.integers(0, 50, image.shape, dtype=np.uint8)
            Image.fromarray(image).save(root / str(label) / f"{i}.png")
    return root


def make_digit_classes(folder: Path, classes: int = 10, per_class: int = 2, size: int = 32) -> Path:
    """Class folders ``0``..``classes-1`` of ``size`` px images, each class its own bar position."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for label in range(classes):
        (folder / str(label)).mkdir(parents=True)
        for i in range(per_class):
            image = rng.integers(0, 40, (size, size, 3), dtype=np.uint8)
            row = label * size // classes
            image[row: row + max(1, size // classes)] = 220
            Image.fromarray(image).save(folder / str(label) / f"{i}.png")
    return folder


def wan_options(pretrained: Path, data: Path, output: Path, **overrides):
    """Tiny, fast, validated text-to-video options (32x32, 9 frames, fp32, layout 1x2x2)."""
    from mhla_diffusion.finetune.options import WanTrainOptions, options_from_dict

    values = dict(
        pretrained_model=str(pretrained), data_dir=str(data), output_dir=str(output), height=32, width=32,
        num_frames=9, mhla={"layout": [1, 2, 2]}, mixed_precision="no", train_batch_size=2, max_train_steps=4,
        learning_rate=1e-3, lr_warmup_steps=0, checkpointing_steps=0, max_sequence_length=16, report_to="jsonl",
    )
    values.update(overrides)
    return options_from_dict(WanTrainOptions, values)


def dit_options(pretrained: Path, data: Path, output: Path, **overrides):
    """Tiny class-to-image options (16 px images -> 8x8 latents, fp32)."""
    from mhla_diffusion.finetune.options import DiTTrainOptions, options_from_dict

    values = dict(
        pretrained_model=str(pretrained), data_dir=str(data), output_dir=str(output), resolution=16,
        mixed_precision="no", train_batch_size=4, max_train_steps=4, learning_rate=1e-3, checkpointing_steps=0,
        report_to="jsonl", ema_decay=0.0,
    )
    values.update(overrides)
    return options_from_dict(DiTTrainOptions, values)


def metrics(output: Path) -> list[dict]:
    from mhla_diffusion.finetune.tracking import read_metrics

    return read_metrics(Path(output) / "logs")


def base_wan_transformer(pipeline_dir: Path, layout=(1, 2, 2)):
    """The model a run starts from: the pipeline's transformer converted with the tiny options' MHLA config."""
    from mhla_diffusion import MHLAConfig, convert_to_mhla, load_transformer

    transformer = load_transformer(str(pipeline_dir))
    convert_to_mhla(transformer, MHLAConfig(layout=layout))
    return transformer


class WanEvaluator:
    """End-to-end flow-matching loss of a transformer on a video set, with fixed draws (posterior means)."""

    def __init__(self, pipeline_dir: Path, data: Path, draws: int = 6, size: int = 32) -> None:
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

    @torch.no_grad()
    def __call__(self, transformer) -> float:
        from mhla_diffusion.finetune.objectives import flow_match_inputs, flow_match_loss

        transformer.eval()
        losses = []
        for i, (latents, text) in enumerate(self.items):
            generator = torch.Generator().manual_seed(1000 + i)
            for _ in range(self.draws):
                inputs = flow_match_inputs(latents, generator)
                out = transformer(hidden_states=inputs.noisy, timestep=inputs.timesteps, encoder_hidden_states=text).sample
                losses.append(flow_match_loss(out, inputs.target).item())
        return float(np.mean(losses))


def subprocess_env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    return env


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
        self.items = [(encode_posterior(vae, dataset.load(i, 0)["pixels"][None], shift, scale)[:, :4],
                       torch.tensor([s.label])) for i, s in enumerate(samples)]
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
    from mhla_diffusion.tiny import tiny_wan_pipeline, tiny_wan_transformer

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


def one_colour_clips(folder: Path, count: int, size: int) -> Path:
    """``count`` captioned clips, each one random colour with a moving square of it (caption "a video")."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(count):
        color = tuple(int(v) for v in rng.integers(0, 256, 3))
        write_video(folder / f"clip{i}.mp4", 10, size, size, color, "left" if i % 2 else "right")
        (folder / f"clip{i}.txt").write_text("a video")
    return folder
