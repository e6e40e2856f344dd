"""benchmarks/teacher_forcing_step.py on the tiny causal pipeline: one teacher-forced step, its median printed."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "teacher_forcing_step.py"


def _script():
    spec = importlib.util.spec_from_file_location("teacher_forcing_step", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_times_a_teacher_forced_step_of_a_causal_pipeline(causal_pipeline_dir, capsys):
    args = [str(causal_pipeline_dir), "--batch", "2", "--frames", "3", "--latent", "4", "--chunks", "1,2"]
    assert _script().main([*args, "--warmup", "0", "--runs", "2"]) == 0
    out = capsys.readouterr().out
    assert "teacher-forced step, batch 2, 24 tokens (3 latent frames x 2 copies), chunks [1, 2]: median" in out
    with pytest.raises(SystemExit):
        _script().main([*args[:-1], "1,1"])  # chunks that do not add up to the frames
