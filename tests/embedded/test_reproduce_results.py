"""The committed `mhla reproduce` results (``docs/reproduce/``): made by the committed command with its default
settings, complete, and the table, reading and figures beside the report are computed from it.

The checks run on the smoke run's folder in every session, and on the committed folder once it holds a report
of the current design (``schema`` :data:`~mhla_diffusion.embedded.attention_experiment.SCHEMA`); until the full
run is committed, ``docs/reproduce/`` holds no such report and that test skips, naming why.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.reproduce import check_outputs_come_from_report, check_report_is_complete
from mhla_diffusion.embedded.attention_experiment import SCHEMA, ExperimentSettings

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "reproduce"


@pytest.mark.slow  # trains
def test_smoke_outputs_come_from_its_report_and_settings(smoke_reproduction):
    report = check_outputs_come_from_report(smoke_reproduction)
    check_report_is_complete(report, ExperimentSettings.smoke())


def test_committed_results_come_from_the_default_settings():
    path = RESULTS / "report.json"
    report = json.loads(path.read_text()) if path.exists() else {}
    if report.get("schema") != SCHEMA:
        pytest.skip(
            f"{RESULTS / 'report.json'} holds no report of schema {SCHEMA!r} yet; "
            "commit the full run's folder (`mhla reproduce`, then copy runs/reproduce/ there)"
        )
    s = ExperimentSettings()
    check_report_is_complete(report, s)
    check_outputs_come_from_report(RESULTS)
    # the minimum design
    assert max(s.token_counts) >= 4096 and len(s.part_a_seeds) >= 5 and len(s.part_b_seeds) >= 4
