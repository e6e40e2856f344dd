"""Training block-causal MHLA (``mhla: {causal: true}``) by diffusion forcing: the options that the trainer refuses,
a tiny run that learns and reloads causal, and exact resume. The per-chunk noise levels themselves:
``test_finetune_objectives.py``."""

from __future__ import annotations

import functools

import pytest
import torch
import yaml

from helpers.finetune import (
    WanEvaluator,
    assert_same_final_weights,
    base_wan_transformer,
    killed_and_resumed,
    metrics,
    wan_options,
)
from mhla_diffusion import load_mhla
from mhla_diffusion.finetune import train_wan
from mhla_diffusion.models.conversion import get_mhla_conversion
from mhla_diffusion.pipelines import MHLAWanPipeline

CAUSAL = {"layout": [1, 2, 2], "causal": True, "causal_window": 1, "causal_fold": "decay"}
FORCED = {"causal_objective": "teacher_forcing", "gradient_checkpointing": False}


# ---------------------------------------------------------------------- options


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(causal_chunk_frames=0), "`causal_chunk_frames` must be >= 1"),
        (dict(causal_clean_chunks=1.5), r"`causal_clean_chunks` must be in \[0, 1\]"),
        (dict(causal_context_noise=1.0), r"`causal_context_noise` must be in \[0, 1\)"),
        (dict(causal_first_chunk_frames=0), "`causal_first_chunk_frames` must be >= 1"),
        (dict(context_parallel_degree=2), "context parallelism has no block-causal MHLA"),
        (dict(mhla={"causal": True, "lepe": True}), "cannot take `lepe`"),
        (dict(causal_objective="teacher_forcing", gradient_checkpointing=True), "set gradient_checkpointing: false"),
        (dict(**FORCED, distillation_weight=0.5), "set distillation_weight: 0"),
        (dict(**FORCED, causal_clean_chunks=0.2), "drop causal_clean_chunks"),
        (dict(causal_objective="forcing"), "`causal_objective` must be one of"),
    ],
)
def test_causal_options_the_trainer_cannot_honour_are_refused(tmp_path, overrides, message):
    values = dict(mhla=CAUSAL, **overrides) if "mhla" not in overrides else overrides
    with pytest.raises(ValueError, match=message):
        wan_options(tmp_path / "model", tmp_path / "data", tmp_path / "run", **values)


def test_causal_options_need_a_causal_model(tmp_path):
    with pytest.raises(ValueError, match="`causal_chunk_frames` sets how a block-causal model trains, but this model"):
        wan_options(tmp_path, tmp_path, tmp_path / "run", attention="softmax", mhla={}, causal_chunk_frames=2)
    from mhla_diffusion.finetune.options import DiTTrainOptions, options_from_dict

    with pytest.raises(ValueError, match="images have no time axis"):
        options_from_dict(
            DiTTrainOptions,
            dict(pretrained_model="x", data_dir="d", output_dir=str(tmp_path / "o"), mhla={"causal": True}),
        )


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(causal_chunk_frames=2), "`causal_chunk_frames` sets how a block-causal model trains, but this model"),
        (dict(mhla=CAUSAL, causal_chunk_frames=4), r"more than the 3 latent frames of num_frames 9: choose 1 \.\. 3"),
        (
            dict(mhla=CAUSAL, causal_first_chunk_frames=3),
            r"causal_first_chunk_frames 3 leaves no chunk after the first in the 3 latent frames .*choose 1 \.\. 2",
        ),
    ],
)
def test_the_loaded_model_is_checked_before_any_encoding(tmp_path, pipeline_dirs, video_set, overrides, message):
    options = wan_options(pipeline_dirs["wan"], video_set, tmp_path / "run", cache_latents=True, **overrides)
    with pytest.raises(ValueError, match=message):
        train_wan.train(options)
    assert not (tmp_path / "run" / "cache" / "latents").exists()


def test_a_causal_run_records_its_chunks_and_context_noise_for_the_stream(tmp_path, pipeline_dirs, video_set):
    def defaults(**values):
        task = train_wan.WanTask(wan_options(pipeline_dirs["wan"], video_set, tmp_path / "run", mhla=CAUSAL, **values))
        task.causal = True  # what setup finds in the converted model
        return task.generation_defaults()

    plain = defaults(causal_chunk_frames=2)
    assert plain["chunk_frames"] == 2 and "first_chunk_frames" not in plain and "context_noise" not in plain
    recorded = defaults(causal_chunk_frames=2, causal_first_chunk_frames=1, causal_context_noise=0.1)
    assert (recorded["chunk_frames"], recorded["first_chunk_frames"], recorded["context_noise"]) == (2, 1, 0.1)
    from mhla_diffusion.utils.model_defaults import checked_record

    assert checked_record(recorded, video=True, where="test") == recorded  # a pipeline folder may carry it


# ---------------------------------------------------------------------- training


@pytest.mark.slow
def test_causal_run_learns_and_reloads_causal(tmp_path, pipeline_dirs, video_set, monkeypatch):
    base = pipeline_dirs["wan"]
    drawn = []
    real = train_wan.diffusion_forcing_inputs
    monkeypatch.setattr(train_wan, "flow_match_inputs", None)  # a causal run never draws one level per clip
    monkeypatch.setattr(
        train_wan, "diffusion_forcing_inputs", lambda *a, **k: drawn.append((a[2:], k)) or real(*a, **k)
    )
    evaluate = WanEvaluator(base, video_set, chunk_frames=1)  # the last latent frame after two clean ones
    mhla = {k: v for k, v in CAUSAL.items() if k != "layout"}
    before = evaluate(base_wan_transformer(base, **mhla))
    run = tmp_path / "run"
    final = train_wan.train(wan_options(base, video_set, run, mhla=CAUSAL, max_train_steps=30, save_pipeline=True))

    trained = load_mhla(final)
    config = get_mhla_conversion(trained).config
    assert (config.causal, config.causal_window, config.causal_fold) == (True, 1, "decay")
    after = evaluate(trained)
    assert after < 0.8 * before, (before, after)
    steps = [r for r in metrics(run) if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 31))
    assert len(drawn) == 30 and drawn[0] == (  # chunks of 1 frame, 2 x 2 tokens
        (1, 4, 0.5),
        {"logit_mean": 0.0, "logit_std": 1.0, "shift": 3.0, "first_chunk_frames": None, "context_noise": 0.0},
    )
    recorded = yaml.safe_load((run / "run_config.yaml").read_text())
    assert recorded["mhla"] == CAUSAL and recorded["causal_chunk_frames"] == 1

    pipe = MHLAWanPipeline.from_pretrained(run / "pipeline")
    assert get_mhla_conversion(pipe.transformer).config == config
    x, text = torch.randn(1, 16, 3, 4, 4), torch.randn(1, 16, 32)
    timesteps = torch.tensor([0, 0, 0, 0, 0, 0, 0, 0, 700, 700, 700, 700])[None]  # clean context, noisy last frame
    with torch.no_grad():
        torch.testing.assert_close(
            pipe.transformer(hidden_states=x, timestep=timesteps, encoder_hidden_states=text).sample,
            trained(hidden_states=x, timestep=timesteps, encoder_hidden_states=text).sample,
        )
        changed = x.clone()
        changed[:, :, 2] += 1  # a later frame never reaches an earlier one
        out, out_changed = (
            trained(hidden_states=h, timestep=timesteps, encoder_hidden_states=text).sample for h in (x, changed)
        )
        torch.testing.assert_close(out[:, :, :2], out_changed[:, :, :2])


@pytest.mark.slow
def test_causal_resume_equals_uninterrupted(tmp_path, pipeline_dirs, video_set):
    common = dict(
        mhla=CAUSAL,
        causal_chunk_frames=2,
        caption_dropout=0.5,
        max_train_steps=5,
        checkpointing_steps=2,
        ema_decay=0.8,
    )
    options = functools.partial(wan_options, pipeline_dirs["wan"], video_set, **common)
    train_wan.train(options(tmp_path / "a"))
    killed_and_resumed(train_wan.train, options, tmp_path / "b", at=3)
    for tensors in assert_same_final_weights(tmp_path / "a", tmp_path / "b").values():
        assert any(k.endswith(".processor.fold_decay_logit") for k in tensors)


@pytest.mark.slow
def test_a_teacher_forced_run_learns_from_the_clean_copy(tmp_path, pipeline_dirs, video_set, monkeypatch):
    base = pipeline_dirs["wan"]
    forced, real = [], train_wan.teacher_forcing_inputs
    monkeypatch.setattr(train_wan, "diffusion_forcing_inputs", None)  # teacher forcing never draws these
    monkeypatch.setattr(train_wan, "teacher_forcing_inputs", lambda *a, **k: forced.append(a[2:]) or real(*a, **k))
    evaluate = WanEvaluator(base, video_set, chunk_frames=1)  # the last latent frame after two clean ones
    before = evaluate(base_wan_transformer(base, **{k: v for k, v in CAUSAL.items() if k != "layout"}))
    options = dict(mhla=CAUSAL, **FORCED, max_train_steps=30)
    final = train_wan.train(wan_options(base, video_set, tmp_path / "run", **options))
    after = evaluate(load_mhla(final))
    assert after < 0.8 * before, (before, after)
    assert len(forced) == 30 and forced[0][:2] == (1, 4)  # chunks of 1 latent frame, 2 x 2 tokens
