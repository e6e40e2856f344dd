"""Fixtures of the fine-tuning tests: one thread and fresh Accelerate state per test (autouse), and
read-only synthetic data sets on disk shared by the session. Helpers: :mod:`helpers.finetune`,
:mod:`helpers.media`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers.media import make_image_classes, make_video_set


@pytest.fixture(autouse=True)
def _one_thread_and_fresh_accelerate():
    """Tiny models run fastest on one thread (two threads thrash on a busy 2-core machine); each test
    gets fresh Accelerate singletons so runs with different settings can follow each other."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.fixture(scope="session")
def video_set(tmp_path_factory) -> Path:
    """Read-only synthetic text-to-video set: 8 captioned clips and one captioned image (copy it
    before changing anything)."""
    return make_video_set(tmp_path_factory.mktemp("videos"))


@pytest.fixture(scope="session")
def image_classes(tmp_path_factory) -> Path:
    """Read-only class folders 0, 1, 2 of 20x24 noisy colour images."""
    return make_image_classes(tmp_path_factory.mktemp("classes"))
