"""Fixtures of the evaluation tests. Helpers: :mod:`helpers.features`, :mod:`helpers.media`."""

from __future__ import annotations

import pytest

from helpers.features import StandInFeatures
from mhla_diffusion.cli import evaluate as eval_cli


@pytest.fixture
def standin() -> StandInFeatures:
    """The toy-size stand-in for the Inception feature network (fixed-seed weights)."""
    return StandInFeatures()


@pytest.fixture
def weights_and_standin(tmp_path, monkeypatch):
    """A stand-in weights file for ``--inception-weights``; the commands load :class:`StandInFeatures` for it."""
    weights = tmp_path / "inception.pth"
    weights.write_bytes(b"stand-in weights")
    monkeypatch.setattr(eval_cli, "load_feature_extractor", lambda w, device: StandInFeatures())
    return weights
