"""The library keeps freed CPU memory by itself on its first MHLA call (once, logged in one debug line), unless
``MHLA_KEEP_MALLOC=1``. Each case runs in a fresh interpreter, whose allocator nothing has touched yet,
and checks the effect by counting page faults (``ru_minflt``) of a re-allocated 64 MiB tensor: not a
timing test."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

#: Every test here starts processes or trains (``pytest -m 'not slow'`` skips them).
pytestmark = pytest.mark.slow

SCRIPT = r"""
import json, logging, resource
import torch
from mhla_diffusion import mhla_attention, mixing_init
from mhla_diffusion.ops import cpu_memory

records = []
handler = logging.Handler()
handler.emit = records.append
logging.getLogger("mhla_diffusion").addHandler(handler)
logging.getLogger("mhla_diffusion").setLevel(logging.DEBUG)

def faults_of_refill() -> int:
    # 64 MiB, above glibc's largest dynamic mmap threshold (32 MiB): by default a fresh mapping each time
    x = torch.ones(16 * 2**20); del x
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.ones(16 * 2**20); del x
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

report = {"retained_before": cpu_memory.malloc_retained(), "faults_before": faults_of_refill()}
q = torch.rand(1, 12, 2, 4)
for _ in range(3):  # only the first call may change anything or log
    mhla_attention(q, q, q, (3, 4), (1, 2), mixing_init((1, 2)))
# the least of three refills: now and then glibc serves one refill from a fresh mapping anyway (seen in
# about one run in five on the 2-core CI machine); a setting that did not work would fault every time
report.update(retained_after=cpu_memory.malloc_retained(), faults_after=min(faults_of_refill() for _ in range(3)),
              messages=[r.getMessage() for r in records], levels=[r.levelname for r in records],
              explicit_call=cpu_memory.retain_freed_memory())
print("REPORT " + json.dumps(report))
"""


def run_fresh(keep_malloc: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "MHLA_KEEP_MALLOC"}
    if keep_malloc is not None:
        env["MHLA_KEEP_MALLOC"] = keep_malloc
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert "REPORT " in done.stdout, done.stderr[-3000:]
    return json.loads(done.stdout.rsplit("REPORT ", 1)[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt exists on Linux only")
def test_first_cpu_call_keeps_freed_memory_once_and_logs_why():
    report = run_fresh(None)
    assert not report["retained_before"] and report["retained_after"]
    assert report["faults_before"] > 8000  # 16,384 pages of 4 KiB mapped afresh
    assert report["faults_after"] < 1000, report  # the freed heap memory is reused
    # once, although the operator ran three times; one debug line, not an INFO paragraph in a table or progress bar
    assert report["levels"] == ["DEBUG"], report["messages"]
    message = report["messages"][0]
    assert "keeps freed memory" in message and "page-faulted" in message and "MHLA_KEEP_MALLOC=1" in message
    assert "\n" not in message and len(message) < 240
    assert report["explicit_call"] is True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt exists on Linux only")
def test_keep_malloc_environment_variable_leaves_the_allocator_alone():
    report = run_fresh("1")
    assert not report["retained_before"] and not report["retained_after"]
    assert report["faults_after"] > 8000, report  # still a fresh mapping every time
    assert report["levels"] == ["DEBUG"] and "MHLA_KEEP_MALLOC=1 is set" in report["messages"][0]
    assert report["explicit_call"] is False  # entry points' retain_freed_memory() honours it too
