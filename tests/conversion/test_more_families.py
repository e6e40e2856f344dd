"""The six Diffusers families beyond Wan and DiT (SkyReels-V2, HunyuanVideo, LTX-Video, CogVideoX, SANA-Video, Flux):
each converts with ``MHLAConfig()`` on every self-attention layer (joint or not) and on nothing else, runs, saves and
reloads with its MHLA weights, runs its softmax original inside ``softmax_attention`` and after ``revert_mhla``, and
refuses in one line a call whose token grid cannot be known."""

from __future__ import annotations

import pytest
import torch

from mhla_diffusion import (
    MHLAConfig,
    auto_layout,
    convert_to_mhla,
    get_mhla_conversion,
    load_mhla,
    revert_mhla,
    softmax_attention,
    video_token_grid,
)
from mhla_diffusion.models.conversion import mhla_parameter_names, self_attention_layers
from mhla_diffusion.models.families import FAMILIES, family_of
from mhla_diffusion.models.processors.base import MHLAProcessor
from mhla_diffusion.models.tiny_families import tiny_family_inputs

NEW = ["skyreels-v2", "hunyuan-video", "ltx-video", "cogvideox", "sana-video", "flux"]
#: The joint families' text-image attention layers; every other family's self-attention is ``attn1``.
SITES = {
    "hunyuan-video": ["transformer_blocks.0.attn", "single_transformer_blocks.0.attn"],
    "flux": ["transformer_blocks.0.attn", "single_transformer_blocks.0.attn"],
}


def _grid(name: str) -> tuple[int, ...]:
    return (4, 6) if name == "flux" else (2, 4, 6)


def _run(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs)[0]


def _moved(model: torch.nn.Module) -> torch.nn.Module:
    """Every parameter moved off its initialisation, as after fine-tuning: a parameter not loaded shows."""
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.01 * torch.randn_like(parameter))
    return model


@pytest.fixture(params=NEW)
def converted(request):
    name = request.param
    model = FAMILIES[name].tiny_transformer()
    inputs = tiny_family_inputs(name, _grid(name))
    stock = _run(model, inputs)
    processors = {key: type(module.processor) for key, module in model.named_modules() if hasattr(module, "processor")}
    conversion = convert_to_mhla(model, MHLAConfig())
    return name, model, inputs, stock, processors, conversion


def test_every_self_attention_layer_converts_and_nothing_else(converted):
    name, model, inputs, stock, before, conversion = converted
    family = FAMILIES[name]
    assert family_of(model) is family and conversion.family == name
    expected = SITES.get(name, [f"{family.attention_sites[0][0]}.{i}.attn1" for i in range(2 if name in (
        "skyreels-v2", "cogvideox", "sana-video") else 1)])  # fmt: skip
    assert conversion.layer_names == expected == [n for n, _ in self_attention_layers(model)]
    modules = dict(model.named_modules())
    for key, kind in before.items():
        processor = modules[key].processor
        if key in expected:
            assert isinstance(processor, family.processor_class())
            mixing = processor.mixing
            m = conversion.num_blocks + (1 if family.joint else 0)  # the joint families' text block
            assert mixing.shape == (m, m)
        else:  # cross-attention, Hunyuan's text refiner: as they were
            assert type(processor) is kind, key
    out = _run(model, inputs)
    assert out.shape == stock.shape and torch.isfinite(out).all()
    assert not torch.allclose(out, stock)  # MHLA, not softmax


def test_softmax_attention_and_revert_give_the_stock_model_back(converted):
    name, model, inputs, stock, _, _ = converted
    with softmax_attention(model):
        torch.testing.assert_close(_run(model, inputs), stock, rtol=0, atol=0)
    revert_mhla(model)
    assert get_mhla_conversion(model) is None and "mhla" not in model.config
    torch.testing.assert_close(_run(model, inputs), stock, rtol=0, atol=0)


def test_saves_and_reloads_with_its_mhla_weights(converted, tmp_path):
    name, model, inputs, _, _, conversion = converted
    _moved(model)
    model.save_pretrained(tmp_path)
    mhla_class = FAMILIES[name].mhla_transformer_class()
    loaded = mhla_class.from_pretrained(tmp_path).eval()
    assert type(loaded) is mhla_class and get_mhla_conversion(loaded).config == conversion.config
    names = mhla_parameter_names(model)
    assert names and names == mhla_parameter_names(loaded)
    saved, again = model.state_dict(), loaded.state_dict()
    assert all(torch.equal(saved[key], again[key]) for key in saved)
    torch.testing.assert_close(_run(loaded, inputs), _run(model, inputs), rtol=0, atol=0)
    # the folder's MHLA weights also load onto a stock model of the same shape (its layer count read from the
    # config: Flux and HunyuanVideo count their single-stream blocks too)
    onto = load_mhla(tmp_path, FAMILIES[name].tiny_transformer())
    assert all(torch.equal(saved[key], onto.state_dict()[key]) for key in names)


@pytest.mark.parametrize("name", NEW)
def test_the_mhla_class_is_built_converted_from_its_config(name):
    stock = FAMILIES[name].tiny_transformer()
    init = {key: value for key, value in stock.config.items() if not key.startswith("_")}
    model = FAMILIES[name].mhla_transformer_class()(**init, mhla=MHLAConfig().to_dict())
    conversion = get_mhla_conversion(model)
    assert conversion is not None and model.config["mhla"] == conversion.config.to_dict()
    assert isinstance(model, FAMILIES[name].transformer_class())


def test_sana_video_with_equal_mixing_is_the_stock_model():
    """SANA-Video's self-attention is global ReLU linear attention, which MHLA is when every coefficient is equal."""
    model = FAMILIES["sana-video"].tiny_transformer()
    inputs = tiny_family_inputs("sana-video", (3, 4, 6))
    stock = _run(model, inputs)
    convert_to_mhla(model, MHLAConfig(layout=(2, 2, 3)))
    for name, attn in self_attention_layers(model):
        assert isinstance(attn.processor, MHLAProcessor)
        attn.processor.mixing.data.fill_(1.0)
    torch.testing.assert_close(_run(model, inputs), stock, rtol=1e-5, atol=1e-5)


def test_a_call_whose_grid_cannot_be_known_is_refused_in_one_line():
    flux = FAMILIES["flux"].tiny_transformer()
    convert_to_mhla(flux, MHLAConfig())
    inputs = tiny_family_inputs("flux", (4, 6))
    inputs["img_ids"] = torch.randn(24, 3)  # not the ids of one image
    with pytest.raises(ValueError, match=r"^MHLA cannot know the token grid: `img_ids` \(24, 3\) are not") as error:
        _run(flux, inputs)
    assert "\n" not in str(error.value)
    inputs = tiny_family_inputs("flux", (4, 6))
    inputs["txt_ids"][:, 1] = torch.arange(5.0)  # rotated text: MHLA's text block has no positions
    with pytest.raises(ValueError, match=r"Flux's text tokens must not rotate \(`txt_ids` all zero"):
        _run(flux, inputs)
    ltx = FAMILIES["ltx-video"].tiny_transformer()
    convert_to_mhla(ltx, MHLAConfig())
    inputs = tiny_family_inputs("ltx-video", (2, 4, 6))
    del inputs["height"]
    with pytest.raises(ValueError, match=r"call the transformer with `num_frames=`, `height=`, `width=`.*missing h"):
        _run(ltx, inputs)


def test_hunyuan_text_padding_is_no_key():
    """A padded text token changes nothing in the output of the other tokens (its key is masked out)."""
    model = FAMILIES["hunyuan-video"].tiny_transformer()
    convert_to_mhla(model, MHLAConfig())
    inputs = tiny_family_inputs("hunyuan-video", (2, 4, 6))
    changed = {**inputs, "encoder_hidden_states": inputs["encoder_hidden_states"].clone()}
    changed["encoder_hidden_states"][-1, -1] += 5.0  # a padded token of the last sample
    torch.testing.assert_close(_run(model, changed), _run(model, inputs), rtol=0, atol=0)


def test_skyreels_block_causal_mask_is_replaced_by_causal_mhla():
    """With ``num_frame_per_block`` 2, SkyReels-V2 passes a block-causal mask: causal MHLA with one row per block of
    2 frames keeps the first block's output independent of later frames; bidirectional MHLA refuses the mask."""
    model = FAMILIES["skyreels-v2"].tiny_transformer(num_frame_per_block=2)
    inputs = tiny_family_inputs("skyreels-v2", (4, 2, 3), batch=1)
    with pytest.raises(ValueError, match=r"convert with MHLAConfig\(causal=True\)"):
        convert_to_mhla(model, MHLAConfig())
        _run(model, inputs)
    revert_mhla(model)
    convert_to_mhla(model, MHLAConfig(causal=True, layout=(2, 2, 3)))
    later = {**inputs, "hidden_states": inputs["hidden_states"].clone()}
    later["hidden_states"][:, :, 2:] += 1.0  # the second block of frames
    out, out_later = _run(model, inputs), _run(model, later)
    torch.testing.assert_close(out_later[:, :, :2], out[:, :, :2], rtol=0, atol=0)
    assert not torch.allclose(out_later[:, :, 2:], out[:, :, 2:])
    processor = model.blocks[0].attn1.processor
    assert processor.frames_per_row == 2 and processor.causal_layout((4, 2, 3)) == (2, 2, 3)


#: Each family's published default size in the size rules of its VAE (time, space) and patch (time, space).
DEFAULT_RULES = {
    "skyreels-v2": ((4, 8, 8), (1, 2, 2)),
    "hunyuan-video": ((4, 8, 8), (1, 2, 2)),
    "ltx-video": ((8, 32, 32), (1, 1, 1)),
    "cogvideox": ((4, 8, 8), (1, 2, 2)),
    "sana-video": ((4, 8, 8), (1, 2, 2)),
}


@pytest.mark.parametrize("name", NEW)
def test_the_default_layout_is_chosen_for_the_published_default_size(name):
    family = FAMILIES[name]
    if name == "flux":  # 1024 px, VAE x8 and Flux's 2x2 packing
        grid = tuple(side // 16 for side in family.default_pixels)
    else:
        vae, patch = DEFAULT_RULES[name]
        grid = video_token_grid(*family.default_pixels, patch_size=patch, vae_scale=vae)
    conversion = convert_to_mhla(family.tiny_transformer(), MHLAConfig())
    assert conversion.grid == grid and conversion.layout == auto_layout(grid)
    assert "x".join(map(str, family.default_pixels)) in conversion.grid_origin
