"""One load plan per model source (:mod:`mhla_diffusion.loaders.plan`): each kind of source resolves to the plan it
should, every load goes through it, and no source is resolved twice nor any of its files looked up twice."""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from helpers.original_format import released_model, to_original
from mhla_diffusion import MHLAWanPipeline, load_mhla, load_transformer, save_mhla
from mhla_diffusion.loaders import plan as plan_module
from mhla_diffusion.loaders.hub_failures import ModelUnavailable
from mhla_diffusion.loaders.loading import load_pipeline, load_transformer_file
from mhla_diffusion.loaders.plan import plan_pipeline, resolve_source

HUB_ID = "mhla-tests/tiny-wan"


@pytest.fixture
def lookups(monkeypatch):
    """Every source resolved (``resolved``: source -> count) and every file looked up (``files``: (source,
    subfolder, name) -> count) while the test runs."""
    resolved: Counter = Counter()
    files: Counter = Counter()
    resolve, lookup = plan_module.resolve_source, plan_module._Files._lookup

    def counting_resolve(source, *args, **kwargs):
        if not isinstance(source, plan_module.LoadPlan):
            resolved[str(source)] += 1
        return resolve(source, *args, **kwargs)

    def counting_lookup(self, filename, subfolder):
        files[(str(self.source), subfolder, filename)] += 1
        return lookup(self, filename, subfolder)

    monkeypatch.setattr(plan_module, "resolve_source", counting_resolve)
    monkeypatch.setattr(plan_module._Files, "_lookup", counting_lookup)
    # the modules that imported the function by name at import time: patch them too (the others import it on use)
    import mhla_diffusion.finetune.components as components
    import mhla_diffusion.loaders.weights as weights

    monkeypatch.setattr(weights, "resolve_source", counting_resolve)
    monkeypatch.setattr(components, "resolve_source", counting_resolve)
    return resolved, files


def once_each(files: Counter) -> None:
    again = {key: count for key, count in files.items() if count > 1}
    assert not again, f"files looked up more than once: {again}"


@pytest.fixture(scope="module")
def hub_cache(pipeline_dirs, tmp_path_factory):
    """A Hugging Face cache holding the tiny Wan pipeline as hub repo :data:`HUB_ID` (the hub itself switched off)."""
    cache = tmp_path_factory.mktemp("hub_cache")
    repo = cache / f"models--{HUB_ID.replace('/', '--')}"
    shutil.copytree(pipeline_dirs["wan"], repo / "snapshots" / ("0" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    return cache


@pytest.fixture
def offline_hub(hub_cache, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return hub_cache


# ----------------------------------------------------------------------------- each kind of source


def test_a_plain_diffusers_pipeline_folder(pipeline_dirs):
    plan = resolve_source(pipeline_dirs["wan"], dtype=torch.float16)
    assert (plan.kind, plan.form, plan.class_name) == ("folder", "pipeline", "WanPipeline")
    assert list(plan.components) == ["transformer"] and plan.dtype == torch.float16
    transformer = plan.components["transformer"]
    assert (transformer.form, transformer.family, transformer.class_name) == (
        "transformer",
        "wan",
        "WanTransformer3DModel",
    )
    assert transformer.mhla is None and transformer.dtype == torch.float16 and not plan.has_mhla
    # a config.json without an `mhla` entry: mhla_config.json was looked for, and is not there
    assert set(plan.files) == {"model_index.json", "transformer/config.json"}
    assert transformer.directory == pipeline_dirs["wan"] / "transformer"
    assert plan.describe() == "a WanPipeline pipeline folder (transformer: WanTransformer3DModel without MHLA layers)"


def test_a_folder_with_mhla_weights(pipeline_dirs):
    plan = resolve_source(pipeline_dirs["wan_mhla"])
    assert (plan.kind, plan.form, plan.family) == ("folder", "mhla-weights", "wan")
    assert plan.mhla["contents"] == "mhla" and plan.mhla["mhla_config"]["layout"] == [2, 2, 2]
    assert plan.mhla_weight_files() == [pipeline_dirs["wan_mhla"] / "mhla_weights.safetensors"]
    assert plan.describe() == "an MHLA weights folder (save_mhla) for a wan transformer of 2 layers"


def test_a_whole_mhla_transformer_folder_and_a_pipeline_saved_with_mhla(pipeline_dirs, tmp_path):
    pipe = MHLAWanPipeline.from_pretrained(pipeline_dirs["wan"], mhla_weights=pipeline_dirs["wan_mhla"])
    pipe.save_pretrained(tmp_path / "saved")
    save_mhla(pipe.transformer, tmp_path / "whole", include_base=True)
    whole = resolve_source(tmp_path / "whole")
    assert (whole.form, whole.family, whole.mhla["contents"]) == ("transformer", "wan", "transformer")
    assert whole.describe().endswith("transformer folder with MHLA layers (layout 2x2x2)")
    saved = resolve_source(tmp_path / "saved")
    assert saved.form == "pipeline" and saved.has_mhla
    assert saved.components["transformer"].mhla["mhla_config"] == whole.mhla["mhla_config"]


def test_an_original_wan_checkpoint_file(tmp_path):
    checkpoint = tmp_path / "released.safetensors"
    save_file(to_original(released_model(gate=True)), checkpoint)
    plan = resolve_source(checkpoint)
    assert (plan.kind, plan.form, plan.files) == ("file", "checkpoint", {"checkpoint": checkpoint})
    assert plan.describe() == "an original-format checkpoint file"
    with pytest.raises(ValueError, match="is a file: it has no subfolder 'transformer'"):
        resolve_source(checkpoint, "transformer")


def test_per_transformer_mhla_weights(wan_family_dirs):
    plan = resolve_source(wan_family_dirs["wan2.2-a14b-t2v-mhla"])
    assert plan.form == "mhla-per-transformer" and list(plan.components) == ["transformer", "transformer_2"]
    assert all(part.form == "mhla-weights" for part in plan.components.values())
    weights = plan_pipeline(wan_family_dirs["wan2.2-a14b-t2v"], plan).mhla_weights
    assert {name: part.subfolder for name, part in weights.items()} == {
        "transformer": "transformer",
        "transformer_2": "transformer_2",
    }


def test_a_hub_id_in_offline_mode(offline_hub, pipeline_dirs):
    plan = resolve_source(HUB_ID)
    assert (plan.kind, plan.form, plan.class_name) == ("hub", "pipeline", "WanPipeline")
    assert plan.components["transformer"].family == "wan"
    assert all(Path(path).is_relative_to(offline_hub) for path in plan.files.values())  # read from the cache
    assert plan.describe().startswith("a WanPipeline pipeline hub repo (transformer:")
    with pytest.raises(ModelUnavailable, match=r"mhla-tests/not-cached \(model_index.json\) could not be fetched"):
        resolve_source("mhla-tests/not-cached")


def test_what_kind_of_folder_it_is_is_in_the_errors(pipeline_dirs, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(
        ValueError, match=r"empty is a folder with none of model_index.json, config.json or mhla_config"
    ):
        plan_pipeline(tmp_path / "empty")
    with pytest.raises(ValueError, match="wan_mhla is an MHLA weights folder .*, not a pipeline"):
        plan_pipeline(pipeline_dirs["wan_mhla"])
    with pytest.raises(FileNotFoundError, match="dit is a DiTPipeline pipeline folder .*: no mhla_config.json in it"):
        plan_pipeline(pipeline_dirs["wan"], pipeline_dirs["dit"])
    with pytest.raises(ValueError, match="--transformer .* is an MHLA weights folder"):
        plan_pipeline(pipeline_dirs["wan"], transformer=pipeline_dirs["wan_mhla"])
    with pytest.raises(ValueError, match=r"the model has no MHLA layers \(.* is a WanPipeline pipeline folder"):
        load_pipeline(MHLAWanPipeline, pipeline_dirs["wan"])
    with pytest.raises(FileNotFoundError, match="nothing is there"):
        resolve_source(tmp_path / "missing")


# ----------------------------------------------------------------------------- resolved once, then loaded


def test_a_pipeline_load_resolves_each_source_once(pipeline_dirs, lookups):
    resolved, files = lookups
    pipe = load_pipeline(MHLAWanPipeline, pipeline_dirs["wan"], mhla_weights=pipeline_dirs["wan_mhla"])
    assert pipe.mhla is not None
    assert resolved == Counter({str(pipeline_dirs["wan"]): 1, str(pipeline_dirs["wan_mhla"]): 1})
    once_each(files)
    assert (str(pipeline_dirs["wan_mhla"]), None, "mhla_weights.safetensors") in files  # the weights' file, once


def test_a_pipeline_saved_with_mhla_lends_its_plan_to_diffusers(pipeline_dirs, tmp_path, lookups):
    resolved, files = lookups
    MHLAWanPipeline.from_pretrained(pipeline_dirs["wan"], mhla_weights=pipeline_dirs["wan_mhla"]).save_pretrained(
        tmp_path / "saved"
    )
    resolved.clear(), files.clear()
    pipe = MHLAWanPipeline.from_pretrained(tmp_path / "saved")  # Diffusers loads the MHLA transformer class itself
    assert pipe.mhla is not None
    assert resolved == Counter({str(tmp_path / "saved"): 1})
    once_each(files)


def test_transformer_loads_resolve_once(pipeline_dirs, tmp_path, lookups):
    resolved, files = lookups
    base = load_transformer(pipeline_dirs["wan"])
    load_mhla(pipeline_dirs["wan_mhla"], base)
    save_mhla(base, tmp_path / "whole", include_base=True)
    resolved.clear(), files.clear()
    for source in (tmp_path / "whole", pipeline_dirs["wan"] / "transformer"):
        load_transformer_file(source)
    load_mhla(tmp_path / "whole")
    assert resolved == Counter({str(tmp_path / "whole"): 2, str(pipeline_dirs["wan"] / "transformer"): 1})
    # two loads of one folder: each resolves once, and each file is looked up once per load
    assert max(files.values()) == 2 and all(key[0] == str(tmp_path / "whole") for key, n in files.items() if n == 2)


def test_a_plan_given_is_not_resolved_again(pipeline_dirs, lookups):
    from mhla_diffusion import MHLAConfig
    from mhla_diffusion.finetune.components import load_mhla_transformer, load_softmax_transformer, pipeline_index

    resolved, files = lookups
    plan = resolve_source(pipeline_dirs["wan"])
    resolved.clear(), files.clear()
    assert pipeline_index(plan)["_class_name"] == "WanPipeline"
    load_softmax_transformer(plan)
    transformer, how = load_mhla_transformer(plan, MHLAConfig(layout=(2, 2, 2)))
    assert how == "converted"
    assert not resolved and not files  # a trainer's loads read the plan it resolved once


def test_a_hub_pipeline_loads_offline_through_its_plan(offline_hub, pipeline_dirs, lookups):
    resolved, files = lookups
    from_hub = load_pipeline(MHLAWanPipeline, HUB_ID, mhla_weights=pipeline_dirs["wan_mhla"])
    assert resolved == Counter({HUB_ID: 1, str(pipeline_dirs["wan_mhla"]): 1})
    once_each(files)
    local = load_pipeline(MHLAWanPipeline, pipeline_dirs["wan"], mhla_weights=pipeline_dirs["wan_mhla"])
    for (name, a), b in zip(from_hub.transformer.state_dict().items(), local.transformer.state_dict().values()):
        assert torch.equal(a, b), name


def test_the_web_demo_resolves_each_task_once(pipeline_dirs, lookups):
    from mhla_diffusion.web.config import DemoConfig, TaskModels, UIDefaults
    from mhla_diffusion.web.models import ModelStore

    resolved, _ = lookups
    config = DemoConfig(
        video=TaskModels(
            "text-to-video", str(pipeline_dirs["wan"]), mhla_weights=pipeline_dirs["wan_mhla"], softmax_source="base"
        ),
        image=TaskModels("class-to-image", str(pipeline_dirs["dit"])),
        defaults=UIDefaults(9, 32, 32, 8, 2, 1.0, 2, 1.0),
        device="cpu",
        preload=False,
    )
    store = ModelStore(config)
    mhla, softmax = store.pipeline("text-to-video", "mhla"), store.pipeline("text-to-video", "softmax")
    assert mhla.mhla is not None and softmax.mhla is None  # the softmax side: the base transformer
    assert resolved == Counter({str(pipeline_dirs["wan"]): 1, str(pipeline_dirs["wan_mhla"]): 1})


def test_plans_are_lent_only_inside_a_pipeline_load(pipeline_dirs):
    # outside a pipeline load nothing is lent: a transformer's from_pretrained resolves its own source
    assert plan_module._lent_plan(pipeline_dirs["wan"], "transformer") is None
    with plan_module.plans_in_use(resolve_source(pipeline_dirs["wan"])):
        # Diffusers names a local component by its folder
        lent = plan_module._lent_plan(str(pipeline_dirs["wan"] / "transformer"), None)
        assert lent is not None and lent.subfolder == "transformer"
        assert plan_module._lent_plan(str(pipeline_dirs["dit"] / "transformer"), None) is None
    assert plan_module._lent_plan(str(pipeline_dirs["wan"] / "transformer"), None) is None


def test_the_commands_resolve_each_source_once(pipeline_dirs, wan_family_dirs, tmp_path, lookups):
    from helpers.cli import class_to_image
    from mhla_diffusion.cli import main

    resolved, files = lookups
    assert class_to_image(pipeline_dirs, tmp_path / "images", "--class", "goldfish") == 0
    assert resolved == Counter({str(pipeline_dirs["dit"]): 1, str(pipeline_dirs["dit_mhla"]): 1})
    once_each(files)
    resolved.clear(), files.clear()
    model = wan_family_dirs["wan2.2-a14b-t2v"]  # two transformers, each loaded by its part of one plan
    assert main(["convert", "--model", str(model), "--layout", "2x2x2", "--no-check"]) == 0
    assert resolved == Counter({str(model): 1})
    once_each(files)
