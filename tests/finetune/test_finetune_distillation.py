"""Output distillation of an MHLA student from its softmax original, and EMA, in the text-to-video trainer."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from accelerate import Accelerator

from helpers.finetune import metrics, wan_options
from mhla_diffusion import load_mhla
from mhla_diffusion.finetune import train_wan
from mhla_diffusion.pipelines import MHLAWanPipeline


def _task_and_batch(tmp_path, base, video_set, **overrides):
    task = train_wan.WanTask(wan_options(base, video_set, tmp_path / "run", **overrides))
    parts = task.setup(Accelerator(cpu=True))
    batch = parts.collate_fn([parts.dataset[(i, 0)] for i in range(2)])
    return task, parts.transformer, batch


def _loss(task, model, batch, weight):
    task.options = dataclasses.replace(task.options, distillation_weight=weight)
    with torch.no_grad():
        return task.batch_loss(model, batch, torch.Generator().manual_seed(7))


@pytest.mark.slow
def test_distillation_mixes_the_data_loss_with_the_error_to_the_softmax_original(tmp_path, pipeline_dirs, video_set):
    task, student, batch = _task_and_batch(tmp_path, pipeline_dirs["wan"], video_set, distillation_weight=0.25)
    original = task.original
    assert original is not None and not any(p.requires_grad for p in original.parameters())
    assert type(original).__name__ == "WanTransformer3DModel"  # softmax, as the pipeline holds it

    data, _ = _loss(task, student, batch, 0.0)
    distilled, parts = _loss(task, student, batch, 1.0)
    mixed, mixed_parts = _loss(task, student, batch, 0.25)
    torch.testing.assert_close(parts["distillation_loss"], distilled)
    torch.testing.assert_close(mixed_parts["data_loss"], data)
    torch.testing.assert_close(mixed, 0.75 * data + 0.25 * distilled)
    assert distilled > 0  # the fresh conversion is not yet the original
    # the target is the original's prediction for the same noisy latents, timesteps and text
    assert _loss(task, original, batch, 1.0)[0] == 0

    task.stage = "transfer"  # attention transfer keeps only its layer losses: the original is not run
    assert _loss(task, student, batch, 1.0)[1] == {}


@pytest.mark.slow
def test_a_distilled_run_logs_both_losses_and_skips_the_original_in_transfer(
    tmp_path, pipeline_dirs, video_set, monkeypatch
):
    stages = []  # the task's stage at every batch_loss call: the engine must tell it when transfer ends
    batch_loss = train_wan.WanTask.batch_loss
    monkeypatch.setattr(
        train_wan.WanTask, "batch_loss", lambda self, *args: (stages.append(self.stage), batch_loss(self, *args))[1]
    )
    options = wan_options(
        pipeline_dirs["wan"],
        video_set,
        tmp_path / "run",
        max_train_steps=3,
        distillation_weight=0.5,
        attention_transfer_steps=2,
    )
    train_wan.train(options)
    assert stages == ["transfer", "transfer", "train", "train", "train"]
    rows = [r for r in metrics(tmp_path / "run") if "loss" in r]
    assert [r["step"] for r in rows] == [3, 4, 5]
    for row in rows:
        assert row["loss"] == pytest.approx(0.5 * row["data_loss"] + 0.5 * row["distillation_loss"], rel=1e-5)


@pytest.mark.slow
def test_ema_weights_are_the_final_model_and_the_pipeline(tmp_path, pipeline_dirs, video_set):
    options = wan_options(
        pipeline_dirs["wan"], video_set, tmp_path / "run", max_train_steps=3, ema_decay=0.5, save_pipeline=True
    )
    train_wan.train(options)
    final, raw = load_mhla(tmp_path / "run" / "final"), load_mhla(tmp_path / "run" / "final-no-ema")
    pipe = MHLAWanPipeline.from_pretrained(tmp_path / "run" / "pipeline")
    final_state, raw_state, pipe_state = final.state_dict(), raw.state_dict(), pipe.transformer.state_dict()
    assert any(not torch.equal(final_state[k], raw_state[k]) for k in final_state)
    assert all(torch.equal(final_state[k], pipe_state[k]) for k in final_state)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(distillation_weight=1.5), "`distillation_weight` must be in [0, 1]"),
        (dict(distillation_weight=0.5, attention="softmax", mhla={}), "attention: softmax trains the original itself"),
        (dict(ema_decay=1.0), "`ema_decay` must be in [0, 1)"),
    ],
)
def test_bad_distillation_and_ema_options_are_refused(tmp_path, pipeline_dirs, video_set, overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        wan_options(pipeline_dirs["wan"], video_set, tmp_path / "run", **overrides)


@pytest.mark.slow
def test_distilling_from_an_mhla_pipeline_is_refused_before_training(tmp_path, pipeline_dirs, video_set):
    first = wan_options(pipeline_dirs["wan"], video_set, tmp_path / "mhla", max_train_steps=1, save_pipeline=True)
    train_wan.train(first)
    options = wan_options(tmp_path / "mhla" / "pipeline", video_set, tmp_path / "run", mhla={}, distillation_weight=1.0)
    with pytest.raises(ValueError, match="holds an MHLA transformer: give the softmax pipeline"):
        train_wan.train(options)
    assert not (tmp_path / "run").exists()
