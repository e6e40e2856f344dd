"""The README's first command makes a clip the judge reads as its prompt, and the build's verdicts (the
README's three prompts and the side-by-side figure) are what the command line makes."""

from __future__ import annotations

import json
from pathlib import Path

from mhla_diffusion.cli import main
from mhla_diffusion.embedded.locations import EMBEDDED_ROOT
from mhla_diffusion.embedded.side_by_side import FIGURE_PROMPTS


def test_readme_prompts_are_read_as_asked_and_match_the_build(tmp_path):
    verdicts = json.loads((EMBEDDED_ROOT / "build_report.json").read_text())["stages"]["evaluate"]["verdicts"]
    assert [v["prompt"] for v in verdicts] == list(FIGURE_PROMPTS)
    assert verdicts[0]["prompt"] == "a red circle moving left"  # the quick start's prompt
    for i, verdict in enumerate(verdicts):
        out = tmp_path / str(i)
        assert (
            main(
                [
                    "text-to-video",
                    "--prompt",
                    verdict["prompt"],
                    "--seed",
                    str(verdict["seed"]),
                    "--output-dir",
                    str(out),
                ]
            )
            == 0
        )
        (sidecar,) = sorted(out.glob("*.json"))
        judge = json.loads(sidecar.read_text())["judge"]
        assert judge["reading"] == verdict["MHLA"]["reading"]
        assert judge["matches_prompt"] == verdict["MHLA"]["matches_prompt"]
    assert verdicts[0]["MHLA"]["matches_prompt"] is True  # the first command's clip shows what it asked for


def _reading(verdict: dict) -> str:
    return (
        f"{verdict['reading']} ({verdict['confidence']:.2f}){'' if verdict['matches_prompt'] else ' (not the prompt)'}"
    )


def test_readme_shows_the_builds_verdicts():
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    verdicts = json.loads((EMBEDDED_ROOT / "build_report.json").read_text())["stages"]["evaluate"]["verdicts"]
    for v in verdicts:
        assert f'| "{v["prompt"]}" | {v["seed"]} | {_reading(v["MHLA"])} | {_reading(v["softmax"])} |' in readme
