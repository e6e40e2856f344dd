"""Training objectives: Wan's flow matching and DiT's epsilon prediction (+ variational bound).

Flow matching (MHLA reference, ``predict_flow_v`` / ``linear_flow``):
``u ~ sigmoid(N(mean, std))``, ``sigma = floor(1000 u) / 1000``,
shifted ``s = shift * sigma / (1 + (shift - 1) sigma)``,
``x_t = (1 - s) x0 + s * noise``, target ``noise - x0``, timestep ``int(1000 s)``, plain MSE.

Diffusion forcing (block-causal Wan, ``MHLAConfig(causal=True)``; :func:`diffusion_forcing_inputs`): the same
recipe with one noise level per *chunk* of latent frames instead of one per clip. Each chunk draws its own ``u``;
a chunk may instead be clean (level 0, timestep 0: the context a stream conditions on) and is then left out of the
loss. The timesteps are per token ``(B, N)``, which Diffusers' ``WanTransformer3DModel`` takes as they are.

Teacher forcing (block-causal Wan; :func:`teacher_forcing_inputs`): the clip twice along the frame axis, a clean
copy (timestep 0, or a context level drawn *without* the shift from ``[0, context_noise)``) and a noisy copy with one
shifted level per chunk; run under :class:`~mhla_diffusion.models.teacher_forcing.TeacherForcing`, each noisy chunk
sees the clean chunks before it and its own frames, as a stream's denoising does. The loss is on the noisy copy only.

DiT (ADM ``GaussianDiffusion`` with learned range variance, ``loss_type=MSE``): ``x_t`` from Diffusers'
scheduler ``add_noise``, loss ``MSE(eps) + VB`` where the VB term (in bits per dimension) trains the
variance channels against the true posterior with the predicted mean held fixed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from diffusers.training_utils import compute_density_for_timestep_sampling

__all__ = [
    "DiffusionObjective",
    "FlowMatchInputs",
    "diffusion_forcing_inputs",
    "flow_match_inputs",
    "flow_match_loss",
    "normal_kl",
    "discretized_gaussian_log_likelihood",
    "teacher_forcing_inputs",
    "training_chunks",
]


@dataclass
class FlowMatchInputs:
    noisy: torch.Tensor  # (B, C, F, H, W)
    timesteps: torch.Tensor  # (B,) int64 in [0, num_train_timesteps); diffusion forcing: (B, N), one per token
    sigmas: torch.Tensor  # (B,) shifted sigma in [0, 1); diffusion forcing: (B, F), one per latent frame
    target: torch.Tensor  # (B, C, F, H, W) = noise - x0
    weight: torch.Tensor | None = None  # diffusion forcing: (B, 1, F, 1, 1), 0 on clean frames (not in the loss)


def _shifted_sigmas(
    count: int,
    generator: torch.Generator | None,
    device: torch.device,
    logit_mean: float,
    logit_std: float,
    shift: float,
    num_train_timesteps: int,
) -> torch.Tensor:
    """``count`` noise levels ``(count,)``: logit-normal ``u``, floored to the timestep grid, then shifted."""
    u = compute_density_for_timestep_sampling(
        "logit_normal", count, logit_mean=logit_mean, logit_std=logit_std, device=device, generator=generator
    )
    index = (u * num_train_timesteps).long().clamp(max=num_train_timesteps - 1)
    sigma = index.float() / num_train_timesteps
    return shift * sigma / (1.0 + (shift - 1.0) * sigma)


def flow_match_inputs(
    latents: torch.Tensor,
    generator: torch.Generator | None,
    logit_mean: float = 0.0,
    logit_std: float = 1.0,
    shift: float = 3.0,
    num_train_timesteps: int = 1000,
) -> FlowMatchInputs:
    """Noisy latents, timesteps and velocity target for ``latents`` ``(B, C, ...)`` (float32)."""
    batch = latents.shape[0]
    sigma = _shifted_sigmas(batch, generator, latents.device, logit_mean, logit_std, shift, num_train_timesteps)
    noise = torch.randn(latents.shape, generator=generator, device=latents.device, dtype=latents.dtype)
    s = sigma.view(batch, *([1] * (latents.ndim - 1)))
    noisy = (1.0 - s) * latents + s * noise
    timesteps = (sigma * num_train_timesteps).long()  # truncated, as the reference
    return FlowMatchInputs(noisy=noisy, timesteps=timesteps, sigmas=sigma, target=noise - latents)


def diffusion_forcing_inputs(
    latents: torch.Tensor,
    generator: torch.Generator | None,
    chunk_frames: int,
    tokens_per_frame: int,
    clean_chunks: float = 0.0,
    logit_mean: float = 0.0,
    logit_std: float = 1.0,
    shift: float = 3.0,
    num_train_timesteps: int = 1000,
    first_chunk_frames: int | None = None,
    context_noise: float = 0.0,
) -> FlowMatchInputs:
    """:func:`flow_match_inputs` with one noise level per chunk of ``chunk_frames`` latent frames.

    ``latents`` ``(B, C, F, H, W)`` is cut into chunks from its first frame: a first chunk of ``first_chunk_frames``
    (``None``: ``chunk_frames``), then chunks of ``chunk_frames`` (the last one shorter when they do not divide what
    is left), as a stream with those chunks cuts a video. Every chunk draws its own level as the plain recipe
    does; then each chunk but the last is made clean (level 0, timestep 0) with probability ``clean_chunks``, and
    clean chunks get ``weight`` 0: their target ``noise - x0`` cannot be told from a clean input, and a stream never
    asks for it (its context is clean and only the current chunk is predicted). The last chunk is always noisy:
    a causal model's last chunk is context to nothing, so clean it would teach nothing.
    ``clean_chunks`` 0 is diffusion forcing proper; 1 is "clean context plus one noisy current chunk".
    ``context_noise`` ``c`` in ``[0, 1)``: a context chunk is not quite clean but noised to a level ``s`` drawn
    uniformly from ``[0, c)`` (timestep ``int(1000 s)``, still weight 0), so the model learns to read a context
    with small errors in it, as its own earlier chunks are in a stream (which then re-noises each finished chunk to
    a fixed level: ``MHLAWanStreamingPipeline(context_noise=...)``).

    Returns per-token ``timesteps`` ``(B, F * tokens_per_frame)`` (tokens frame-major, as Wan flattens its patch
    grid; ``tokens_per_frame`` tokens per latent frame, i.e. a temporal patch of 1), ``sigmas`` ``(B, F)`` and
    ``weight`` ``(B, 1, F, 1, 1)``. Draws, in order: the levels, the clean coins (only when ``clean_chunks > 0``
    and there are two chunks or more), the context levels (only when ``context_noise > 0`` and coins were drawn),
    the noise; so one chunk with ``clean_chunks`` 0 draws exactly what :func:`flow_match_inputs` draws.
    """
    batch, frames = latents.shape[0], latents.shape[2]
    sizes = training_chunks(frames, chunk_frames, first_chunk_frames)
    if not 0 <= context_noise < 1:
        raise ValueError(f"context_noise must be a noise level in [0, 1), got {context_noise}")
    chunks = len(sizes)
    device = latents.device
    index = _chunk_of_frame(sizes, device)
    sigma = _shifted_sigmas(batch * chunks, generator, device, logit_mean, logit_std, shift, num_train_timesteps)
    sigma = sigma.view(batch, chunks)
    keep = torch.ones(batch, chunks, dtype=torch.bool, device=device)
    if clean_chunks > 0 and chunks > 1:
        coins = torch.rand(batch, chunks - 1, generator=generator, device=device)
        keep[:, :-1] = coins >= clean_chunks
        sigma = sigma * keep
        if context_noise > 0:
            level = _context_levels(batch, chunks, context_noise, generator, device, num_train_timesteps)
            sigma = torch.where(keep, sigma, level)
    per_frame = sigma[:, index]  # (B, F)
    noise = torch.randn(latents.shape, generator=generator, device=device, dtype=latents.dtype)
    s = per_frame.view(batch, 1, frames, 1, 1).to(latents.dtype)
    noisy = (1.0 - s) * latents + s * noise
    timesteps = (per_frame * num_train_timesteps).long().repeat_interleave(tokens_per_frame, dim=1)
    weight = keep[:, index].view(batch, 1, frames, 1, 1).float()
    return FlowMatchInputs(noisy=noisy, timesteps=timesteps, sigmas=per_frame, target=noise - latents, weight=weight)


def training_chunks(frames: int, chunk_frames: int, first_chunk_frames: int | None = None) -> list[int]:
    """Latent frames of each chunk of a ``frames``-frame clip, cut as :func:`diffusion_forcing_inputs` cuts it: a
    first chunk of ``first_chunk_frames`` (``None``: ``chunk_frames``), then chunks of ``chunk_frames``, the last one
    shorter when they do not divide what is left."""
    first = chunk_frames if first_chunk_frames is None else first_chunk_frames
    if first < 1 or chunk_frames < 1:
        raise ValueError(f"chunks need at least one latent frame, got first {first}, then {chunk_frames}")
    sizes = [min(first, frames)]
    while sum(sizes) < frames:
        sizes.append(min(chunk_frames, frames - sum(sizes)))
    return sizes


def _context_levels(
    batch: int,
    chunks: int,
    context_noise: float,
    generator: torch.Generator | None,
    device: torch.device,
    num_train_timesteps: int,
) -> torch.Tensor:
    """Context chunks' noise levels ``(B, chunks)``: uniform in ``[0, context_noise)``, unshifted, floored to the
    timestep grid (one draw of ``torch.rand``)."""
    level = torch.rand(batch, chunks, generator=generator, device=device) * context_noise
    return (level * num_train_timesteps).floor() / num_train_timesteps


def _chunk_of_frame(sizes: list[int], device: torch.device) -> torch.Tensor:
    """The chunk of each latent frame ``(F,)`` of chunks of ``sizes`` frames."""
    return torch.repeat_interleave(torch.arange(len(sizes), device=device), torch.tensor(sizes, device=device))


def teacher_forcing_inputs(
    latents: torch.Tensor,
    generator: torch.Generator | None,
    chunk_frames: int,
    tokens_per_frame: int,
    logit_mean: float = 0.0,
    logit_std: float = 1.0,
    shift: float = 3.0,
    num_train_timesteps: int = 1000,
    first_chunk_frames: int | None = None,
    context_noise: float = 0.0,
) -> FlowMatchInputs:
    """The inputs of one teacher-forced step (see the module docstring): ``[clean | noisy]`` ``(B, C, 2F, H, W)``.

    The noisy copy's chunks (:func:`training_chunks`) each draw a shifted level as :func:`flow_match_inputs` draws one
    per clip. The clean copy is the clip itself at timestep 0, or with ``context_noise`` ``c`` each of its chunks
    noised to a level drawn uniformly from ``[0, c)`` (unshifted, on the timestep grid), as a stream re-noises its
    finished chunks. ``weight`` is 0 on the clean copy and 1 on the noisy one; ``timesteps`` are per token
    ``(B, 2 F tokens_per_frame)``, ``sigmas`` ``(B, 2F)``, ``target`` ``noise - x0`` on the noisy copy (zeros on the
    clean one, which the loss leaves out). Draws, in order: the noisy levels, the context levels (only when
    ``context_noise > 0``), the noisy copy's noise, the clean copy's noise (only when ``context_noise > 0``).
    """
    if not 0 <= context_noise < 1:
        raise ValueError(f"context_noise must be a noise level in [0, 1), got {context_noise}")
    batch, frames = latents.shape[0], latents.shape[2]
    sizes = training_chunks(frames, chunk_frames, first_chunk_frames)
    device = latents.device
    index = _chunk_of_frame(sizes, device)
    sigma = _shifted_sigmas(batch * len(sizes), generator, device, logit_mean, logit_std, shift, num_train_timesteps)
    noisy_levels = sigma.view(batch, len(sizes))[:, index]  # (B, F)
    context_levels = torch.zeros_like(noisy_levels)
    if context_noise > 0:
        level = _context_levels(batch, len(sizes), context_noise, generator, device, num_train_timesteps)
        context_levels = level[:, index]
    noise = torch.randn(latents.shape, generator=generator, device=device, dtype=latents.dtype)
    s = noisy_levels.view(batch, 1, frames, 1, 1).to(latents.dtype)
    noisy = (1.0 - s) * latents + s * noise
    context = latents
    if context_noise > 0:
        context_noise_draw = torch.randn(latents.shape, generator=generator, device=device, dtype=latents.dtype)
        c = context_levels.view(batch, 1, frames, 1, 1).to(latents.dtype)
        context = (1.0 - c) * latents + c * context_noise_draw
    per_frame = torch.cat([context_levels, noisy_levels], dim=1)  # (B, 2F)
    timesteps = (per_frame * num_train_timesteps).long().repeat_interleave(tokens_per_frame, dim=1)
    weight = torch.cat([torch.zeros(batch, frames, device=device), torch.ones(batch, frames, device=device)], dim=1)
    target = torch.cat([torch.zeros_like(latents), noise - latents], dim=2)
    return FlowMatchInputs(
        noisy=torch.cat([context, noisy], dim=2),
        timesteps=timesteps,
        sigmas=per_frame,
        target=target,
        weight=weight.view(batch, 1, 2 * frames, 1, 1),
    )


def flow_match_loss(prediction: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """Plain MSE over all elements, in float32; with ``weight`` (broadcast to ``prediction``, e.g. ``(B, 1, F, 1,
    1)`` of 0 and 1) the mean over the weighted elements (:attr:`FlowMatchInputs.weight`)."""
    if weight is None:
        return F.mse_loss(prediction.float(), target.float())
    squared = (prediction.float() - target.float()).square()
    weight = weight.float().expand_as(squared)
    return (squared * weight).sum() / weight.sum()


# ---------------------------------------------------------------------- DiT: epsilon + VB


def normal_kl(mean1: torch.Tensor, logvar1: torch.Tensor, mean2: torch.Tensor, logvar2: torch.Tensor) -> torch.Tensor:
    """Elementwise ``KL(N(mean1, e^logvar1) || N(mean2, e^logvar2))`` in nats."""
    return 0.5 * (-1.0 + logvar2 - logvar1 + torch.exp(logvar1 - logvar2) + (mean1 - mean2) ** 2 * torch.exp(-logvar2))


def _approx_standard_normal_cdf(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


def discretized_gaussian_log_likelihood(x: torch.Tensor, means: torch.Tensor, log_scales: torch.Tensor) -> torch.Tensor:
    """Log-likelihood of ``x`` in ``[-1, 1]`` under a Gaussian discretised to 256 bins (ADM's decoder term)."""
    centered = x - means
    inv_stdv = torch.exp(-log_scales)
    cdf_plus = _approx_standard_normal_cdf(inv_stdv * (centered + 1.0 / 255.0))
    cdf_min = _approx_standard_normal_cdf(inv_stdv * (centered - 1.0 / 255.0))
    log_cdf_plus = torch.log(cdf_plus.clamp(min=1e-12))
    log_one_minus_cdf_min = torch.log((1.0 - cdf_min).clamp(min=1e-12))
    log_cdf_delta = torch.log((cdf_plus - cdf_min).clamp(min=1e-12))
    return torch.where(x < -0.999, log_cdf_plus, torch.where(x > 0.999, log_one_minus_cdf_min, log_cdf_delta))


def _mean_flat(x: torch.Tensor) -> torch.Tensor:
    return x.mean(dim=tuple(range(1, x.ndim)))


class DiffusionObjective:
    """DiT's objective on a Diffusers DDPM-family scheduler (betas, ``add_noise``, prediction type).

    Args:
        scheduler: e.g. ``DDPMScheduler`` (only its betas / alphas and ``add_noise`` are used).
        learned_sigma: the model outputs ``2C`` channels (epsilon, variance interpolation ``v``).
        vb: add the variational-bound term for the variance channels (ADM hybrid loss).
    """

    def __init__(self, scheduler, learned_sigma: bool, vb: bool = True) -> None:
        self.scheduler = scheduler
        self.prediction_type = scheduler.config.prediction_type
        if self.prediction_type not in ("epsilon", "v_prediction"):
            raise ValueError(f"DiT training supports epsilon or v_prediction schedulers, got {self.prediction_type!r}")
        self.learned_sigma = learned_sigma
        self.vb = vb and learned_sigma
        if self.vb and self.prediction_type != "epsilon":
            raise ValueError("the VB term needs an epsilon-prediction scheduler; set learned_sigma_loss: none")
        self.num_train_timesteps = int(scheduler.config.num_train_timesteps)
        betas = scheduler.betas.double()
        alphas_cumprod = torch.cumprod(1.0 - betas, dim=0)
        prev = torch.cat([torch.ones(1, dtype=torch.float64), alphas_cumprod[:-1]])
        posterior_variance = betas * (1.0 - prev) / (1.0 - alphas_cumprod)
        self._tables = {
            "sqrt_recip_alphas_cumprod": torch.sqrt(1.0 / alphas_cumprod),
            "sqrt_recipm1_alphas_cumprod": torch.sqrt(1.0 / alphas_cumprod - 1.0),
            "posterior_log_variance_clipped": torch.log(torch.cat([posterior_variance[1:2], posterior_variance[1:]])),
            "log_betas": torch.log(betas),
            "posterior_mean_coef1": betas * torch.sqrt(prev) / (1.0 - alphas_cumprod),
            "posterior_mean_coef2": (1.0 - prev) * torch.sqrt(1.0 - betas) / (1.0 - alphas_cumprod),
        }

    def _at(self, name: str, t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        values = self._tables[name].to(like.device)[t].to(like.dtype)
        return values.view(-1, *([1] * (like.ndim - 1)))

    def sample_inputs(
        self, latents: torch.Tensor, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Uniform timesteps, noise and ``x_t`` for ``latents`` ``(B, C, H, W)`` -> ``(noisy, timesteps, noise)``."""
        batch = latents.shape[0]
        timesteps = torch.randint(0, self.num_train_timesteps, (batch,), generator=generator, device=latents.device)
        noise = torch.randn(latents.shape, generator=generator, device=latents.device, dtype=latents.dtype)
        noisy = self.scheduler.add_noise(latents, noise, timesteps)
        return noisy, timesteps, noise

    def loss(
        self,
        model_output: torch.Tensor,
        latents: torch.Tensor,
        noisy: torch.Tensor,
        timesteps: torch.Tensor,
        noise: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Mean loss over the batch and its parts ``{"mse", "vb"}`` (detached, for logging)."""
        model_output = model_output.float()
        channels = latents.shape[1]
        prediction = model_output[:, :channels]
        target = noise if self.prediction_type == "epsilon" else self.scheduler.get_velocity(latents, noise, timesteps)
        mse = _mean_flat((prediction - target.float()) ** 2)
        parts = {"mse": mse.mean().detach()}
        total = mse
        if self.vb:
            vb = self.vb_term(
                prediction.detach(), model_output[:, channels : 2 * channels], latents.float(), noisy.float(), timesteps
            )
            parts["vb"] = vb.mean().detach()
            total = total + vb
        return total.mean(), parts

    def vb_term(
        self, eps: torch.Tensor, var_values: torch.Tensor, x0: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor
    ) -> torch.Tensor:
        """Per-sample VB term in bits/dim: ``KL(q(x_{t-1}|x_t,x_0) || p(x_{t-1}|x_t))``, decoder NLL at ``t = 0``."""
        min_log = self._at("posterior_log_variance_clipped", t, x_t)
        max_log = self._at("log_betas", t, x_t)
        frac = (var_values + 1.0) / 2.0
        model_log_variance = frac * max_log + (1.0 - frac) * min_log
        pred_x0 = (
            self._at("sqrt_recip_alphas_cumprod", t, x_t) * x_t - self._at("sqrt_recipm1_alphas_cumprod", t, x_t) * eps
        )
        coef1, coef2 = self._at("posterior_mean_coef1", t, x_t), self._at("posterior_mean_coef2", t, x_t)
        model_mean = coef1 * pred_x0 + coef2 * x_t
        true_mean = coef1 * x0 + coef2 * x_t
        kl = _mean_flat(normal_kl(true_mean, min_log, model_mean, model_log_variance)) / math.log(2.0)
        decoder_nll = -_mean_flat(
            discretized_gaussian_log_likelihood(x0, model_mean, 0.5 * model_log_variance)
        ) / math.log(2.0)
        return torch.where(t == 0, decoder_nll, kl)
