"""MHLA conversion of every published full-size Wan transformer, on the meta device (shapes only, no memory).

For each config of :mod:`mhla_diffusion.utils.wan_configs` the test builds the model without memory, converts
it three ways and accounts for every state-dict key: the new ones are exactly what the MHLA processors
should add (shapes computed here from the config), everything else -- text and image cross-attention
included -- is untouched, and the parameter counts add up.
"""

from __future__ import annotations

import math

import pytest
import torch

from mhla_diffusion import MHLAConfig, convert_to_mhla, get_mhla_conversion, revert_mhla
from mhla_diffusion.loaders.original_wan import empty_wan_transformer
from mhla_diffusion.utils.wan_configs import WAN_TRANSFORMER_CONFIGS, wan_transformer_config

#: Published sizes (parameters of the Diffusers transformer, from the models' cards), 0.5 % tolerance.
PUBLISHED_SIZES = {
    "Wan2.1-T2V-1.3B": 1.42e9,
    "Wan2.1-T2V-14B": 14.3e9,
    "Wan2.2-T2V-A14B": 14.3e9,
    "Wan2.2-TI2V-5B": 5.0e9,
}

#: The conversions checked, as functions of the block count: (the MHLAConfig, the layers it converts).
VARIANTS = {
    # the released Wan-MHLA setting: every layer, 3x5x10 blocks, no denominator, output RMSNorm, SiLU gate
    "released": lambda n: (MHLAConfig.released_wan(), list(range(n))),
    # ungated, the 2/3 hybrid, LePE and one mixing matrix per head
    "hybrid-lepe-per-head": lambda n: (
        MHLAConfig.released_wan(gate=False, layers="hybrid", lepe=True, per_head_mixing=True),
        [i for i in range(n) if i % 3 != 0],
    ),
    # the paper's denominator with the released DiT's input LayerNorm, on the first and last block
    "paper-input-norm": lambda n: (MHLAConfig(layout=(2, 4, 4), input_norm=True, layers=[0, n - 1]), [0, n - 1]),
}


def expected_processor_keys(config: dict, mhla: MHLAConfig, layers: list[int]) -> dict[str, tuple[int, ...]]:
    """Every key an MHLA conversion adds, with its shape, from the model config alone."""
    heads, head_dim = config["num_attention_heads"], config["attention_head_dim"]
    width, blocks = heads * head_dim, math.prod(mhla.layout)
    per_layer = {"mixing": (heads, blocks, blocks) if mhla.per_head_mixing else (blocks, blocks)}
    if mhla.output_norm:
        per_layer["out_norm.weight"] = (head_dim,)  # per-head RMSNorm, shared by the heads
    if mhla.gate:
        per_layer |= {"gate.weight": (width, width), "gate.bias": (width,)}
    if mhla.lepe:
        per_layer |= {"lepe.weight": (width, 1, 3, 3, 3), "lepe.bias": (width,)}  # depthwise 3x3x3 over the grid
    if mhla.input_norm:
        per_layer |= {"input_norm.weight": (width,), "input_norm.bias": (width,)}
    return {f"blocks.{i}.attn1.processor.{name}": shape for i in layers for name, shape in per_layer.items()}


def image_conditioning_parameters(config: dict) -> int:
    """Parameters the CLIP image branch adds to a Wan transformer (embedder MLP, image keys/values per block)."""
    if config["image_dim"] is None:
        return 0
    image, kv = config["image_dim"], config["added_kv_proj_dim"]
    width = config["num_attention_heads"] * config["attention_head_dim"]
    embedder = 2 * image + (image * image + image) + (image * width + width) + 2 * width  # LN, Linear, Linear, LN
    embedder += config["pos_embed_seq_len"] * image if config["pos_embed_seq_len"] else 0
    per_block = 2 * (kv * width + width) + width  # add_k_proj, add_v_proj, norm_added_k
    return embedder + config["num_layers"] * per_block


def shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {key: tuple(value.shape) for key, value in model.state_dict().items()}


@pytest.fixture(scope="module")
def t2v_14b_parameters() -> int:
    return sum(p.numel() for p in empty_wan_transformer(wan_transformer_config("Wan2.1-T2V-14B")).parameters())


@pytest.mark.parametrize("name", list(WAN_TRANSFORMER_CONFIGS))
def test_mhla_adds_exactly_its_parameters_to_the_published_model(name, t2v_14b_parameters):
    config = wan_transformer_config(name)
    model = empty_wan_transformer(config)
    base = shapes(model)
    base_count = sum(p.numel() for p in model.parameters())
    assert all(p.is_meta for p in model.parameters())
    if name in PUBLISHED_SIZES:
        assert base_count == pytest.approx(PUBLISHED_SIZES[name], rel=5e-3)
    if config["num_attention_heads"] == 40:  # the 14B body: image conditioning is all the difference
        assert (
            base_count - t2v_14b_parameters
            == image_conditioning_parameters(config)
            + (config["in_channels"] - 16) * config["num_attention_heads"] * config["attention_head_dim"] * 4
        )  # patch conv
    if config["added_kv_proj_dim"]:
        assert base[f"blocks.{config['num_layers'] - 1}.attn2.add_k_proj.weight"] == (5120, 5120)
        assert base["condition_embedder.image_embedder.norm1.weight"] == (1280,)

    for variant, make in VARIANTS.items():
        mhla_config, layers = make(config["num_layers"])
        conversion = convert_to_mhla(model, mhla_config)
        assert conversion.layers == layers, variant
        after = shapes(model)
        added = {key: shape for key, shape in after.items() if key not in base}
        assert added == expected_processor_keys(config, mhla_config, layers), variant
        assert {key: after[key] for key in base} == base, variant  # nothing removed or reshaped
        new_parameters = {n: p for n, p in model.named_parameters() if ".processor." in n}
        assert all(p.is_meta for p in new_parameters.values()), variant  # nothing allocated
        assert all(
            p.requires_grad == mhla_config.learnable_mixing for n, p in new_parameters.items() if n.endswith("mixing")
        )
        new_count = sum(math.prod(shape) for shape in added.values())
        assert conversion.num_new_parameters == new_count, variant
        assert sum(p.numel() for p in model.parameters()) == base_count + new_count, variant
        # cross-attention (text, and the I2V image keys/values) keeps Diffusers' own processor
        for i, block in enumerate(model.blocks):
            assert type(block.attn2.processor).__name__ == "WanAttnProcessor", (variant, i)
            assert (type(block.attn1.processor).__name__ == "WanMHLAProcessor") == (i in layers), (variant, i)
        revert_mhla(model)
        assert shapes(model) == base and get_mhla_conversion(model) is None


def test_converting_a_meta_model_initialises_nothing_in_memory(monkeypatch):
    """The processors of a meta model are built on the meta device: their weight inits touch no real tensor
    (built in memory first, the 40 gates and LePEs of a 14B model took ~10 s and 4 GB of initialisation)."""
    devices = []
    kaiming = torch.nn.init.kaiming_uniform_

    def spy(tensor, *args, **kwargs):
        devices.append(tensor.device.type)
        return kaiming(tensor, *args, **kwargs)

    model = empty_wan_transformer(wan_transformer_config("Wan2.1-I2V-14B-480P"))
    monkeypatch.setattr(torch.nn.init, "kaiming_uniform_", spy)
    convert_to_mhla(model, MHLAConfig.released_wan(lepe=True))
    assert len(devices) >= 2 * 40 and set(devices) == {"meta"}  # (at least) the gate and LePE of every block
