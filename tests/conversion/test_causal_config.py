"""The causal setting of ``MHLAConfig`` (issue 47): validation, saving, the Wan processors that run it, and the
paths without a causal form (the fused Triton kernel, context parallelism) that must not run it bidirectionally."""

from __future__ import annotations

import json

import pytest
import torch

import mhla_diffusion.models.processors.base as base
from helpers.models import run, wan_inputs
from mhla_diffusion import (
    MHLAConfig,
    MHLAWanTransformer3DModel,
    causal_mixing_init,
    convert_to_mhla,
    get_mhla_conversion,
    load_mhla,
    save_mhla,
)
from mhla_diffusion.models.context_parallel import enable_context_parallel
from mhla_diffusion.models.tiny import tiny_dit_transformer, tiny_wan_transformer
from mhla_diffusion.utils.choices import CAUSAL_FOLDS

LAYOUT = (4, 2, 2)  # one latent frame per temporal block row on the 4-frame grids below


def causal_wan(fold="decay", window=1, **options):
    """A tiny Wan with causal MHLA in every layer, its MHLA parameters moved off their init."""
    model = tiny_wan_transformer(num_layers=2)
    config = MHLAConfig(layout=LAYOUT, causal=True, causal_window=window, causal_fold=fold, **options)
    convert_to_mhla(model, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".processor." in name:
                p.add_(0.05 * torch.randn_like(p))
    return model


def test_config_round_trips_and_old_configs_load():
    config = MHLAConfig(causal=True, causal_window=3, causal_fold="decay")
    assert MHLAConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    default = MHLAConfig()
    assert (default.causal, default.causal_window, default.causal_fold) == (False, 2, "sum")
    old = {k: v for k, v in default.to_dict().items() if not k.startswith("causal")}  # saved before the setting
    assert MHLAConfig.from_dict(old) == default


@pytest.mark.parametrize(
    "options,message",
    [
        (dict(causal="yes"), "`causal` must be True or False"),
        (dict(causal_window=-1), "`causal_window` must be an int >= 0"),
        (dict(causal_window=1.5), "`causal_window` must be an int >= 0"),
        (dict(causal_window=True), "`causal_window` must be an int >= 0"),
        (dict(causal_fold="max"), "`causal_fold` must be one of 'sum', 'decay', 'mean'"),
        (dict(causal=True, normalization="scalar_mixed_denominator"), "use normalization='denominator' or 'none'"),
        (dict(causal=True, lepe=True), "reads the next frame"),
    ],
)
def test_bad_causal_options_are_one_clear_error(options, message):
    with pytest.raises(ValueError, match=message):
        MHLAConfig(**options)


@pytest.mark.parametrize("fold", CAUSAL_FOLDS)
def test_causal_processors_own_per_offset_mixing_and_decay(fold):
    model = tiny_wan_transformer(num_layers=1)
    convert_to_mhla(model, MHLAConfig(layout=LAYOUT, causal=True, causal_window=1, causal_fold=fold))
    processor = model.blocks[0].attn1.processor
    torch.testing.assert_close(processor.mixing.data, causal_mixing_init(LAYOUT[1:], 1), rtol=0, atol=0)
    assert (processor.fold_decay is None) == (fold != "decay")
    assert processor.fold_options["mean_fold"] == (fold == "mean")
    if fold == "decay":
        assert processor.fold_decay.shape == (2,) and torch.allclose(processor.fold_decay, torch.tensor(0.9))
    model.to(torch.bfloat16)  # the mixing and the decay stay float32, as the plain mixing does
    assert processor.mixing.dtype == torch.float32
    assert fold != "decay" or processor.fold_decay_logit.dtype == torch.float32
    assert "block-causal: window 1" in get_mhla_conversion(model).summary()


def test_a_causal_wan_model_does_not_look_ahead():
    """Changing the last latent frame (the last temporal block row) leaves every earlier frame's output as it was;
    the same model converted without causal changes them."""
    inputs = wan_inputs(frames=4, height=4, width=6)
    later = {**inputs, "hidden_states": inputs["hidden_states"].clone()}
    later["hidden_states"][:, :, -1] += 1.0
    causal = causal_wan()
    before, after = run(causal, inputs), run(causal, later)
    torch.testing.assert_close(after[:, :, :-1], before[:, :, :-1], rtol=0, atol=1e-6)
    assert not torch.allclose(after[:, :, -1], before[:, :, -1])
    plain = tiny_wan_transformer(num_layers=2)
    convert_to_mhla(plain, MHLAConfig(layout=LAYOUT))
    assert not torch.allclose(run(plain, later)[:, :, :-1], run(plain, inputs)[:, :, :-1], atol=1e-4)


@pytest.mark.parametrize("fold", CAUSAL_FOLDS)
def test_the_causal_setting_is_saved_and_loaded(tmp_path, fold):
    """Through ``save_mhla`` (mhla_config.json) and ``save_pretrained`` (config.json): the same config and output."""
    model = causal_wan(fold=fold, window=2, per_head_mixing=True)
    inputs = wan_inputs(frames=4, height=4, width=6)
    expected = run(model, inputs)
    config = get_mhla_conversion(model).config
    save_mhla(model, tmp_path / "mhla")
    assert json.loads((tmp_path / "mhla" / "mhla_config.json").read_text())["mhla_config"]["causal"] is True
    fresh = tiny_wan_transformer(num_layers=2)
    fresh.load_state_dict({k: v for k, v in model.state_dict().items() if ".processor." not in k})
    load_mhla(tmp_path / "mhla", fresh)
    assert get_mhla_conversion(fresh).config == config
    assert torch.equal(run(fresh, inputs), expected)

    model.save_pretrained(tmp_path / "whole")
    saved = json.loads((tmp_path / "whole" / "config.json").read_text())["mhla"]
    assert (saved["causal"], saved["causal_window"], saved["causal_fold"]) == (True, 2, fold)
    loaded = MHLAWanTransformer3DModel.from_pretrained(tmp_path / "whole")
    assert get_mhla_conversion(loaded).config == config
    assert torch.equal(run(loaded, inputs), expected)


def test_dit_refuses_the_causal_setting():
    with pytest.raises(ValueError, match="has no causal form"):
        convert_to_mhla(tiny_dit_transformer(), MHLAConfig(causal=True))


def test_the_fused_kernel_is_not_chosen_for_causal_layers(monkeypatch):
    """Where the fused Triton kernel is available (CUDA; here made so), causal layers still run the causal operator:
    the kernel, bidirectional only, is never launched for them, and the output is the eager one."""
    model = causal_wan()
    inputs = wan_inputs(frames=4, height=4, width=6)
    eager = run(model, inputs)
    launched = []
    monkeypatch.setattr(base, "fused_available", lambda tensor: True)
    monkeypatch.setattr(base, "mhla_attention_fused", lambda *a, **kw: launched.append(1))
    assert torch.equal(run(model, inputs), eager) and not launched
    plain = tiny_wan_transformer(num_layers=1)  # the switch does reach the kernel for bidirectional layers
    convert_to_mhla(plain, MHLAConfig(layout=LAYOUT))
    with pytest.raises(AttributeError):  # the stand-in kernel returns None
        run(plain, inputs)
    assert launched


def test_context_parallelism_refuses_causal_layers(monkeypatch):
    """Refused by enable_context_parallel before anything else (no process group needed to learn it), and by
    a causal processor that is handed a share of the sequence anyway."""
    model = causal_wan()
    with pytest.raises(ValueError, match="context parallelism has no block-causal MHLA"):
        enable_context_parallel(model, 2)
    processor = model.blocks[0].attn1.processor
    monkeypatch.setattr(processor, "_context_shard", lambda num_tokens: object())  # as under Diffusers' split
    with pytest.raises(ValueError, match="context parallelism has no block-causal MHLA"):
        run(model, wan_inputs(frames=4, height=4, width=6))
