"""Objectives and encoders: flow matching (Wan), epsilon + VB (DiT), VAE posteriors, prompt embeddings."""

from __future__ import annotations

import math

import pytest
import torch

from mhla_diffusion.finetune.latents import draw_latents, encode_posterior, wan_latent_normalization
from mhla_diffusion.finetune.objectives import DiffusionObjective, flow_match_inputs, normal_kl
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
