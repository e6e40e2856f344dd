"""save_mhla / load_mhla round trips and strictness."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.models import dit_inputs, run, wan_inputs
from mhla_diffusion import (
    MHLAConfig,
    MHLAWanTransformer3DModel,
    convert_to_mhla,
    get_mhla_conversion,
    load_mhla,
    load_transformer,
    save_mhla,
)
from mhla_diffusion.models.tiny import tiny_dit_transformer, tiny_wan_transformer


def trained_wan():
    """A converted tiny Wan whose MHLA parameters differ from their init (as after fine-tuning)."""
    model = tiny_wan_transformer(num_layers=3)
    convert_to_mhla(model, MHLAConfig.released_wan(layers="hybrid", layout=(2, 2, 3), per_head_mixing=True, lepe=True))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def base_weights(model):
    return {k: v for k, v in model.state_dict().items() if ".processor." not in k}


@pytest.mark.parametrize("family", ["wan", "dit"])
def test_mhla_only_round_trip_is_bit_exact(tmp_path, family):
    if family == "wan":
        model, inputs, fresh = trained_wan(), wan_inputs(3, 5, 7), tiny_wan_transformer(num_layers=3, seed=1)
    else:
        model, inputs, fresh = tiny_dit_transformer(), dit_inputs(), tiny_dit_transformer(seed=1)
        convert_to_mhla(model, MHLAConfig(lepe=True, gate=True))
    expected = run(model, inputs)
    save_mhla(model, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mhla_config.json", "mhla_weights.safetensors"]
    assert all(".processor." in k for k in load_file(tmp_path / "mhla_weights.safetensors"))

    fresh.load_state_dict(base_weights(model))
    load_mhla(tmp_path, fresh)
    assert get_mhla_conversion(fresh).config == get_mhla_conversion(model).config
    assert torch.equal(run(fresh, inputs), expected)


def test_whole_transformer_round_trip_is_bit_exact(tmp_path):
    model = trained_wan()
    inputs = wan_inputs(3, 5, 7)
    expected = run(model, inputs)
    save_mhla(model, tmp_path, include_base=True)
    loaded = load_mhla(tmp_path)
    assert isinstance(loaded, MHLAWanTransformer3DModel)
    assert get_mhla_conversion(loaded).layer_names == ["blocks.1.attn1", "blocks.2.attn1"]
    assert torch.equal(run(loaded, inputs), expected)
    dit = tiny_dit_transformer()
    convert_to_mhla(dit, MHLAConfig(gate=True))
    save_mhla(dit, tmp_path / "dit", include_base=True)
    assert torch.equal(run(load_mhla(tmp_path / "dit"), dit_inputs()), run(dit, dit_inputs()))
    # the MHLA part of a whole-transformer folder also loads into a separately built base model
    fresh = tiny_wan_transformer(num_layers=3, seed=3)
    fresh.load_state_dict(base_weights(model))
    load_mhla(tmp_path, fresh)
    assert torch.equal(run(fresh, inputs), expected)


def test_existing_files_are_never_overwritten(tmp_path):
    model = trained_wan()
    save_mhla(model, tmp_path)
    before = (tmp_path / "mhla_weights.safetensors").read_bytes()
    with torch.no_grad():
        model.blocks[1].attn1.processor.mixing.add_(1.0)
    with pytest.raises(FileExistsError, match="overwrite"):
        save_mhla(model, tmp_path)
    assert (tmp_path / "mhla_weights.safetensors").read_bytes() == before
    save_mhla(model, tmp_path, overwrite=True)
    assert (tmp_path / "mhla_weights.safetensors").read_bytes() != before


def assert_untouched(model):
    assert get_mhla_conversion(model) is None
    assert not any(".processor." in k for k in model.state_dict())


def test_wrong_model_shape_is_an_error(tmp_path):
    save_mhla(trained_wan(), tmp_path)
    other = tiny_wan_transformer(num_layers=3, num_attention_heads=3)
    with pytest.raises(ValueError, match="heads: saved 2 vs model 3"):
        load_mhla(tmp_path, other)
    assert_untouched(other)
    dit = tiny_dit_transformer()
    with pytest.raises(ValueError, match="family"):
        load_mhla(tmp_path, dit)


def test_missing_unexpected_and_misshaped_keys_are_listed(tmp_path):
    save_mhla(trained_wan(), tmp_path)
    path = tmp_path / "mhla_weights.safetensors"
    tensors = load_file(path)
    tensors.pop("blocks.2.attn1.processor.gate.bias")
    tensors["blocks.0.attn1.processor.mixing"] = torch.zeros(12, 12)
    tensors["blocks.1.attn1.processor.mixing"] = torch.zeros(2, 3, 3)
    save_file(tensors, path)
    model = tiny_wan_transformer(num_layers=3)
    with pytest.raises(ValueError) as info:
        load_mhla(tmp_path, model)
    message = str(info.value)
    assert "missing keys ['blocks.2.attn1.processor.gate.bias']" in message
    assert "unexpected keys ['blocks.0.attn1.processor.mixing']" in message
    assert "blocks.1.attn1.processor.mixing: saved (2, 3, 3) vs model (2, 12, 12)" in message
    assert_untouched(model)


def test_loading_needs_the_right_folder_and_model(tmp_path):
    model = trained_wan()
    save_mhla(model, tmp_path / "mhla")
    with pytest.raises(ValueError, match="pass the base transformer"):
        load_mhla(tmp_path / "mhla")
    with pytest.raises(ValueError, match="already converted"):
        load_mhla(tmp_path / "mhla", model)
    with pytest.raises(FileNotFoundError, match="mhla_config.json"):
        load_mhla(tmp_path, tiny_wan_transformer(num_layers=3))
    with pytest.raises(ValueError, match="not converted"):
        save_mhla(tiny_wan_transformer(), tmp_path / "other")
    meta = json.loads((tmp_path / "mhla" / "mhla_config.json").read_text())
    meta["mhla_config"]["window"] = 3
    (tmp_path / "mhla" / "mhla_config.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="unknown MHLAConfig keys"):
        load_mhla(tmp_path / "mhla", tiny_wan_transformer(num_layers=3))


def test_load_transformer_from_pipeline_style_folder(tmp_path):
    model = tiny_wan_transformer()
    model.save_pretrained(tmp_path / "transformer")
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))
    loaded = load_transformer(tmp_path)
    assert torch.equal(run(loaded, wan_inputs()), run(model, wan_inputs()))
    with pytest.raises(FileNotFoundError, match="neither a local folder nor a hub repo id"):
        load_transformer(tmp_path / "transformer" / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_transformer(tmp_path / "empty")


@pytest.mark.parametrize("suffix", [".pt", ".safetensors", ".bin"])
def test_files_of_random_bytes_are_one_readable_error_whatever_the_bytes(tmp_path, suffix):
    """torch's unpickler fails on random bytes with many kinds of errors (UnpicklingError, KeyError, EOFError,
    ...): every one becomes the same line naming the file."""
    import random

    from mhla_diffusion.loaders.weight_files import read_checkpoint_file

    for seed in range(40):
        path = tmp_path / f"random{seed}{suffix}"
        path.write_bytes(random.Random(seed).randbytes(64 + 97 * seed))
        with pytest.raises(ValueError) as error:
            read_checkpoint_file(path)
        assert str(error.value) == f"{path} is not a readable PyTorch/safetensors checkpoint (corrupt or truncated?)"
    with pytest.raises(FileNotFoundError):  # a missing file keeps its own message
        read_checkpoint_file(tmp_path / f"missing{suffix}")
