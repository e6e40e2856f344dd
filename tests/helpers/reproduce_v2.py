"""The reader of ``docs/reproduce/report.json`` as committed before issue 50 (schema ``reproduce-2``): its
summary, ``table.md`` and ``reading.md`` as the library computed them then (two-standard-error calls).

The library now writes schema ``reproduce-3`` (Holm-corrected families, five Part A controls, three tasks);
this frozen copy keeps checking the committed folder until the new full run replaces it. Delete it then, with
the schema-2 branch of ``tests/embedded/test_reproduce_results.py``."""

from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

import numpy as np

from mhla_diffusion.embedded.experiment_statistics import interval

SCHEMA_V2 = "reproduce-2"

CALL_STANDARD_ERRORS = 2.0


def paired_difference(a: Sequence[float], b: Sequence[float]) -> dict[str, float | int | bool | None]:
    """``a - b`` seed by seed: the mean difference, its standard error, the paired t statistic, its
    two-sided p-value and ``called`` (the mean lies more than two standard errors from zero)."""
    d = np.asarray(a, dtype=float) - np.asarray(b, dtype=float)
    mean = float(d.mean())
    if len(d) < 2:
        return {"n": len(d), "mean": mean, "se": None, "t": None, "p": None, "called": False, "differences": d.tolist()}
    se = float(d.std(ddof=1) / math.sqrt(len(d)))
    if se == 0.0:
        t_stat, p = None, (1.0 if mean == 0.0 else 0.0)  # every seed the same difference (no inf in JSON)
    else:
        from scipy.stats import t

        t_stat = mean / se
        p: float = float(2 * t.sf(abs(t_stat), len(d) - 1))
    return {
        "n": len(d),
        "mean": mean,
        "se": se,
        "t": t_stat,
        "p": p,
        "called": bool(abs(mean) > CALL_STANDARD_ERRORS * se),
        "differences": d.tolist(),
    }


#: Part A comparisons (a, b): a - b seed by seed.
PART_A_PAIRS = (("mhla", "linear"), ("mhla-per-head", "mhla"), ("softmax", "mhla"))
#: Part B comparisons (a, b).
PART_B_PAIRS = (
    ("linear", "softmax"),
    ("mhla", "softmax"),
    ("mhla", "linear"),
    ("linear-lepe", "linear"),
    ("mhla", "linear-lepe"),
)
PART_B_METRICS = ("mean_held_out_loss", "asymmetry")
RANK_MEASURES = ("numerical_rank", "effective_rank", "row_entropy")
SCORE_NAMES = {"local": "relative error (lower is better)", "recall": "recall accuracy (higher is better)"}
NAMES = {
    "linear": "global linear attention",
    "mhla": "MHLA",
    "mhla-per-head": "MHLA with per-head mixing",
    "softmax": "softmax",
    "linear-lepe": "global linear attention with LePE",
}
FIGURES = ("part-a-score-vs-tokens.png", "part-a-rank-vs-tokens.png", "part-b-paired-differences.png")


def _groups(runs: Iterable[dict[str, Any]], *keys: str) -> dict[tuple, list[dict[str, Any]]]:
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault(tuple(run[k] for k in keys), []).append(run)
    return groups


def _paired(a_runs: list[dict[str, Any]], b_runs: list[dict[str, Any]], value) -> dict[str, Any] | None:
    """``paired_difference`` of ``value(run)`` over the seeds both lists hold (``None`` under two)."""
    a = {r["seed"]: value(r) for r in a_runs}
    b = {r["seed"]: value(r) for r in b_runs}
    seeds = sorted(set(a) & set(b))
    if len(seeds) < 2:
        return None
    return {"seeds": seeds, **paired_difference([a[s] for s in seeds], [b[s] for s in seeds])}


def summarise(report: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Intervals per (task, student, N), the rank measures against their bounds, the Part A paired
    comparisons per (task, N), and Part B's intervals per arm and paired comparisons per metric."""
    part_a = _groups(report["part_a"], "task", "student", "tokens")
    scores = [
        {"task": t, "student": k, "tokens": n, "score": interval([r["score"] for r in runs])}
        for (t, k, n), runs in part_a.items()
    ]
    ranks = [
        {
            "task": t,
            "student": k,
            "tokens": n,
            "bound": runs[0]["rank_bound"],
            **{m: interval([r["rank"][m] for r in runs]) for m in RANK_MEASURES},
        }
        for (t, k, n), runs in part_a.items()
        if runs[0]["rank"] is not None
    ]
    paired_a = []
    for (t, n), _ in _groups(report["part_a"], "task", "tokens").items():
        for a, b in PART_A_PAIRS:
            if (t, a, n) in part_a and (t, b, n) in part_a:
                diff = _paired(part_a[t, a, n], part_a[t, b, n], lambda r: r["score"])
                if diff is not None:
                    paired_a.append({"task": t, "tokens": n, "a": a, "b": b, "score": diff})
    part_b = _groups(report["part_b"], "arm")
    arms = [
        {
            "arm": arm,
            **{m: interval([r[m] for r in runs]) for m in (*PART_B_METRICS, "sample_scale")},
            "held_out_loss": {t: interval([r["held_out_loss"][t] for r in runs]) for t in runs[0]["held_out_loss"]},
        }
        for (arm,), runs in part_b.items()
    ]
    paired_b = [
        {"metric": m, "a": a, "b": b, **diff}
        for m in PART_B_METRICS
        for a, b in PART_B_PAIRS
        if (a,) in part_b
        and (b,) in part_b
        and (diff := _paired(part_b[a,], part_b[b,], lambda r, m=m: r[m])) is not None
    ]
    return {"part_a": scores, "part_a_paired": paired_a, "rank": ranks, "part_b": arms, "part_b_paired": paired_b}


# ---------------------------------------------------------------------------- table


def _cell(stat: dict[str, Any] | None, digits: int = 3) -> str:
    if stat is None:
        return ""
    if stat["low"] is None:
        return f"{stat['mean']:.{digits}f}"
    return f"{stat['mean']:.{digits}f} [{stat['low']:.{digits}f}, {stat['high']:.{digits}f}]"


def _difference(diff: dict[str, Any], verdict: bool = True) -> str:
    """``mean ± SE (verdict, p, seeds)`` of a paired difference."""
    se = "" if diff["se"] is None else f" ± {diff['se']:.2g}"
    p = "" if diff["p"] is None else f"p = {diff['p']:.2g}, "
    said = ("beyond two standard errors, " if diff["called"] else "within two standard errors, ") if verdict else ""
    return f"{diff['mean']:+.3g}{se} ({said}{p}{diff['n']} seeds)"


def _row(cells: Iterable[Any]) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _header(cells: list[str]) -> list[str]:
    return [_row(cells), "|" + "---|" * len(cells)]


def table_markdown(report: dict[str, Any]) -> str:
    """The report's summary as Markdown tables: mean [95 % interval] over seeds, paired differences."""
    summary, s = report["summary"], report["settings"]
    tokens = sorted({row["tokens"] for row in summary["part_a"]})
    lines = [
        "**Part A: one attention layer fitted to a fixed teacher** (held-out score; mean [95 % interval] over "
        f"{len(s['part_a_seeds'])} seeds; {s['part_a_steps']} steps; local: {SCORE_NAMES['local']}; recall: "
        f"{SCORE_NAMES['recall']})",
        "",
        *_header(["task", "attention", *[f"{n} tokens" for n in tokens]]),
    ]
    for (task, student), rows in _groups(summary["part_a"], "task", "student").items():
        by_tokens = {r["tokens"]: r["score"] for r in rows}
        lines.append(_row([task, student, *[_cell(by_tokens.get(n)) for n in tokens]]))
    lines += [
        "",
        "**Part A, paired by seed** (same batches; a - b of the score)",
        "",
        *_header(["task", "tokens", "a - b", "difference ± SE"]),
    ]
    lines += [
        _row([d["task"], d["tokens"], f"{d['a']} - {d['b']}", _difference(d["score"])])
        for d in summary["part_a_paired"]
    ]
    lines += [
        "",
        "**The rank of the N x N attention matrix** (first held-out input, mean over heads; numerical rank: "
        "singular values above 1e-3 of the largest; bound: d for linear, sum over blocks of min(n_b, d) for MHLA, "
        "N for softmax)",
        "",
        *_header(["task", "attention", "tokens", "numerical rank", "bound", "effective rank", "row entropy (nats)"]),
    ]
    lines += [
        _row(
            [
                r["task"],
                r["student"],
                r["tokens"],
                _cell(r["numerical_rank"], 1),
                r["bound"],
                _cell(r["effective_rank"], 1),
                _cell(r["row_entropy"], 2),
            ]
        )
        for r in summary["rank"]
    ]
    timesteps = list(summary["part_b"][0]["held_out_loss"]) if summary["part_b"] else []
    lines += [
        "",
        f"**Part B: DiT denoiser on mirror-symmetric images, {s['part_b_tokens']} tokens** (mean [95 % interval] "
        f"over {len(s['part_b_seeds'])} seeds; {s['part_b_steps']} steps; asymmetry: 1 - corr(sample, its mirror "
        "image), 0 = symmetric, about 1 = halves unrelated)",
        "",
        *_header(
            ["attention", *[f"loss t={t}" for t in timesteps], "mean loss", "asymmetry", "sample contrast / data's"]
        ),
    ]
    lines += [
        _row(
            [
                r["arm"],
                *[_cell(r["held_out_loss"][t], 4) for t in timesteps],
                _cell(r["mean_held_out_loss"], 4),
                _cell(r["asymmetry"]),
                _cell(r["sample_scale"], 2),
            ]
        )
        for r in summary["part_b"]
    ]
    lines += [
        "",
        "**Part B, paired by seed** (same initial weights, batches, noise and timesteps; a - b)",
        "",
        *_header(["measure", "a - b", "per-seed differences", "difference ± SE"]),
    ]
    lines += [
        _row([d["metric"], f"{d['a']} - {d['b']}", ", ".join(f"{x:+.3g}" for x in d["differences"]), _difference(d)])
        for d in summary["part_b_paired"]
    ]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- reading


def _versus(diff: dict[str, Any], lower_is_better: bool) -> str:
    """``diff`` (a - b) in words: better / worse only when called."""
    if not diff["called"]:
        return f"no difference beyond two standard errors, {_difference(diff, verdict=False)}"
    better = (diff["mean"] < 0) == lower_is_better
    return f"{'better' if better else 'worse'} by {_difference(diff)}"


def reading_markdown(report: dict[str, Any]) -> str:
    """One plain sentence per finding, each stating its interval or test, null results included."""
    summary = report["summary"]
    out = []
    for (task, student), rows in _groups(summary["part_a"], "task", "student").items():
        cells = "; ".join(
            f"{_cell(r['score'])} at {r['tokens']} tokens" for r in sorted(rows, key=lambda r: r["tokens"])
        )
        out.append(f"Part A, {task} teacher, {NAMES[student]}: {SCORE_NAMES[task]} {cells} (mean [95 % interval]).")
    for (task, a, b), diffs in _groups(summary["part_a_paired"], "task", "a", "b").items():
        parts = "; ".join(
            f"{d['tokens']} tokens: {_versus(d['score'], task == 'local')}"
            for d in sorted(diffs, key=lambda d: d["tokens"])
        )
        out.append(
            f"Part A, {task} teacher, {NAMES[a]} against {NAMES[b]} ({SCORE_NAMES[task]}, paired by seed): {parts}."
        )
    for (task, student), rows in _groups(summary["rank"], "task", "student").items():
        rows = sorted(rows, key=lambda r: r["tokens"])
        cells = ", ".join(
            f"{r['numerical_rank']['mean']:.0f} of at most {r['bound']} at {r['tokens']} tokens" for r in rows
        )
        out.append(
            f"Rank, {task} teacher, {NAMES[student]}: numerical rank {cells}; effective rank "
            + ", ".join(f"{r['effective_rank']['mean']:.1f}" for r in rows)
            + "."
        )
    for d in summary["part_b_paired"]:
        measure = "held-out denoising loss" if d["metric"] == "mean_held_out_loss" else "sample asymmetry"
        out.append(f"Part B, {measure}, {NAMES[d['a']]} against {NAMES[d['b']]}: {_versus(d, True)}.")
    return "\n".join(f"- {line}" for line in out) + "\n"
