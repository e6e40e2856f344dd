"""Class-to-image trainer on a tiny DiT pipeline and class folders: learning with EMA and mixing
clamps, outputs that load with the pipelines, resume equality with EMA, label dropout handling."""

from __future__ import annotations

import functools

import pytest
import torch

from helpers.finetune import DiTEvaluator, assert_same_final_weights, dit_options, killed_and_resumed, metrics
from mhla_diffusion import MHLAConfig, convert_to_mhla, load_mhla, load_transformer
from mhla_diffusion.finetune import train_dit
from mhla_diffusion.pipelines import MHLADiTPipeline


@pytest.mark.slow
def test_dit_learns_and_outputs_load_with_the_pipelines(tmp_path, pipeline_dirs, image_classes):
    base = pipeline_dirs["dit"]
    evaluate = DiTEvaluator(base, image_classes)
    start = load_transformer(str(base))
    convert_to_mhla(start, MHLAConfig())
    before = evaluate(start)
    options = dit_options(
        base,
        image_classes,
        tmp_path / "run",
        max_train_steps=30,
        ema_decay=0.9,
        cache_latents=True,
        save_pipeline=True,
        validation_classes=[0, "goldfish"],
        validation_num_inference_steps=2,
    )
    final = train_dit.train(options)
    raw, averaged = load_mhla(tmp_path / "run" / "final-no-ema"), load_mhla(final)
    after = evaluate(raw)
    assert after < 0.8 * before, (before, after)
    assert evaluate(averaged) < before
    raw_state, ema_state = raw.state_dict(), averaged.state_dict()
    assert any(not torch.equal(raw_state[k], ema_state[k]) for k in raw_state)
    for name in ("transformer_blocks.0.attn1.processor.mixing", "transformer_blocks.1.attn1.processor.mixing"):
        assert 0 <= raw_state[name].min() and raw_state[name].max() <= 1

    rows = [r for r in metrics(tmp_path / "run") if "loss" in r]
    assert len(rows) == 30 and all({"mse", "vb"} <= set(r) for r in rows)
    pipe = MHLADiTPipeline.from_pretrained(tmp_path / "run" / "pipeline")
    assert pipe.mhla is not None and pipe.labels["goldfish"] == 1
    image = pipe(["goldfish"], num_inference_steps=2, output_type="np").images[0]
    assert image.shape == (16, 16, 3)
    assert (tmp_path / "run" / "validation" / "step-00000030" / "01-goldfish.png").is_file()


@pytest.mark.slow
def test_dit_resume_with_ema_equals_uninterrupted(tmp_path, pipeline_dirs, image_classes):
    base = pipeline_dirs["dit"]
    common = dict(
        max_train_steps=5,
        checkpointing_steps=2,
        ema_decay=0.8,
        class_dropout=0.5,
        train_batch_size=3,
        mhla={"lepe": True},
    )
    options = functools.partial(dit_options, base, image_classes, **common)
    train_dit.train(options(tmp_path / "a"))
    killed_and_resumed(train_dit.train, options, tmp_path / "b", at=3)
    for tensors in assert_same_final_weights(tmp_path / "a", tmp_path / "b").values():
        assert any(".processor.lepe." in k for k in tensors)


def test_label_dropout_is_left_to_the_trainer(pipeline_dirs):
    transformer = load_transformer(str(pipeline_dirs["dit"])).train()
    inputs = dict(hidden_states=torch.randn(8, 4, 8, 8), timestep=torch.full((8,), 10), class_labels=torch.arange(8))
    with torch.no_grad():
        torch.manual_seed(0)
        first = transformer(**inputs).sample
        torch.manual_seed(1)
        assert not torch.equal(first, transformer(**inputs).sample)  # the stock blocks drop labels at random
        assert train_dit.disable_label_dropout(transformer) == len(transformer.transformer_blocks)  # one per block
        torch.manual_seed(0)
        first = transformer(**inputs).sample
        torch.manual_seed(1)
        assert torch.equal(first, transformer(**inputs).sample)


def test_clamp_mixing(pipeline_dirs):
    transformer = load_transformer(str(pipeline_dirs["dit"]))
    convert_to_mhla(transformer, MHLAConfig())
    mixing = transformer.transformer_blocks[0].attn1.processor.mixing
    with torch.no_grad():
        mixing.copy_(torch.linspace(-1, 2, mixing.numel()).view_as(mixing))
    train_dit.clamp_mixing(transformer)
    assert mixing.min() == 0 and mixing.max() == 1


def test_dit_input_errors(tmp_path, pipeline_dirs, image_classes):
    base = pipeline_dirs["dit"]
    with pytest.raises(ValueError, match="unknown class names \\['unicorn'\\]"):
        train_dit.train(dit_options(base, image_classes, tmp_path / "a", validation_classes=["unicorn"]))
    with pytest.raises(ValueError, match="`resolution` 18 must be a multiple of 4"):
        train_dit.train(dit_options(base, image_classes, tmp_path / "b", resolution=18))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()  # failed runs leave no run folder
    (tmp_path / "flat").mkdir()
    with pytest.raises(ValueError, match="no class sub-folders"):
        train_dit.train(dit_options(base, tmp_path / "flat", tmp_path / "c"))
