"""Import of original-format Wan checkpoints (the released MHLA-Wan format), on synthetic tiny ones."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import run, wan_inputs
from safetensors.torch import save_file

from mhla_diffusion import MHLAConfig, MHLAWanTransformer3DModel, convert_to_mhla, get_mhla_conversion
from mhla_diffusion.original_format import load_original_wan
from mhla_diffusion.tiny import tiny_wan_transformer

# Diffusers -> original Wan names, written out independently of the importer's rules.
TO_ORIGINAL = [
    (r"condition_embedder\.text_embedder\.linear_1\.", "text_embedding.0."),
    (r"condition_embedder\.text_embedder\.linear_2\.", "text_embedding.2."),
    (r"condition_embedder\.time_embedder\.linear_1\.", "time_embedding.0."),
    (r"condition_embedder\.time_embedder\.linear_2\.", "time_embedding.2."),
    (r"condition_embedder\.time_proj\.", "time_projection.1."),
    (r"^proj_out\.", "head.head."),
    (r"^scale_shift_table$", "head.modulation"),
    (r"\.scale_shift_table$", ".modulation"),
    (r"\.attn1\.processor\.mixing$", ".self_attn.block_attn.conv.weight"),
    (r"\.attn1\.processor\.out_norm\.", ".self_attn.g_norm."),
    (r"\.attn1\.processor\.gate\.", ".self_attn.g."),
    (r"\.attn1\.processor\.lepe\.", ".self_attn.lepe."),
    (r"\.attn1\.to_out\.0\.", ".self_attn.o."),
    (r"\.attn2\.to_out\.0\.", ".cross_attn.o."),
    (r"\.attn1\.to_(q|k|v)\.", r".self_attn.\1."),
    (r"\.attn2\.to_(q|k|v)\.", r".cross_attn.\1."),
    (r"\.attn1\.norm_", ".self_attn.norm_"),
    (r"\.attn2\.norm_", ".cross_attn.norm_"),
    (r"\.norm2\.", ".norm3."),
    (r"\.ffn\.net\.0\.proj\.", ".ffn.0."),
    (r"\.ffn\.net\.2\.", ".ffn.2."),
]


def to_original(model) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in model.state_dict().items():
        for pattern, repl in TO_ORIGINAL:
            key = re.sub(pattern, repl, key)
        if key.endswith("block_attn.conv.weight"):
            value = value[:, :, None, None]
        out[key] = value.clone()
    return out


def released_model(gate: bool, lepe: bool = False):
    model = tiny_wan_transformer(num_layers=3)
    convert_to_mhla(model, MHLAConfig.released_wan(gate=gate, layers="hybrid", layout=(2, 2, 3), lepe=lepe))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("gate,lepe", [(True, False), (False, False), (True, True)])
def test_released_checkpoint_round_trip(tmp_path, gate, lepe):
    model = released_model(gate, lepe)
    original = to_original(model)
    assert "blocks.1.self_attn.block_attn.conv.weight" in original and "blocks.1.self_attn.g_norm.weight" in original
    assert ("blocks.1.self_attn.g.weight" in original) == gate
    path = tmp_path / "mhla_wan.safetensors"
    save_file(original, path)
    imported = load_original_wan(path, layout=(2, 2, 3), attention_head_dim=12, rope_max_seq_len=32)
    assert isinstance(imported, MHLAWanTransformer3DModel)
    conversion = get_mhla_conversion(imported)
    assert conversion.layers == [1, 2]
    assert conversion.config == get_mhla_conversion(model).config
    inputs = wan_inputs(3, 5, 7)
    torch.testing.assert_close(run(imported, inputs), run(model, inputs), rtol=0, atol=0)


def test_pt_checkpoint_with_wrapper_and_prefix(tmp_path):
    model = released_model(gate=True)
    path = tmp_path / "ckpt.pt"
    torch.save({"state_dict": {f"module.{k}": v for k, v in to_original(model).items()}, "step": 10}, path)
    imported = load_original_wan(path, layout=(2, 2, 3), attention_head_dim=12, rope_max_seq_len=32)
    assert torch.equal(run(imported, wan_inputs()), run(model, wan_inputs()))


def test_plain_wan_checkpoint_converts(tmp_path):
    model = tiny_wan_transformer(num_layers=2)
    path = tmp_path / "wan.safetensors"
    save_file(to_original(model), path)
    imported = load_original_wan(path, attention_head_dim=12, rope_max_seq_len=32)
    assert get_mhla_conversion(imported) is None
    assert torch.equal(run(imported, wan_inputs()), run(model, wan_inputs()))


def test_unknown_and_missing_keys_are_listed():
    original = to_original(released_model(gate=True))
    bad = dict(original)
    bad["blocks.1.self_attn.out_rmsnorm.weight"] = torch.ones(24)
    bad["extra.thing"] = torch.ones(1)
    with pytest.raises(ValueError, match=r"\['blocks.1.self_attn.out_rmsnorm.weight', 'extra.thing'\]"):
        load_original_wan(bad, layout=(2, 2, 3), attention_head_dim=12)
    missing = dict(original)
    del missing["blocks.0.ffn.2.bias"]
    del missing["blocks.2.self_attn.g.bias"]
    with pytest.raises(ValueError, match="blocks.0.ffn.net.2.bias") as info:
        load_original_wan(missing, layout=(2, 2, 3), attention_head_dim=12)
    assert "blocks.2.attn1.processor.gate.bias" in str(info.value)


def test_layout_must_match_the_mixing_size():
    original = to_original(released_model(gate=False))
    with pytest.raises(ValueError, match="pass the block layout"):
        load_original_wan(original, attention_head_dim=12)
    with pytest.raises(ValueError, match="has 8 blocks but the checkpoint.s mixing has 12"):
        load_original_wan(original, layout=(2, 2, 2), attention_head_dim=12)
