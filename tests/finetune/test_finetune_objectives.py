"""Objectives and encoders: flow matching (Wan; per-chunk levels for block-causal models), epsilon + VB (DiT),
VAE posteriors, prompt embeddings."""

from __future__ import annotations

import math

import pytest
import torch

from mhla_diffusion.finetune.engine import step_generator
from mhla_diffusion.finetune.latents import draw_latents, encode_posterior, wan_latent_normalization
from mhla_diffusion.finetune.objectives import (
    DiffusionObjective,
    diffusion_forcing_inputs,
    flow_match_inputs,
    flow_match_loss,
    normal_kl,
    teacher_forcing_inputs,
    training_chunks,
)
from mhla_diffusion.finetune.text import encode_prompts, pad_prompt_embeds


def test_flow_matching_follows_the_reference_formula():
    x0 = torch.randn(4096, 2, 1, 1, 1, generator=torch.Generator().manual_seed(0))
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    inputs = flow_match_inputs(x0, g1, logit_mean=0.0, logit_std=1.0, shift=3.0)
    u = torch.sigmoid(torch.normal(0.0, 1.0, (4096,), generator=g2))
    sigma = (u * 1000).long().clamp(max=999).float() / 1000
    shifted = 3 * sigma / (1 + 2 * sigma)
    noise = torch.randn(x0.shape, generator=g2)
    torch.testing.assert_close(inputs.sigmas, shifted)
    torch.testing.assert_close(
        inputs.noisy, (1 - shifted.view(-1, 1, 1, 1, 1)) * x0 + shifted.view(-1, 1, 1, 1, 1) * noise
    )
    torch.testing.assert_close(inputs.target, noise - x0)
    assert inputs.timesteps.dtype == torch.int64 and torch.equal(inputs.timesteps, (shifted * 1000).long())
    # shift 3 pushes sigma up: the median of logit-normal(0, 1) is 0.5 -> 0.75
    assert abs(inputs.sigmas.median().item() - 0.75) < 0.02


def _draw(seed_step: int, latents: torch.Tensor, **kwargs):
    generator = step_generator(1, 0, seed_step, 0, latents.device)
    return diffusion_forcing_inputs(latents, generator, **kwargs)


def test_one_noise_level_per_chunk_constant_within_it_and_deterministic_per_step():
    x0 = torch.randn(5, 2, 7, 4, 4, generator=torch.Generator().manual_seed(0))
    kwargs = dict(chunk_frames=3, tokens_per_frame=4, clean_chunks=0.5)  # chunks of frames 0-2, 3-5, 6
    inputs = _draw(3, x0, **kwargs)
    assert inputs.sigmas.shape == (5, 7) and inputs.timesteps.shape == (5, 7 * 4)
    assert inputs.timesteps.dtype == torch.int64 and inputs.weight.shape == (5, 1, 7, 1, 1)
    levels = inputs.sigmas[:, [0, 3, 6]]
    for start, stop in ((0, 3), (3, 6), (6, 7)):  # constant within a chunk
        assert torch.equal(inputs.sigmas[:, start:stop], inputs.sigmas[:, start : start + 1].expand(-1, stop - start))
    per_frame = (inputs.sigmas * 1000).long()
    assert torch.equal(inputs.timesteps, per_frame.repeat_interleave(4, dim=1))  # tokens frame-major
    s = inputs.sigmas.view(5, 1, 7, 1, 1)
    noise = inputs.target + x0
    torch.testing.assert_close(inputs.noisy, (1 - s) * x0 + s * noise)
    # a clean chunk: level 0, timestep 0, weight 0; the last chunk is never clean
    clean = inputs.weight[:, 0, [0, 3, 6], 0, 0] == 0
    assert clean.any() and not clean[:, -1].any()
    assert torch.all(levels[clean] == 0) and torch.all(levels[~clean] > 0)
    assert torch.equal(inputs.weight.view(5, 7), (inputs.sigmas > 0).float())
    # deterministic per (seed, step); another step draws other levels
    again = _draw(3, x0, **kwargs)
    for name in ("noisy", "timesteps", "sigmas", "target", "weight"):
        assert torch.equal(getattr(inputs, name), getattr(again, name)), name
    assert not torch.equal(_draw(4, x0, **kwargs).sigmas, inputs.sigmas)


def test_chunk_levels_are_independent_and_clean_chunks_come_at_their_rate():
    x0 = torch.zeros(4000, 1, 3, 1, 1)
    inputs = _draw(0, x0, chunk_frames=1, tokens_per_frame=1, clean_chunks=0.25)
    clean = inputs.weight.view(4000, 3) == 0
    assert not clean[:, 2].any()
    assert abs(clean[:, :2].float().mean().item() - 0.25) < 0.03
    noisy = inputs.sigmas[~clean]
    assert abs(noisy.median().item() - 0.75) < 0.03  # the recipe's levels (logit-normal, shift 3) per chunk
    both = ~clean[:, 0] & ~clean[:, 1]
    a, b = inputs.sigmas[both, 0], inputs.sigmas[both, 1]
    assert (a != b).float().mean() > 0.95 and abs(torch.corrcoef(torch.stack([a, b]))[0, 1].item()) < 0.06
    every = _draw(0, x0, chunk_frames=1, tokens_per_frame=1, clean_chunks=1.0).weight.view(4000, 3)
    assert torch.equal(every, torch.tensor([0.0, 0.0, 1.0]).expand(4000, -1))  # clean context + one noisy chunk
    assert bool((_draw(0, x0, chunk_frames=1, tokens_per_frame=1).weight == 1).all())  # 0: every chunk noisy


def test_one_chunk_draws_what_plain_flow_matching_draws():
    x0 = torch.randn(3, 2, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    chunked = diffusion_forcing_inputs(x0, torch.Generator().manual_seed(5), chunk_frames=3, tokens_per_frame=4)
    plain = flow_match_inputs(x0, torch.Generator().manual_seed(5))
    torch.testing.assert_close(chunked.noisy, plain.noisy, rtol=0, atol=0)
    assert torch.equal(chunked.target, plain.target)
    assert torch.equal(chunked.timesteps, plain.timesteps[:, None].expand(-1, 12))


def _reference_forcing(x0, generator, sizes, clean_chunks, context_noise, shift=3.0):
    """Diffusion forcing written out chunk by chunk (chunks of ``sizes`` latent frames), in the documented draw
    order: levels, clean coins, context levels, noise."""
    batch, count = x0.shape[0], len(sizes)
    u = torch.sigmoid(torch.normal(0.0, 1.0, (batch * count,), generator=generator))
    sigma = (u * 1000).long().clamp(max=999).float() / 1000
    sigma = (shift * sigma / (1 + (shift - 1) * sigma)).view(batch, count)
    coins = torch.rand(batch, count - 1, generator=generator)
    context = torch.zeros(batch, count)
    if context_noise > 0:  # drawn only then
        context = (torch.rand(batch, count, generator=generator) * context_noise * 1000).floor() / 1000
    noise = torch.randn(x0.shape, generator=generator)
    levels, weights = [], []
    for b in range(batch):
        row, kept = [], []
        for c, size in enumerate(sizes):
            clean = c < count - 1 and coins[b, c] < clean_chunks
            level = context[b, c] if clean else sigma[b, c]
            row += [level] * size
            kept += [0.0 if clean else 1.0] * size
        levels.append(torch.stack(row))
        weights.append(torch.tensor(kept))
    levels, weights = torch.stack(levels), torch.stack(weights)
    s = levels.view(batch, 1, -1, 1, 1)
    return levels, weights, (1 - s) * x0 + s * noise


@pytest.mark.parametrize(
    ("frames", "chunk_frames", "first", "sizes"),
    [(9, 4, 1, [1, 4, 4]), (9, 4, None, [4, 4, 1]), (7, 2, 3, [3, 2, 2]), (6, 4, 1, [1, 4, 1])],
)
@pytest.mark.parametrize("context_noise", [0.0, 0.2])
def test_a_first_chunk_of_its_own_and_noisy_context_follow_a_chunk_by_chunk_reference(
    frames, chunk_frames, first, sizes, context_noise
):
    x0 = torch.randn(64, 2, frames, 2, 2, generator=torch.Generator().manual_seed(1))
    inputs = diffusion_forcing_inputs(
        x0,
        torch.Generator().manual_seed(9),
        chunk_frames=chunk_frames,
        tokens_per_frame=4,
        clean_chunks=0.5,
        first_chunk_frames=first,
        context_noise=context_noise,
    )
    levels, weights, noisy = _reference_forcing(x0, torch.Generator().manual_seed(9), sizes, 0.5, context_noise)
    torch.testing.assert_close(inputs.sigmas, levels, rtol=0, atol=0)
    torch.testing.assert_close(inputs.noisy, noisy, rtol=0, atol=1e-6)
    assert torch.equal(inputs.weight.view(64, frames), weights)
    assert torch.equal(inputs.timesteps, (levels * 1000).long().repeat_interleave(4, dim=1))
    clean = weights == 0
    assert clean.any() and not clean[:, -1].any()
    if context_noise:  # context levels spread over [0, c), below any noisy level the recipe gives here
        assert 0 <= levels[clean].min() and levels[clean].max() < context_noise and levels[clean].std() > 0.03
    else:
        assert torch.all(levels[clean] == 0)


def test_context_noise_and_first_chunk_out_of_range_are_refused():
    x0 = torch.zeros(1, 1, 5, 1, 1)
    with pytest.raises(ValueError, match=r"context_noise must be a noise level in \[0, 1\), got 1.0"):
        diffusion_forcing_inputs(x0, None, chunk_frames=2, tokens_per_frame=1, context_noise=1.0)
    with pytest.raises(ValueError, match="chunks need at least one latent frame"):
        diffusion_forcing_inputs(x0, None, chunk_frames=2, tokens_per_frame=1, first_chunk_frames=0)


def test_weighted_loss_is_the_mean_over_noisy_frames():
    prediction, target = torch.randn(2, 3, 4, 2, 2), torch.randn(2, 3, 4, 2, 2)
    weight = torch.tensor([[1.0, 0, 1, 1], [0, 0, 0, 1]]).view(2, 1, 4, 1, 1)
    kept = torch.cat([(prediction - target)[0][:, [0, 2, 3]].flatten(), (prediction - target)[1][:, 3].flatten()])
    torch.testing.assert_close(flow_match_loss(prediction, target, weight), kept.square().mean())
    torch.testing.assert_close(
        flow_match_loss(prediction, target, torch.ones_like(weight)), flow_match_loss(prediction, target)
    )


def _objective():
    from diffusers import DDPMScheduler

    scheduler = DDPMScheduler(num_train_timesteps=1000, beta_schedule="linear", beta_start=1e-4, beta_end=0.02)
    return DiffusionObjective(scheduler, learned_sigma=True, vb=True)


def test_epsilon_objective_uses_the_scheduler_and_a_zero_vb_for_the_true_posterior():
    objective = _objective()
    generator = torch.Generator().manual_seed(0)
    x0 = torch.rand(6, 4, 8, 8, generator=generator) * 2 - 1
    noisy, t, noise = objective.sample_inputs(x0, generator)
    torch.testing.assert_close(noisy, objective.scheduler.add_noise(x0, noise, t))
    t = torch.tensor([1, 5, 100, 500, 900, 999])
    noisy = objective.scheduler.add_noise(x0, noise, t)
    # exact epsilon and v = -1 (log variance = the clipped posterior one): MSE 0, KL 0
    perfect = torch.cat([noise, -torch.ones_like(noise)], dim=1)
    loss, parts = objective.loss(perfect, x0, noisy, t, noise)
    assert parts["mse"].item() == 0 and abs(parts["vb"].item()) < 1e-6
    wrong_variance = torch.cat([noise, torch.ones_like(noise)], dim=1)
    assert objective.loss(wrong_variance, x0, noisy, t, noise)[1]["vb"].item() > 1e-3
    wrong_eps = torch.cat([noise + 0.1, -torch.ones_like(noise)], dim=1)
    loss, parts = objective.loss(wrong_eps, x0, noisy, t, noise)
    assert abs(parts["mse"].item() - 0.01) < 1e-6 and parts["vb"].item() > 0
    assert torch.isclose(loss, parts["mse"] + parts["vb"])


def test_vb_gradient_reaches_only_the_variance_channels():
    objective = _objective()
    x0 = torch.rand(2, 4, 8, 8) * 2 - 1
    noise = torch.randn_like(x0)
    t = torch.tensor([0, 300])
    output = torch.cat([noise + 0.3, torch.zeros_like(noise)], dim=1).requires_grad_(True)
    vb = objective.vb_term(output[:, :4].detach(), output[:, 4:], x0, objective.scheduler.add_noise(x0, noise, t), t)
    vb.sum().backward()
    assert output.grad[:, :4].abs().sum() == 0 and output.grad[:, 4:].abs().sum() > 0


def test_normal_kl_matches_torch_distributions():
    m1, m2, lv1, lv2 = torch.randn(4, 10).unbind(0)
    expected = torch.distributions.kl_divergence(
        torch.distributions.Normal(m1, (0.5 * lv1).exp()), torch.distributions.Normal(m2, (0.5 * lv2).exp())
    )
    torch.testing.assert_close(normal_kl(m1, lv1, m2, lv2), expected)


def test_posterior_in_model_space(pipeline_dirs):
    from mhla_diffusion.finetune.components import load_component

    vae = load_component(str(pipeline_dirs["wan"]), "vae")
    pixels = torch.rand(1, 3, 5, 32, 32) * 2 - 1
    shift, scale = wan_latent_normalization(vae, 16)
    params = encode_posterior(vae, pixels, shift, scale)
    dist = vae.encode(pixels).latent_dist
    torch.testing.assert_close(params[:, :16], (dist.mean - shift) * scale)
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    drawn = draw_latents(params, 16, "sample", g1)
    expected = (dist.mean + dist.std * torch.randn(dist.mean.shape, generator=g2) - shift) * scale
    torch.testing.assert_close(drawn, expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(draw_latents(params, 16, "mode", None), params[:, :16])
    with pytest.raises(ValueError, match="posterior means only"):
        draw_latents(params[:, :16], 16, "sample", g1)


def test_prompt_embeddings_match_the_pipeline(pipeline_dirs):
    from mhla_diffusion.pipelines import MHLAWanPipeline

    pipe = MHLAWanPipeline.from_pretrained(str(pipeline_dirs["wan"]))
    prompts = ["a red circle moving left", "", "the   blue square"]
    ours = pad_prompt_embeds(encode_prompts(pipe.tokenizer, pipe.text_encoder, prompts, 16), 16)
    theirs, _ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False, max_sequence_length=16, device="cpu")
    torch.testing.assert_close(ours, theirs)
    assert not math.isnan(ours.sum().item())


@pytest.mark.parametrize("context_noise", [0.0, 0.2])
def test_teacher_forcing_inputs_are_a_clean_copy_then_a_noisy_copy_with_a_level_per_chunk(context_noise):
    latents = torch.randn(2, 4, 9, 3, 3, generator=torch.Generator().manual_seed(0))
    generator = torch.Generator().manual_seed(1)
    inputs = teacher_forcing_inputs(
        latents, generator, 4, tokens_per_frame=9, shift=12.0, first_chunk_frames=1, context_noise=context_noise
    )
    assert training_chunks(9, 4, 1) == [1, 4, 4] and training_chunks(10, 4) == [4, 4, 2]
    assert inputs.noisy.shape == (2, 4, 18, 3, 3) and inputs.timesteps.shape == (2, 18 * 9)
    context, noisy = inputs.sigmas[:, :9], inputs.sigmas[:, 9:]
    for first, last in ((0, 1), (1, 5), (5, 9)):  # one level per chunk of the noisy copy
        assert (noisy[:, first:last] == noisy[:, first : first + 1]).all()
    assert not torch.equal(noisy[:, 1], noisy[:, 5])
    assert (inputs.timesteps == (inputs.sigmas * 1000).long().repeat_interleave(9, dim=1)).all()
    if context_noise:  # unshifted, below the level asked for, on the timestep grid, one per chunk
        assert (context < context_noise).all() and (context > 0).any()
        assert torch.equal(context * 1000, (context * 1000).round())
        assert (context[:, 1:5] == context[:, 1:2]).all()
    else:  # the clean copy is the clip itself at timestep 0
        assert (context == 0).all() and torch.equal(inputs.noisy[:, :, :9], latents)
    s = noisy.view(2, 1, 9, 1, 1)
    noise = (inputs.noisy[:, :, 9:] - (1 - s) * latents) / s
    torch.testing.assert_close(inputs.target[:, :, 9:], noise - latents)
    assert inputs.weight.view(2, 18).tolist() == [[0.0] * 9 + [1.0] * 9] * 2  # the loss sees the noisy copy only
    # the same step draws the same inputs
    again = teacher_forcing_inputs(
        latents, torch.Generator().manual_seed(1), 4, 9, shift=12.0, first_chunk_frames=1, context_noise=context_noise
    )
    assert torch.equal(again.noisy, inputs.noisy)
