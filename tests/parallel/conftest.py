"""One start of the gloo processes per group size, shared by the context-parallel tests.

Starting processes costs far more than the tiny computations, so each group size runs every case once
(:func:`helpers.context_parallel.parallel_suite`) and the tests assert on the results.
"""

from __future__ import annotations

import pytest

from helpers.context_parallel import parallel_suite
from mhla_diffusion.models.context_parallel import run_cpu_processes

#: The group size that also runs the tiny pipeline and the command line (``text-to-video --context-parallel``).
PIPELINE_WORLD_SIZE = 2


@pytest.fixture(scope="session")
def parallel_output_dir(tmp_path_factory):
    """Where the command-line runs of the context-parallel processes write (``one/``: one process, ``split/``)."""
    return tmp_path_factory.mktemp("context-parallel-cli")


@pytest.fixture(scope="session")
def parallel_results(pipeline_dirs, parallel_output_dir, wan_family_dirs):
    """``parallel_results(P)``: every rank's results of :func:`parallel_suite` on ``P`` processes.

    Run once per ``P``.
    """
    cache: dict[int, list] = {}

    def results(world_size: int) -> list:
        if world_size not in cache:
            extra = (
                (pipeline_dirs, str(parallel_output_dir), wan_family_dirs) if world_size == PIPELINE_WORLD_SIZE else ()
            )
            cache[world_size] = run_cpu_processes(parallel_suite, world_size, *extra, timeout=300)
        return cache[world_size]

    return results
