"""A DiT trained from random initialisation (``model_size``): the size table, DiT's initialisation,
a few steps with each attention (softmax, global linear, MHLA, MHLA + LePE + gate, released DiT-MHLA)
whose saved pipeline loads and samples, resume with the shared embedder, the pre-extracted latents
(both flips, one posterior sample each, no VAE needed afterwards) and one flip coin per batch."""

from __future__ import annotations

import functools
import json
import math

import pytest
import torch

from helpers.finetune import (
    TINY_DIT_OVERRIDES,
    assert_same_final_weights,
    dit_scratch_options,
    killed_and_resumed,
    metrics,
)
from mhla_diffusion import MHLAConfig, convert_to_mhla
from mhla_diffusion.finetune import train_dit
from mhla_diffusion.finetune.dit_scratch import has_shared_embedder, new_dit_transformer, unshared_embedders
from mhla_diffusion.finetune.image_data import ClassImageDataset, ImageSample, batch_view, latent_identity
from mhla_diffusion.finetune.latent_cache import LatentCache
from mhla_diffusion.finetune.options import DiTTrainOptions, options_from_dict
from mhla_diffusion.models.tiny import tiny_dit_transformer
from mhla_diffusion.pipelines import MHLADiTPipeline
from mhla_diffusion.utils.dit_sizes import DIT_MODEL_SIZES, dit_model_size, dit_transformer_config


def test_size_table():
    sizes = {name: (s.depth, s.hidden_size, s.num_heads, s.patch_size) for name, s in DIT_MODEL_SIZES.items()}
    assert len(sizes) == 14 and sizes["DiT-L/2-half-small-head"] == (12, 1024, 8, 2)
    assert sizes["DiT-S/2"] == (12, 384, 6, 2) and sizes["DiT-B/4"] == (12, 768, 12, 4)
    assert sizes["DiT-L/8"] == (24, 1024, 16, 8) and sizes["DiT-XL/8"] == (28, 1152, 16, 8)
    config = dit_transformer_config("DiT-XL/2", sample_size=256 // 8)  # facebook/DiT-XL-2-256's shape
    assert (
        config["num_layers"],
        config["num_attention_heads"],
        config["attention_head_dim"],
        config["patch_size"],
    ) == (28, 16, 72, 2)
    assert (config["in_channels"], config["out_channels"], config["num_embeds_ada_norm"], config["sample_size"]) == (
        4,
        8,
        1000,
        32,
    )
    assert config["norm_eps"] == 1e-6 and config["norm_type"] == "ada_norm_zero"
    small = dit_transformer_config("DiT-S/4", sample_size=32, num_classes=10, overrides={"num_layers": 2})
    assert (small["num_layers"], small["patch_size"], small["num_embeds_ada_norm"]) == (2, 4, 10)
    with pytest.raises(ValueError, match="unknown DiT model size 'DiT-M/2'"):
        dit_model_size("DiT-M/2")


def test_dit_s2_has_dits_parameter_count():
    model = new_dit_transformer(dit_transformer_config("DiT-S/2", sample_size=32), seed=0)
    # DiT-S/2 at 256 px: 32,963,360 parameters in the DiT code, 98,304 of them its frozen sin-cos
    # pos_embed (a buffer here); per-block embedders (share=False) would add ~7M
    assert sum(p.numel() for p in model.parameters()) + 256 * 384 == 32_963_360


def test_dit_initialisation():
    config = dit_transformer_config("DiT-S/2", sample_size=8, overrides={**TINY_DIT_OVERRIDES, "num_layers": 3})
    mhla = MHLAConfig(gate=True, lepe=True)
    model = new_dit_transformer(config, seed=0, mhla=mhla)
    width = 16
    stock = type(model)(**config)  # what Diffusers' construction leaves: not adaLN-Zero
    assert stock.transformer_blocks[0].norm1.linear.weight.abs().sum() > 0

    for block in model.transformer_blocks:  # adaLN-Zero: modulation zero, so each block starts as the identity
        assert block.norm1.linear.weight.abs().sum() == 0 and block.norm1.linear.bias.abs().sum() == 0
        assert block.norm1.emb is model.transformer_blocks[0].norm1.emb  # one embedder, as DiT
        assert block.norm1.norm.eps == block.norm3.eps == 1e-6
    for linear in (model.proj_out_1, model.proj_out_2):  # final adaLN and final linear layer zero
        assert linear.weight.abs().sum() == 0 and linear.bias.abs().sum() == 0
    x = torch.randn(2, 4, 8, 8)
    with torch.no_grad():
        assert model(x, timestep=torch.tensor([1, 900]), class_labels=torch.tensor([3, 1000])).sample.abs().max() == 0

    block = model.transformer_blocks[1]
    attn = block.attn1
    fused_bound = math.sqrt(6 / (width + 3 * width))  # q, k, v drawn as DiT's one Linear(C, 3C)
    qkv = torch.cat([attn.to_q.weight, attn.to_k.weight, attn.to_v.weight])
    assert qkv.abs().max() <= fused_bound and qkv.abs().max() > 0.9 * fused_bound
    for linear in (attn.to_out[0], block.ff.net[0].proj, block.ff.net[2], attn.processor.gate):
        bound = math.sqrt(6 / sum(linear.weight.shape))
        assert linear.weight.abs().max() <= bound and linear.weight.abs().max() > 0.8 * bound
        assert linear.bias.abs().sum() == 0
    proj = model.pos_embed.proj
    assert proj.weight.abs().max() <= math.sqrt(6 / (width + 4 * 2 * 2)) and proj.bias.abs().sum() == 0
    emb = block.norm1.emb
    assert abs(emb.class_embedder.embedding_table.weight.std().item() - 0.02) < 0.002
    for linear in (emb.timestep_embedder.linear_1, emb.timestep_embedder.linear_2):
        assert abs(linear.weight.std().item() - 0.02) < 0.004 and linear.bias.abs().sum() == 0

    reference = tiny_dit_transformer()  # same 4x4 token grid: the MHLA parameters keep their own init
    convert_to_mhla(reference, mhla)
    assert torch.equal(attn.processor.mixing, reference.transformer_blocks[0].attn1.processor.mixing)
    assert torch.equal(attn.processor.lepe.weight, reference.transformer_blocks[0].attn1.processor.lepe.weight)

    again = new_dit_transformer(config, seed=0, mhla=mhla)
    other = new_dit_transformer(config, seed=1, mhla=mhla)
    state, same, different = model.state_dict(), again.state_dict(), other.state_dict()
    assert all(torch.equal(state[k], same[k]) for k in state)
    assert not torch.equal(
        state["transformer_blocks.0.attn1.to_q.weight"], different["transformer_blocks.0.attn1.to_q.weight"]
    )

    with unshared_embedders(model):  # saved as Diffusers' per-block copies, equal values
        assert not has_shared_embedder(model)
        copy = model.transformer_blocks[2].norm1.emb.class_embedder.embedding_table.weight
        assert torch.equal(copy, emb.class_embedder.embedding_table.weight)
    assert has_shared_embedder(model)
    assert not has_shared_embedder(new_dit_transformer(config, seed=0, share=False))


ATTENTIONS = {
    "softmax": dict(attention="softmax"),
    "linear": dict(mhla={"layout": [1, 1]}),  # global linear attention: one block
    "mhla": dict(vae="pipeline"),  # the VAE from a pipeline folder (its vae/)
    "mhla_lepe_gate": dict(mhla={"lepe": True, "gate": True}, cache_latents=True),
    "released_dit": dict(
        mhla_preset="released-dit", cache_latents=True, latent_sampling="presampled", flip_coin_per_batch=True
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", ATTENTIONS)
def test_from_scratch_trains_and_saves_a_pipeline(tmp_path, pipeline_dirs, image_classes, name):
    extra = dict(ATTENTIONS[name])
    vae = pipeline_dirs["dit"] if extra.pop("vae", None) == "pipeline" else pipeline_dirs["dit"] / "vae"
    options = dit_scratch_options(
        vae, image_classes, tmp_path / "run", num_classes="data", save_pipeline=True, ema_decay=0.9, **extra
    )
    train_dit.train(options)
    rows = [r for r in metrics(tmp_path / "run") if "loss" in r]
    assert len(rows) == 3 and all(math.isfinite(r["loss"]) and {"mse", "vb"} <= set(r) for r in rows)

    pipe = MHLADiTPipeline.from_pretrained(tmp_path / "run" / "pipeline")
    config = pipe.transformer.config
    assert (config.num_layers, config.num_attention_heads, config.attention_head_dim, config.patch_size) == (2, 2, 8, 2)
    assert (config.sample_size, config.in_channels, config.out_channels, config.num_embeds_ada_norm) == (8, 4, 8, 3)
    assert pipe.labels["2"] == 2  # id2label from the class folders
    assert type(pipe.scheduler).__name__ == "DDIMScheduler" and pipe.scheduler.config.num_train_timesteps == 1000
    assert (pipe.scheduler.config.beta_schedule, pipe.scheduler.config.beta_end) == ("linear", 0.02)
    if name == "softmax":
        assert pipe.mhla is None
    else:
        expected = {
            "linear": dict(layout=(1, 1)),
            "mhla": dict(layout=(2, 2), lepe=False, gate=False),
            "mhla_lepe_gate": dict(lepe=True, gate=True),
            "released_dit": dict(normalization="scalar_mixed_denominator", input_norm=True, lepe=True),
        }[name]
        assert {k: getattr(pipe.mhla.config, k) for k in expected} == expected
    assert pipe.transformer.proj_out_2.weight.abs().sum() > 0  # trained away from its zero init
    blocks = pipe.transformer.transformer_blocks  # the shared embedder, saved as equal per-block copies
    assert torch.equal(
        blocks[0].norm1.emb.timestep_embedder.linear_1.weight, blocks[1].norm1.emb.timestep_embedder.linear_1.weight
    )
    images = pipe([0, "2"], num_inference_steps=2, output_type="np").images
    assert images.shape == (2, 16, 16, 3) and torch.isfinite(torch.as_tensor(images)).all()


@pytest.mark.slow
def test_from_scratch_resume_equals_uninterrupted(tmp_path, pipeline_dirs, image_classes):
    vae = pipeline_dirs["dit"] / "vae"
    common = dict(
        max_train_steps=5,
        checkpointing_steps=2,
        ema_decay=0.8,
        train_batch_size=3,
        learning_rate=1e-2,
        mhla={"gate": True},
    )
    options = functools.partial(dit_scratch_options, vae, image_classes, **common)
    train_dit.train(options(tmp_path / "a"))
    killed_and_resumed(train_dit.train, options, tmp_path / "b", at=3)
    for tensors in assert_same_final_weights(tmp_path / "a", tmp_path / "b").values():
        assert "transformer_blocks.1.norm1.emb.class_embedder.embedding_table.weight" in tensors


def _cache_entries(cache_dir) -> tuple[list[ImageSample], list[dict[str, torch.Tensor]]]:
    """The samples of a complete DiT latent cache and their entries, in the trainer's sample order."""
    samples = [ImageSample.from_dict(s) for s in json.loads((cache_dir / "index.json").read_text())["samples"]]
    cache = LatentCache(cache_dir, {})
    return samples, [cache.read("latents", latent_identity(s)) for s in samples]


@pytest.mark.slow
def test_prepass_stores_both_flips_and_training_needs_no_vae(tmp_path, pipeline_dirs, image_classes, monkeypatch):
    from diffusers import AutoencoderKL

    from mhla_diffusion.finetune.latents import dit_latent_normalization, encode_posterior, presample

    vae_dir, cache_dir = pipeline_dirs["dit"] / "vae", tmp_path / "cache"
    common = dict(cache_latents=True, latent_sampling="presampled", cache_dir=str(cache_dir), max_train_steps=1)
    train_dit.train(dit_scratch_options(vae_dir, image_classes, tmp_path / "a", **common))
    samples, entries = _cache_entries(cache_dir)
    assert len(samples) == 12
    vae = AutoencoderKL.from_pretrained(vae_dir)
    shift, scale = dit_latent_normalization(vae)
    assert scale.item() == pytest.approx(0.18215)  # x 0.18215, as the released recipe
    pixels = ClassImageDataset(samples, resolution=16, random_flip=False)
    for i, (sample, entry) in enumerate(zip(samples, entries)):
        assert set(entry) == {"latents", "latents_flipped"} and entry["latents"].shape == (4, 8, 8)
        image = pixels.load(i, 0)["pixels"][None]
        for key, view in (("latents", image), ("latents_flipped", image.flip(-1))):  # the flipped image encoded
            params = encode_posterior(vae, view, shift, scale)[0]
            torch.testing.assert_close(entry[key], presample(params, 4, [*latent_identity(sample), key]))
            assert not torch.allclose(entry[key], params[:4])  # a posterior sample, not the mean

    def no_vae(*args, **kwargs):
        raise AssertionError("the VAE was read although the latents are cached")

    monkeypatch.setattr(train_dit, "load_vae", no_vae)
    monkeypatch.setattr(train_dit, "load_vae_config", no_vae)
    train_dit.train(dit_scratch_options(vae_dir, image_classes, tmp_path / "b", **{**common, "max_train_steps": 2}))
    assert len([r for r in metrics(tmp_path / "b") if "loss" in r]) == 2


def test_batch_view_flips_all_or_none():
    pixels = torch.randn(3, 3, 4, 4)
    batch = {"pixels": pixels, "labels": torch.arange(3)}
    assert torch.equal(batch_view(batch, True)["pixels"], pixels.flip(-1))
    assert torch.equal(batch_view(batch, False)["pixels"], pixels)
    cached = {"latents": torch.zeros(3, 4, 2, 2), "latents_flipped": torch.ones(3, 4, 2, 2), "labels": torch.arange(3)}
    assert batch_view(cached, True)["latents"].eq(1).all() and "latents_flipped" not in batch_view(cached, True)
    assert batch_view(cached, False)["latents"].eq(0).all()


@pytest.mark.slow
def test_flip_coin_per_batch(tmp_path, pipeline_dirs, image_classes, monkeypatch):
    seen = []

    def recording_view(batch, flipped):
        out = batch_view(batch, flipped)
        seen.append((batch["indices"].tolist(), out["latents"].clone(), flipped))
        return out

    monkeypatch.setattr(train_dit, "batch_view", recording_view)
    cache_dir = tmp_path / "cache"
    common = dict(cache_latents=True, flip_coin_per_batch=True, cache_dir=str(cache_dir), max_train_steps=8, seed=3)
    train_dit.train(dit_scratch_options(pipeline_dirs["dit"] / "vae", image_classes, tmp_path / "a", **common))
    _, entries = _cache_entries(cache_dir)
    flips = []
    for indices, latents, flipped in seen:
        views = []
        for row, i in enumerate(indices):
            assert not torch.equal(entries[i]["latents"], entries[i]["latents_flipped"])
            views.append(next(k for k in ("latents", "latents_flipped") if torch.equal(latents[row], entries[i][k])))
        assert views == ["latents_flipped" if flipped else "latents"] * len(indices)  # the whole batch, or none of it
        flips.append(flipped)
    assert len(flips) == 8 and True in flips and False in flips
    assert [r["flipped"] for r in metrics(tmp_path / "a") if "loss" in r] == [float(f) for f in flips]

    seen.clear()  # the same seed throws the same coins
    train_dit.train(dit_scratch_options(pipeline_dirs["dit"] / "vae", image_classes, tmp_path / "b", **common))
    assert [flipped for *_, flipped in seen] == flips


@pytest.mark.parametrize(
    "values, message",
    [
        ({"pretrained_model": "facebook/DiT-XL-2-256"}, "`pretrained_model` and `model_size` are both set"),
        ({"model_size": "DiT-M/2"}, "unknown DiT model size 'DiT-M/2'"),
        ({"trainable": "mhla"}, "trains every parameter: trainable: all"),
        ({"attention_transfer_steps": 5}, "no pretrained softmax attention to distil"),
        ({"num_classes": "all"}, '`num_classes` must be a count or "data"'),
        (
            {"model_size": None, "pretrained_model": "p"},
            "`model_overrides`, `vae_model` describe a DiT trained from scratch",
        ),
        ({"random_flip": False, "flip_coin_per_batch": True}, "set random_flip: true"),
        ({"latent_sampling": "presampled"}, "set cache_latents: true"),
    ],
)
def test_from_scratch_option_errors(values, message):
    base = dict(model_size="DiT-S/2", model_overrides={"num_layers": 2}, vae_model="vae", data_dir="d", output_dir="o")
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        options_from_dict(DiTTrainOptions, {**base, **values})
    with pytest.raises(ValueError, match="or `model_size`"):
        options_from_dict(DiTTrainOptions, {"data_dir": "d", "output_dir": "o"})


def test_from_scratch_setup_errors(tmp_path, pipeline_dirs, image_classes):
    vae = pipeline_dirs["dit"] / "vae"
    with pytest.raises(ValueError, match="`num_layer` \\(did you mean `num_layers`\\?\\)"):
        train_dit.train(dit_scratch_options(vae, image_classes, tmp_path / "a", model_overrides={"num_layer": 2}))
    with pytest.raises(ValueError, match="`resolution` 18 must be a multiple of 4"):
        train_dit.train(dit_scratch_options(vae, image_classes, tmp_path / "b", resolution=18))
    with pytest.raises(FileNotFoundError, match="vae_model"):
        train_dit.train(dit_scratch_options(tmp_path / "missing", image_classes, tmp_path / "c"))
    assert not any((tmp_path / name).exists() for name in "abc")  # failed runs leave no run folder
