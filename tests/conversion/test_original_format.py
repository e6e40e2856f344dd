"""Import of original-format Wan checkpoints (the released MHLA-Wan format), on synthetic tiny ones."""

from __future__ import annotations

import json
import os
import random

import pytest
import torch
from safetensors.torch import save_file

from helpers.models import run, wan_inputs
from helpers.original_format import i2v_inputs, outside, released_model, to_original
from mhla_diffusion import MHLAConfig, MHLAWanTransformer3DModel, get_mhla_conversion
from mhla_diffusion.benchmarks.load import in_weight_file_mapping
from mhla_diffusion.loaders.original_wan import (
    empty_original_wan,
    empty_wan_transformer,
    load_original_wan,
    original_wan_config,
    read_checkpoint,
    rename_original_wan_keys,
)
from mhla_diffusion.models.processors.base import kept_in_fp32
from mhla_diffusion.models.tiny import tiny_wan_transformer
from mhla_diffusion.utils.wan_configs import WAN_TRANSFORMER_CONFIGS, wan_transformer_config


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


# ---- image-to-video keys, config inference, sharded files ------------------------------------------------------

I2V = dict(in_channels=36, image_dim=20, added_kv_proj_dim=24)  # tiny widths, the I2V key structure
FLF2V = dict(I2V, pos_embed_seq_len=8)


@pytest.mark.parametrize("options", [I2V, FLF2V], ids=["i2v", "flf2v"])
def test_image_to_video_checkpoint_round_trip(tmp_path, options):
    model = released_model(gate=True, **options)
    original = to_original(model)
    image_keys = {
        "img_emb.proj.0.weight",
        "img_emb.proj.1.weight",
        "img_emb.proj.3.weight",
        "img_emb.proj.4.bias",
        "blocks.2.cross_attn.k_img.weight",
        "blocks.2.cross_attn.v_img.bias",
        "blocks.2.cross_attn.norm_k_img.weight",
    }
    assert image_keys <= set(original)
    assert ("img_emb.emb_pos" in original) == ("pos_embed_seq_len" in options)
    path = tmp_path / "i2v.safetensors"
    save_file(original, path)
    imported = load_original_wan(path, layout=(2, 2, 3), attention_head_dim=12, rope_max_seq_len=32)
    for key, value in options.items():
        assert imported.config[key] == value
    assert get_mhla_conversion(imported).layers == [1, 2]
    inputs = i2v_inputs(model)
    torch.testing.assert_close(run(imported, inputs), run(model, inputs), rtol=0, atol=0)
    # the image branch is live: other image tokens change the output
    other = dict(inputs, encoder_hidden_states_image=inputs["encoder_hidden_states_image"] + 1)
    assert not torch.equal(run(imported, other), run(imported, inputs))


def test_image_to_video_key_problems_are_listed():
    original = to_original(released_model(gate=False, **I2V))
    bad = dict(original)
    del bad["blocks.2.cross_attn.k_img.bias"]
    bad["blocks.1.cross_attn.norm_k_img.weight"] = torch.ones(25)  # wrong shape
    bad["img_emb.proj.1.weight"] = torch.ones(20, 21)  # wrong shape
    with pytest.raises(ValueError) as info:
        load_original_wan(bad, layout=(2, 2, 3), attention_head_dim=12)
    message = str(info.value)
    assert "missing keys ['blocks.2.attn2.add_k_proj.bias']" in message
    assert "blocks.1.attn2.norm_added_k.weight: saved (25,) vs model (24,)" in message
    assert "condition_embedder.image_embedder.ff.net.0.proj.weight: saved (20, 21) vs model (20, 20)" in message
    unknown = dict(original, **{"blocks.0.cross_attn.q_img.weight": torch.ones(24, 24)})
    with pytest.raises(
        ValueError, match=r"no original-Wan \(T2V, I2V\) or MHLA key: \['blocks.0.cross_attn.q_img.weight'\]"
    ):
        load_original_wan(unknown, layout=(2, 2, 3), attention_head_dim=12)
    # image keys in some blocks only: the blocks without them are named, not silently left at their init
    partial = {k: v for k, v in original.items() if not k.startswith("blocks.0.cross_attn.") or "_img" not in k}
    with pytest.raises(ValueError, match=r"missing keys \['blocks.0.attn2.add_k_proj.bias'"):
        load_original_wan(partial, layout=(2, 2, 3), attention_head_dim=12)


def test_given_config_is_checked_against_the_checkpoint():
    model = tiny_wan_transformer(num_layers=2, **I2V)
    original = to_original(model)
    config = dict(model.config)  # a saved config.json's contents, `_class_name` and all
    imported = load_original_wan(original, config=config)
    assert torch.equal(run(imported, i2v_inputs(model)), run(model, i2v_inputs(model)))
    with pytest.raises(ValueError, match=r"ffn_dim: checkpoint 32, config 64; image_dim: checkpoint 20, config None"):
        load_original_wan(original, config=dict(config, ffn_dim=64, image_dim=None))
    with pytest.raises(ValueError, match=r"width: checkpoint 24, config 3 heads x 12"):
        load_original_wan(original, config=dict(config, num_attention_heads=3))
    with pytest.raises(ValueError, match="attention_head_dim 8 contradicts the given config's 12"):
        load_original_wan(original, config=config, attention_head_dim=8)


def _shard(original: dict, folder, index: bool = True) -> dict[str, str]:
    """Write ``original`` as two safetensors shards (+ their index); returns the weight map."""
    keys = sorted(original)
    weight_map = {
        k: ("model-00001-of-00002.safetensors" if i % 2 else "model-00002-of-00002.safetensors")
        for i, k in enumerate(keys)
    }
    for name in set(weight_map.values()):
        save_file({k: original[k] for k in keys if weight_map[k] == name}, folder / name)
    if index:
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return weight_map


def test_sharded_checkpoint_by_folder_or_index(tmp_path):
    model = released_model(gate=True)
    _shard(to_original(model), tmp_path)
    (tmp_path / "Wan2.1_VAE.pth").write_bytes(b"not a transformer")  # other files of an original Wan folder are ignored
    expected = run(model, wan_inputs())
    for source in (tmp_path, tmp_path / "model.safetensors.index.json"):
        imported = load_original_wan(source, layout=(2, 2, 3), attention_head_dim=12, rope_max_seq_len=32)
        assert torch.equal(run(imported, wan_inputs()), expected)


def test_sharded_checkpoint_problems_are_named(tmp_path):
    original = to_original(released_model(gate=True))
    weight_map = _shard(original, tmp_path)
    index = tmp_path / "model.safetensors.index.json"
    extra = {"blocks.9.ffn.0.weight": "model-00001-of-00002.safetensors"}
    index.write_text(json.dumps({"weight_map": dict(weight_map, **extra)}))
    with pytest.raises(ValueError, match=r"listed but absent \['blocks.9.ffn.0.weight'\]"):
        read_checkpoint(tmp_path)
    index.write_text(json.dumps({"weight_map": dict(weight_map, x="model-00003-of-00003.safetensors")}))
    with pytest.raises(FileNotFoundError, match=r"missing from .*\['model-00003-of-00003.safetensors'\]"):
        read_checkpoint(index)
    index.unlink()  # a folder without an index: every .safetensors file in it, and none may repeat a key
    save_file({"head.head.bias": original["head.head.bias"]}, tmp_path / "extra.safetensors")
    with pytest.raises(ValueError, match=r"1 keys occur in more than one of .*: \['head.head.bias \(model-0000"):
        read_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="holds no .safetensors files nor a shard index"):
        read_checkpoint(_empty_dir(tmp_path))
    with pytest.raises(ValueError, match="unsupported checkpoint"):
        read_checkpoint(_touch(tmp_path / "weights.npz"))


def _empty_dir(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    return empty


def _touch(path):
    path.write_bytes(b"")
    return path


# ---- memory: the import maps the file and adds no second copy ----------------------------------------------------

needs_proc_maps = pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux /proc/self/maps")


@needs_proc_maps
@pytest.mark.parametrize("form", ["safetensors", "pt"])
def test_import_in_the_file_dtype_uses_the_mapped_file_itself(tmp_path, form):
    model = released_model(gate=True, lepe=True)
    path = tmp_path / f"ckpt.{form}"
    (save_file if form == "safetensors" else torch.save)(to_original(model), path)
    for dtype in (None, torch.float32):
        imported = load_original_wan(path, layout=(2, 2, 3), attention_head_dim=12, rope_max_seq_len=32, dtype=dtype)
        tensors = dict(imported.named_parameters())
        assert any(in_weight_file_mapping(tensors.values(), [path])), f"{path} is not memory-mapped"
        assert len(tensors) == len(model.state_dict())
        assert outside(tensors, path) == []  # every parameter, MHLA mixing included, is the file's data
        assert torch.equal(run(imported, wan_inputs()), run(model, wan_inputs()))
        del imported


@needs_proc_maps
def test_import_in_another_dtype_converts_each_tensor_once(tmp_path):
    model = released_model(gate=True)
    path = tmp_path / "ckpt.safetensors"
    save_file(to_original(model), path)
    imported = load_original_wan(
        path, layout=(2, 2, 3), attention_head_dim=12, rope_max_seq_len=32, dtype=torch.bfloat16
    )
    keep = imported._keep_in_fp32_modules
    params = dict(imported.named_parameters())
    # as Diffusers' from_pretrained keeps them, and MHLA's mixing and norms (processors.base.FP32_PARAMETERS)
    fp32 = {n for n, p in params.items() if any(part in keep for part in n.split(".")) or kept_in_fp32(n)}
    assert fp32 and "blocks.0.norm2.weight" in fp32 and "scale_shift_table" in fp32
    assert "blocks.1.attn1.processor.mixing" in fp32
    assert {n for n, p in params.items() if p.dtype == torch.float32} == fp32
    assert all(p.dtype == torch.bfloat16 for n, p in params.items() if n not in fp32)
    assert outside({n: params[n] for n in fp32}, path) == []  # unchanged dtype: still the file's data
    assert outside(
        {"blocks.1.attn1.processor.gate.weight": params["blocks.1.attn1.processor.gate.weight"]}, path
    )  # converted: a new tensor
    # a bfloat16 file imported as stored stays bfloat16 and mapped
    bf16_path = tmp_path / "bf16.safetensors"
    save_file({k: v.to(torch.bfloat16) for k, v in to_original(model).items()}, bf16_path)
    stored = load_original_wan(bf16_path, layout=(2, 2, 3), attention_head_dim=12, rope_max_seq_len=32)
    assert {p.dtype for p in stored.parameters()} == {torch.bfloat16}
    assert outside(dict(stored.named_parameters()), bf16_path) == []


PEAK_SCRIPT = """
import torch
from mhla_diffusion.loaders.original_wan import load_original_wan
def status(field):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(field + ":"))
load_original_wan({warm!r}, attention_head_dim=12, dtype=torch.float32)  # warm up: lazy imports, first allocations
try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
except OSError as error:
    print("NO_CLEAR_REFS", error)
    raise SystemExit(0)
start = status("VmRSS")
imported = load_original_wan({path!r}, attention_head_dim=48, dtype=torch.bfloat16)
print(status("VmHWM") - start)
"""


@pytest.mark.slow
@needs_proc_maps
def test_peak_memory_of_a_dtype_import_is_the_file_plus_the_converted_copy(tmp_path):
    """fp32 -> bf16: the mapped file's pages (its size, reclaimable page cache) plus the bf16 copy (half of
    it), 1.5 x the file; reading the file into memory and loading an fp32 model before casting (the
    previous import) took 2 x the file."""
    import subprocess
    import sys

    path, warm = tmp_path / "mid.safetensors", tmp_path / "warm.safetensors"
    model = tiny_wan_transformer(num_layers=6, num_attention_heads=8, attention_head_dim=48, ffn_dim=4096, text_dim=384)
    save_file(to_original(model), path)
    save_file(to_original(tiny_wan_transformer()), warm)
    file_bytes = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    del model
    assert file_bytes > 100e6  # big enough that the bound below is not lost in allocator noise
    script = PEAK_SCRIPT.format(path=str(path), warm=str(warm))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    if "NO_CLEAR_REFS" in result.stdout:
        pytest.skip(f"this system does not let a process reset its peak RSS: {result.stdout}")
    peak = int(result.stdout.split()[-1])
    assert peak < 1.5 * file_bytes + 24e6, f"peak {peak / 1e6:.0f} MB for a {file_bytes / 1e6:.0f} MB file"


def test_legacy_torch_file_is_read_whole_with_a_warning(tmp_path):
    model = released_model(gate=False)
    path = tmp_path / "legacy.pt"
    torch.save(to_original(model), path, _use_new_zipfile_serialization=False)
    with pytest.warns(UserWarning, match="legacy .non-zip. format, which cannot be memory-mapped"):
        imported = load_original_wan(path, layout=(2, 2, 3), attention_head_dim=12, rope_max_seq_len=32)
    assert torch.equal(run(imported, wan_inputs()), run(model, wan_inputs()))


# ---- full-size checkpoints, on the meta device (keys and shapes only, no memory) --------------------------------


@pytest.mark.parametrize("name", list(WAN_TRANSFORMER_CONFIGS))
def test_published_models_import_strictly_at_full_size(name):
    """Each published model's original-format keys and shapes (made on the meta device) map onto exactly the
    Diffusers model with MHLA that the importer infers, and the inferred config is the published one."""
    published = wan_transformer_config(name)
    source = empty_wan_transformer(published, MHLAConfig.released_wan(layers="hybrid"))
    original = to_original(source)
    assert all(t.is_meta for t in original.values())
    if published["image_dim"]:
        image_keys = {
            "img_emb.proj.1.weight",
            "blocks.39.cross_attn.k_img.weight",
            "blocks.0.cross_attn.norm_k_img.weight",
        }
        assert image_keys <= set(original)
    renamed = rename_original_wan_keys(original)
    assert original_wan_config(renamed) == published
    imported = empty_original_wan(renamed)  # raises listing every missing / unexpected / wrongly shaped key
    assert {k: imported.config[k] for k in published} == published
    assert get_mhla_conversion(imported).config == get_mhla_conversion(source).config
    expected = {k: tuple(v.shape) for k, v in source.state_dict().items()}
    assert {k: tuple(v.shape) for k, v in imported.state_dict().items()} == expected


# ---- the command ---------------------------------------------------------------------------------------------------


def test_import_wan_command_with_config_and_dtype(tmp_path, capsys):
    from mhla_diffusion.cli import main

    model = released_model(gate=True, **I2V)
    checkpoint = tmp_path / "i2v.safetensors"
    save_file(to_original(model), checkpoint)
    config = tmp_path / "config.json"
    config.write_text(json.dumps(dict(model.config, _class_name="WanTransformer3DModel")))
    out = tmp_path / "transformer"
    assert (
        main(
            [
                "import-wan",
                str(checkpoint),
                "--output",
                str(out),
                "--layout",
                "2x2x3",
                "--config",
                str(config),
                "--dtype",
                "bfloat16",
            ]
        )
        == 0
    )
    assert "MHLA on 2 of 3" in capsys.readouterr().out
    reloaded = MHLAWanTransformer3DModel.from_pretrained(out, torch_dtype=torch.bfloat16)
    assert reloaded.config.image_dim == 20 and get_mhla_conversion(reloaded).layers == [1, 2]
    saved = {}
    for file in out.glob("*.safetensors"):
        saved.update(read_checkpoint(file))
    assert saved["blocks.1.attn1.processor.gate.weight"].dtype == torch.bfloat16
    assert saved["blocks.1.attn2.add_k_proj.weight"].dtype == torch.bfloat16
    assert saved["blocks.1.norm2.weight"].dtype == torch.float32  # Diffusers' keep-in-fp32 modules
    inputs = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in i2v_inputs(model).items()}
    torch.testing.assert_close(run(reloaded, inputs).float(), run(model, i2v_inputs(model)), rtol=0.05, atol=0.05)
    # a published config that does not fit, and a name that is none, are refused before anything is written
    for config_spec, message in (
        (
            "Wan2.1-I2V-14B-480P",
            "does not fit the given config (text_dim: checkpoint 32, config 4096; ffn_dim: checkpoint 32, config 13824",
        ),
        ("Wan9-T2V", "neither a config.json nor a published config"),
    ):
        assert (
            main(
                [
                    "import-wan",
                    str(checkpoint),
                    "--output",
                    str(tmp_path / "other"),
                    "--layout",
                    "2x2x3",
                    "--config",
                    config_spec,
                ]
            )
            == 2
        )
        assert message in capsys.readouterr().err
        assert not (tmp_path / "other").exists()


def test_published_config_names():
    assert (
        wan_transformer_config("Wan-AI/Wan2.1-I2V-14B-720P-Diffusers") == WAN_TRANSFORMER_CONFIGS["Wan2.1-I2V-14B-720P"]
    )
    config = wan_transformer_config("wan2.1-t2v-1.3b")
    config["num_layers"] = 1  # a copy: the published dict stays as it is
    assert WAN_TRANSFORMER_CONFIGS["Wan2.1-T2V-1.3B"]["num_layers"] == 30
    with pytest.raises(ValueError, match="known: Wan2.1-T2V-1.3B, Wan2.1-T2V-14B"):
        wan_transformer_config("Wan2.1-T2V-2B")


@pytest.mark.parametrize("name", ["random.safetensors", "random.pt"])
def test_import_wan_of_a_corrupt_file_is_one_line_naming_it(tmp_path, capsys, name):
    from mhla_diffusion.cli import main

    checkpoint, out = tmp_path / name, tmp_path / "transformer"
    checkpoint.write_bytes(random.Random(0).randbytes(4096))  # e.g. a truncated download
    assert main(["import-wan", str(checkpoint), "--output", str(out)]) == 2
    assert capsys.readouterr().err == (
        f"mhla import-wan: error: {checkpoint} is not a readable PyTorch/safetensors "
        "checkpoint (corrupt or truncated?)\n"
    )
    assert not out.exists()
