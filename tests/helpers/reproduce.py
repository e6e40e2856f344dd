"""Checks that an ``mhla reproduce`` output folder is what its ``report.json`` says: the committed one
(``docs/reproduce/``) and the smoke run's alike."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from mhla_diffusion.reproduce.experiment import ExperimentSettings
from mhla_diffusion.reproduce.report import FIGURES, reading_markdown, summarise, table_markdown


def check_report_is_complete(report: dict, settings: ExperimentSettings) -> None:
    """``report`` was made with ``settings`` and holds every run they ask for, with its time."""
    s = settings
    assert report["settings"] == dataclasses.asdict(s)
    assert report.get("complete") is True
    expected_a = {
        (task, kind, plan.tokens, seed)
        for task in s.part_a_tasks
        for plan in s.part_a_plan(task)
        for kind in s.students_at(task, plan.tokens)
        for seed in s.part_a_seeds
    }
    assert sorted((r["task"], r["student"], r["tokens"], r["seed"]) for r in report["part_a"]) == sorted(expected_a)
    swept = {
        (task, kind, plan.tokens, lr)
        for task in s.part_a_tasks
        for plan in s.part_a_plan(task)
        if len(plan.lrs) > 1
        for kind in s.students_at(task, plan.tokens)
        for lr in plan.lrs
    }
    assert sorted((r["task"], r["student"], r["tokens"], r["lr"]) for r in report["sweeps"]) == sorted(swept)
    assert {r["seed"] for r in report["sweeps"]} <= {s.sweep_seed}
    expected_b = {(arm, seed) for arm in s.part_b_arms for seed in s.part_b_seeds}
    assert sorted((r["arm"], r["seed"]) for r in report["part_b"]) == sorted(expected_b)
    unit_seconds = {(r["task"], r["tokens"], r["seed"]): r["unit_seconds"] for r in report["part_a"]}
    unit_seconds |= {(r["task"], r["tokens"], r["lr"]): r["unit_seconds"] for r in report["sweeps"]}
    assert report["seconds"] == round(sum(unit_seconds.values()) + sum(r["seconds"] for r in report["part_b"]), 1)


def check_outputs_come_from_report(folder: Path) -> dict:
    """The summary, ``table.md`` and ``reading.md`` in ``folder`` are computed from its ``report.json`` alone,
    and the figures are there; returns the report."""
    report = json.loads((folder / "report.json").read_text())
    assert summarise(report) == report["summary"]
    assert (folder / "table.md").read_text() == table_markdown(report)
    assert (folder / "reading.md").read_text() == reading_markdown(report)
    for name in FIGURES:
        assert (folder / name).stat().st_size > 5_000, name
    return report
