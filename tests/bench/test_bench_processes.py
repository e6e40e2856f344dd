"""`mhla bench --processes N`: the case measured in N fresh processes, the spread of MHLA / linear across
them in the printed tables and the JSON. Structure only; no timing is asserted."""

from __future__ import annotations

import json

import pytest

from helpers.cli import TINY_BENCH
from mhla_diffusion.benchmarks.bench import combine_processes, report_markdown
from mhla_diffusion.cli import main


def test_bench_processes_reports_each_process(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", *TINY_BENCH, "--no-block", "--processes", "2", "--output", str(out)]) == 0
    text = capsys.readouterr().out
    assert "MHLA / linear attention in each of 2 fresh processes" in text
    assert "| MHLA / linear, each process |" in text and "| max / min |" in text
    result = json.loads(out.read_text())
    assert result["processes"]["count"] == 2
    assert "2 fresh processes" in result["device"]
    spreads = result["processes"]["mhla_over_linear"]
    assert [row["method"] for row in spreads] == ["mhla + φ", "mhla"]
    mhla_row = next(row for row in result["attention"] if row["method"] == "mhla")
    for row in spreads:
        assert row["grid"] == "2x4x6" and len(row["per_process"]) == len(row["per_process_ms"]) == 2
        assert row["min"] == min(row["per_process"]) and row["max"] == max(row["per_process"])
        assert row["spread"] == pytest.approx(row["max"] / row["min"]) and row["spread"] >= 1
        assert row["min"] <= row["median"] <= row["max"]
    assert mhla_row["mhla_over_linear"] == spreads[1]["median"]
    # the saved JSON prints the same tables again
    assert main(["bench", "--report", str(out)]) == 0
    assert "MHLA / linear attention in each of 2 fresh processes" in capsys.readouterr().out


def _result(ratio: float, linear_ms: float = 10.0, peak: float = 1.0) -> dict:
    row = dict(grid="2x4", tokens=8, layout="1x2", blocks=2)
    return {
        "spec": {"heads": 2, "head_dim": 8, "repeats": 1, "quick_passes": 1},
        "device": "x86_64 CPU, 2 threads, fresh process",
        "device_type": "cpu",
        "dtype": "float32",
        "torch": "x",
        "attention": [
            {**row, "method": "linear", "median_ms": linear_ms, "peak_extra_mb": peak, "extra_vs_io": peak / 10},
            {
                **row,
                "method": "mhla",
                "median_ms": linear_ms * ratio,
                "peak_extra_mb": 2 * peak,
                "extra_vs_io": peak / 5,
                "sdpa_over_mhla": None,
                "mhla_over_linear": ratio,
            },
        ],
        "wan_block": [],
        "wan_transformer": [],
    }


def test_combine_processes_takes_medians_and_lists_each_process():
    combined = combine_processes([_result(1.3, 10.0, 1.0), _result(2.0, 12.0, 3.0), _result(1.4, 11.0, 2.0)])
    linear, mhla = combined["attention"]
    assert linear["median_ms"] == 11.0 and linear["peak_extra_mb"] == 3.0  # median time, largest peak
    assert mhla["mhla_over_linear"] == 1.4 and mhla["sdpa_over_mhla"] is None
    (spread,) = combined["processes"]["mhla_over_linear"]
    assert spread["per_process"] == [1.3, 2.0, 1.4]
    assert spread["per_process_ms"] == pytest.approx([13.0, 24.0, 15.4])
    assert (spread["median"], spread["min"], spread["max"]) == (1.4, 1.3, 2.0)
    assert spread["spread"] == pytest.approx(2.0 / 1.3)
    assert "| 2x4 | 1x2 | mhla | 1.30 2.00 1.40 | 1.40 | 1.30 | 2.00 | 1.54 |" in report_markdown(combined)


def test_combine_processes_refuses_different_specs():
    other = _result(1.5)
    other["attention"][1]["method"] = "mhla + φ"
    with pytest.raises(ValueError, match="different rows"):
        combine_processes([_result(1.3), other])
    with pytest.raises(ValueError, match="at least one"):
        combine_processes([])


def test_processes_only_for_the_timing_tables(capsys):
    assert main(["bench", "--traffic", "--processes", "2"]) == 2
    assert "--processes" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--processes", "0"])
    assert exit_.value.code == 2 and "expected an integer >= 1" in capsys.readouterr().err
