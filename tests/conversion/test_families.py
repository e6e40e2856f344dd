"""The model-family registry (:mod:`mhla_diffusion.models.families`): the one table of what differs between
Wan and DiT, which conversion, the weight folders, the transformer loader and the command line ask."""

from __future__ import annotations

import pytest
import torch
from diffusers import DiTPipeline, DiTTransformer2DModel, WanPipeline, WanTransformer3DModel

from mhla_diffusion import MHLAConfig, convert_to_mhla
from mhla_diffusion.models.conversion import self_attention_layers
from mhla_diffusion.models.families import FAMILIES, family_for_class_name, family_named, family_of
from mhla_diffusion.utils.geometry import ImageGeometry, VideoGeometry


@pytest.mark.parametrize(
    "name,base,pipeline,geometry",
    [
        ("wan", WanTransformer3DModel, WanPipeline, VideoGeometry),
        ("dit", DiTTransformer2DModel, DiTPipeline, ImageGeometry),
    ],
)
def test_each_family_names_its_classes_geometry_and_processor(request, name, base, pipeline, geometry):
    transformer = request.getfixturevalue(f"tiny_{name}")
    family = family_of(transformer)
    assert family is family_named(name) is FAMILIES[name]
    assert family.transformer_class() is base and family.geometry is geometry
    assert family_for_class_name(base.__name__) is family
    assert issubclass(family.mhla_transformer_class(), base)
    assert type(family.tiny_transformer(num_layers=1)) is base and family.label in family.transformer_class_name
    assert all(issubclass(cls, pipeline) for cls in family.pipeline_classes()[:1])
    assert len(family.patch_grid(transformer.config)) == len(family.grid_axes)
    layers = [n for n, _ in self_attention_layers(transformer)]
    assert layers and all(n.startswith(f"{family.attention_sites[0][0]}.") for n in layers)
    layout = (1,) * len(family.grid_axes) if name == "dit" else (1, 2, 2)
    conversion = convert_to_mhla(transformer, MHLAConfig(layers=[0], layout=layout, target_grid=None))
    processor = dict(transformer.named_modules())[conversion.layer_names[0]].processor
    assert type(processor) is family.processor_class() and conversion.family == name


def test_unknown_families_and_class_names_are_named():
    assert family_for_class_name("Transformer2DModel") is FAMILIES["dit"]  # the legacy name hub DiT configs record
    assert family_for_class_name("UNet2DConditionModel") is None
    with pytest.raises(ValueError, match="unknown model family 'sd': expected one of 'wan', 'dit', 'skyreels-v2',"):
        family_named("sd")
    supported = "MHLA supports Diffusers' WanTransformer3DModel, DiTTransformer2DModel, SkyReels.*, got Linear"
    with pytest.raises(TypeError, match=supported):
        family_of(torch.nn.Linear(2, 2))
