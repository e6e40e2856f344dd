"""Part B of ``mhla reproduce``: a small DiT-shaped denoiser trained from scratch on images whose correct
content depends on distant tokens, by construction.

Data (:func:`mirror_images`): ``side`` x ``side`` one-channel images, sums of random Gaussian blobs
reflected about the vertical mid-line, so every pixel equals its mirror image across the picture
(up to ``side - 1`` tokens away); generated from seeds, never downloaded. With patch 1, a 32 px image
is 1,024 tokens.

Arms (:data:`ARMS`): the same ``DiTTransformer2DModel`` (patch 1, torch's default initialisation) with
softmax attention, global linear attention (MHLA with one block), MHLA (``M <= sqrt(N)`` blocks) and global
linear attention with LePE alone (the 3x3 depthwise convolution the paper's full variant adds, to tell
MHLA's effect from the convolution's). All arms of one seed share the initial weights of their common
parts and see the same batches, noise and timesteps, so their measures pair seed by seed:

* the held-out denoising loss (epsilon MSE) at :data:`EVAL_TIMESTEPS`, on fixed held-out images and noise;
* the asymmetry of DDIM samples drawn from fixed noise, ``1 - corr(x, mirror(x))`` per sample (0: exactly
  mirror-symmetric; about 1: the halves unrelated; :func:`asymmetry`), beside their contrast against the
  data's (:func:`sample_scale`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F

from ..config import MHLAConfig
from ..training.loop import LoopProgress, run_loop, step_generator
from .operators import grid_side, mhla_layout

__all__ = ["ARMS", "EVAL_TIMESTEPS", "asymmetry", "mirror_images", "new_denoiser", "sample_scale", "train_and_measure"]

#: Arm name -> MHLA options (``None``: softmax) for a ``side`` x ``side`` token grid.
ARMS: dict[str, Callable[[int], MHLAConfig | None]] = {
    "softmax": lambda side: None,
    "linear": lambda side: MHLAConfig(layout=(1, 1)),
    "mhla": lambda side: MHLAConfig(layout=mhla_layout(side)),
    "linear-lepe": lambda side: MHLAConfig(layout=(1, 1), lepe=True),
}
EVAL_TIMESTEPS = (50, 200, 500, 800)
BLOBS = 4
DATA_SEED, EVAL_SEED, SAMPLE_SEED = 31, 32, 33


def mirror_images(count: int, side: int, generator: torch.Generator) -> torch.Tensor:
    """``(count, 1, side, side)`` images: :data:`BLOBS` Gaussian blobs (random centre, width 1.5 to 5 px,
    amplitude +-0.5 to 1.5) plus their reflections about the vertical mid-line."""
    centre = torch.rand(count, BLOBS, 2, generator=generator) * side
    width = 1.5 + 3.5 * torch.rand(count, BLOBS, 1, 1, generator=generator)
    sign = torch.randint(0, 2, (count, BLOBS, 1, 1), generator=generator) * 2 - 1
    amplitude = sign * (0.5 + torch.rand(count, BLOBS, 1, 1, generator=generator))
    coords = torch.arange(side, dtype=torch.float32)
    dy = coords[None, None, :, None] - centre[..., 0, None, None]
    dx = coords[None, None, None, :] - centre[..., 1, None, None]
    blobs = (amplitude * torch.exp(-(dy**2 + dx**2) / (2 * width**2))).sum(dim=1, keepdim=True)
    return blobs + blobs.flip(-1)


def asymmetry(images: torch.Tensor) -> float:
    """The mean over images of ``|x - mirror(x)|**2 / (2 |x - mean(x)|**2)``, which is ``1 - corr(x, mirror(x))``:
    0 for a mirror-symmetric image, about 1 for one whose halves are unrelated, whatever its scale (a
    badly trained model's samples can be far brighter than the data; :func:`train_and_measure` reports
    their scale beside)."""
    x = images.flatten(1).double()
    mirrored = images.flip(-1).flatten(1).double()
    centred = ((x - x.mean(dim=1, keepdim=True)) ** 2).sum(dim=1)
    return float((((x - mirrored) ** 2).sum(dim=1) / (2 * centred).clamp_min(1e-12)).mean())


def _median_std(images: torch.Tensor) -> float:
    return float(images.flatten(1).std(dim=1).median())


def sample_scale(samples: torch.Tensor, side: int) -> float:
    """The median per-image standard deviation of ``samples`` over that of held-out data (1: the data's
    contrast; an undertrained model's samples are often far brighter)."""
    return _median_std(samples) / _median_std(
        mirror_images(len(samples), side, torch.Generator().manual_seed(EVAL_SEED))
    )


def new_denoiser(arm: str, side: int, layers: int, heads: int, head_dim: int, seed: int):
    """The arm's DiT (patch 1, one channel, unconditional: one class), deterministic given ``seed``; torch's
    default initialisation (DiT's zero-initialised gates learn slowly at this budget)."""
    from ..finetune.dit_scratch import new_dit_transformer

    config = dict(
        num_layers=layers,
        num_attention_heads=heads,
        attention_head_dim=head_dim,
        in_channels=1,
        out_channels=1,
        sample_size=side,
        patch_size=1,
        num_embeds_ada_norm=1,
        norm_type="ada_norm_zero",
    )
    return new_dit_transformer(config, seed=seed, mhla=ARMS[arm](side), share=False, dit_init=False)


def _noise_prediction(model, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return model(x, timestep=t, class_labels=torch.zeros(len(x), dtype=torch.long)).sample


def _train(model, side: int, steps: int, batch_size: int, lr: float, seed: int, progress: LoopProgress):
    """DDPM epsilon-prediction (DiT's linear schedule), AdamW with a 50-step warm-up, gradients clipped to 1;
    every draw depends on ``(seed, step)`` only, so every arm of a seed sees the same images, noise and timesteps."""
    from ..finetune.dit_scratch import dit_scheduler

    scheduler = dit_scheduler()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: min(1.0, (k + 1) / 50))

    def loss_fn(step: int) -> torch.Tensor:
        torch.manual_seed(int(step_generator(seed, step, 7).initial_seed()))  # the model's label dropout
        g = step_generator(seed, step)
        x0 = mirror_images(batch_size, side, g)
        noise = torch.randn(x0.shape, generator=g)
        t = torch.randint(0, scheduler.config.num_train_timesteps, (batch_size,), generator=g)
        return F.mse_loss(_noise_prediction(model, scheduler.add_noise(x0, noise, t), t), noise)

    model.train()
    with torch.random.fork_rng(devices=[]):
        log = run_loop("denoiser", steps, loss_fn, model, optimizer, schedule, progress, clip_norm=1.0)
    model.eval()
    return log


@torch.no_grad()
def held_out_losses(model, side: int, count: int) -> dict[str, float]:
    """Epsilon MSE at each of :data:`EVAL_TIMESTEPS` on ``count`` fixed held-out images with fixed noise."""
    from ..finetune.dit_scratch import dit_scheduler

    scheduler = dit_scheduler()
    g = torch.Generator().manual_seed(EVAL_SEED)
    x0 = mirror_images(count, side, g)
    noise = torch.randn(x0.shape, generator=g)
    losses = {}
    for step in EVAL_TIMESTEPS:
        t = torch.full((count,), step)
        losses[str(step)] = float(F.mse_loss(_noise_prediction(model, scheduler.add_noise(x0, noise, t), t), noise))
    return losses


@torch.no_grad()
def sample(model, side: int, count: int, steps: int) -> torch.Tensor:
    """``count`` DDIM samples (``steps`` steps) from fixed noise (the same for every arm and seed)."""
    from ..finetune.dit_scratch import dit_scheduler

    scheduler = dit_scheduler()
    scheduler.set_timesteps(steps)
    x = torch.randn(count, 1, side, side, generator=torch.Generator().manual_seed(SAMPLE_SEED))
    for t in scheduler.timesteps:
        x = scheduler.step(_noise_prediction(model, x, t.expand(count)), t, x).prev_sample
    return x


def train_and_measure(
    folder: Path, arm: str, tokens: int, seed: int, s: Any, on_step: Callable[[int], None] | None = None
) -> dict[str, Any]:
    """Train one arm for one seed (resuming from ``folder/checkpoint.pt``) and measure it. ``s``: the
    experiment's settings (``part_b_*`` fields)."""
    side = grid_side(tokens)
    model = new_denoiser(arm, side, s.part_b_layers, s.heads, s.head_dim, seed)
    progress = LoopProgress(folder / "checkpoint.pt", every=s.checkpoint_every, on_step=on_step)
    log = _train(model, side, s.part_b_steps, s.part_b_batch_size, s.part_b_lr, seed, progress)
    losses = held_out_losses(model, side, s.part_b_eval_images)
    began = time.perf_counter()
    samples = sample(model, side, s.part_b_samples, s.part_b_sample_steps)
    sample_seconds = time.perf_counter() - began
    return {
        "arm": arm,
        "tokens": tokens,
        "seed": seed,
        "steps": s.part_b_steps,
        "parameters": int(sum(p.numel() for p in model.parameters())),
        "final_train_loss": float(np.mean(log.losses[-50:])),
        "train_seconds": round(log.seconds, 1),
        "held_out_loss": losses,
        "mean_held_out_loss": float(np.mean(list(losses.values()))),
        "asymmetry": asymmetry(samples),
        "sample_scale": sample_scale(samples, side),
        "sample_seconds": round(sample_seconds, 1),
    }
