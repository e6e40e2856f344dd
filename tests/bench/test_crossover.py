"""Where MHLA overtakes SDPA and linear attention: read from the committed `mhla bench` sweep, and said next to
every timing the command line's JSON and the web demo show, and in the README's speed section."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from mhla_diffusion.benchmarks.crossover import CROSSOVER_RUN, crossovers, speed_context
from mhla_diffusion.cli import main
from mhla_diffusion.web.models import Generated
from mhla_diffusion.web.report import summary

REPO = Path(__file__).resolve().parents[2]


def _rows(times: dict[int, dict[str, float]]) -> dict:
    return {
        "attention": [
            {"tokens": n, "method": method, "median_ms": ms} for n, by in times.items() for method, ms in by.items()
        ]
    }


def test_the_crossover_is_where_mhla_stays_faster_from_on():
    result = _rows(
        {
            100: {"sdpa (native)": 1.0, "linear": 1.0, "mhla": 2.0, "mhla + φ": 0.1},
            400: {"sdpa (native)": 5.0, "linear": 2.0, "mhla": 4.0},  # faster than SDPA once ...
            900: {"sdpa (native)": 7.0, "linear": 3.0, "mhla": 8.0},  # ... not here
            1600: {"sdpa (native)": 30.0, "linear": 9.0, "mhla": 10.0},
            2500: {"sdpa (native)": 90.0, "linear": 20.0, "mhla": 15.0},
        }
    )
    assert crossovers(result) == {"tokens": [100, 400, 900, 1600, 2500], "sdpa": 1600, "linear": 2500}
    slower = _rows({100: {"sdpa (native)": 1.0, "linear": 1.0, "mhla": 2.0}})
    assert crossovers(slower) == {"tokens": [100], "sdpa": None, "linear": None}


def _committed() -> dict:
    return crossovers(json.loads(CROSSOVER_RUN.read_text()))


def test_the_committed_sweep_reaches_past_the_embedded_model_and_is_said_in_the_readme():
    found = _committed()
    assert found["tokens"][0] <= 720 < found["tokens"][-1]  # the embedded video model's 5x12x12 tokens inside
    speed = " ".join((REPO / "README.md").read_text().split("## Speed", 1)[1].split("\n## ", 1)[0].split())
    assert f"docs/benchmarks/{CROSSOVER_RUN.name}" in speed
    for baseline in ("sdpa", "linear"):
        n = found[baseline]
        said = f"{n:,} tokens" if n is not None else f"up to {found['tokens'][-1]:,} tokens"
        assert said in speed, (baseline, said)


def test_the_cli_json_gives_the_crossover_beside_the_wall_time(tmp_path):
    out = tmp_path / "out"
    assert (
        main(["text-to-video", "--prompt", "a red circle moving left", "--steps", "2", "--output-dir", str(out)]) == 0
    )
    (sidecar,) = out.glob("*.json")
    settings = json.loads(sidecar.read_text())
    found, speed = _committed(), settings["speed"]
    assert list(settings).index("speed") == list(settings).index("wall_time_s") + 1
    assert speed["attention_tokens"] == 720  # 9 frames of 48x48: 5 x 12 x 12 tokens
    assert speed["mhla_faster_than_sdpa_from_tokens"] == found["sdpa"]
    assert speed["mhla_faster_than_linear_from_tokens"] == found["linear"]
    assert "720 tokens" in speed["note"] and CROSSOVER_RUN.name in speed["note"]


def test_the_web_demo_gives_the_crossover_under_its_timings():
    results = [
        Generated([np.zeros((9, 48, 48, 3))], [0], 2.0, attention, [0.0, 0.1, 0.2], tokens=720)
        for attention in ("mhla", "softmax")
    ]
    text = summary(results, "a red circle moving left")
    (line,) = [line for line in text.splitlines() if line.startswith("*Speed in context:*")]
    assert speed_context(720)["note"] in line
    assert text.index("End to end: softmax took") < text.index(line)
    number = _committed()["sdpa"]
    if number is not None:
        assert re.search(rf"from {number:,} tokens on", line)
