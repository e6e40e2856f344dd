"""Text conditioning once per prompt (models/text_cache.py): the pipelines' outputs with the cache equal those
without it, bit for bit, while the text embedding and every cross-attention key and value projection run once per
prompt and guidance branch; the kept outputs are dropped when an input changes in place, and nothing is kept while
gradients flow (training)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers.models import WAN_CALL, seeded
from helpers.streaming import STREAM_CALL
from helpers.wan_family import call_args, pipeline_class
from mhla_diffusion import MHLAWanPipeline, MHLAWanStreamingPipeline
from mhla_diffusion.models.text_cache import TextConditioningCache, text_conditioning_modules
from mhla_diffusion.models.tiny import tiny_wan_transformer


class Recorded(TextConditioningCache):
    """The cache, remembering its last instance so a test can read its counts."""

    last: "Recorded | None" = None

    def __enter__(self):
        Recorded.last = self
        return super().__enter__()


class Uncached:
    def __init__(self, *transformers, **_):
        pass

    __enter__ = lambda self: self  # noqa: E731
    __exit__ = lambda self, *exc: None  # noqa: E731


def both_ways(monkeypatch, module: str, run):
    """``run()`` with the cache (recorded) and without it: ``(cached, uncached, cache)``."""
    monkeypatch.setattr(module + ".TextConditioningCache", Recorded)
    cached = run()
    cache = Recorded.last
    monkeypatch.setattr(module + ".TextConditioningCache", Uncached)
    return cached, run(), cache


def test_a_text_to_video_call_equals_the_uncached_one_and_projects_text_once_per_branch(pipeline_dirs, monkeypatch):
    pipe = MHLAWanPipeline.from_pretrained(pipeline_dirs["wan"], mhla_weights=pipeline_dirs["wan_mhla"])
    pipe.set_progress_bar_config(disable=True)
    steps = 3
    cached, uncached, cache = both_ways(
        monkeypatch,
        "mhla_diffusion.pipelines.wan_video",
        lambda: pipe(**{**WAN_CALL, "num_inference_steps": steps}, generator=seeded(0)).frames,
    )
    assert np.array_equal(cached, uncached)
    modules = len(text_conditioning_modules(pipe.transformer))
    assert modules == 1 + 3 * len(pipe.transformer.blocks)  # the text embedder; to_k, to_v, norm_k per block
    # guidance: the conditional and the unconditional prompt, each a forward of its own every step
    assert cache.misses == 2 * modules and cache.hits == 2 * (steps - 1) * modules
    assert "forward" not in pipe.transformer.condition_embedder.text_embedder.__dict__  # taken off after the call


@pytest.mark.parametrize("variant", ["wan2.1-i2v", "wan2.2-a14b-t2v"])
def test_image_to_video_and_two_transformers_equal_the_uncached_call(wan_family_dirs, monkeypatch, variant):
    """Wan2.1-I2V concatenates the image and text states anew every forward (found equal, not the same tensor);
    Wan2.2-A14B has two transformers, each with its own kept outputs."""
    image_to_video = variant.endswith("i2v")
    pipe = pipeline_class(image_to_video).from_pretrained(
        wan_family_dirs[variant], mhla_weights=wan_family_dirs[f"{variant}-mhla"]
    )
    pipe.set_progress_bar_config(disable=True)
    call = {**call_args(variant, image_to_video), "num_inference_steps": 3}
    cached, uncached, cache = both_ways(
        monkeypatch, "mhla_diffusion.pipelines.wan_video", lambda: pipe(**call, generator=seeded(0)).frames
    )
    assert np.array_equal(cached, uncached)
    assert cache.hits > 0 and cache.misses > 0  # A14B: the steps are shared out between the two transformers


def test_a_stream_equals_the_uncached_one_and_projects_text_once(causal_pipeline_dir, monkeypatch):
    pipe = MHLAWanStreamingPipeline.from_pretrained(causal_pipeline_dir)
    pipe.set_progress_bar_config(disable=True)
    call = {**STREAM_CALL, "num_frames": 13, "chunk_frames": 1}
    cached, uncached, cache = both_ways(
        monkeypatch, "mhla_diffusion.pipelines.wan_streaming", lambda: pipe(**call, generator=seeded(0)).frames
    )
    assert np.array_equal(cached, uncached)
    # guidance runs both prompts as one batch: one input per module for every chunk's steps and advance forward
    forwards = 4 * call["num_inference_steps"] + 3  # 4 chunks of 1 latent frame, 3 of them advance the stream
    assert cache.misses == len(text_conditioning_modules(pipe.transformer))
    assert cache.hits == (forwards - 1) * cache.misses


def _one_layer():
    """A one-layer tiny Wan transformer, its text embedder and a text input for it."""
    transformer = tiny_wan_transformer(num_layers=1).eval()
    return transformer, transformer.condition_embedder.text_embedder, torch.randn(1, 5, transformer.config.text_dim)


def test_an_input_changed_in_place_is_computed_again_and_training_keeps_nothing():
    transformer, embedder, text = _one_layer()
    with torch.no_grad(), TextConditioningCache(transformer) as cache:
        first = embedder(text)
        assert embedder(text) is first and embedder(text.clone()) is first and cache.hits == 2
        text.mul_(2.0)  # the caller wrote into the input it gave before
        changed = embedder(text)
        assert changed is not first and torch.equal(changed, embedder.__class__.forward(embedder, text))
    assert cache.misses == 2
    with TextConditioningCache(transformer) as cache:  # gradients flow into the embedder's weights
        assert embedder(text) is not embedder(text) and cache.hits == cache.misses == 0


def test_nested_blocks_keep_one_set_of_outputs():
    transformer, embedder, text = _one_layer()
    with torch.no_grad(), TextConditioningCache(transformer) as outer:
        kept = embedder(text)
        with TextConditioningCache(transformer) as inner:
            assert embedder(text) is kept and inner.hits == inner.misses == 0
        assert embedder(text) is kept and outer.hits == 2
    assert "forward" not in embedder.__dict__
    with torch.no_grad(), outer:  # entered again: its outputs are still there
        assert embedder(text) is kept and outer.hits == 3 and outer.nbytes == kept.numel() * kept.element_size()
        with pytest.raises(RuntimeError, match="already in use"):
            outer.__enter__()
    with pytest.raises(ValueError, match="capacity"):
        TextConditioningCache(transformer, capacity=0)


def test_inference_mode_inputs_are_kept_too():
    """``torch.inference_mode`` tensors count no writes; the cache keys them by identity and content alone."""
    transformer, embedder, _ = _one_layer()
    with torch.inference_mode(), TextConditioningCache(transformer) as cache:
        text = torch.randn(1, 5, transformer.config.text_dim)
        first = embedder(text)
        assert embedder(text) is first and embedder(text.clone()) is first and cache.misses == 1
