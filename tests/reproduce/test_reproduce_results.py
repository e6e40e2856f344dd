"""The committed `mhla reproduce` results (``docs/reproduce/``): made by the committed command with its default
settings (schema :data:`~mhla_diffusion.reproduce.experiment.SCHEMA`), complete, and the table,
reading and figures beside the report are computed from it; so are the README section "Attentions compared"
and ``docs/reproduce.md`` (:mod:`~mhla_diffusion.reproduce.docs` writes them from it).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.reproduce import check_outputs_come_from_report, check_report_is_complete
from mhla_diffusion.reproduce.docs import readme_section, replace_readme_section, reproduce_doc
from mhla_diffusion.reproduce.experiment import SCHEMA, ExperimentSettings

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "reproduce"


@pytest.mark.slow  # trains
def test_smoke_outputs_come_from_its_report_and_settings(smoke_reproduction):
    report = check_outputs_come_from_report(smoke_reproduction)
    check_report_is_complete(report, ExperimentSettings.smoke())


def _committed() -> dict:
    path = RESULTS / "report.json"
    assert path.exists(), f"{path} is missing: commit the full run's folder (`mhla reproduce`)"
    report = json.loads(path.read_text())
    assert report.get("schema") == SCHEMA, f"unknown report schema {report.get('schema')!r}"
    return report


def test_committed_results_come_from_their_report():
    report = _committed()
    s = ExperimentSettings()
    check_report_is_complete(report, s)
    check_outputs_come_from_report(RESULTS)
    # the issues' minimum design: the controls on the local and groups teachers, at least 5 seeds per cell, the
    # new arms at 256 and 1,024 tokens, blocks and batch size held fixed across N, and recall's rates swept
    controls = {"linear-lepe", "mhla-uniform", "mhla-frozen", "mhla", "mhla-permuted", "linear-wide", "mhla-lepe"}
    for task in ("local", "groups"):
        assert controls | {"softmax"} <= set(s.students_at(task, 1024)) and {256, 1024} <= set(
            getattr(s, f"{task}_tokens")
        )
        assert len(set(getattr(s, f"{task}_batch_sizes"))) == 1
    assert {"linear-lepe", "mhla", "mhla-lepe"} <= set(s.recall_students) and len(s.recall_lrs) > 1
    assert s.block_side is not None and {"local", "groups", "recall"} <= set(s.part_a_tasks)
    assert len(s.part_a_seeds) >= 5 and report["sweeps"]
    # recall compared only where softmax learned it
    summary = report["summary"]
    dropped = {d["tokens"] for d in summary["recall_dropped"]}
    for row in summary["part_a"]:
        if row["task"] == "recall" and row["student"] == "softmax" and row["tokens"] not in dropped:
            assert row["score"]["mean"] >= s.recall_softmax_floor


def test_committed_readme_section_and_docs_page_come_from_the_report():
    report = _committed()
    readme = (ROOT / "README.md").read_text()
    assert replace_readme_section(readme, readme_section(report)) == readme
    assert (ROOT / "docs" / "reproduce.md").read_text() == reproduce_doc(report)
