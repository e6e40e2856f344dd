"""``attention: softmax`` with ``softmax_block_causal: true``: the streaming teacher, a softmax model trained
block-causal over latent frames by the diffusion forcing of block-causal MHLA; the options it needs, and a tiny
run whose saved pipeline streams with a KV cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers.finetune import wan_options
from helpers.models import seeded
from helpers.streaming import one_pass_stream
from mhla_diffusion import MHLAWanStreamingPipeline, load_transformer
from mhla_diffusion.finetune import train_wan
from mhla_diffusion.models.kv_cache import BLOCK_CAUSAL_KEY, KVCacheStream, kv_cache_processors

SOFTMAX = dict(attention="softmax", mhla={})


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(softmax_block_causal=True), "softmax_block_causal makes softmax self-attention block-causal, but "),
        (dict(**SOFTMAX, causal_chunk_frames=2), "this model is not causal: .*softmax_block_causal: true"),
        (
            dict(**SOFTMAX, softmax_block_causal=True, context_parallel_degree=2),
            "context parallelism has no block-causal MHLA or softmax",
        ),
    ],
)
def test_options_the_trainer_cannot_honour_are_refused(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        wan_options(tmp_path / "model", tmp_path / "data", tmp_path / "run", **overrides)


def test_the_causal_options_go_with_softmax_block_causal(tmp_path):
    options = wan_options(
        tmp_path, tmp_path, tmp_path / "run", **SOFTMAX, softmax_block_causal=True, causal_chunk_frames=2
    )
    assert options._causal_asked() is True


@pytest.mark.slow
def test_a_block_causal_softmax_run_trains_by_diffusion_forcing_and_its_pipeline_streams(
    tmp_path, pipeline_dirs, video_set, monkeypatch
):
    drawn = []
    real = train_wan.diffusion_forcing_inputs
    monkeypatch.setattr(train_wan, "flow_match_inputs", None)  # a block-causal run never draws one level per clip
    monkeypatch.setattr(train_wan, "diffusion_forcing_inputs", lambda *a, **k: drawn.append(a[2:]) or real(*a, **k))
    run = tmp_path / "run"
    options = wan_options(
        pipeline_dirs["wan"],
        video_set,
        run,
        **SOFTMAX,
        softmax_block_causal=True,
        max_train_steps=2,
        save_pipeline=True,
    )
    final = train_wan.train(options)
    assert len(drawn) == 2 and drawn[0][:3] == (1, 4, 0.5)  # chunks of 1 latent frame of 2 x 2 tokens
    assert load_transformer(str(final)).config[BLOCK_CAUSAL_KEY] is True  # the final transformer records it too

    pipe = MHLAWanStreamingPipeline.from_pretrained(run / "pipeline")
    pipe.set_progress_bar_config(disable=True)
    assert [p.block_causal for p in kv_cache_processors(pipe.transformer)] == [True, True]
    assert isinstance(pipe.make_stream(), KVCacheStream)
    call = dict(
        prompt="a red circle moving left",
        negative_prompt="",
        height=32,
        width=32,
        num_frames=13,
        chunk_frames=1,
        num_inference_steps=2,
        guidance_scale=2.0,
        max_sequence_length=16,
    )
    frames = pipe(**call, generator=seeded(0)).frames
    assert frames.shape == (1, 13, 32, 32, 3)
    np.testing.assert_allclose(frames, one_pass_stream(pipe, call, seeded(0)), rtol=0, atol=1e-5)

    # the trained transformer is block-causal: a later frame never reaches an earlier one
    x, text = torch.randn(1, 16, 3, 4, 4), torch.randn(1, 16, 32)
    changed = x.clone()
    changed[:, :, 2] += 1
    with torch.no_grad():
        out, out_changed = (pipe.transformer(h, torch.tensor([500.0]), text).sample for h in (x, changed))
    torch.testing.assert_close(out[:, :, :2], out_changed[:, :, :2])
    assert (out[:, :, 2] - out_changed[:, :, 2]).abs().max() > 1e-4


@pytest.mark.slow
def test_a_block_causal_softmax_run_trains_by_teacher_forcing(tmp_path, pipeline_dirs, video_set, monkeypatch):
    from mhla_diffusion.models import teacher_forcing

    entered = []
    real = teacher_forcing.TeacherForcing.__enter__
    monkeypatch.setattr(train_wan, "diffusion_forcing_inputs", None)  # teacher forcing never draws these
    monkeypatch.setattr(teacher_forcing.TeacherForcing, "__enter__", lambda self: entered.append(self) or real(self))
    options = wan_options(
        pipeline_dirs["wan"],
        video_set,
        tmp_path / "run",
        **SOFTMAX,
        softmax_block_causal=True,
        causal_objective="teacher_forcing",
        gradient_checkpointing=False,
        max_train_steps=2,
    )
    train_wan.train(options)
    assert len(entered) == 2 and entered[0].chunk_rows == [1, 1, 1]  # the 3 latent frames, a chunk each
    assert all(type(p).__name__ == "KVCacheWanAttnProcessor" for p in entered[0].processors)
