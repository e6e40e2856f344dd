"""Import of original-format Wan checkpoints (the released MHLA-Wan format), on synthetic tiny ones."""

from __future__ import annotations

import pytest
import torch
from helpers.models import run, wan_inputs
from helpers.original_format import released_model, to_original
from safetensors.torch import save_file

from mhla_diffusion import MHLAWanTransformer3DModel, get_mhla_conversion
from mhla_diffusion.original_format import load_original_wan
from mhla_diffusion.tiny import tiny_wan_transformer


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
