"""The committed `mhla reproduce` results (``docs/reproduce/``): made by the committed command with its
default settings, from the digits VAE and judge committed beside them (``docs/reproduce/inputs/``), and
``docs/reproduce.md`` shows exactly that table."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from mhla_diffusion.embedded.attention_experiment import ExperimentSettings, summarise, table_markdown
from mhla_diffusion.embedded.attention_experiment import check_digits_vae
from mhla_diffusion.embedded.locations import weight_hashes

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "reproduce"
INPUTS = RESULTS / "inputs"


def _report() -> dict:
    return json.loads((RESULTS / "report.json").read_text())


def test_report_comes_from_the_default_settings_and_the_committed_vae_and_judge():
    report = _report()
    assert report["settings"] == dataclasses.asdict(ExperimentSettings())
    assert report["inputs_sha256"] == {"vae": weight_hashes(INPUTS / "vae"), "judge": weight_hashes(INPUTS / "judge")}
    check_digits_vae(json.loads((INPUTS / "vae" / "config.json").read_text()))
    s = ExperimentSettings()
    assert len(report["runs"]) == len(s.variants) * len(s.token_counts) * len(s.seeds)
    assert max(s.token_counts) >= 1024 and len(s.seeds) >= 2  # the minimum
    assert report["seconds"] == round(sum(run["seconds"] for run in report["runs"]), 1)


def test_table_and_docs_page_are_the_reports():
    report = _report()
    assert summarise(report["runs"]) == report["summary"]
    table = table_markdown(report["summary"], ExperimentSettings())
    assert (RESULTS / "table.md").read_text() == table
    page = (ROOT / "docs" / "reproduce.md").read_text()
    assert [line for line in table.splitlines() if line.startswith("| ") and line not in page] == []
    assert (ROOT / "docs" / "reproduce-fid-vs-tokens.png").stat().st_size > 10_000
