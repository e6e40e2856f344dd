"""Fixtures of the ``mhla reproduce`` tests. Helpers: :mod:`helpers.reproduce`."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smoke_reproduction(tmp_path_factory) -> Path:
    """``mhla reproduce --smoke`` run once per session through the CLI: its output folder. Shared: do not
    write into it."""
    from mhla_diffusion.cli import main

    out = tmp_path_factory.mktemp("reproduce") / "smoke"
    assert main(["reproduce", "--smoke", "--output", str(out)]) == 0
    return out
