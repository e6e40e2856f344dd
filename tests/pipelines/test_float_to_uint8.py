"""The project's one float -> uint8 rule (generation outputs, evaluation samples, the reproduction table)."""

from __future__ import annotations

import math

import numpy as np

from mhla_diffusion.pipelines.outputs import float_to_uint8


def test_float_to_uint8_matches_dits_rounding_elementwise():
    rng = np.random.default_rng(0)
    values = np.concatenate([rng.uniform(-0.2, 1.2, 500), np.arange(256) / 255, (np.arange(255) + 0.5) / 255])
    expected = [min(255, max(0, math.floor(255 * float(x) + 0.5))) for x in values]
    assert float_to_uint8(values).tolist() == expected


def test_uint8_passes_through_unchanged():
    image = np.arange(12, dtype=np.uint8).reshape(2, 2, 3)
    assert float_to_uint8(image) is image
