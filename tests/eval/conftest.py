"""Fixtures of the evaluation tests. Helpers: :mod:`helpers.features`, :mod:`helpers.media`."""

from __future__ import annotations

import pytest

from helpers.features import StandInFeatures


@pytest.fixture
def standin() -> StandInFeatures:
    """The toy-size stand-in for the Inception feature network (fixed-seed weights)."""
    return StandInFeatures()
