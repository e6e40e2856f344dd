"""Import of original DiT and released DiT-MHLA checkpoints, checked against our own forward of the originals."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random

import pytest
import torch
from diffusers import DiTTransformer2DModel
from safetensors.torch import save_file

from helpers.models import run
from helpers.original_dit import dit_inputs, original_checkpoint, original_dit_forward, sincos_table
from helpers.original_format import outside
from mhla_diffusion import MHLAConfig, MHLADiTTransformer2DModel, get_mhla_conversion, load_mhla, load_transformer
from mhla_diffusion.cli import main
from mhla_diffusion.loaders.loading import load_transformer_file
from mhla_diffusion.loaders.original_dit import dit_model_size, load_original_dit, read_dit_checkpoint
from mhla_diffusion.loaders.original_wan import read_checkpoint


def reference(sd, inputs, heads=4, block_tokens=None):
    return original_dit_forward(
        sd, inputs["hidden_states"], inputs["timestep"], inputs["class_labels"], heads=heads, block_tokens=block_tokens
    )


@pytest.mark.parametrize("latent,learn_sigma", [(8, True), (16, False)])
def test_original_dit_matches_the_original_forward(latent, learn_sigma):
    sd = original_checkpoint(latent=latent, learn_sigma=learn_sigma)
    model = load_original_dit(sd, num_heads=4)
    assert type(model) is DiTTransformer2DModel and get_mhla_conversion(model) is None
    assert model.config.sample_size == latent and model.config.out_channels == (8 if learn_sigma else 4)
    assert model.config.num_embeds_ada_norm == 10 and model.config.attention_head_dim == 16
    inputs = dit_inputs(latent=latent)
    torch.testing.assert_close(run(model, inputs), reference(sd, inputs), rtol=1e-5, atol=1e-5)
    model.double()
    inputs = dit_inputs(latent=latent, dtype=torch.float64)
    torch.testing.assert_close(run(model, inputs), reference(sd, inputs), rtol=0, atol=1e-10)


@pytest.mark.parametrize("latent,block_tokens,layout", [(8, 4, (2, 2)), (16, 16, (2, 2)), (16, 4, (4, 4))])
def test_released_dit_mhla_matches_the_original_forward(latent, block_tokens, layout):
    sd = original_checkpoint(latent=latent, block_tokens=block_tokens)
    model = load_original_dit(sd, num_heads=4)
    assert isinstance(model, MHLADiTTransformer2DModel)
    conversion = get_mhla_conversion(model)
    assert conversion.layers == [0, 1] and conversion.layout == layout
    assert conversion.config == MHLAConfig.released_dit(layers=[0, 1], layout=layout)
    inputs = dit_inputs(latent=latent)
    torch.testing.assert_close(
        run(model, inputs), reference(sd, inputs, block_tokens=block_tokens), rtol=1e-5, atol=1e-5
    )
    model.double()
    inputs = dit_inputs(latent=latent, dtype=torch.float64)
    torch.testing.assert_close(run(model, inputs), reference(sd, inputs, block_tokens=block_tokens), rtol=0, atol=1e-10)


def test_the_imported_model_is_not_diffusers_default_timestep_embedding():
    """Diffusers' DiT divides the sinusoid's exponent by 127, the original by 128: the import undoes that."""
    sd = original_checkpoint()
    model = load_original_dit(sd, num_heads=4)
    assert model.config.timestep_freq_shift == 0 and model.config.norm_eps == 1e-6
    inputs = dit_inputs()
    for block in model.transformer_blocks:
        block.norm1.emb.time_proj.downscale_freq_shift = 1
    assert (run(model, inputs) - reference(sd, inputs)).abs().max() > 1e-3


def test_train_checkpoint_prefers_ema_and_can_choose(tmp_path):
    ema, weights = original_checkpoint(seed=1), original_checkpoint(seed=2)
    path = tmp_path / "0001000.pt"
    torch.save(
        {
            "model": {f"module.{k}": v for k, v in weights.items()},
            "ema": ema,
            "opt": {"state": {}},
            "args": argparse.Namespace(model="DiT-S/2", lr=1e-4),
        },
        path,
    )
    assert torch.equal(read_dit_checkpoint(path)["x_embedder.proj.bias"], ema["x_embedder.proj.bias"])
    assert torch.equal(read_dit_checkpoint(path, "model")["x_embedder.proj.bias"], weights["x_embedder.proj.bias"])
    inputs = dit_inputs()
    torch.testing.assert_close(
        run(load_original_dit(path, num_heads=4, weights="model"), inputs), reference(weights, inputs)
    )
    plain = tmp_path / "plain.pt"
    torch.save(ema, plain)
    with pytest.raises(ValueError, match="plain state dict"):
        read_dit_checkpoint(plain, "ema")
    torch.save({"model": ema}, plain)
    with pytest.raises(ValueError, match="has no 'ema' weights"):
        read_dit_checkpoint(plain, "ema")
    torch.save({"model": ema, "args": pathlib.PurePosixPath("not/allowed")}, plain)
    with pytest.raises(ValueError, match="objects other than tensors"):
        read_dit_checkpoint(plain)


@pytest.mark.parametrize("prefix", ["module.", "model.", "_orig_mod."])
def test_both_importers_read_files_alike_mapped_and_without_a_wrapper_prefix(tmp_path, prefix):
    """The Wan and DiT importers share one reader: the same wrapper prefixes come off (``model.`` included),
    and a ``.pt`` file is memory-mapped, not read into memory."""
    sd = original_checkpoint()
    path = tmp_path / "wrapped.pt"
    torch.save({prefix + k: v for k, v in sd.items()}, path)
    for read in (read_dit_checkpoint, read_checkpoint):
        tensors = read(path)
        assert sorted(tensors) == sorted(sd), read.__name__
        if os.path.exists("/proc/self/maps"):
            assert outside(tensors, path) == [], f"{read.__name__} copied the file into memory"
    torch.testing.assert_close(run(load_original_dit(path, num_heads=4), dit_inputs()), reference(sd, dit_inputs()))


def test_unknown_and_missing_keys_are_named():
    sd = original_checkpoint(block_tokens=4)
    extra = dict(sd, **{"blocks.1.attn.gate.weight": torch.ones(64), "extra.thing": torch.ones(1)})
    with pytest.raises(ValueError, match=r"unknown keys \['blocks.1.attn.gate.weight', 'extra.thing'\]"):
        load_original_dit(extra, num_heads=4)
    missing = dict(sd)
    del missing["blocks.0.attn.lepe.bias"]
    del missing["t_embedder.mlp.2.weight"]
    with pytest.raises(ValueError, match=r"missing keys \['blocks.0.attn.lepe.bias', 't_embedder.mlp.2.weight'\]"):
        load_original_dit(missing, num_heads=4)
    mixed = dict(sd, **{"blocks.1.attn.proj.weight": torch.ones(64, 64)})  # a softmax key in an MHLA block
    with pytest.raises(ValueError, match=r"unknown keys \['blocks.1.attn.proj.weight'\]"):
        load_original_dit(mixed, num_heads=4)
    qk = dict(sd, **{"blocks.0.attn.q_norm.weight": torch.ones(64), "blocks.0.attn.k_norm.weight": torch.ones(64)})
    with pytest.raises(ValueError, match="qk_norm .* not supported"):
        load_original_dit(qk, num_heads=4)
    shapes = dict(sd, **{"blocks.1.mlp.fc1.weight": torch.ones(128, 64), "blocks.1.mlp.fc1.bias": torch.ones(128)})
    with pytest.raises(ValueError, match=r"wrong shapes .*transformer_blocks.1.ff.net.0.proj.weight"):
        load_original_dit(shapes, num_heads=4)


def test_heads_layout_and_sizes_are_checked():
    sd = original_checkpoint()
    with pytest.raises(ValueError, match="number of heads is not in the checkpoint"):
        load_original_dit(sd)
    with pytest.raises(ValueError, match="DiT-S/2 has depth 12, hidden size 384"):
        load_original_dit(sd, model_size="DiT-S/2")
    with pytest.raises(ValueError, match="not image size 256"):
        load_original_dit(sd, num_heads=4, image_size=256)
    assert load_original_dit(sd, num_heads=4, image_size=64).config.sample_size == 8
    assert dit_model_size("DiT-XL-2") == dit_model_size("xl/2") == dit_model_size("DiT-XL/2")
    assert dit_model_size("DiT-XL/2").num_heads == 16 and dit_model_size("DiT-L/2-half-small-head").num_heads == 8
    with pytest.raises(ValueError, match="unknown DiT model size"):
        dit_model_size("DiT-XXL/2")
    bad_mixing = original_checkpoint(latent=8, block_tokens=4)
    for i in range(2):
        bad_mixing[f"blocks.{i}.attn.piece_attn.conv.weight"] = torch.rand(8, 8, 1, 1)
    with pytest.raises(ValueError, match="8x8 mixing does not split the 4x4 token grid"):
        load_original_dit(bad_mixing, num_heads=4)
    moved = dict(sd, pos_embed=sincos_table(64, 4).roll(1, dims=1))
    with pytest.raises(ValueError, match="pos_embed differs from the fixed 2-D sin-cos table"):
        load_original_dit(moved, num_heads=4)


def test_import_dit_cli_mhla_folder_reloads(tmp_path, capsys):
    sd = original_checkpoint(block_tokens=4)
    checkpoint = tmp_path / "dit_mhla.safetensors"
    save_file(sd, checkpoint)
    out = tmp_path / "transformer"
    assert main(["import-dit", str(checkpoint), "--output", str(out), "--num-heads", "4"]) == 0
    printed = capsys.readouterr().out
    assert "MHLA on 2 of 2" in printed and "4 heads" in printed
    assert json.loads((out / "config.json").read_text())["mhla"]["normalization"] == "scalar_mixed_denominator"
    inputs = dit_inputs()
    expected = reference(sd, inputs, block_tokens=4)
    for loaded in (load_mhla(out), load_transformer_file(out)):
        assert get_mhla_conversion(loaded).layout == (2, 2)
        torch.testing.assert_close(run(loaded, inputs), expected, rtol=1e-5, atol=1e-5)
    assert main(["import-dit", str(checkpoint), "--output", str(out), "--num-heads", "4"]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert main(["import-dit", str(checkpoint), "--output", str(out), "--num-heads", "4", "--overwrite"]) == 0


def test_import_dit_cli_plain_folder_reloads(tmp_path, capsys):
    sd = original_checkpoint()
    checkpoint = tmp_path / "DiT-tiny.pt"
    torch.save(sd, checkpoint)
    out = tmp_path / "transformer"
    assert main(["import-dit", str(checkpoint), "--output", str(out), "--num-heads", "4", "--image-size", "64"]) == 0
    assert "no MHLA keys" in capsys.readouterr().out
    assert not (out / "mhla_config.json").exists()
    config = json.loads((out / "config.json").read_text())
    assert config["_class_name"] == "DiTTransformer2DModel" and config["timestep_freq_shift"] == 0
    inputs = dit_inputs()
    expected = reference(sd, inputs)
    for loaded in (load_transformer(out), load_transformer_file(out), MHLADiTTransformer2DModel.from_pretrained(out)):
        torch.testing.assert_close(run(loaded, inputs), expected, rtol=1e-5, atol=1e-5)
    stock = DiTTransformer2DModel.from_pretrained(out)  # loads, but Diffusers ignores timestep_freq_shift
    assert (
        stock.config.timestep_freq_shift == 0
        and stock.transformer_blocks[0].norm1.emb.time_proj.downscale_freq_shift == 1
    )
    assert main(["import-dit", str(checkpoint), "--output", str(out), "--num-heads", "4"]) == 2
    assert "not an empty folder" in capsys.readouterr().err
    mhla_checkpoint = tmp_path / "dit_mhla.pt"
    torch.save(original_checkpoint(block_tokens=4), mhla_checkpoint)
    assert main(["import-dit", str(mhla_checkpoint), "--output", str(out), "--num-heads", "4", "--overwrite"]) == 0
    assert main(["import-dit", str(checkpoint), "--output", str(out), "--num-heads", "4", "--overwrite"]) == 0
    assert "mhla" not in json.loads((out / "config.json").read_text())  # the plain import replaced the MHLA one
    torch.testing.assert_close(run(load_transformer_file(out), inputs), expected, rtol=1e-5, atol=1e-5)
    assert main(["import-dit", str(checkpoint), "--output", str(tmp_path / "o"), "--model-size", "DiT-S/2"]) == 2
    assert "DiT-S/2 has depth 12" in capsys.readouterr().err


def test_import_dit_then_class_to_image(pipeline_dirs, tmp_path, capsys):
    sd = original_checkpoint(latent=8, num_classes=1000, block_tokens=4)  # fits the tiny DiT pipeline's VAE and labels
    checkpoint = tmp_path / "dit_mhla.pt"
    torch.save({"model": sd, "ema": sd, "args": argparse.Namespace(block_size=4)}, checkpoint)
    out = tmp_path / "transformer"
    assert main(["import-dit", str(checkpoint), "--output", str(out), "--num-heads", "4"]) == 0
    capsys.readouterr()
    assert (
        main(
            [
                "class-to-image",
                "--model",
                str(pipeline_dirs["dit"]),
                "--transformer",
                str(out),
                "--class",
                "goldfish",
                "--steps",
                "2",
                "--output-dir",
                str(tmp_path / "images"),
            ]
        )
        == 0
    )
    settings = json.loads((tmp_path / "images" / "000-goldfish-seed0-mhla.json").read_text())
    assert settings["transformer"] == str(out) and settings["attention"] == "mhla"


@pytest.mark.parametrize("name", ["random.pt", "random.safetensors"])
def test_import_dit_of_a_corrupt_file_is_one_line_without_unsafe_advice(tmp_path, capsys, name):
    checkpoint, out = tmp_path / name, tmp_path / "transformer"
    checkpoint.write_bytes(random.Random(0).randbytes(4096))  # e.g. a truncated download
    assert main(["import-dit", str(checkpoint), "--output", str(out), "--num-heads", "4"]) == 2
    assert capsys.readouterr().err == (
        f"mhla import-dit: error: {checkpoint} is not a readable PyTorch/safetensors "
        "checkpoint (corrupt or truncated?)\n"
    )
    assert not out.exists()


def test_a_checkpoint_with_other_objects_is_refused_naming_them_not_advising_unsafe_loading(tmp_path, capsys):
    checkpoint, out = tmp_path / "dit.pt", tmp_path / "transformer"
    torch.save({"model": original_checkpoint(), "args": pathlib.PurePosixPath("not/allowed")}, checkpoint)
    assert main(["import-dit", str(checkpoint), "--output", str(out), "--num-heads", "4"]) == 2
    assert capsys.readouterr().err == (
        f"mhla import-dit: error: {checkpoint} holds objects other than tensors and plain "
        "values (pathlib.PurePosixPath), which are not loaded\n"
    )
    assert not out.exists()
