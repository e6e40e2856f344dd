"""Fixtures of the demo-data tests. Helpers: :mod:`helpers.shapes`."""

from __future__ import annotations

import pytest

from mhla_diffusion.embedded import DigitSplit, split_digits


@pytest.fixture(scope="session")
def digit_split() -> DigitSplit:
    """scikit-learn digits split with seed 0, once per session (loading them takes a few seconds).
    Shared: do not modify its arrays."""
    return split_digits(0)
