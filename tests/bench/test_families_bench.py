"""``mhla bench --families``: one row per family at a chosen size, SDPA beside MHLA, the ratios from the times."""

from __future__ import annotations

import json

import pytest

from mhla_diffusion.cli import main


def test_one_row_per_family_with_ratios_from_the_times(tmp_path, capsys):
    out = tmp_path / "families.json"
    small = ["--heads", "2", "--head-dim", "8", "--repeats", "1", "--output", str(out)]
    families = ["--family", "flux:4x6", "--family", "cogvideox:2x4x4", "--family", "ltx-video:2x4x4"]
    assert main(["bench", *families, "--sdpa-max-tokens", "300", *small]) == 0
    table = capsys.readouterr().out
    rows = {row["family"]: row for row in json.loads(out.read_text())["families"]}
    assert list(rows) == ["flux", "cogvideox", "ltx-video"] and all(f"| {name} |" in table for name in rows)
    flux, cogvideox, ltx = rows["flux"], rows["cogvideox"], rows["ltx-video"]
    assert (flux["tokens"], flux["text_tokens"], flux["heads"]) == (24, 512, "2 x 8")  # the joint text joins
    assert flux["sdpa_s"] is None and flux["sdpa_over_mhla"] is None  # 24 + 512 tokens > --sdpa-max-tokens 300
    assert (cogvideox["text_tokens"], ltx["text_tokens"]) == (226, 0)
    for row in (cogvideox, ltx):
        assert row["sdpa_over_mhla"] == pytest.approx(row["sdpa_s"] / row["mhla_s"])
    assert all(row["mhla_over_linear"] == pytest.approx(row["mhla_s"] / row["linear_s"]) for row in rows.values())
    assert main(["bench", "--family", "dit", *small[:-2], "--output", str(tmp_path / "x.json")]) == 2
    assert "--family dit: choose from wan, skyreels-v2" in capsys.readouterr().err


def test_the_docs_table_is_the_committed_runs_output():
    from pathlib import Path

    from mhla_diffusion.benchmarks.bench import format_table
    from mhla_diffusion.benchmarks.families import FAMILY_COLUMNS, FAMILY_MODELS

    root = Path(__file__).resolve().parents[2]
    result = json.loads((root / "docs" / "benchmarks" / "families-cpu.json").read_text())
    assert [row["family"] for row in result["families"]] == list(FAMILY_MODELS)
    assert format_table(result["families"], FAMILY_COLUMNS) in (root / "docs" / "speed.md").read_text()
