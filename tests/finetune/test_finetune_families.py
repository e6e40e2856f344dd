"""The text-to-video trainer on other families: SkyReels-V2 (Wan's attention) and HunyuanVideo (joint image-text
attention) through attention transfer, fine-tuning, validation and the saved pipeline."""

from __future__ import annotations

import pytest
import torch

from helpers.finetune import metrics, wan_options
from mhla_diffusion import MHLAConfig, convert_to_mhla, load_mhla, load_transformer
from mhla_diffusion.finetune import train_wan
from mhla_diffusion.finetune.video_families import video_recipe_for
from mhla_diffusion.models.conversion import get_mhla_conversion


@pytest.mark.slow
@pytest.mark.parametrize("family", ["skyreels-v2", "hunyuan-video"])
def test_attention_transfer_and_fine_tuning_save_a_pipeline_that_reloads_as_mhla(
    tmp_path, family_pipeline_dirs, video_set, family
):
    out = tmp_path / "run"
    options = wan_options(
        family_pipeline_dirs[family],
        video_set,
        out,
        mhla={},  # the default MHLAConfig(): the layout from the model's grid
        attention_transfer_steps=2,
        max_train_steps=2,
        validation_prompts=["a red square"],
        validation_steps=2,
        validation_num_inference_steps=2,
        save_pipeline=True,
        cache_latents=family == "hunyuan-video",  # the cache holds HunyuanVideo's pooled embedding too
    )
    final = train_wan.train(options)

    rows = metrics(out)
    layers = get_mhla_conversion(load_mhla(out / "pipeline", subfolder="transformer")).layer_names
    transfer = [r for r in rows if "transfer/loss" in r]
    assert len(transfer) == 2 and all(f"transfer/{name}" in transfer[0] for name in layers)
    if family == "hunyuan-video":  # joint layers: double-stream and single-stream blocks both transfer
        assert any(n.startswith("transformer_blocks.") for n in layers)
        assert any(n.startswith("single_transformer_blocks.") for n in layers)
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    assert sorted(p.suffix for p in (out / "validation" / "step-00000002").iterdir()) == [".json", ".mp4"]

    # the saved pipeline's transformer is the trained one: equal to the stock transformer + the final MHLA weights
    saved = load_mhla(out / "pipeline", subfolder="transformer")
    assert type(saved).__name__ == f"MHLA{type(load_transformer(family_pipeline_dirs[family])).__name__}"
    rebuilt = load_mhla(final, load_transformer(family_pipeline_dirs[family]))
    trained = {k: v for k, v in saved.state_dict().items() if ".processor." in k}
    assert trained and all(torch.equal(v, rebuilt.state_dict()[k]) for k, v in trained.items())
    start = load_mhla(family_pipeline_dirs[f"{family}-mhla"], load_transformer(family_pipeline_dirs[family]))
    first = f"{layers[0]}.processor.mixing"
    assert not torch.equal(trained[first], start.state_dict()[first])  # it trained


def test_hunyuan_video_training_text_gives_the_pipelines_output(family_pipeline_dirs):
    """What the trainer feeds HunyuanVideo (unpadded Llama embeddings, zero-padded with a text mask, and the CLIP
    pooled embedding) gives the transformer output the stock pipeline's own ``encode_prompt`` gives."""
    from diffusers import HunyuanVideoPipeline

    pipe = HunyuanVideoPipeline.from_pretrained(family_pipeline_dirs["hunyuan-video"])
    convert_to_mhla(pipe.transformer, MHLAConfig())
    recipe = video_recipe_for(type(pipe.transformer).__name__, "tiny")
    prompts, length = ["a red square moving left", "a cat"], 12
    encoders = {name: getattr(pipe, name) for name in recipe.text_components}
    text = recipe.transformer_text(recipe.encode(encoders, prompts, length), length)
    embeds, pooled, mask = pipe.encode_prompt(prompts, max_sequence_length=length)
    assert mask.sum(dim=1).tolist() == text["encoder_attention_mask"].sum(dim=1).tolist()
    g = torch.Generator().manual_seed(0)
    common = dict(
        hidden_states=torch.randn(2, 4, 2, 4, 4, generator=g),
        timestep=torch.tensor([300.0, 800.0]),
        **recipe.forward_extras(2, 6.0, torch.device("cpu")),
    )
    with torch.no_grad():
        ours = pipe.transformer(**common, **text).sample
        stock = pipe.transformer(
            **common, encoder_hidden_states=embeds, encoder_attention_mask=mask, pooled_projections=pooled
        ).sample
    torch.testing.assert_close(ours, stock, rtol=1e-5, atol=1e-5)


def test_the_trainer_names_the_families_it_trains():
    assert video_recipe_for("SkyReelsV2Transformer3DModel", "x").label == "SkyReels-V2"
    assert video_recipe_for("MHLAHunyuanVideoTransformer3DModel", "x").label == "HunyuanVideo"
    with pytest.raises(ValueError, match="FluxTransformer2DModel.*trains pipelines of WanTransformer3DModel"):
        video_recipe_for("FluxTransformer2DModel", "black-forest-labs/FLUX.1-dev")


def test_block_causal_training_is_refused_for_other_families(tmp_path, family_pipeline_dirs, video_set):
    options = wan_options(
        family_pipeline_dirs["skyreels-v2"], video_set, tmp_path / "run", mhla={"causal": True}, causal_chunk_frames=1
    )
    with pytest.raises(ValueError, match="block-causal training .* trains Wan only.* is a SkyReels-V2 pipeline"):
        train_wan.train(options)
    assert not (tmp_path / "run" / "final").exists()
