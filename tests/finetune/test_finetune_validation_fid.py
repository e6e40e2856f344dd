"""Validation FID during fine-tuning: logged at the configured steps and at the end, skipped with one
line without Inception weights, bad options refused before the run folder is touched.

The Inception network has the real architecture and random weights (the real file is not available),
and the reference statistics are computed with the same network.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch

from helpers.features import StandInFeatures, inception_template_state_dict
from helpers.finetune import dit_options, metrics
from mhla_diffusion.eval.evaluate import make_reference
from mhla_diffusion.eval.images import ArrayImages
from mhla_diffusion.eval.inception_weights import INCEPTION_WEIGHTS_ENV
from mhla_diffusion.finetune import train_dit


@pytest.fixture(autouse=True)
def _one_blas_thread():
    """FID's 2048 x 2048 eigendecompositions on one BLAS thread: OpenBLAS's spinning threads are several times
    slower on a busy 2-core machine (the conftest limits torch's threads only)."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # optional: only speed is at stake
        yield
        return
    with threadpool_limits(1, user_api="blas"):
        yield


@pytest.fixture(scope="module")
def inception(tmp_path_factory):
    """``(weights file, reference .npz)``: random-weight Inception and statistics of 6 noise images under it."""
    from mhla_diffusion.eval.inception import InceptionV3Features

    folder = tmp_path_factory.mktemp("fid")
    weights = folder / "random-inception.pth"
    torch.save(inception_template_state_dict(), weights)
    images = np.random.default_rng(0).integers(0, 256, (6, 16, 16, 3), dtype=np.uint8)
    reference = folder / "reference.npz"
    make_reference(ArrayImages(images), InceptionV3Features(weights), reference, pr_images=0, progress=False)
    return weights, reference


@pytest.mark.slow
def test_dit_logs_validation_fid_at_the_configured_steps_and_the_end(
    tmp_path, pipeline_dirs, image_classes, inception, monkeypatch
):
    weights, reference = inception
    monkeypatch.delenv(INCEPTION_WEIGHTS_ENV, raising=False)
    options = dit_options(
        pipeline_dirs["dit"],
        image_classes,
        tmp_path / "run",
        max_train_steps=3,
        validation_fid_reference=str(reference),
        validation_fid_steps=2,
        validation_fid_samples=3,
        validation_fid_batch_size=2,
        validation_num_inference_steps=2,
        inception_weights=str(weights),
    )
    train_dit.train(options)
    rows = metrics(tmp_path / "run")
    fid_rows = [r for r in rows if "validation/fid" in r]
    assert [r["step"] for r in fid_rows] == [2, 3]  # every 2 steps, and at the end
    for row in fid_rows:  # random Inception weights: tiny but finite distances
        assert math.isfinite(row["validation/fid"]) and row["validation/fid"] >= 0
        assert math.isfinite(row["validation/sfid"]) and row["validation/sfid"] >= 0
    assert len([r for r in rows if "loss" in r]) == 3


@pytest.mark.slow
def test_without_inception_weights_validation_fid_is_skipped_with_one_line(
    tmp_path, pipeline_dirs, image_classes, inception, monkeypatch, caplog
):
    _, reference = inception
    monkeypatch.delenv(INCEPTION_WEIGHTS_ENV, raising=False)
    options = dit_options(
        pipeline_dirs["dit"],
        image_classes,
        tmp_path / "run",
        max_train_steps=1,
        validation_fid_reference=str(reference),
        validation_fid_steps=1,
        validation_fid_samples=2,
    )
    with caplog.at_level(logging.WARNING, logger="mhla_diffusion.finetune.validation_fid"):
        train_dit.train(options)
    skipped = [r.getMessage() for r in caplog.records if "validation FID skipped" in r.getMessage()]
    assert len(skipped) == 1 and "\n" not in skipped[0]
    assert "inception_weights" in skipped[0] and INCEPTION_WEIGHTS_ENV in skipped[0]
    assert not [r for r in metrics(tmp_path / "run") if "validation/fid" in r]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(validation_fid_steps=0), "`validation_fid_steps` must be >= 1"),
        (dict(validation_fid_samples=0), "`validation_fid_samples` must be >= 1"),
        (dict(validation_fid_samples=1), "`validation_fid_samples` must be >= 2"),
        (dict(validation_fid_batch_size=0), "`validation_fid_batch_size` must be >= 1"),
    ],
)
def test_bad_numbers_are_refused(tmp_path, pipeline_dirs, image_classes, inception, overrides, message):
    with pytest.raises(ValueError, match=message):
        dit_options(
            pipeline_dirs["dit"],
            image_classes,
            tmp_path / "run",
            validation_fid_reference=str(inception[1]),
            **overrides,
        )


def test_inception_weights_without_a_reference_is_refused(tmp_path, pipeline_dirs, image_classes, inception):
    with pytest.raises(ValueError, match="set `validation_fid_reference`"):
        dit_options(pipeline_dirs["dit"], image_classes, tmp_path / "run", inception_weights=str(inception[0]))


def test_wan_validation_fid_needs_prompts(tmp_path, pipeline_dirs, video_set, inception):
    from helpers.finetune import wan_options

    with pytest.raises(ValueError, match="validation_prompts"):
        wan_options(pipeline_dirs["wan"], video_set, tmp_path / "run", validation_fid_reference=str(inception[1]))


def _refused(tmp_path, pipeline_dirs, image_classes, error, match, **overrides):
    options = dit_options(pipeline_dirs["dit"], image_classes, tmp_path / "run", **overrides)
    with pytest.raises(error, match=match):
        train_dit.train(options)
    assert not (tmp_path / "run").exists()  # refused before any work


def test_missing_or_non_adm_reference_is_refused_before_any_work(tmp_path, pipeline_dirs, image_classes, inception):
    weights = str(inception[0])
    _refused(
        tmp_path,
        pipeline_dirs,
        image_classes,
        FileNotFoundError,
        "does not exist",
        validation_fid_reference=str(tmp_path / "nowhere.npz"),
        inception_weights=weights,
    )
    images_only = tmp_path / "images.npz"
    np.savez(images_only, arr_0=np.zeros((2, 4, 4, 3), np.uint8))
    _refused(
        tmp_path,
        pipeline_dirs,
        image_classes,
        ValueError,
        "lacks mu, sigma, mu_s, sigma_s",
        validation_fid_reference=str(images_only),
        inception_weights=weights,
    )
    not_npz = tmp_path / "reference.txt"
    not_npz.write_text("x")
    _refused(
        tmp_path,
        pipeline_dirs,
        image_classes,
        ValueError,
        "expected an ADM .npz",
        validation_fid_reference=str(not_npz),
        inception_weights=weights,
    )


def test_an_explicit_weights_path_that_is_missing_is_an_error(
    tmp_path, pipeline_dirs, image_classes, inception, monkeypatch
):
    monkeypatch.delenv(INCEPTION_WEIGHTS_ENV, raising=False)
    _refused(
        tmp_path,
        pipeline_dirs,
        image_classes,
        FileNotFoundError,
        "nowhere.pth",
        validation_fid_reference=str(inception[1]),
        inception_weights=str(tmp_path / "nowhere.pth"),
    )
    monkeypatch.setenv(INCEPTION_WEIGHTS_ENV, str(tmp_path / "also-nowhere.pth"))
    _refused(
        tmp_path,
        pipeline_dirs,
        image_classes,
        FileNotFoundError,
        "also-nowhere.pth",
        validation_fid_reference=str(inception[1]),
    )


class _StandInWithWeights(StandInFeatures):
    def __init__(self, weights=None, device="cpu") -> None:
        super().__init__()


@pytest.mark.slow
def test_wan_per_frame_fid_counts_every_frame_of_every_clip(tmp_path, pipeline_dirs, video_set, inception, monkeypatch):
    from helpers.finetune import wan_options
    from mhla_diffusion.finetune import train_wan

    shapes = []
    original = train_wan.WanTask.fid_samples

    def recording(self, model, indices):
        images = original(self, model, indices)
        shapes.append((list(indices), images.shape))
        return images

    monkeypatch.setattr(train_wan.WanTask, "fid_samples", recording)
    # The toy feature network of the evaluation tests in place of Inception (the per-frame plumbing is
    # what is tested here; the DiT test above runs the real architecture).
    monkeypatch.setattr("mhla_diffusion.eval.inception.InceptionV3Features", _StandInWithWeights)
    weights, reference = inception[0], tmp_path / "standin-reference.npz"
    images = np.random.default_rng(1).integers(0, 256, (6, 32, 32, 3), dtype=np.uint8)
    make_reference(ArrayImages(images), StandInFeatures(), reference, pr_images=0, progress=False)
    options = wan_options(
        pipeline_dirs["wan"],
        video_set,
        tmp_path / "run",
        max_train_steps=1,
        validation_prompts=["a red ball", "a blue cube"],
        validation_num_frames=5,
        validation_num_inference_steps=2,
        validation_fid_reference=str(reference),
        validation_fid_samples=2,
        inception_weights=str(weights),
    )
    train_wan.train(options)
    assert shapes == [([0, 1], (2 * 5, 32, 32, 3))]  # 2 clips x 5 frames, each frame one image
    (row,) = [r for r in metrics(tmp_path / "run") if "validation/fid" in r]
    assert row["step"] == 1 and math.isfinite(row["validation/fid"]) and math.isfinite(row["validation/sfid"])
