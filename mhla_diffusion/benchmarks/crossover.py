"""Where MHLA's attention overtakes SDPA and plain linear attention, read from a committed ``mhla bench`` run.

MHLA's cost grows as O(N) in the number of tokens and softmax attention's as O(N^2), so MHLA is faster only
from some token count on; below it (the embedded video model's 720 tokens, for one) softmax attention is
faster. :data:`CROSSOVER_RUN` is the ``mhla bench --output`` JSON of a sweep over token counts (the command is
in ``docs/speed.md``); :func:`crossovers` reads the crossing points from its rows, and :func:`speed_context`
says them next to a timing (the command line's JSON settings, the web demo's timing table). Nothing here is
measured, and nothing imports torch.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

__all__ = ["BASELINES", "CROSSOVER_RUN", "crossovers", "speed_context"]

#: The committed sweep (``docs/benchmarks/`` of the checkout; absent from a wheel, then no context is given).
CROSSOVER_RUN = Path(__file__).resolve().parents[2] / "docs" / "benchmarks" / "crossover-cpu.json"
#: The methods MHLA is compared with, by how the bench names their rows.
BASELINES = {"sdpa": "SDPA (softmax attention)", "linear": "plain linear attention"}


def _method(row: dict[str, Any]) -> str | None:
    """``"mhla"``, ``"sdpa"`` or ``"linear"`` for the bench rows the crossover reads (MHLA and linear attention on
    feature-mapped inputs, SDPA with any backend), else ``None``."""
    name = row["method"]
    if name in ("mhla", "linear"):
        return name
    return "sdpa" if name.startswith("sdpa") else None


def crossovers(result: dict[str, Any]) -> dict[str, Any]:
    """The crossing points of an ``mhla bench`` result: ``{"sdpa": N or None, "linear": N or None,
    "tokens": [measured token counts]}``, N the smallest measured token count from which MHLA's median time is
    below the baseline's at that and every larger measured count (``None``: not faster at the largest)."""
    times: dict[int, dict[str, float]] = {}
    for row in result["attention"]:
        method = _method(row)
        if method is not None:
            times.setdefault(row["tokens"], {})[method] = row["median_ms"]
    sizes = sorted(n for n, by in times.items() if "mhla" in by)
    found: dict[str, Any] = {"tokens": sizes}
    for baseline in BASELINES:
        measured = [n for n in sizes if baseline in times[n]]
        crossing = None
        for n in reversed(measured):
            if times[n]["mhla"] >= times[n][baseline]:
                break
            crossing = n
        found[baseline] = crossing
    return found


@lru_cache(maxsize=1)
def _committed() -> dict[str, Any] | None:
    try:
        result = json.loads(CROSSOVER_RUN.read_text())
    except OSError:
        return None
    spec = result["spec"]
    return {
        **crossovers(result),
        "measured_on": f"{result['device'].split(', fresh process')[0]}; {spec['heads']} heads x {spec['head_dim']}, "
        f"{result['dtype']}",
    }


def speed_context(tokens: int | None) -> dict[str, Any] | None:
    """What a timing of a generation whose attention sees ``tokens`` tokens means, from :data:`CROSSOVER_RUN`:
    ``{"attention_tokens", "mhla_faster_than_sdpa_from_tokens", "mhla_faster_than_linear_from_tokens",
    "note", "source"}`` (``None`` without the committed run)."""
    run = _committed()
    if run is None:
        return None
    largest = f"{run['tokens'][-1]:,}"
    parts = []
    for baseline, name in BASELINES.items():
        crossing = run[baseline]
        smaller = [n for n in run["tokens"] if crossing is not None and n < crossing]
        before = f" (not at {smaller[-1]:,}, the next size measured)" if smaller else ""
        parts.append(
            f"faster than {name} from {crossing:,} tokens on{before}"
            if crossing is not None
            else f"slower than {name} at every measured size (up to {largest} tokens)"
        )
    note = f"MHLA's attention operator alone is {parts[0]}, and {parts[1]}"
    if tokens is not None:
        below = run["sdpa"] is None or tokens < run["sdpa"]
        note += f"; this model's attention sees {tokens:,} tokens" + (
            ", below that: softmax attention's operator is the faster here"
            if below
            else ": MHLA's operator is the faster here, but a whole generation also runs what MHLA adds around it "
            "(feature map, mixing, gate, LePE) and what it leaves as it is (text encoder, feed-forward layers, VAE), "
            "so at this size it can still take longer end to end"
        )
    note += f" (mhla bench on {run['measured_on']}: {CROSSOVER_RUN.name})"
    return {
        "attention_tokens": tokens,
        "mhla_faster_than_sdpa_from_tokens": run["sdpa"],
        "mhla_faster_than_linear_from_tokens": run["linear"],
        "note": note,
        "source": f"docs/benchmarks/{CROSSOVER_RUN.name}",
    }
