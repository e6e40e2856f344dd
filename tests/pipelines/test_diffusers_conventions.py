"""Diffusers conventions a Diffusers user tries on our pipelines and folders: ``from_pipe``, Diffusers' own
loaders (``AutoModel``, ``DiffusionPipeline``), processors swapped by hand, ``softmax_attention()``, pickled
(``.bin``) saves, LoRA state dicts, Wan2.2-A14B settings files, imported and from-scratch DiT folders.

No path may run softmax attention where MHLA weights were given without an error or a warning that says so.
"""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch
from diffusers import AutoModel, DiffusionPipeline, DiTPipeline, WanPipeline
from diffusers.models.transformers.transformer_wan import WanAttnProcessor

from helpers.models import WAN_CALL, seeded
from helpers.original_dit import original_checkpoint
from helpers.wan_family import call_args
from mhla_diffusion import get_mhla_conversion, load_mhla, load_transformer
from mhla_diffusion.cli import main
from mhla_diffusion.models.tiny import tiny_dit_pipeline, tiny_dit_transformer
from mhla_diffusion.models.transformers import MHLADiTTransformer2DModel, MHLAWanTransformer3DModel
from mhla_diffusion.pipelines import MHLADiTPipeline, MHLAWanPipeline


@pytest.fixture
def diffusers_log():
    """The messages Diffusers logs (warnings and above) during the test, as Diffusers' handler would print them."""
    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler, logger = Collect(logging.WARNING), logging.getLogger("diffusers")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def _mhla_folder(kind: str, pipeline_dirs, tmp_path, **save_kwargs):
    """A pipeline folder saved by our pipeline with MHLA.

    Converted in place, as `from_pretrained(mhla_weights=)` does.
    """
    cls = MHLAWanPipeline if kind == "wan" else MHLADiTPipeline
    pipe = cls.from_pretrained(pipeline_dirs[kind], mhla_weights=pipeline_dirs[f"{kind}_mhla"])
    pipe.save_pretrained(tmp_path / "saved", **save_kwargs)
    return pipe, tmp_path / "saved"


def _generate(pipe, kind: str) -> np.ndarray:
    if kind == "wan":
        return pipe(**WAN_CALL, generator=seeded()).frames[0]
    return pipe(class_labels=[1, 2], num_inference_steps=2, generator=seeded(), output_type="np").images


@pytest.mark.parametrize("kind", ["wan", "dit"])
def test_from_pipe_keeps_and_type_checks_the_mhla_transformer(kind, pipeline_dirs, tmp_path):
    cls = MHLAWanPipeline if kind == "wan" else MHLADiTPipeline
    mhla_class = MHLAWanTransformer3DModel if kind == "wan" else MHLADiTTransformer2DModel
    _, folder = _mhla_folder(kind, pipeline_dirs, tmp_path)
    loaded = cls.from_pretrained(folder)
    assert type(loaded.transformer) is mhla_class
    again = cls.from_pipe(loaded)
    assert again.transformer is loaded.transformer and again.mhla == loaded.mhla is not None
    np.testing.assert_array_equal(_generate(again, kind), _generate(loaded, kind))
    other = MHLADiTTransformer2DModel if kind == "wan" else MHLAWanTransformer3DModel
    assert mhla_class in cls._get_signature_types()["transformer"]
    assert other not in cls._get_signature_types()["transformer"]  # still type-checked


@pytest.mark.parametrize("kind", ["wan", "dit"])
def test_stock_from_pipe_says_it_drops_the_mhla_transformer_and_takes_it_passed(
    kind, pipeline_dirs, tmp_path, diffusers_log
):
    """Diffusers' from_pipe keeps a model component only of exactly a listed type: the stock pipeline cannot keep
    our MHLA transformer class. Its warning says so and names the two calls that work; both keep MHLA."""
    _, folder = _mhla_folder(kind, pipeline_dirs, tmp_path)
    cls = MHLAWanPipeline if kind == "wan" else MHLADiTPipeline
    stock = WanPipeline if kind == "wan" else DiTPipeline
    loaded = cls.from_pretrained(folder)
    if kind == "wan":
        assert stock.from_pipe(loaded).transformer is None
    else:
        with pytest.raises(ValueError, match="expected"):  # DiTPipeline's transformer is not optional
            stock.from_pipe(loaded)
    warning = next(m for m in diffusers_log if m.startswith("component transformer is not switched over"))
    assert "Diffusers' from_pipe keeps a model only when its type is exactly one" in warning
    assert f"{cls.__name__}" in warning and "from_pipe(pipe, transformer=pipe.transformer)" in warning
    passed = stock.from_pipe(loaded, transformer=loaded.transformer)
    assert passed.transformer is loaded.transformer and get_mhla_conversion(passed.transformer) == loaded.mhla
    np.testing.assert_array_equal(_generate(passed, kind), _generate(loaded, kind))


@pytest.mark.parametrize("kind", ["wan", "dit"])
@pytest.mark.parametrize("saved_by", ["converted in place", "reloaded MHLA class"])
def test_automodel_reads_every_mhla_folder_alike(kind, saved_by, pipeline_dirs, tmp_path, diffusers_log):
    """Diffusers' AutoModel looks a transformer folder's class up in `diffusers` only: it loads softmax, and its
    warning says so and names the loader, whether the folder was saved by a converted stock transformer or by
    our MHLA class (a pipeline loaded from an MHLA folder). Through the pipeline folder's model_index.json
    (`subfolder="transformer"`) it finds our class and loads MHLA."""
    pipe, folder = _mhla_folder(kind, pipeline_dirs, tmp_path)
    if saved_by == "reloaded MHLA class":
        cls = MHLAWanPipeline if kind == "wan" else MHLADiTPipeline
        pipe = cls.from_pretrained(folder)
        assert type(pipe.transformer).__name__.startswith("MHLA")
        folder = tmp_path / "resaved"
        pipe.save_pretrained(folder)
    model = AutoModel.from_pretrained(str(folder / "transformer"))
    assert get_mhla_conversion(model) is None
    warning = next(m for m in diffusers_log if "were not used" in m)
    assert "loaded with softmax attention" in warning and "load_mhla(folder)" in warning
    assert get_mhla_conversion(load_mhla(folder / "transformer")) == pipe.mhla  # the call it names
    assert get_mhla_conversion(AutoModel.from_pretrained(str(folder), subfolder="transformer")) == pipe.mhla


def test_diffusion_pipeline_ignoring_mhla_weights_names_our_pipelines(pipeline_dirs, diffusers_log):
    pipe = DiffusionPipeline.from_pretrained(str(pipeline_dirs["wan"]), mhla_weights=str(pipeline_dirs["wan_mhla"]))
    assert get_mhla_conversion(pipe.transformer) is None
    warning = next(m for m in diffusers_log if "will be ignored" in m)
    assert "runs softmax attention" in warning and "MHLAWanPipeline" in warning and "MHLADiTPipeline" in warning


def test_processors_swapped_by_hand_are_what_pipe_mhla_reports(pipeline_dirs, tmp_path):
    pipe = MHLAWanPipeline.from_pretrained(pipeline_dirs["wan"], mhla_weights=pipeline_dirs["wan_mhla"])
    layers = pipe.mhla.layers
    pipe.transformer.blocks[0].attn1.set_processor(WanAttnProcessor())  # one layer back to softmax
    assert pipe.mhla.layers == layers[1:] and pipe.mhla.layer_names == ["blocks.1.attn1"]
    frames = _generate(pipe, "wan")
    pipe.save_pretrained(tmp_path / "partial")
    reloaded = MHLAWanPipeline.from_pretrained(tmp_path / "partial")
    assert reloaded.mhla.layers == layers[1:]
    np.testing.assert_array_equal(_generate(reloaded, "wan"), frames)

    pipe.transformer.set_attn_processor(WanAttnProcessor())  # every layer
    assert pipe.mhla is None and pipe.mhla_conversions == {"transformer": None}
    pipe.save_pretrained(tmp_path / "softmax")
    index = json.loads((tmp_path / "softmax" / "model_index.json").read_text())
    assert index["transformer"] == ["diffusers", "WanTransformer3DModel"]
    assert not (tmp_path / "softmax" / "transformer" / "mhla_config.json").exists()
    assert MHLAWanPipeline.from_pretrained(tmp_path / "softmax").mhla is None


def test_pipe_mhla_inside_softmax_attention_is_none(pipeline_dirs):
    pipe = MHLAWanPipeline.from_pretrained(pipeline_dirs["wan"], mhla_weights=pipeline_dirs["wan_mhla"])
    conversion = pipe.mhla
    with pipe.softmax_attention():
        assert pipe.mhla is None and pipe.mhla_conversions == {"transformer": None}
    assert pipe.mhla == conversion


@pytest.mark.parametrize("kind", ["wan", "dit"])
def test_a_pickled_save_reloads_with_mhla(kind, pipeline_dirs, tmp_path):
    pipe, folder = _mhla_folder(kind, pipeline_dirs, tmp_path, safe_serialization=False)
    assert (folder / "transformer" / "diffusion_pytorch_model.bin").is_file()
    assert not (folder / "transformer" / "diffusion_pytorch_model.safetensors").exists()
    cls = MHLAWanPipeline if kind == "wan" else MHLADiTPipeline
    reloaded = cls.from_pretrained(folder)
    assert reloaded.mhla == pipe.mhla
    np.testing.assert_array_equal(_generate(reloaded, kind), _generate(pipe, kind))


def _tiny_wan_lora(pipe) -> dict[str, torch.Tensor]:
    """A rank-1 LoRA state dict (Diffusers' key names) on block 0's self-attention query."""
    to_q = pipe.transformer.blocks[0].attn1.to_q
    return {
        "transformer.blocks.0.attn1.to_q.lora_A.weight": torch.zeros(1, to_q.in_features),
        "transformer.blocks.0.attn1.to_q.lora_B.weight": torch.zeros(to_q.out_features, 1),
    }


def test_a_lora_state_dict_is_loaded_with_a_warning_that_it_was_not_checked(pipeline_dirs):
    pipe = MHLAWanPipeline.from_pretrained(pipeline_dirs["wan"])
    with pytest.warns(
        UserWarning,
        match=r"load_lora_weights got a state dict, which carries no MHLA mark: .* pass "
        r"the local \.safetensors file",
    ):
        pipe.load_lora_weights(_tiny_wan_lora(pipe))


def test_a14b_settings_name_the_weights_folder_of_each_transformer(wan_family_dirs, tmp_path):
    variant = "wan2.2-a14b-t2v"
    weights = wan_family_dirs[f"{variant}-mhla"]
    args = call_args(variant, False)
    assert (
        main(
            [
                "text-to-video",
                "--model",
                str(wan_family_dirs[variant]),
                "--mhla-weights",
                str(weights),
                "--prompt",
                "x",
                "--num-frames",
                str(args["num_frames"]),
                "--height",
                str(args["height"]),
                "--width",
                str(args["width"]),
                "--steps",
                "1",
                "--max-sequence-length",
                "16",
                "--output-dir",
                str(tmp_path),
            ]
        )
        == 0
    )
    settings = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert settings["mhla_weights"] == str(weights)
    assert settings["mhla_weights_2"] == str(weights / "transformer_2")


def test_an_imported_dit_folder_loads_quietly_and_load_mhla_names_the_loader(tmp_path, diffusers_log):
    checkpoint = tmp_path / "DiT-tiny.pt"
    torch.save(original_checkpoint(), checkpoint)
    out = tmp_path / "transformer"
    assert main(["import-dit", str(checkpoint), "--output", str(out), "--num-heads", "4", "--image-size", "64"]) == 0
    for loaded in (load_transformer(out), MHLADiTTransformer2DModel.from_pretrained(out)):
        assert loaded.transformer_blocks[0].norm1.emb.time_proj.downscale_freq_shift == 0  # applied
    assert not [m for m in diffusers_log if "timestep_freq_shift" in m]
    with pytest.raises(
        FileNotFoundError,
        match=r"holds no MHLA layers; load a plain Diffusers transformer folder .* "
        r"with load_transformer\(folder\)",
    ):
        load_mhla(out)


def test_a_saved_dit_folder_reloads_without_an_id2label_warning(pipeline_dirs, tmp_path, diffusers_log):
    _, folder = _mhla_folder("dit", pipeline_dirs, tmp_path)
    assert json.loads((folder / "model_index.json").read_text())["id2label"]
    pipe = MHLADiTPipeline.from_pretrained(folder)
    assert pipe.labels and not [m for m in diffusers_log if "id2label" in m]


def test_a_dit_with_its_own_class_count_warns_on_save_that_stock_dit_needs_no_guidance(tmp_path):
    stock = tiny_dit_pipeline()
    pipe = MHLADiTPipeline(
        transformer=tiny_dit_transformer(num_embeds_ada_norm=2), vae=stock.vae, scheduler=stock.scheduler
    )
    with pytest.warns(
        UserWarning,
        match=r"DiT with 2 classes .* stock DiTPipeline guides with class 1000 .* only with "
        r"guidance_scale <= 1 \(with guidance it fails with IndexError\); load it "
        r"with mhla_diffusion.MHLADiTPipeline",
    ):
        pipe.save_pretrained(tmp_path / "two")
    reloaded = DiTPipeline.from_pretrained(tmp_path / "two")
    reloaded(
        class_labels=[1], guidance_scale=1.0, num_inference_steps=1, output_type="np"
    )  # what docs/generate.md says
    with pytest.raises(IndexError):
        reloaded(class_labels=[1], num_inference_steps=1, output_type="np")
    MHLADiTPipeline.from_pretrained(tmp_path / "two")(class_labels=[1], num_inference_steps=1, output_type="np")
