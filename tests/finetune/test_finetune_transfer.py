"""Attention transfer: layer-wise distillation of MHLA from its softmax original, and its effect on
the end-to-end loss of a tiny pretrained model."""

from __future__ import annotations

import copy

import pytest
import torch

from helpers.finetune import WanEvaluator, attention_reliant_wan, base_wan_transformer, metrics, wan_options
from helpers.media import one_colour_clips
from mhla_diffusion import MHLAConfig, convert_to_mhla, load_mhla, load_transformer, softmax_attention
from mhla_diffusion.finetune import train_wan
from mhla_diffusion.finetune.attention_transfer import AttentionTransfer
from mhla_diffusion.models.tiny import tiny_wan_transformer

SIZE = 64  # 64x64 px -> 4x4 tokens per latent frame


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return dict(
        hidden_states=torch.randn(1, 16, 3, 8, 8, generator=g),
        timestep=torch.tensor([700]),
        encoder_hidden_states=torch.randn(1, 5, 32, generator=g),
    )


@pytest.mark.parametrize("params", ["mhla", "attention"])
def test_layer_losses_and_teacher_forcing(params):
    transformer = tiny_wan_transformer(num_layers=2)
    convert_to_mhla(transformer, MHLAConfig(layout=(1, 2, 2), gate=True))
    inputs = _inputs()
    with torch.no_grad(), softmax_attention(transformer):
        softmax_out = transformer(**inputs).sample
    with torch.no_grad():
        mhla_out = transformer(**inputs).sample
    transfer = AttentionTransfer(transformer, params, teacher_forcing=True)
    with torch.no_grad(), transfer:
        forced = transformer(**inputs).sample
    torch.testing.assert_close(forced, softmax_out)  # later layers saw the softmax outputs
    assert set(transfer.losses) == {"blocks.0.attn1", "blocks.1.attn1"} and transfer.loss() > 0
    free = AttentionTransfer(transformer, params, teacher_forcing=False)
    with torch.no_grad(), free:
        torch.testing.assert_close(transformer(**inputs).sample, mhla_out)
    assert free.losses["blocks.0.attn1"] == transfer.losses["blocks.0.attn1"]  # same input to the first layer
    names = transfer.parameter_names()
    assert all(".processor." in n for n in names) == (params == "mhla")
    assert (
        "blocks.0.attn1.to_q.weight" in names
        if params == "attention"
        else "blocks.0.attn1.processor.gate.weight" in names
    )
    with pytest.raises(RuntimeError, match="no distillation loss"):
        AttentionTransfer(transformer, params).loss()


def test_attention_mode_keeps_a_frozen_teacher():
    transformer = tiny_wan_transformer(num_layers=2)
    convert_to_mhla(transformer, MHLAConfig(layout=(1, 2, 2)))
    reference = copy.deepcopy(transformer)
    transfer = AttentionTransfer(transformer, "attention")
    with torch.no_grad():
        for name, p in transformer.named_parameters():
            if ".attn1.to_" in name:
                p.add_(0.5)  # the student's projections move away ...
    inputs = _inputs(1)
    with torch.no_grad(), transfer:
        forced = transformer(**inputs).sample
    with torch.no_grad(), softmax_attention(reference):
        original = reference(**inputs).sample
    torch.testing.assert_close(forced, original)  # ... the teacher does not


@pytest.mark.slow
def test_transfer_stage_lowers_the_end_to_end_loss(tmp_path):
    data = one_colour_clips(tmp_path / "data", 8, SIZE)
    pretrained = attention_reliant_wan(tmp_path / "pretrained", data, SIZE, pretrain_steps=300)
    evaluate = WanEvaluator(pretrained, data, size=SIZE)
    softmax = evaluate(load_transformer(str(pretrained)))
    converted = evaluate(base_wan_transformer(pretrained))
    assert converted > 1.3 * softmax, (softmax, converted)  # the conversion hurts: there is something to recover

    common = dict(
        height=SIZE,
        width=SIZE,
        trainable="all",
        caption_dropout=0.0,
        cache_latents=True,
        cache_dir=str(tmp_path / "cache"),
    )
    transfer_steps, e2e_steps = 40, 5
    with_transfer = train_wan.train(
        wan_options(
            pretrained,
            data,
            tmp_path / "transfer",
            max_train_steps=e2e_steps,
            attention_transfer_steps=transfer_steps,
            attention_transfer_lr=1e-2,
            **common,
        )
    )
    plain = train_wan.train(wan_options(pretrained, data, tmp_path / "plain", max_train_steps=e2e_steps, **common))
    plain_long = train_wan.train(
        wan_options(pretrained, data, tmp_path / "long", max_train_steps=e2e_steps + transfer_steps, **common)
    )
    losses = {
        name: evaluate(load_mhla(folder))
        for name, folder in (("transfer", with_transfer), ("plain", plain), ("long", plain_long))
    }
    assert losses["transfer"] < 0.85 * losses["plain"], losses  # equal end-to-end steps
    assert losses["transfer"] < 0.85 * losses["long"], losses  # equal total steps

    rows = metrics(tmp_path / "transfer")
    stage = [r for r in rows if "transfer/loss" in r]
    assert [r["step"] for r in stage] == list(range(1, transfer_steps + 1))
    for layer in ("transfer/blocks.0.attn1", "transfer/blocks.1.attn1"):
        first, last = stage[0][layer], stage[-1][layer]
        assert last < 0.5 * first, (layer, first, last)
    assert [r["step"] for r in rows if "loss" in r] == list(range(transfer_steps + 1, transfer_steps + e2e_steps + 1))
