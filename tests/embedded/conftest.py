"""Fixtures of the demo-data tests. Helpers: :mod:`helpers.shapes`."""

from __future__ import annotations

from pathlib import Path

import pytest

from mhla_diffusion.embedded import DigitSplit, split_digits


@pytest.fixture(scope="session")
def digit_split() -> DigitSplit:
    """scikit-learn digits split with seed 0, once per session (loading them takes a few seconds).
    Shared: do not modify its arrays."""
    return split_digits(0)


@pytest.fixture(scope="session")
def smoke_reproduction(tmp_path_factory) -> Path:
    """``mhla reproduce --smoke`` run once per session through the CLI: its output folder. Shared: do not
    write into it."""
    from mhla_diffusion.cli import main

    out = tmp_path_factory.mktemp("reproduce") / "smoke"
    assert main(["reproduce", "--smoke", "--output", str(out)]) == 0
    return out
