"""Feature interface: sFID layout, TF1 resize, the stand-in's contract, agreement with torchmetrics' FID."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch_fidelity.interpolate_compat_tensorflow import interpolate_bilinear_2d_like_tensorflow1x

from helpers.features import PoolOnly
from helpers.media import random_images, smooth_images
from mhla_diffusion.eval import ArrayImages, Reference, evaluate
from mhla_diffusion.eval.features import flatten_spatial, spatial_features


def test_sfid_features_are_flattened_height_width_channel():
    n, c, h, w = 2, 9, 3, 4
    idx_n, idx_c, idx_y, idx_x = np.meshgrid(np.arange(n), np.arange(c), np.arange(h), np.arange(w), indexing="ij")
    fmap = torch.from_numpy(1000 * idx_n + 100 * idx_c + 10 * idx_y + idx_x)  # value encodes (n, c, y, x)
    flat = flatten_spatial(spatial_features(fmap, 7))
    assert flat.shape == (2, h * w * 7)
    for sample in range(n):
        for y in range(h):
            for x in range(w):
                for channel in range(7):
                    assert flat[sample, (y * w + x) * 7 + channel] == 1000 * sample + 100 * channel + 10 * y + x


def tf1_legacy_resize(image: np.ndarray, out_h: int, out_w: int) -> np.ndarray:
    """The facts' formula, per axis: src = i * in / out, i0 = floor(src), i1 = min(i0 + 1, in - 1)."""

    def axis(n_in: int, n_out: int):
        src = np.arange(n_out) * (n_in / n_out)
        i0 = np.floor(src).astype(int)
        return i0, np.minimum(i0 + 1, n_in - 1), src - i0

    y0, y1, wy = axis(image.shape[0], out_h)
    x0, x1, wx = axis(image.shape[1], out_w)
    rows = (1 - wy)[:, None] * image[y0] + wy[:, None] * image[y1]
    return (1 - wx)[None, :] * rows[:, x0] + wx[None, :] * rows[:, x1]


@pytest.mark.parametrize("size_in, size_out", [((2, 2), (4, 4)), ((5, 7), (11, 3)), ((8, 8), (3, 3)), ((6, 5), (6, 5))])
def test_resize_is_tf1_legacy_bilinear(size_in, size_out):
    image = np.random.default_rng(0).uniform(0, 255, size=size_in)
    got = interpolate_bilinear_2d_like_tensorflow1x(
        torch.from_numpy(image)[None, None], size=size_out, align_corners=False
    )[0, 0].numpy()
    # torch-fidelity (like TF) computes the source coordinates in float32: agreement to float32 precision.
    np.testing.assert_allclose(got, tf1_legacy_resize(image, *size_out), rtol=1e-6, atol=1e-4)
    if size_in == size_out:
        np.testing.assert_allclose(got, image, atol=1e-9)


def test_tf1_resize_differs_from_torch_half_pixel_bilinear():
    image = torch.arange(4.0).reshape(1, 1, 2, 2)
    tf1 = interpolate_bilinear_2d_like_tensorflow1x(image, size=(4, 4), align_corners=False)
    half_pixel = torch.nn.functional.interpolate(image, size=(4, 4), mode="bilinear", align_corners=False)
    assert tf1[0, 0, 0].tolist() == [0.0, 0.5, 1.0, 1.0]  # legacy: edge sample repeated at the end
    assert not torch.allclose(tf1, half_pixel)


def test_standin_has_the_extractor_interface(standin):
    images = torch.from_numpy(random_images(3, size=(10, 14))).permute(0, 3, 1, 2)
    features = standin(images)
    assert set(features) == {"pool", "spatial", "logits_unbiased"}
    assert features["pool"].shape == (3, standin.pool_dim)
    assert features["spatial"].shape == (3, *standin.spatial_shape)
    assert features["logits_unbiased"].shape == (3, standin.num_logits)
    assert standin.spatial_dim == 4 * 4 * 7
    assert not standin.train().training
    with pytest.raises(ValueError, match="uint8"):
        standin(images.float())
    with pytest.raises(ValueError, match=r"\(N, 3, H, W\)"):
        standin(images[:, :2])


def test_fid_agrees_with_torchmetrics_given_the_same_features(standin):
    from torchmetrics.image.fid import FrechetInceptionDistance

    real = smooth_images(48, seed=1)
    fake = smooth_images(40, seed=2, brightness=30.0)
    metric = FrechetInceptionDistance(feature=PoolOnly(standin), normalize=False)
    metric.update(torch.from_numpy(real).permute(0, 3, 1, 2), real=True)
    metric.update(torch.from_numpy(fake).permute(0, 3, 1, 2), real=False)
    expected = metric.compute().item()

    result = evaluate(
        ArrayImages(fake),
        Reference("real", ArrayImages(real)),
        standin,
        batch_size=16,
        with_precision_recall=False,
        progress=False,
    )
    assert expected > 0.01
    assert result["metrics"]["fid"] == pytest.approx(expected, rel=1e-5)
