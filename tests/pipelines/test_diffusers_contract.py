"""The contract Diffusers' own test mixins check (``ModelTesterMixin``, ``PipelineTesterMixin``), on the MHLA classes.

A converted transformer round-trips through its own ``save_pretrained`` / ``from_pretrained`` in every format
Diffusers writes (safetensors, pickle, variants, shards), with the MHLA setting in its ``config.json``; folders of
the earlier release (``mhla_config.json``) still load; pipelines save and reload in those formats, and an MHLA-only
folder loads onto a base pipeline with ``load_mhla_weights``; ``MHLAWanPipeline.__call__`` shows ``WanPipeline``'s
signature; ``MHLADiTPipeline`` keeps Diffusers' callback contract and takes class labels in every form
``DiTPipeline`` does; MHLA's modules follow layerwise casting, and its float32 parameters ``_keep_in_fp32_modules``.
"""

from __future__ import annotations

import inspect
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.models import WAN_CALL, dit_inputs, run, seeded, wan_inputs
from mhla_diffusion import MHLAConfig, convert_to_mhla, get_mhla_conversion, revert_mhla
from mhla_diffusion.embedded.locations import embedded_model
from mhla_diffusion.loaders.weights import write_mhla_config
from mhla_diffusion.models.processors.base import FP32_PARAMETERS
from mhla_diffusion.models.tiny import tiny_dit_pipeline, tiny_dit_transformer, tiny_wan_pipeline, tiny_wan_transformer
from mhla_diffusion.models.transformers import MHLADiTTransformer2DModel, MHLAWanTransformer3DModel
from mhla_diffusion.pipelines import MHLADiTPipeline, MHLAWanPipeline

CLASSES = {"wan": MHLAWanTransformer3DModel, "dit": MHLADiTTransformer2DModel}
#: ``save_pretrained`` keyword arguments of each format Diffusers writes (and ``from_pretrained``'s ``variant``).
FORMATS = {
    "safetensors": {},
    "pickle": {"safe_serialization": False},
    "variant": {"variant": "fp16"},
    "sharded": {"max_shard_size": "20KB"},
}


def _settings(family: str) -> MHLAConfig:
    """The full MHLA setting of each family: every module with parameters of its own (LePE, gate, norms)."""
    if family == "wan":
        return MHLAConfig(layers="hybrid", layout=(2, 2, 2), lepe=True, gate=True, output_norm=True)
    return MHLAConfig.released_dit(layout=(2, 2), gate=True)


def _converted(family: str) -> torch.nn.Module:
    """A tiny transformer converted in place (a stock Diffusers class, as ``convert_to_mhla`` leaves it), every
    parameter moved off its initialisation (as after fine-tuning), so a parameter not loaded changes the output."""
    model = tiny_wan_transformer(num_layers=3) if family == "wan" else tiny_dit_transformer()
    convert_to_mhla(model, _settings(family))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.01 * torch.randn_like(parameter))
    return model


def _inputs(family: str) -> dict:
    return wan_inputs(3, 4, 4) if family == "wan" else dit_inputs()


def _assert_same_model(loaded: torch.nn.Module, model: torch.nn.Module, family: str) -> None:
    assert type(loaded) is CLASSES[family]
    assert get_mhla_conversion(loaded).config == get_mhla_conversion(model).config
    expected = model.state_dict()
    assert {key: torch.equal(value, expected[key]) for key, value in loaded.state_dict().items()} == {
        key: True for key in expected
    }
    assert torch.equal(run(loaded, _inputs(family)), run(model, _inputs(family)))


# ----------------------------------------------------------------------------- models


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("family", ["wan", "dit"])
def test_a_converted_model_round_trips_through_its_own_save_pretrained(family, fmt, tmp_path):
    model = _converted(family)
    model.save_pretrained(tmp_path, **FORMATS[fmt])
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["mhla"] == get_mhla_conversion(model).config.to_dict()
    assert not (tmp_path / "mhla_config.json").exists()  # one standard Diffusers folder
    loaded = CLASSES[family].from_pretrained(tmp_path, variant=FORMATS[fmt].get("variant"))
    _assert_same_model(loaded, model, family)
    loaded.save_pretrained(tmp_path / "again")  # and again from the MHLA class
    _assert_same_model(CLASSES[family].from_pretrained(tmp_path / "again"), model, family)


@pytest.mark.parametrize("family", ["wan", "dit"])
def test_the_mhla_classes_are_built_converted_from_their_config(family):
    """What Diffusers' mixins do: ``model_class(**init_dict)``, ``model_class.from_config(model.config)``."""
    stock = tiny_wan_transformer() if family == "wan" else tiny_dit_transformer()
    init = {key: value for key, value in stock.config.items() if not key.startswith("_")}
    model = CLASSES[family](**init, mhla=_settings(family).to_dict())
    conversion = get_mhla_conversion(model)
    assert conversion is not None and model.config["mhla"] == conversion.config.to_dict()
    again = CLASSES[family].from_config(model.config)
    assert get_mhla_conversion(again).config == conversion.config
    assert get_mhla_conversion(CLASSES[family](**init)) is None


def test_converting_and_reverting_keep_the_config_consistent():
    stock = tiny_wan_transformer(num_layers=3)
    conversion = convert_to_mhla(stock, MHLAConfig(layers="hybrid", layout=(2, 2, 2)))
    assert stock.config["mhla"]["layers"] == [1, 2] == conversion.layers  # resolved
    revert_mhla(stock)
    assert "mhla" not in stock.config  # a stock class has no such entry
    model = MHLAWanTransformer3DModel.from_config(stock.config, mhla=MHLAConfig(layout=(2, 2, 2)).to_dict())
    revert_mhla(model)
    assert model.config["mhla"] is None  # the MHLA class's default: softmax


@pytest.mark.parametrize("family", ["wan", "dit"])
def test_a_folder_of_the_earlier_release_still_loads(family, tmp_path):
    """The earlier release wrote Diffusers' folder of the stock class plus ``mhla_config.json``."""
    model = _converted(family)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("mhla", None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    write_mhla_config(model, tmp_path, contents="transformer")
    loaded = CLASSES[family].from_pretrained(tmp_path)
    _assert_same_model(loaded, model, family)
    assert loaded.config["mhla"] == get_mhla_conversion(model).config.to_dict()  # saved anew, config.json holds it
    embedded = MHLADiTTransformer2DModel.from_pretrained(embedded_model("class-to-image") / "transformer")
    assert embedded.config["mhla"] == get_mhla_conversion(embedded).config.to_dict()


def test_mhla_parameters_missing_from_the_checkpoint_are_an_error(tmp_path):
    model = _converted("wan")
    model.save_pretrained(tmp_path)
    weights = tmp_path / "diffusion_pytorch_model.safetensors"
    tensors = load_file(weights)
    del tensors["blocks.1.attn1.processor.mixing"]
    save_file(tensors, weights)
    with pytest.raises(
        ValueError, match=r"do not match its MHLA setting: missing keys \['blocks.1.attn1.processor.mixing'\]"
    ):
        MHLAWanTransformer3DModel.from_pretrained(tmp_path)


@pytest.mark.parametrize("family", ["wan", "dit"])
def test_loading_in_half_precision_keeps_the_float32_parameters(family, tmp_path):
    """MHLA's float32 parameters are ``_keep_in_fp32_modules`` of the MHLA classes: Diffusers keeps them float32."""
    model = _converted(family)
    model.save_pretrained(tmp_path)
    loaded = CLASSES[family].from_pretrained(tmp_path, torch_dtype=torch.bfloat16)
    assert set(FP32_PARAMETERS) <= set(loaded._keep_in_fp32_modules)
    kept = {name: p.dtype for name, p in loaded.named_parameters() if ".processor." in name}
    assert kept and all(
        dtype == (torch.float32 if name.split(".")[4] in FP32_PARAMETERS else torch.bfloat16)
        for name, dtype in kept.items()
    ), kept
    assert loaded.dtype == torch.bfloat16


@pytest.mark.parametrize("family", ["wan", "dit"])
def test_layerwise_casting_stores_mhla_in_float8_and_computes_in_float32(family):
    model = _converted(family)
    expected = run(model, _inputs(family))
    model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
    processor = (model.blocks[1] if family == "wan" else model.transformer_blocks[0]).attn1.processor
    assert processor.lepe.weight.dtype == processor.gate.weight.dtype == torch.float8_e4m3fn
    assert processor.mixing.dtype == torch.float32
    out = run(model, _inputs(family))
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    assert (out - expected).abs().max() < 0.5 * expected.abs().max()  # float8 weights: close, not equal


# ----------------------------------------------------------------------------- pipelines


def _converted_pipeline(kind: str):
    """An MHLA pipeline built from components, its transformer converted (as Diffusers' pipeline tests build one)."""
    stock = tiny_wan_pipeline() if kind == "wan" else tiny_dit_pipeline()
    pipe = (MHLAWanPipeline if kind == "wan" else MHLADiTPipeline)(**stock.components)
    pipe.convert_to_mhla(_settings(kind))
    with torch.no_grad():
        for name, parameter in pipe.transformer.named_parameters():
            if ".processor." in name:
                parameter.add_(0.01 * torch.randn_like(parameter))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _generate(pipe, kind: str) -> np.ndarray:
    if kind == "wan":
        return pipe(**WAN_CALL, generator=seeded()).frames[0]
    return pipe(class_labels=[1, 2], num_inference_steps=2, generator=seeded(), output_type="np").images


@pytest.mark.parametrize("fmt", ["pickle", "variant"])
@pytest.mark.parametrize("kind", ["wan", "dit"])
def test_pipelines_saved_in_diffusers_formats_reload_with_mhla(kind, fmt, tmp_path):
    pipe = _converted_pipeline(kind)
    save = {"safe_serialization": False, **({"variant": "fp16"} if fmt == "variant" else {})}
    pipe.save_pretrained(tmp_path, **save)
    assert json.loads((tmp_path / "transformer" / "config.json").read_text())["mhla"] == pipe.mhla.config.to_dict()
    assert not (tmp_path / "transformer" / "mhla_config.json").exists()
    reloaded = type(pipe).from_pretrained(tmp_path, variant=save.get("variant"))
    reloaded.set_progress_bar_config(disable=True)
    assert reloaded.mhla == pipe.mhla
    np.testing.assert_array_equal(_generate(reloaded, kind), _generate(pipe, kind))


@pytest.mark.parametrize("kind", ["wan", "dit"])
def test_load_mhla_weights_converts_a_base_pipeline(kind, pipeline_dirs):
    cls = MHLAWanPipeline if kind == "wan" else MHLADiTPipeline
    pipe = cls.from_pretrained(pipeline_dirs[kind])
    pipe.set_progress_bar_config(disable=True)
    conversions = pipe.load_mhla_weights(pipeline_dirs[f"{kind}_mhla"])
    assert conversions == pipe.mhla_conversions and pipe.mhla is not None
    alias = cls.from_pretrained(pipeline_dirs[kind], mhla_weights=pipeline_dirs[f"{kind}_mhla"])
    alias.set_progress_bar_config(disable=True)
    assert alias.mhla == pipe.mhla
    np.testing.assert_array_equal(_generate(pipe, kind), _generate(alias, kind))
    with pytest.raises(ValueError, match="already converted to MHLA: revert_mhla"):
        pipe.load_mhla_weights(pipeline_dirs[f"{kind}_mhla"])
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['dtype'\]"):
        cls.from_pretrained(pipeline_dirs[kind]).load_mhla_weights(pipeline_dirs[f"{kind}_mhla"], dtype=torch.float16)


def test_the_wan_pipeline_call_shows_wan_pipelines_signature():
    from diffusers import WanPipeline

    parameters = inspect.signature(MHLAWanPipeline.__call__).parameters
    assert parameters == inspect.signature(WanPipeline.__call__).parameters
    assert {"prompt", "callback_on_step_end", "callback_on_step_end_tensor_inputs"} <= set(parameters)


def test_the_dit_pipeline_keeps_diffusers_callback_contract():
    pipe = _converted_pipeline("dit")
    seen = []

    def callback(p, i, t, kwargs):
        seen.append((i, p.num_timesteps, p.guidance_scale, p.do_classifier_free_guidance, sorted(kwargs)))
        p._guidance_scale += 1.0  # what Diffusers' test_callback_cfg does
        return {"latents": torch.zeros_like(kwargs["latents"])} if i == p.num_timesteps - 1 else kwargs

    assert pipe._callback_tensor_inputs == ["latents"]
    pipe(
        class_labels=[1],
        num_inference_steps=3,
        guidance_scale=2.0,
        callback_on_step_end=callback,
        callback_on_step_end_tensor_inputs=pipe._callback_tensor_inputs,
        output_type="np",
    )
    assert seen == [(0, 3, 2.0, True, ["latents"]), (1, 3, 3.0, True, ["latents"]), (2, 3, 4.0, True, ["latents"])]
    assert pipe.guidance_scale == 2.0 + pipe.num_timesteps
    with pytest.raises(ValueError, match=r"\['prompt_embeds'\] are not among this pipeline's \['latents'\]"):
        pipe(class_labels=[1], callback_on_step_end=callback, callback_on_step_end_tensor_inputs=["prompt_embeds"])


def test_the_dit_pipeline_takes_class_labels_in_every_form_stock_dit_does():
    """Diffusers' batch tests pass ``[[1], [1], [1]]``; a tensor or an array of ids works in ``DiTPipeline`` too."""
    pipe = _converted_pipeline("dit")

    def images(labels) -> np.ndarray:
        return pipe(class_labels=labels, num_inference_steps=2, generator=seeded(), output_type="np").images

    flat = images([1, 2, 3])
    for form in ([[1], [2], [3]], torch.tensor([1, 2, 3]), np.array([[1], [2], [3]]), (1, [2], torch.tensor([3]))):
        np.testing.assert_array_equal(images(form), flat)
    with pytest.raises(ValueError, match="class labels must be ids or names"):
        images([1.5])
