"""The ``released-dit`` setting: ``MHLAConfig.released_dit()`` reproduces the released ``MHLA4DiT``.

The central test builds one whole ``MHLA4DiT`` attention forward from the reference facts (section
2.1 token order, section 2.2 steps 1-9; our own code, written independently of the library), copies
its weights into a converted tiny DiT layer and compares the outputs in float64.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from helpers.models import dit_inputs, run
from mhla_diffusion import MHLAConfig, convert_to_mhla, get_mhla_conversion, load_mhla, save_mhla
from mhla_diffusion.cli import main
from mhla_diffusion.finetune.components import mhla_config_from_options
from mhla_diffusion.finetune.options import DiTTrainOptions, WanTrainOptions, options_from_dict
from mhla_diffusion.models.tiny import tiny_dit_transformer
from mhla_diffusion.models.transformers import MHLADiTTransformer2DModel

SCALAR = "scalar_mixed_denominator"


# ----------------------------------------------------------------------------- the released module, from the facts


def block_major_positions(side: int, p: int) -> torch.Tensor:
    """Sequence position ``b * L + w`` of every raster token ``(r, c)`` (facts 2.1), shape ``(side * side,)``."""
    r, c = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    b = (r // p) * (side // p) + (c // p)
    w = (r % p) * p + (c % p)
    return (b * p * p + w).reshape(-1)


def released_mhla4dit(x: torch.Tensor, side: int, p: int, heads: int, params: dict, eps: float = 1e-6) -> torch.Tensor:
    """One ``MHLA4DiT`` forward (eval mode) on a raster-order ``x`` ``(B, N, C)`` -> raster ``(B, N, C)``.

    The released model runs on the block-major sequence throughout; the DiT permutes once after the
    patch embedding and back before the unpatchify, which here happens around this one module.
    """
    batch, n, channels = x.shape
    m, length, d = (side // p) ** 2, p * p, channels // heads
    pos = block_major_positions(side, p)
    seq = torch.empty_like(x)
    seq[:, pos] = x  # block-major
    seq = seq.view(batch, m, length, channels)  # the [B, M, L, C] view MHLA4DiT expects
    # 1. LayerNorm with affine, eps 1e-5
    h = F.layer_norm(seq, (channels,), params["norm.weight"], params["norm.bias"], 1e-5)
    # 2. one qkv Linear with bias, chunked
    q, k, v = F.linear(h, params["to_qkv.weight"], params["to_qkv.bias"]).chunk(3, dim=-1)
    # 3. LePE: v laid back onto the side x side image, depthwise 3x3 with bias, back to block-major
    v_raster = v.reshape(batch, n, channels)[:, pos]
    image = v_raster.transpose(1, 2).reshape(batch, channels, side, side)
    lepe = F.conv2d(image, params["lepe.weight"], params["lepe.bias"], padding=1, groups=channels)
    lepe_raster = lepe.reshape(batch, channels, n).transpose(1, 2)
    lepe_seq = torch.empty_like(lepe_raster)
    lepe_seq[:, pos] = lepe_raster
    lepe_seq = lepe_seq.view(batch, m, length, channels)
    # 4. no q/k norm; 5. feature map ReLU + eps before the head split
    q, k = F.relu(q) + eps, F.relu(k) + eps
    # 6. heads; per (batch, head): S_j = K_j^T V_j, mixed with W (the 1x1 conv over the block axis)
    q, k, v = (t.reshape(batch, m, length, heads, d) for t in (q, k, v))
    w = params["piece_attn.conv.weight"][:, :, 0, 0]  # [M, M], W[o, j]
    kv = torch.einsum("bjlhd,bjlhe->bhjde", k, v)
    kv_mixed = torch.einsum("oj,bhjde->bhode", w, kv)
    numerator = torch.einsum("bolhd,bhode->bolhe", q, kv_mixed)
    # 7. denominator: Σ_j W[o, j] (q_(j,w) · z_j) + eps
    z = k.sum(dim=2)  # [B, M, H, D]
    scalars = torch.einsum("bjwhd,bjhd->bjwh", q, z)
    denominator = torch.einsum("oj,bjwh->bowh", w, scalars) + eps
    # 8. output, heads re-concatenated
    out = (numerator / denominator[..., None]).reshape(batch, m, length, channels)
    # 9. + LePE, to_out Linear (dropout is the identity in eval mode)
    out = F.linear(out + lepe_seq, params["to_out.0.weight"], params["to_out.0.bias"])
    return out.reshape(batch, n, channels)[:, pos]  # back to raster order


def random_released_params(channels: int, m: int, seed: int = 0) -> dict:
    """Released-module weights, none at their init (so every piece is exercised)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=0.3):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * scale

    return {
        "norm.weight": 1 + rnd(channels),
        "norm.bias": rnd(channels),
        "to_qkv.weight": rnd(3 * channels, channels),
        "to_qkv.bias": rnd(3 * channels),
        "lepe.weight": rnd(channels, 1, 3, 3),
        "lepe.bias": rnd(channels),
        "piece_attn.conv.weight": torch.rand(m, m, 1, 1, generator=g, dtype=torch.float64),  # in [0, 1] as clamped
        "to_out.0.weight": rnd(channels, channels),
        "to_out.0.bias": rnd(channels),
    }


def copy_released_params(attn: torch.nn.Module, params: dict) -> None:
    """Copy released ``MHLA4DiT`` weights into our converted layer (the names the importer relies on)."""
    proc = attn.processor
    channels = attn.to_q.in_features
    with torch.no_grad():
        for i, proj in enumerate((attn.to_q, attn.to_k, attn.to_v)):
            proj.weight.copy_(params["to_qkv.weight"][i * channels : (i + 1) * channels])
            proj.bias.copy_(params["to_qkv.bias"][i * channels : (i + 1) * channels])
        attn.to_out[0].weight.copy_(params["to_out.0.weight"])
        attn.to_out[0].bias.copy_(params["to_out.0.bias"])
        proc.input_norm.weight.copy_(params["norm.weight"])
        proc.input_norm.bias.copy_(params["norm.bias"])
        proc.lepe.weight.copy_(params["lepe.weight"])
        proc.lepe.bias.copy_(params["lepe.bias"])
        proc.mixing.copy_(params["piece_attn.conv.weight"][:, :, 0, 0])  # mixing[o, j] = W[o, j]


# ----------------------------------------------------------------------------- config


def test_released_dit_config():
    cfg = MHLAConfig.released_dit()
    assert cfg.normalization == SCALAR and cfg.input_norm and cfg.lepe and cfg.output_dropout == 0.1
    assert cfg.layers == "all" and cfg.layout == "auto"
    assert (cfg.transform, cfg.mixing_normalization, cfg.learnable_mixing) == ("linear", "column", True)
    assert not (cfg.gate or cfg.output_norm or cfg.per_head_mixing) and cfg.eps == 1e-6
    assert MHLAConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert MHLAConfig.released_dit(layout=(4, 4), output_dropout=0.0).layout == (4, 4)
    # the defaults stay as they were
    default = MHLAConfig()
    assert (default.normalization, default.input_norm, default.output_dropout) == ("denominator", False, 0.0)
    # an old mhla_config.json without the new keys still loads
    old = {k: v for k, v in default.to_dict().items() if k not in ("input_norm", "output_dropout")}
    assert MHLAConfig.from_dict(old) == default


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(output_dropout=1.0), "`output_dropout` must be a probability"),
        (dict(output_dropout=-0.1), "`output_dropout` must be a probability"),
        (dict(input_norm="yes"), "`input_norm` must be True or False"),
        (dict(normalization="scalar"), "scalar_mixed_denominator"),
        (dict(normalization=SCALAR, layout=(3, 3), target_grid=(16, 16)), r"does not divide `target_grid` \(16, 16\)"),
    ],
)
def test_bad_options_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        MHLAConfig(**options)


# ----------------------------------------------------------------------------- conversion


def test_conversion_on_dit_xl2_grid_picks_4x4_blocks_and_identity_extras():
    model = tiny_dit_transformer(num_layers=1, sample_size=32)  # 16x16 token grid, as DiT-XL/2 at 256 px
    conversion = convert_to_mhla(model, MHLAConfig.released_dit())
    assert conversion.layout == (4, 4) and conversion.config.normalization == SCALAR
    proc = model.transformer_blocks[0].attn1.processor
    assert not proc.training  # the eval-mode model's processors start in eval mode too (no output dropout)
    channels = model.transformer_blocks[0].attn1.to_q.in_features
    assert isinstance(proc.input_norm, torch.nn.LayerNorm) and proc.input_norm.eps == 1e-5
    assert proc.input_norm.normalized_shape == (channels,)
    assert torch.equal(proc.input_norm.weight, torch.ones(channels)) and torch.equal(
        proc.input_norm.bias, torch.zeros(channels)
    )
    assert proc.mixing.shape == (16, 16) and proc.mixing.requires_grad
    assert proc.lepe.weight.shape == (channels, 1, 3, 3) and proc.lepe.groups == channels
    assert proc.lepe.weight[:, 0, 1, 1].eq(1).all() and proc.lepe.weight.abs().sum() == channels
    keys = {k for k in model.state_dict() if ".processor." in k}
    assert keys == {
        f"transformer_blocks.0.attn1.processor.{name}"
        for name in ("mixing", "input_norm.weight", "input_norm.bias", "lepe.weight", "lepe.bias")
    }
    assert "input LayerNorm" in conversion.summary() and "output dropout 0.1" in conversion.summary()


def test_auto_layout_prefers_layouts_that_divide_the_grid():
    model = tiny_dit_transformer(num_layers=1, sample_size=16)  # 8x8 grid: plain auto would give (2, 3)
    assert convert_to_mhla(model, MHLAConfig.released_dit()).layout == (2, 2)
    model = tiny_dit_transformer(num_layers=1, sample_size=16)
    assert convert_to_mhla(model, MHLAConfig(layout="auto")).layout == (2, 3)  # the other normalisations unchanged


def test_conversion_refuses_a_layout_that_does_not_divide_the_grid():
    model = tiny_dit_transformer(num_layers=1, sample_size=16)  # 8x8 token grid
    with pytest.raises(
        ValueError, match=r"layout \(3, 2\) does not divide the model's token grid .*\(8, 8\).*e\.g\. \(2, 2\)"
    ):
        convert_to_mhla(model, MHLAConfig.released_dit(layout=(3, 2)))


def test_forward_on_a_grid_the_layout_does_not_divide_is_refused():
    model = tiny_dit_transformer(num_layers=1)  # 4x4 grid -> 2x2 layout
    convert_to_mhla(model, MHLAConfig.released_dit())
    inputs = dit_inputs()
    run(model, inputs)
    inputs["hidden_states"] = torch.randn(2, 4, 6, 6)  # 3x3 token grid
    with pytest.raises(ValueError, match=r"layout \(2, 2\) does not divide this forward's token grid .*\(3, 3\)"):
        run(model, inputs)
    inputs["hidden_states"] = torch.randn(2, 4, 12, 12)  # 6x6 token grid: divisible, fine
    assert run(model, inputs).shape == (2, 8, 12, 12)


# ----------------------------------------------------------------------------- against the released module


@pytest.mark.parametrize("layout", [(2, 2), (4, 4)])  # 4x4-token blocks (block_size 16, as released) and 2x2
def test_processor_equals_released_mhla4dit(layout):
    side, batch = 8, 2
    model = tiny_dit_transformer(num_layers=1, sample_size=2 * side).double()
    convert_to_mhla(model, MHLAConfig.released_dit(layout=layout))
    model.eval()
    attn = model.transformer_blocks[0].attn1
    channels, heads, m = attn.to_q.in_features, attn.heads, layout[0] * layout[1]
    params = random_released_params(channels, m)
    copy_released_params(attn, params)
    x = torch.randn(batch, side * side, channels, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    attn.processor.grid_context.set_grid((side, side))  # what the transformer's pre-hook records
    with torch.no_grad():
        ours = attn(x)
    expected = released_mhla4dit(x, side, side // layout[0], heads, params)
    torch.testing.assert_close(ours, expected, rtol=1e-10, atol=1e-10)
    # the paper's denominator is a different function of the same weights
    attn.processor.normalization = "denominator"
    with torch.no_grad():
        assert (attn(x) - expected).abs().max() > 1e-3


def test_output_dropout_is_active_in_training_only():
    model = tiny_dit_transformer(num_layers=1).double()
    convert_to_mhla(model, MHLAConfig.released_dit(output_dropout=0.5))
    attn = model.transformer_blocks[0].attn1
    attn.processor.grid_context.set_grid((4, 4))
    x = torch.randn(2, 16, attn.to_q.in_features, dtype=torch.float64)
    model.eval()
    with torch.no_grad():
        clean = attn(x)
        assert torch.equal(attn(x), clean)
        model.train()
        assert attn.processor.training
        dropped = attn(x)
    kept = dropped != 0
    assert 0 < kept.float().mean() < 1
    torch.testing.assert_close(dropped[kept], 2 * clean[kept], rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------- weights I/O


def trained_released_dit():
    model = tiny_dit_transformer(seed=0)
    convert_to_mhla(model, MHLAConfig.released_dit())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".processor." in name:
                p.add_(0.05 * torch.randn_like(p))
    return model


def test_save_load_round_trip(tmp_path):
    model = trained_released_dit()
    inputs = dit_inputs()
    expected = run(model, inputs)
    save_mhla(model, tmp_path / "mhla")
    fresh = tiny_dit_transformer(seed=1)
    fresh.load_state_dict({k: v for k, v in model.state_dict().items() if ".processor." not in k})
    load_mhla(tmp_path / "mhla", fresh)
    assert get_mhla_conversion(fresh).config == get_mhla_conversion(model).config
    assert get_mhla_conversion(fresh).config.normalization == SCALAR
    assert torch.equal(run(fresh, inputs), expected)
    proc = fresh.transformer_blocks[1].attn1.processor
    assert torch.equal(proc.input_norm.weight, model.transformer_blocks[1].attn1.processor.input_norm.weight)
    assert proc.output_dropout == 0.1

    save_mhla(model, tmp_path / "whole", include_base=True)
    for loaded in (load_mhla(tmp_path / "whole"), MHLADiTTransformer2DModel.from_pretrained(tmp_path / "whole")):
        loaded.eval()
        assert get_mhla_conversion(loaded).config == get_mhla_conversion(model).config
        assert torch.equal(run(loaded, inputs), expected)


# ----------------------------------------------------------------------------- trainer options and CLI


def test_trainer_accepts_the_released_dit_preset():
    required = dict(pretrained_model="model", data_dir="data", output_dir="out")
    options = options_from_dict(
        DiTTrainOptions, {**required, "mhla_preset": "released-dit", "mhla": {"layout": [4, 4]}}
    )
    assert options.mhla_preset == "released-dit"
    assert mhla_config_from_options(options.mhla, options.mhla_preset) == MHLAConfig.released_dit(layout=(4, 4))
    assert mhla_config_from_options({}, "released-dit") == MHLAConfig.released_dit()
    with pytest.raises(ValueError, match="`mhla_preset` must be one of"):
        options_from_dict(WanTrainOptions, {**required, "mhla_preset": "released-dt"})


def test_cli_convert_released_dit_preset(tmp_path, capsys):
    out = tmp_path / "mhla"
    assert main(["convert", "--tiny", "dit", "--preset", "released-dit", "--output", str(out)]) == 0
    text = capsys.readouterr().out
    assert "normalisation: scalar_mixed_denominator" in text and "input LayerNorm" in text
    saved = json.loads((out / "mhla_config.json").read_text())["mhla_config"]
    assert saved["normalization"] == SCALAR and saved["input_norm"] and saved["output_dropout"] == 0.1
    assert saved["layout"] == [2, 2]
    assert main(["convert", "--tiny", "dit", "--preset", "released-dit", "--layout", "3x2", "--no-check"]) == 2
    assert "does not divide" in capsys.readouterr().err
    assert main(["convert", "--tiny", "wan", "--preset", "released-dit", "--no-check"]) == 2
    assert "for DiT models" in capsys.readouterr().err
