"""MHLAWanStreamingPipeline (pipelines/wan_streaming.py) on a tiny block-causal MHLA Wan pipeline saved to disk:
each chunk equals one causal pass over the clean earlier chunks (past the rotary table too), the output types,
the callbacks and the progress bar, and every refusal before any work. The same equality for a saved block-causal
softmax pipeline, streamed with a KV cache."""

from __future__ import annotations

import gc
import io
import weakref

import numpy as np
import pytest
import torch

from helpers.models import seeded
from helpers.streaming import STREAM_CALL, one_pass_stream
from mhla_diffusion import MHLAWanPipeline, MHLAWanStreamingPipeline
from mhla_diffusion.models.kv_cache import KVCacheStream, kv_cache_processors
from mhla_diffusion.pipelines.wan_streaming import CONTEXT_PARALLEL_ERROR
from mhla_diffusion.utils.stream_frames import stream_chunks


@pytest.fixture(scope="module")
def pipe(causal_pipeline_dir):
    pipe = MHLAWanStreamingPipeline.from_pretrained(causal_pipeline_dir)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.parametrize(
    ("num_frames", "chunk_frames", "guidance_scale"),
    [
        (29, 2, 3.0),  # 4 chunks: 4x the base chunk
        (141, 6, 3.0),  # 36 latent frames: past the 32 rows of the rotary table
        (13, 1, 1.0),  # no guidance: the conditional pass alone (the reference's guided sum equals it)
    ],
)
def test_each_chunk_equals_one_causal_pass_over_the_clean_chunks_before(pipe, num_frames, chunk_frames, guidance_scale):
    call = {**STREAM_CALL, "num_frames": num_frames, "chunk_frames": chunk_frames, "guidance_scale": guidance_scale}
    seen = []
    frames = pipe(**call, generator=seeded(0), on_frames=seen.append).frames
    reference = one_pass_stream(pipe, call, seeded(0))
    assert frames.shape == reference.shape == (1, num_frames, 32, 48, 3)
    np.testing.assert_allclose(frames, reference, rtol=0, atol=1e-5)
    chunks = stream_chunks(num_frames, chunk_frames)
    assert [chunk.shape[1] for chunk in seen] == [chunks.video_frames(i) for i in range(chunks.num_chunks)]
    np.testing.assert_array_equal(np.concatenate(seen, axis=1), frames)


@pytest.mark.parametrize(
    ("first_chunk_frames", "context_noise", "guidance_scale"),
    [
        (1, 0.0, 3.0),  # 1 + 2 + 2 + 2 latent frames, clean context
        (2, 0.3, 3.0),  # 4 chunks of 2, each finished chunk re-noised to level 0.3 (timestep 300)
        (1, 0.15, 1.0),  # both, without guidance
    ],
)
def test_a_first_chunk_of_its_own_and_noised_context_equal_one_causal_pass(
    pipe, first_chunk_frames, context_noise, guidance_scale
):
    num_frames = 1 + 4 * (first_chunk_frames + 3 * 2 - 1)
    call = {
        **STREAM_CALL,
        "num_frames": num_frames,
        "first_chunk_frames": first_chunk_frames,
        "context_noise": context_noise,
        "guidance_scale": guidance_scale,
    }
    seen = []
    frames = pipe(**call, generator=seeded(0), on_frames=seen.append).frames
    reference = one_pass_stream(pipe, call, seeded(0))
    assert frames.shape == reference.shape == (1, num_frames, 32, 48, 3)
    np.testing.assert_allclose(frames, reference, rtol=0, atol=1e-5)
    assert [chunk.shape[1] for chunk in seen] == [1 + 4 * (first_chunk_frames - 1), 8, 8, 8]
    if context_noise:  # the noised context changes the later chunks, not the first
        plain = pipe(**{**call, "context_noise": 0.0}, generator=seeded(0)).frames
        first = seen[0].shape[1]
        np.testing.assert_array_equal(plain[:, :first], frames[:, :first])
        assert np.abs(plain[:, first:] - frames[:, first:]).max() > 1e-3


def test_context_noise_out_of_range_is_refused(pipe):
    for bad in (1.0, -0.1, True):
        with pytest.raises(ValueError, match=r"context_noise must be a noise level in \[0, 1\)"):
            pipe(**{**STREAM_CALL, "context_noise": bad})


@pytest.mark.parametrize(
    ("num_frames", "chunk_frames"),
    [(29, 2), (141, 6)],  # 4 chunks of 2 latent frames; 36 latent frames, past the 32 rows of the rotary table
)
def test_a_block_causal_softmax_model_streams_with_a_kv_cache(block_causal_softmax_dir, num_frames, chunk_frames):
    pipe = MHLAWanStreamingPipeline.from_pretrained(
        block_causal_softmax_dir
    )  # the config's mark gives back its processors
    pipe.set_progress_bar_config(disable=True)
    assert isinstance(pipe.make_stream(), KVCacheStream)
    call = {**STREAM_CALL, "num_frames": num_frames, "chunk_frames": chunk_frames}
    seen = []
    frames = pipe(**call, generator=seeded(0), on_frames=seen.append).frames
    reference = one_pass_stream(pipe, call, seeded(0))  # one block-causal pass per step over clean chunks + noisy one
    assert frames.shape == reference.shape == (1, num_frames, 32, 48, 3)
    np.testing.assert_allclose(frames, reference, rtol=0, atol=1e-5)
    assert len(seen) == stream_chunks(num_frames, chunk_frames).num_chunks
    one_pass = MHLAWanPipeline.from_pretrained(
        block_causal_softmax_dir
    )  # loads block-causal too: it generates as it was trained
    assert [p.block_causal for p in kv_cache_processors(one_pass.transformer)] == [True] * 2


def test_output_types_and_frames_left_to_the_callback(pipe):
    call = {**STREAM_CALL, "num_frames": 13, "chunk_frames": 1}  # 4 chunks of one latent frame
    frames = pipe(**call, generator=seeded(1)).frames
    pt = pipe(**call, generator=seeded(1), output_type="pt").frames
    np.testing.assert_allclose(pt.permute(0, 1, 3, 4, 2).numpy(), frames, rtol=0, atol=1e-6)
    pil = pipe(**call, generator=seeded(1), output_type="pil").frames
    assert len(pil) == 1 and len(pil[0]) == 13
    np.testing.assert_array_equal(np.stack([np.asarray(image) for image in pil[0]]), (frames[0] * 255).round())
    latents = pipe(**call, generator=seeded(1), output_type="latent").frames
    assert latents.shape == (1, 16, 4, 4, 6)
    config = pipe.vae.config  # the latents are normalised as WanPipeline's output_type="latent" gives them
    mean, std = (torch.tensor(v).view(1, -1, 1, 1, 1) for v in (config.latents_mean, config.latents_std))
    with torch.no_grad():
        whole = pipe.video_processor.postprocess_video(pipe.vae.decode(latents * std + mean).sample, output_type="np")
    np.testing.assert_allclose(whole, frames, rtol=0, atol=1e-5)
    kept, handed_out = [], []

    def on_frames(chunk):
        kept.append(chunk.copy())
        handed_out.append(weakref.ref(chunk))

    output = pipe(**call, generator=seeded(1), on_frames=on_frames, return_frames=False)
    assert output.frames is None and len(kept) == 4
    np.testing.assert_array_equal(np.concatenate(kept, axis=1), frames)
    gc.collect()
    assert [ref() for ref in handed_out] == [None] * 4  # the pipeline keeps no chunk's frames


def test_step_callback_progress_bar_and_interrupt(pipe):
    calls = []

    def callback(p, step, timestep, values):
        calls.append((p.current_chunk, step, tuple(values["latents"].shape)))
        if p.current_chunk == 2 and step == 0:
            p._interrupt = True  # Diffusers' way to stop: this chunk's other steps are skipped, and the video ends
        return {}

    bar = io.StringIO()
    pipe.set_progress_bar_config(file=bar)
    try:
        seen = []
        frames = pipe(**STREAM_CALL, generator=seeded(0), callback_on_step_end=callback, on_frames=seen.append).frames
    finally:
        pipe.set_progress_bar_config(disable=True)
    assert [call[:2] for call in calls] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0)]
    assert {call[2] for call in calls} == {(1, 16, 2, 4, 6)}
    assert frames.shape[1] == 5 + 8 + 8 and len(seen) == 3
    assert "chunk 3/4" in bar.getvalue() and "5/8" in bar.getvalue()
    assert pipe.current_chunk is None


@pytest.fixture
def no_work(monkeypatch):
    """Every check must come before the prompt is encoded: encoding fails the test."""

    def encode_prompt(*args, **kwargs):
        raise AssertionError("the pipeline started working before refusing the call")

    monkeypatch.setattr(MHLAWanStreamingPipeline, "encode_prompt", encode_prompt)


def test_bad_calls_are_refused_before_any_work(pipe, pipeline_dirs, monkeypatch, no_work):
    with pytest.raises(ValueError, match=r"30 frames do not stream in chunks of 2 .*nearest: 29 or 37"):
        pipe(**{**STREAM_CALL, "num_frames": 30})
    with pytest.raises(ValueError, match="output_type must be one of np, pt, pil, latent"):
        pipe(**{**STREAM_CALL, "output_type": "gif"})
    with pytest.raises(ValueError, match="height 36 must be a positive multiple of 16"):
        pipe(**{**STREAM_CALL, "height": 36})
    with monkeypatch.context() as patch:
        patch.setattr(pipe.transformer, "_parallel_config", object(), raising=False)
        with pytest.raises(ValueError, match="no context parallelism") as error:
            pipe(**STREAM_CALL)
        assert str(error.value) == CONTEXT_PARALLEL_ERROR
    bidirectional = MHLAWanStreamingPipeline.from_pretrained(
        pipeline_dirs["wan"], mhla_weights=pipeline_dirs["wan_mhla"]
    )
    softmax = MHLAWanStreamingPipeline.from_pretrained(pipeline_dirs["wan"])
    for model in (bidirectional, softmax):
        with pytest.raises(
            ValueError, match=r"no block-causal MHLA layer.*MHLAConfig\(causal=True\).*softmax_block_causal"
        ):
            model(**STREAM_CALL)


def test_the_recorded_chunk_size_is_the_default(pipe, tmp_path):
    call = {**STREAM_CALL, "num_frames": 13}  # 4 latent frames: the rule's default would be chunks of 2
    del call["chunk_frames"]
    sizes = []
    pipe(**call, generator=seeded(1), on_frames=lambda chunk: sizes.append(chunk.shape[1]), return_frames=False)
    assert sizes == [5, 8]
    pipe.record_generation_defaults(chunk_frames=1)  # what the trainer records for a model trained in chunks of 1
    try:
        pipe.save_pretrained(tmp_path / "recorded")
        loaded = MHLAWanStreamingPipeline.from_pretrained(tmp_path / "recorded")
        loaded.set_progress_bar_config(disable=True)
        sizes.clear()
        loaded(**call, generator=seeded(1), on_frames=lambda chunk: sizes.append(chunk.shape[1]), return_frames=False)
        assert sizes == [1, 4, 4, 4]
        sizes.clear()  # an explicit chunk size wins
        loaded(**call, chunk_frames=2, generator=seeded(1), on_frames=lambda c: sizes.append(c.shape[1]))
        assert sizes == [5, 8]
    finally:
        pipe.register_to_config(_mhla_generation_defaults=None)


def test_a_recorded_first_chunk_and_context_noise_are_the_defaults(pipe, tmp_path):
    call = {**STREAM_CALL, "num_frames": 25}  # 7 latent frames: 1 + 3 x 2
    del call["chunk_frames"]
    explicit = pipe(**call, chunk_frames=2, first_chunk_frames=1, context_noise=0.2, generator=seeded(1)).frames
    pipe.record_generation_defaults(chunk_frames=2, first_chunk_frames=1, context_noise=0.2)  # as the trainer does
    try:
        pipe.save_pretrained(tmp_path / "recorded")
        loaded = MHLAWanStreamingPipeline.from_pretrained(tmp_path / "recorded")
        loaded.set_progress_bar_config(disable=True)
        sizes = []
        frames = loaded(**call, generator=seeded(1), on_frames=lambda c: sizes.append(c.shape[1])).frames
        assert sizes == [1, 8, 8, 8]
        np.testing.assert_array_equal(frames, explicit)
        sizes.clear()  # an explicit chunk size wins over both chunk sizes; the context noise stays recorded
        loaded(**{**STREAM_CALL, "num_frames": 29}, generator=seeded(1), on_frames=lambda c: sizes.append(c.shape[1]))
        assert sizes == [5, 8, 8, 8]
    finally:
        pipe.register_to_config(_mhla_generation_defaults=None)


def test_a_stream_given_its_own_first_chunks_continues_as_it_did(pipe, block_causal_softmax_dir):
    """``context_latents``: the first chunks given instead of generated. Given a stream's own first chunks and the
    same seed, the rest is the same (MHLA state and softmax KV cache, with context noise); the frames decode the
    given latents."""
    softmax = MHLAWanStreamingPipeline.from_pretrained(block_causal_softmax_dir)
    softmax.set_progress_bar_config(disable=True)
    call = {**STREAM_CALL, "context_noise": 0.2}
    for streaming in (pipe, softmax):
        latents = streaming(**call, output_type="latent", generator=seeded(5)).frames
        for given in (2, 6):  # one chunk, three chunks of the four
            context = latents[:, :, :given]
            continued = streaming(**call, output_type="latent", generator=seeded(5), context_latents=context).frames
            torch.testing.assert_close(continued, latents, rtol=0, atol=1e-6)
    frames = pipe(**STREAM_CALL, generator=seeded(5)).frames
    latents = pipe(**STREAM_CALL, output_type="latent", generator=seeded(5)).frames
    given = pipe(**STREAM_CALL, generator=seeded(5), context_latents=latents[:, :, :2]).frames
    np.testing.assert_allclose(given, frames, atol=1e-5)


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        ((1, 16, 3, 4, 6), "not whole first chunks"),  # 3 latent frames: chunks end at 2, 4, 6
        ((1, 16, 8, 4, 6), "not whole first chunks"),  # the whole video: nothing left to generate
        ((1, 3, 2, 4, 6), "16 channels"),
        ((1, 16, 2, 4, 4), "4x6 latents"),
        ((2, 16, 2, 4, 6), "give 1"),
    ],
)
def test_context_latents_that_do_not_fit_are_refused(pipe, shape, message, no_work):
    with pytest.raises(ValueError, match=message):
        pipe(**STREAM_CALL, context_latents=torch.zeros(shape))
