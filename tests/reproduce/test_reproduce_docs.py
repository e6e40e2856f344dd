"""The README section and ``docs/reproduce.md`` written from a ``mhla reproduce`` report
(:mod:`mhla_diffusion.reproduce.docs`): every number in them is a setting or summary value of the
report, every comparison is there in the words of its corrected p, and no sentence calls a difference the
corrected p does not establish. Checked on a made-up report of the current schema (no training) and on the
smoke run's report."""

from __future__ import annotations

import dataclasses
import json
import math
import re

import numpy as np
import pytest

from helpers.reproduce import check_outputs_come_from_report
from mhla_diffusion.reproduce.docs import (
    README_HEADING,
    conclusion,
    readme_section,
    recommendation,
    replace_readme_section,
    reproduce_doc,
    write_docs,
)
from mhla_diffusion.reproduce.experiment import SCHEMA, ExperimentSettings
from mhla_diffusion.reproduce.operators import RANK_MEASURES, rank_bound
from mhla_diffusion.reproduce.report import comparison_words, summarise
from mhla_diffusion.reproduce.statistics import holm

NUMBER = re.compile(r"(?<![\w.\-])[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?%?")
#: numbers the prose states as design constants, not results: 1 - corr, Holm's 0.05, 80 % power, 95 % intervals,
#: the rank tolerances
CONSTANTS = {"1", "0.05", "80", "95", "1e-3", "1e-2"}
#: words that call a difference; allowed only inside the words of an established comparison
CALLING_WORDS = ("lower", "higher", "better", "worse", "beats", "outperform")


def _leaves(value, key: str = ""):
    """Every number in a JSON value, dict keys that are numbers included."""
    if isinstance(value, dict):
        for k, v in value.items():
            if re.fullmatch(r"\d+", str(k)):
                yield int(k)
            yield from _leaves(v, k)
    elif isinstance(value, list):
        for v in value:
            yield from _leaves(v, key)
    elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        yield value


def report_numbers(report: dict) -> set[str]:
    """Each number of the report's settings, summary, seconds and threads in every format the docs use."""
    out: set[str] = set()
    for x in _leaves({k: report[k] for k in ("settings", "summary", "seconds", "torch_threads")}):
        for text in (
            f"{x:.0f}",
            f"{x:.1f}",
            f"{x:.2f}",
            f"{x:.3f}",
            f"{x:.4f}",
            f"{x:.2g}",
            f"{x:.3g}",
            f"{x:g}",
            f"{x:.0%}",
            f"{x:.1%}",
            f"{x / 60:.0f}",
        ):
            out.add(text.lstrip("+-"))
    return out


def check_numbers_come_from_report(text: str, report: dict) -> None:
    allowed = report_numbers(report) | CONSTANTS
    strange = [m.group() for m in NUMBER.finditer(text) if m.group().lstrip("+-") not in allowed]
    assert not strange, f"numbers not in the report: {strange[:10]}"


def check_calls_follow_corrected_p(text: str, report: dict) -> None:
    """Every comparison of a Part A family, and of Part B in the full page, appears in its own words; once
    those are removed, no word that calls a difference remains (line breaks read as spaces)."""
    rest = " ".join(text.split())
    for family in report["summary"]["families"]:
        for c in family["comparisons"]:
            words = comparison_words(c)
            assert words.startswith("not established") != c["established"]
            rest = rest.replace(words, "")
    lowered = rest.lower()
    for word in CALLING_WORDS:
        assert word not in lowered, f"'{word}' outside a comparison's own words"


def _made_up_report(effects: dict[str, float], settings: ExperimentSettings | None = None) -> dict:
    """A complete report of the smoke settings with made-up scores: ``effects[kind]`` added to every score of
    that student (seed noise 0.01), and Part B numbers with MHLA's loss clearly lower than linear's; five Part A
    seeds and four Part B seeds, as in the full run."""
    s = settings or dataclasses.replace(
        ExperimentSettings.smoke(), part_a_seeds=[0, 1, 2, 3, 4], part_b_seeds=[0, 1, 2, 3]
    )
    rng = np.random.default_rng(0)
    part_a, sweeps = [], []
    for task in s.part_a_tasks:
        for plan in s.part_a_plan(task):
            layout = s.task(task, plan.tokens, 0).layout
            swept = [(lr, s.sweep_seed) for lr in plan.lrs] if len(plan.lrs) > 1 else []
            for lr, seed in [*swept, *((plan.lrs[0], seed) for seed in s.part_a_seeds)]:
                noise = rng.normal(0, 0.01)
                for kind in s.students_at(task, plan.tokens):
                    ranks = {m: float(rng.uniform(1, 8)) for m in RANK_MEASURES}
                    base = 0.95 if task == "recall" else 0.5
                    run = {
                        "task": task,
                        "student": kind,
                        "tokens": plan.tokens,
                        "seed": seed,
                        "lr": lr,
                        "score": base + effects.get(kind, 0.0) + noise + rng.normal(0, 0.01),
                        "loss_curve": [2.0, float(rng.uniform(0.5, 1.5))],
                        "chance_loss": 2.77 if task == "recall" else None,
                        "rank_bound": rank_bound(kind, plan.tokens, s.head_dim, layout),
                        "teacher_rank": s.groups if task == "groups" else None,
                        "rank": ranks,
                        "rank_untrained": ranks,
                        "unit_seconds": 1.0,
                    }
                    (sweeps if seed == s.sweep_seed else part_a).append(run)
    part_b = []
    for seed in s.part_b_seeds:
        for arm in s.part_b_arms:
            loss = {"mhla": 0.07, "linear": 0.13}.get(arm, 0.05) + rng.normal(0, 0.001)
            part_b.append(
                {
                    "arm": arm,
                    "seed": seed,
                    "held_out_loss": {t: loss + rng.normal(0, 0.001) for t in ("50", "200", "500", "800")},
                    "mean_held_out_loss": loss,
                    "asymmetry": float(rng.uniform(0.1, 0.9)),
                    "sample_scale": 1.0,
                    "seconds": 2.0,
                }
            )
    report = {
        "schema": SCHEMA,
        "settings": dataclasses.asdict(s),
        "torch_threads": 2,
        "sweeps": sweeps,
        "part_a": part_a,
        "part_b": part_b,
        "complete": True,
        "seconds": 123.4,
    }
    report["summary"] = summarise(report)
    return report


def test_docs_of_a_made_up_report_state_only_its_numbers_and_calls():
    report = _made_up_report({"mhla": -0.2, "softmax": -0.4})  # MHLA clearly lower than every control
    section, doc = readme_section(report), reproduce_doc(report)
    for text in (section, doc):
        code = False
        for line in text.splitlines():  # wrapped prose; no continuation line that Markdown reads as a list item
            code ^= line.startswith("```")
            assert code or line.startswith(("![", "```")) or len(line) <= 115, line
            assert not re.match(r"^\s+([-+*>]|\d+[.)]) ", line), line
        check_numbers_come_from_report(text, report)
        check_calls_follow_corrected_p(text, report)
    local = next(f for f in report["summary"]["families"] if f["family"] == "Part A, local teacher")
    calls = {(c["a"], c["b"], c["tokens"]): c for c in local["comparisons"]}
    for n in (16, 64):
        assert calls["mhla", "mhla-uniform", n]["established"] and calls["mhla", "mhla-uniform", n]["mean"] < 0
        assert "lower (better)" in comparison_words(calls["mhla", "mhla-uniform", n])
        assert not calls["mhla-shuffled", "mhla-uniform", n]["established"]  # no true difference
    for c in local["comparisons"]:
        assert (c["mdd"] is None) == c["established"]
    assert section.startswith(README_HEADING + "\n")
    assert "not established" in doc


def test_the_readme_section_of_a_full_size_report_keeps_the_readme_within_300_lines():
    from pathlib import Path

    report = _made_up_report({"mhla": -0.05}, ExperimentSettings())  # the full run's tasks, sizes and seeds
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme_section(report)
    check_numbers_come_from_report(section, report)
    check_calls_follow_corrected_p(section, report)
    assert len(replace_readme_section(readme, section).splitlines()) <= 300


def test_a_made_up_difference_is_called_only_when_holm_allows():
    report = _made_up_report({})  # no true differences
    for family in report["summary"]["families"]:
        for c in family["comparisons"]:
            assert c["p_holm"] >= c["p"]
            if not c["established"]:
                assert "not established" in comparison_words(c) and c["mdd"] > 0


def test_readme_section_is_replaced_up_to_the_next_heading(tmp_path):
    readme = "# T\n\nintro\n\n## Attentions compared\n\nold words\n\n## Layout\n\nrows\n"
    assert replace_readme_section(readme, "## Attentions compared\n\nnew\n\n") == (
        "# T\n\nintro\n\n## Attentions compared\n\nnew\n\n## Layout\n\nrows\n"
    )
    with pytest.raises(ValueError, match="no '## Attentions compared' section"):
        replace_readme_section("# T\n", "x")
    report = _made_up_report({})
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(readme)
    write_docs(report, tmp_path)
    assert (tmp_path / "README.md").read_text().endswith("## Layout\n\nrows\n")
    assert (tmp_path / "docs" / "reproduce.md").read_text() == reproduce_doc(report)


def test_docs_refuse_an_old_or_unfinished_report():
    report = _made_up_report({})
    with pytest.raises(ValueError, match="schema"):
        readme_section(report | {"schema": "reproduce-2"})
    with pytest.raises(ValueError, match="finish the run"):
        reproduce_doc(report | {"complete": False})


@pytest.mark.slow  # trains
def test_docs_of_the_smoke_run(smoke_reproduction):
    report = json.loads((smoke_reproduction / "report.json").read_text())
    for text in (readme_section(report), reproduce_doc(report)):
        check_numbers_come_from_report(text, report)
        check_calls_follow_corrected_p(text, report)


def test_the_docs_option_rewrites_both_files_from_the_output_folders_report(tmp_path, monkeypatch, capsys):
    from mhla_diffusion.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("# T\n\n## Attentions compared\n\nold\n\n## Layout\n")
    assert main(["reproduce", "--docs", "--output", "run"]) == 2
    assert "no report at run/report.json" in capsys.readouterr().err
    report = _made_up_report({})
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "report.json").write_text(json.dumps(report | {"complete": False}))
    assert main(["reproduce", "--docs", "--output", "run"]) == 2
    assert "is not a finished run" in capsys.readouterr().err
    (tmp_path / "run" / "report.json").write_text(json.dumps(report | {"summary": {}, "seconds": 0}))
    assert main(["reproduce", "--docs", "--output", "run"]) == 0
    # the summary and the seconds are computed again from the runs, and the outputs beside the report with them
    rewritten = json.loads((tmp_path / "run" / "report.json").read_text())
    assert rewritten["summary"] == report["summary"] and rewritten["seconds"] > 0
    check_outputs_come_from_report(tmp_path / "run")
    assert (tmp_path / "README.md").read_text() == replace_readme_section(
        "# T\n\n## Attentions compared\n\nold\n\n## Layout\n", readme_section(rewritten)
    )
    assert (tmp_path / "docs" / "reproduce.md").read_text() == reproduce_doc(rewritten)


def test_equivalence_follows_the_interval_and_the_margin_fixed_before_the_run():
    report = _made_up_report({"mhla": -0.2})
    s = report["settings"]
    seen = set()
    for family in report["summary"]["families"]:
        for c in family["comparisons"]:
            margin = s[f"{c['task']}_margin"] if "task" in c else None
            if margin is not None:
                assert c["margin"] == margin
                assert c["equivalent"] == (-margin <= c["low"] and c["high"] <= margin)
            words = comparison_words(c)
            assert ("equivalent within" in words) == (c["equivalent"] and not c["established"])
            assert ("practically nil" in words) == (c["equivalent"] and c["established"])
            if not c["established"]:
                assert c["mdd"] > 0 and "80 % power only for differences of at least" in words
            seen.add(c["equivalent"])
    assert seen == {True, False}  # recall's margin (0.05) holds the seed noise (0.01), the error margin does not


def test_a_student_left_at_chance_is_reported_and_kept_out_of_the_calls():
    report = _made_up_report({})
    stuck = next(r for r in report["part_a"] if r["task"] == "recall" and r["student"] == "linear-lepe")
    stuck["loss_curve"][-1] = 0.95 * stuck["chance_loss"]  # above 0.9 of chance on one seed
    report["summary"] = summarise(report)
    assert report["summary"]["did_not_train"] == [
        {"task": "recall", "student": "linear-lepe", "tokens": stuck["tokens"], "seeds": [stuck["seed"]]}
    ]
    recall = next(f for f in report["summary"]["families"] if f["family"] == "Part A, associative recall")
    assert all("linear-lepe" not in (c["a"], c["b"]) for c in recall["comparisons"] if c["tokens"] == stuck["tokens"])
    assert "did not train (kept out of the calls): linear + LePE at" in " ".join(readme_section(report).split())


def test_one_holm_correction_over_all_and_the_share_of_the_gap_mhla_closes():
    report = _made_up_report({"mhla": -0.2, "softmax": -0.4})
    summary = report["summary"]
    everything = [c for f in summary["families"] for c in f["comparisons"]]
    calls = sum(p < 0.05 for p in holm([c["p"] for c in everything]))  # Holm over all (holm is tested on its own)
    assert summary["overall"]["established_overall"] == calls <= summary["overall"]["established_in_families"]
    for g in summary["gap_closed"]:
        scores = {
            kind: {
                r["seed"]: r["score"]
                for r in report["part_a"]
                if (r["task"], r["tokens"], r["student"]) == (g["task"], g["tokens"], kind)
            }
            for kind in ("mhla", "mhla-uniform", "softmax")
        }
        shares = [
            (scores["mhla-uniform"][s] - scores["mhla"][s]) / (scores["mhla-uniform"][s] - scores["softmax"][s])
            for s in scores["mhla"]
        ]
        assert g["share"]["mean"] == pytest.approx(np.mean(shares))
        assert g["share"]["mean"] == pytest.approx(0.5, abs=0.1)  # 0.2 of a gap of 0.4


@pytest.mark.parametrize(
    "effects, verdict, advice",
    [
        ({"mhla": -0.2, "mhla-lepe": -0.2}, "point to locality, not to the rank", "No single recommendation"),
        ({"mhla": -0.2, "mhla-permuted": -0.2, "linear-wide": -0.2}, "point to the rank MHLA's blocks add", "not told"),
        ({"mhla": -0.4, "mhla-permuted": -0.2}, "show both locality and the rank", "not told apart"),
        ({"linear-wide": -0.2}, "Neither locality nor the rank", "not told apart"),
        ({}, "Neither locality nor the rank", "not told apart"),
    ],
)
def test_the_conclusion_and_the_recommendation_follow_the_established_calls(effects, verdict, advice):
    # recall scores accuracy (higher is better): an effect of -0.2 there puts a student behind
    report = _made_up_report(effects)
    assert verdict in conclusion(report["summary"])[0]
    assert advice in recommendation(report["summary"])
    section = readme_section(report)
    check_numbers_come_from_report(section, report)
    check_calls_follow_corrected_p(section, report)
