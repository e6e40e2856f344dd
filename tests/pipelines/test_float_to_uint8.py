"""The project's one float -> uint8 rule (generation outputs, evaluation samples, the reproduction table)."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import torch

from mhla_diffusion.pipelines.outputs import float_to_uint8


def test_float_to_uint8_matches_dits_rounding_elementwise():
    rng = np.random.default_rng(0)
    values = np.concatenate([rng.uniform(-0.2, 1.2, 500), np.arange(256) / 255, (np.arange(255) + 0.5) / 255])
    expected = [min(255, max(0, math.floor(255 * float(x) + 0.5))) for x in values]
    assert float_to_uint8(values).tolist() == expected


def test_uint8_passes_through_unchanged():
    image = np.arange(12, dtype=np.uint8).reshape(2, 2, 3)
    assert float_to_uint8(image) is image


def test_decoded_pixels_in_minus_one_to_one_round_by_the_same_rule():
    """The embedded models' decoder output (float32 in [-1, 1]) near every half-step: the bytes are the rule
    applied to the exact value of each pixel, not to a float32 product rounded onto a tie."""
    from mhla_diffusion.embedded.judges.image_judge import tensor_to_uint8

    near_half_steps = np.float32((2 * np.arange(256) + 1) / 255 - 1)
    pixels = np.concatenate([near_half_steps, np.nextafter(near_half_steps, 2), np.float32([-1.5, 1.5])])
    expected = [min(255, max(0, math.floor(255 * (Fraction(float(s)) + 1) / 2 + Fraction(1, 2)))) for s in pixels]
    decoded = torch.from_numpy(pixels).reshape(1, 1, -1).expand(1, 3, -1)  # (N, 3, W)
    assert tensor_to_uint8(decoded)[0, :, 0].tolist() == expected
