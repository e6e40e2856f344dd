"""What ``mhla reproduce`` writes, computed from ``report.json`` alone: the summary (intervals, the families of
paired comparisons with Holm-corrected p-values, ranks before and after training), ``table.md``,
``reading.md`` (plain sentences that claim no more than the corrected p-values) and the figures.

A family is a named set of paired comparisons corrected together (:data:`PART_A_PAIRS` at every token count of
one Part A task; the Part B pairs of one measure). A comparison is ``established`` where its Holm-corrected p
is below :data:`~.statistics.ALPHA`; otherwise it carries ``mdd``, the smallest true difference the
paired t test would call with 80 % power at the level Holm's first step asks of its family (``ALPHA / m``), from
the differences' own standard deviation."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable

from .operators import RANK_MEASURES, choose_rates
from .statistics import ALPHA, POWER, holm, interval, minimal_detectable_difference, paired_difference

__all__ = [
    "FIGURES",
    "NAMES",
    "PART_A_PAIRS",
    "PART_B_PAIRS",
    "SHORT_NAMES",
    "comparison_words",
    "reading_markdown",
    "summarise",
    "table_markdown",
    "write_figures",
]

#: Part A comparisons (a, b), a - b seed by seed, and the question each answers.
PART_A_PAIRS = (
    ("mhla", "mhla-uniform", "MHLA against global linear attention"),
    ("mhla-lepe", "linear-lepe", "MHLA + LePE against linear + LePE"),
    ("mhla", "linear-lepe", "MHLA against locality without blocks"),
    ("mhla", "mhla-permuted", "locality: MHLA against the same blocks on permuted tokens"),
    ("mhla-permuted", "mhla-uniform", "rank without locality: blocks of permuted tokens against no blocks"),
    ("linear-wide", "mhla-uniform", "rank without blocks: wide heads against global linear attention"),
    ("mhla", "linear-wide", "MHLA against wide-head linear attention of the same rank bound"),
    ("mhla-shuffled", "mhla-uniform", "blocks without locality against no blocks"),
    ("mhla-frozen", "mhla-shuffled", "local mixing against shuffled mixing"),
    ("mhla", "mhla-frozen", "learning the mixing"),
    ("softmax", "mhla", "softmax against MHLA"),
)
#: Part B comparisons (a, b).
PART_B_PAIRS = (
    ("linear", "softmax"),
    ("mhla", "softmax"),
    ("mhla", "linear"),
    ("linear-lepe", "linear"),
    ("mhla", "linear-lepe"),
)
#: Part B's per-timestep loss comparisons (where the loss gain comes from).
PART_B_TIMESTEP_PAIRS = (("mhla", "linear"), ("mhla", "linear-lepe"))
PART_B_METRICS = ("mean_held_out_loss", "asymmetry")
SCORE_NAMES = {
    "local": "relative error: the smaller, the closer to the teacher",
    "groups": "relative error: the smaller, the closer to the teacher",
    "recall": "recall accuracy: the share of queries answered right",
}
TASK_NAMES = {
    "local": "local teacher",
    "groups": "groups teacher (not local, rank known)",
    "recall": "associative recall",
}
NAMES = {
    "mhla-permuted": "MHLA on permuted tokens (blocks without spatial meaning)",
    "linear-wide": "wide-head global linear attention (MHLA's rank bound)",
    "mhla-lepe": "MHLA (learned) with LePE",
    "linear": "global linear attention",
    "linear-lepe": "global linear attention with LePE",
    "mhla-uniform": "MHLA with uniform mixing, frozen (= global linear attention)",
    "mhla-shuffled": "MHLA with shuffled mixing, frozen",
    "mhla-frozen": "MHLA with local mixing, frozen",
    "mhla": "MHLA (local mixing, learned)",
    "mhla-per-head": "MHLA with per-head mixing",
    "softmax": "softmax",
}
SHORT_NAMES = {
    "mhla-permuted": "MHLA permuted",
    "linear-wide": "linear wide",
    "mhla-lepe": "MHLA + LePE",
    "linear": "linear",
    "linear-lepe": "linear + LePE",
    "mhla-uniform": "MHLA uniform (frozen)",
    "mhla-shuffled": "MHLA shuffled (frozen)",
    "mhla-frozen": "MHLA local (frozen)",
    "mhla": "MHLA",
    "mhla-per-head": "MHLA per-head",
    "softmax": "softmax",
}
MEASURE_NAMES = {
    "mean_held_out_loss": "held-out denoising loss",
    "asymmetry": "sample asymmetry",
    "held_out_loss": "held-out denoising loss at one timestep",
}
FIGURES = ("part-a-score-vs-tokens.png", "part-a-rank-vs-tokens.png", "part-b-paired-differences.png")


def _groups(runs: Iterable[dict[str, Any]], *keys: str) -> dict[tuple, list[dict[str, Any]]]:
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault(tuple(run[k] for k in keys), []).append(run)
    return groups


def _paired(a_runs: list[dict[str, Any]], b_runs: list[dict[str, Any]], value: Callable) -> dict[str, Any] | None:
    """``paired_difference`` of ``value(run)`` over the seeds both lists hold (``None`` under two)."""
    a = {r["seed"]: value(r) for r in a_runs}
    b = {r["seed"]: value(r) for r in b_runs}
    seeds = sorted(set(a) & set(b))
    if len(seeds) < 2:
        return None
    return {"seeds": seeds, **paired_difference([a[s] for s in seeds], [b[s] for s in seeds])}


def _margin(settings: dict[str, Any], c: dict[str, Any]) -> float | None:
    """The smallest effect of interest of comparison ``c``: its task's (Part A) or its measure's (Part B)."""
    if "task" in c:
        return settings.get(f"{c['task']}_margin")
    return settings.get("part_b_asymmetry_margin" if c["metric"] == "asymmetry" else "part_b_loss_margin")


def _correct(name: str, comparisons: list[dict[str, Any]], settings: dict[str, Any]) -> dict[str, Any]:
    """The family ``name``: Holm-corrected p per comparison, the call, the MDD of those not established, and
    whether the 95 % interval lies within the smallest effect of interest (``equivalent``)."""
    adjusted = holm([c["p"] for c in comparisons])
    m = sum(p is not None for p in adjusted)
    for c, p in zip(comparisons, adjusted):
        c["p_holm"] = p
        c["established"] = p is not None and p < ALPHA
        c["mdd"] = (
            minimal_detectable_difference(c["sd"], c["n"], alpha=ALPHA / m)
            if not c["established"] and c["sd"] is not None and m
            else None
        )
        margin = _margin(settings, c)
        c["margin"] = margin
        c["equivalent"] = margin is not None and c["low"] is not None and -margin <= c["low"] and c["high"] <= margin
    return {"family": name, "size": m, "alpha": ALPHA, "power": POWER, "comparisons": comparisons}


def recall_reported(report: dict[str, Any]) -> dict[int, str]:
    """Recall token count -> why it is left out of the comparisons (softmax not run there, or its mean
    accuracy below ``recall_softmax_floor``); token counts absent from the result are reported."""
    floor = report["settings"]["recall_softmax_floor"]
    runs = [r for r in report["part_a"] if r["task"] == "recall"]
    dropped = {}
    for (tokens,), members in _groups(runs, "tokens").items():
        softmax = [r["score"] for r in members if r["student"] == "softmax"]
        if not softmax:
            dropped[tokens] = "softmax not run"
        elif sum(softmax) / len(softmax) < floor:
            dropped[tokens] = f"softmax below {floor:.0%}"
    return dropped


def did_not_train(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The students (task, token count) that ended a seed with their training loss over the last tenth of the
    steps above ``chance_fraction`` of the chance loss, with those seeds: kept out of the comparisons."""
    fraction = report["settings"]["chance_fraction"]
    out = []
    for (task, student, tokens), runs in _groups(report["part_a"], "task", "student", "tokens").items():
        stuck = [r["seed"] for r in runs if r["chance_loss"] and r["loss_curve"][-1] > fraction * r["chance_loss"]]
        if stuck:
            out.append({"task": task, "student": student, "tokens": tokens, "seeds": sorted(stuck)})
    return out


def _sweeps(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Per swept cell and student: the training loss over the last tenth of the steps at each learning rate,
    and the rate chosen (the lowest loss)."""
    rows = []
    for (task, tokens), runs in _groups(report["sweeps"], "task", "tokens").items():
        chosen = choose_rates(runs)
        for (student,), members in _groups(runs, "student").items():
            rows.append(
                {
                    "task": task,
                    "tokens": tokens,
                    "student": student,
                    "final_loss": {f"{r['lr']:g}": r["loss_curve"][-1] for r in members},
                    "chosen": chosen[student],
                }
            )
    return rows


def _gap_closed(part_a: dict[tuple, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Where softmax ran on a teacher scored by its error: the share of the gap between global linear attention
    (uniform mixing) and softmax that MHLA closes, ``(uniform - MHLA) / (uniform - softmax)`` seed by seed, as
    mean and 95 % interval."""
    out = []
    for (task, student, tokens), runs in part_a.items():
        if student != "mhla" or task == "recall":
            continue
        uniform, softmax = part_a.get((task, "mhla-uniform", tokens)), part_a.get((task, "softmax", tokens))
        if not uniform or not softmax:
            continue
        by_seed = [{r["seed"]: r["score"] for r in group} for group in (runs, uniform, softmax)]
        seeds = sorted(set(by_seed[0]) & set(by_seed[1]) & set(by_seed[2]))
        shares = [(by_seed[1][s] - by_seed[0][s]) / (by_seed[1][s] - by_seed[2][s]) for s in seeds]
        if shares:
            out.append({"task": task, "tokens": tokens, "share": interval(shares)})
    return out


def _overall(families: list[dict[str, Any]]) -> dict[str, Any]:
    """Every comparison of every family under one Holm correction: how many stay established."""
    everything = [c for f in families for c in f["comparisons"]]
    adjusted = holm([c["p"] for c in everything])
    in_families = sum(c["established"] for c in everything)
    overall = sum(p is not None and p < ALPHA for p in adjusted)
    lost = sum(c["established"] and not (p is not None and p < ALPHA) for c, p in zip(everything, adjusted))
    return {
        "size": sum(p is not None for p in adjusted),
        "established_in_families": in_families,
        "established_overall": overall,
        "lost": lost,
    }


def _tallies(families: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per Part A task and pair of :data:`PART_A_PAIRS`: over its token counts, how many comparisons are
    established in ``a``'s favour, in ``b``'s, practically nil (established, interval within the margin) and
    equivalent (not established, interval within the margin)."""
    out = []
    for family in families:
        for a, b, _ in PART_A_PAIRS:
            found = [c for c in family["comparisons"] if c.get("task") and c["a"] == a and c["b"] == b]
            if not found:
                continue
            out.append(
                {
                    "task": found[0]["task"],
                    "a": a,
                    "b": b,
                    "cells": len(found),
                    "a_better": sum(c["established"] and _better(c) and not c["equivalent"] for c in found),
                    "b_better": sum(c["established"] and not _better(c) and not c["equivalent"] for c in found),
                    "nil": sum(c["established"] and c["equivalent"] for c in found),
                    "equivalent": sum(not c["established"] and c["equivalent"] for c in found),
                }
            )
    return out


def summarise(report: dict[str, Any]) -> dict[str, Any]:
    """Intervals per (task, student, N); the rank measures after and before training against their bounds;
    the learning-rate sweeps; the students that did not train and the recall token counts left out; the named
    families of paired comparisons (Part A per task, Part B per measure), each Holm-corrected, with the count
    that survives one correction over all; MHLA's share of the gap to softmax; Part B's intervals per arm."""
    settings = report["settings"]
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
            "teacher_rank": runs[0]["teacher_rank"],
            "trained": {m: interval([r["rank"][m] for r in runs]) for m in RANK_MEASURES},
            "untrained": {m: interval([r["rank_untrained"][m] for r in runs]) for m in RANK_MEASURES},
        }
        for (t, k, n), runs in part_a.items()
        if runs[0]["rank"] is not None
    ]
    dropped = recall_reported(report) if any(r["task"] == "recall" for r in report["part_a"]) else {}
    untrained = did_not_train(report)
    stuck = {(d["task"], d["student"], d["tokens"]) for d in untrained}
    families = []
    for (task,), runs in _groups(report["part_a"], "task").items():
        comparisons = []
        for a, b, question in PART_A_PAIRS:
            for n in sorted({r["tokens"] for r in runs}):
                if task == "recall" and n in dropped or (task, a, n) in stuck or (task, b, n) in stuck:
                    continue
                if (task, a, n) in part_a and (task, b, n) in part_a:
                    diff = _paired(part_a[task, a, n], part_a[task, b, n], lambda r: r["score"])
                    if diff is not None:
                        comparisons.append(
                            {"task": task, "tokens": n, "a": a, "b": b, "question": question, "metric": "score"} | diff
                        )
        if comparisons:
            families.append(_correct(f"Part A, {TASK_NAMES[task]}", comparisons, settings))
    part_b = _groups(report["part_b"], "arm")
    arms = [
        {
            "arm": arm,
            **{m: interval([r[m] for r in runs]) for m in (*PART_B_METRICS, "sample_scale")},
            "held_out_loss": {t: interval([r["held_out_loss"][t] for r in runs]) for t in runs[0]["held_out_loss"]},
        }
        for (arm,), runs in part_b.items()
    ]
    for metric in PART_B_METRICS:
        comparisons = [
            {"a": a, "b": b, "metric": metric} | diff
            for a, b in PART_B_PAIRS
            if (a,) in part_b
            and (b,) in part_b
            and (diff := _paired(part_b[a,], part_b[b,], lambda r, m=metric: r[m])) is not None
        ]
        if comparisons:
            families.append(_correct(f"Part B, {MEASURE_NAMES[metric]}", comparisons, settings))
    timesteps = list(report["part_b"][0]["held_out_loss"]) if report["part_b"] else []
    comparisons = [
        {"a": a, "b": b, "metric": "held_out_loss", "timestep": t} | diff
        for a, b in PART_B_TIMESTEP_PAIRS
        for t in timesteps
        if (a,) in part_b
        and (b,) in part_b
        and (diff := _paired(part_b[a,], part_b[b,], lambda r, t=t: r["held_out_loss"][t])) is not None
    ]
    if comparisons:
        families.append(_correct("Part B, held-out denoising loss per timestep", comparisons, settings))
    return {
        "part_a": scores,
        "rank": ranks,
        "sweeps": _sweeps(report),
        "did_not_train": untrained,
        "recall_dropped": [{"tokens": n, "why": why} for n, why in sorted(dropped.items())],
        "families": families,
        "overall": _overall(families),
        "tallies": _tallies(families),
        "gap_closed": _gap_closed(part_a),
        "part_b": arms,
    }


# ---------------------------------------------------------------------------- words and cells


def _num(x: float, digits: int = 3) -> str:
    return f"{x:.{digits}g}"


def _p(p: float | None) -> str:
    return "n/a" if p is None else f"{p:.2g}"


def _cell(stat: dict[str, Any] | None, digits: int = 3) -> str:
    if stat is None:
        return ""
    if stat["low"] is None:
        return f"{stat['mean']:.{digits}f}"
    return f"{stat['mean']:.{digits}f} [{stat['low']:.{digits}f}, {stat['high']:.{digits}f}]"


def _diff_interval(c: dict[str, Any]) -> str:
    """``mean [low, high]`` of a paired difference (3 significant digits)."""
    if c["low"] is None:
        return f"{c['mean']:+.3g}"
    return f"{c['mean']:+.3g} [{c['low']:+.3g}, {c['high']:+.3g}]"


def _capital(text: str) -> str:
    return text[:1].upper() + text[1:]


def _lower_is_better(c: dict[str, Any]) -> bool:
    return c.get("task") != "recall"


def _better(c: dict[str, Any]) -> bool:
    """Whether ``a`` did better than ``b`` in comparison ``c`` (whatever its call)."""
    return (c["mean"] < 0) == _lower_is_better(c)


def comparison_words(c: dict[str, Any]) -> str:
    """One comparison in words, no stronger than its corrected p: ``lower by ...`` / ``higher by ...`` only
    where established (and then ``practically nil`` where its interval lies within the smallest effect of
    interest), else ``not established``, with ``equivalent within +-margin`` where the interval says so and the
    minimal detectable difference."""
    stats = f"{_diff_interval(c)}, p = {_p(c['p'])}, Holm p = {_p(c['p_holm'])}, {c['n']} seeds"
    margin = c.get("margin")
    if c["established"]:
        direction = "lower" if c["mean"] < 0 else "higher"
        nil = f"; practically nil (interval within ±{margin:g})" if c.get("equivalent") else ""
        return f"{direction} ({'better' if _better(c) else 'worse'}): {stats}{nil}"
    equivalent = f", equivalent within ±{margin:g}" if c.get("equivalent") else ""
    mdd = "" if c["mdd"] is None else f"; 80 % power only for differences of at least {_num(c['mdd'], 2)}"
    return f"not established{equivalent}: {stats}{mdd}"


def _within(c: dict[str, Any]) -> str:
    """The table's margin cell: equivalent / practically nil where the interval lies within the margin."""
    if not c.get("equivalent"):
        return ""
    return f"{'practically nil' if c['established'] else 'equivalent'} (±{c['margin']:g})"


def _where(c: dict[str, Any]) -> str:
    if "tokens" in c:
        return f"{c['tokens']} tokens"
    if "timestep" in c:
        return f"t = {c['timestep']}"
    return ""


def _row(cells: Iterable[Any]) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _header(cells: list[str]) -> list[str]:
    return [_row(cells), "|" + "---|" * len(cells)]


# ---------------------------------------------------------------------------- table


def table_markdown(report: dict[str, Any]) -> str:
    """The report's summary as Markdown tables: mean [95 % interval] over seeds; every family of paired
    differences with raw and Holm-corrected p and the call; ranks before and after training."""
    summary, s = report["summary"], report["settings"]
    lines: list[str] = []
    for (task,), rows in _groups(summary["part_a"], "task").items():
        tokens = sorted({r["tokens"] for r in rows})
        steps = dict(zip(s[f"{task}_tokens"], s[f"{task}_steps"]))
        batches = dict(zip(s[f"{task}_tokens"], s[f"{task}_batch_sizes"]))
        lines += [
            f"**Part A, {TASK_NAMES[task]}** ({SCORE_NAMES[task]}; held out; mean [95 % interval] over "
            f"{len(s['part_a_seeds'])} seeds; steps / batch: "
            + ", ".join(f"{steps[n]} / {batches[n]} at {n}" for n in tokens)
            + "; learning rate "
            + ("swept over " if len(s[f"{task}_lrs"]) > 1 else "")
            + ", ".join(f"{lr:g}" for lr in s[f"{task}_lrs"])
            + ")",
            "",
            *_header(["attention", *[f"{n} tokens" for n in tokens]]),
        ]
        for (student,), members in _groups(rows, "student").items():
            by_tokens = {r["tokens"]: r["score"] for r in members}
            lines.append(_row([SHORT_NAMES[student], *[_cell(by_tokens.get(n)) for n in tokens]]))
        lines.append("")
    if summary["recall_dropped"]:
        lines += [
            "Recall left out of the comparisons at: "
            + "; ".join(f"{d['tokens']} tokens ({d['why']})" for d in summary["recall_dropped"]),
            "",
        ]
    if summary["sweeps"]:
        rates = sorted({lr for r in summary["sweeps"] for lr in r["final_loss"]}, key=float)
        lines += [
            f"**Learning-rate sweeps** (seed {s['sweep_seed']}, not reported; training loss over the last tenth of "
            "the steps at each rate; chosen: the lowest, used for every reported seed)",
            "",
            *_header(["task", "tokens", "attention", *[f"loss at {lr}" for lr in rates], "chosen"]),
        ]
        lines += [
            _row(
                [
                    r["task"],
                    r["tokens"],
                    SHORT_NAMES[r["student"]],
                    *[f"{r['final_loss'][lr]:.3f}" if lr in r["final_loss"] else "" for lr in rates],
                    f"{r['chosen']:g}",
                ]
            )
            for r in summary["sweeps"]
        ]
        lines.append("")
    for d in summary["did_not_train"]:
        lines += [
            f"Did not train (kept out of the comparisons): {SHORT_NAMES[d['student']]}, {d['task']}, {d['tokens']} "
            f"tokens: its training loss stayed above {s['chance_fraction']:g} of the chance loss on seeds "
            + ", ".join(str(x) for x in d["seeds"])
            + ".",
            "",
        ]
    if summary["gap_closed"]:
        lines += [
            "**The share of the gap to softmax that MHLA closes**, (uniform - MHLA) / (uniform - softmax) seed by "
            "seed (MHLA uniform (frozen) is global linear attention), mean [95 % interval]: "
            + "; ".join(f"{g['task']} {g['tokens']} tokens {_cell(g['share'])}" for g in summary["gap_closed"]),
            "",
        ]
    for family in summary["families"]:
        lines += [
            f"**{family['family']}** (a family of {family['size']} paired comparisons, Holm-corrected; called where "
            f"Holm p < {family['alpha']:g}; MDD: the difference detected with {family['power']:.0%} power at "
            f"{family['alpha']:g} / {family['size']})",
            "",
            *_header(["a - b", "where", "difference [95 % interval]", "p", "Holm p", "call", "MDD", "within ±margin"]),
        ]
        lines += [
            _row(
                [
                    f"{SHORT_NAMES[c['a']]} - {SHORT_NAMES[c['b']]}",
                    _where(c),
                    _diff_interval(c),
                    _p(c["p"]),
                    _p(c["p_holm"]),
                    "established" if c["established"] else "not established",
                    "" if c["mdd"] is None else _num(c["mdd"], 2),
                    _within(c),
                ]
            )
            for c in family["comparisons"]
        ]
        lines.append("")
    o = summary["overall"]
    lines += [
        f"**All {o['size']} comparisons under one Holm correction**: {o['established_overall']} established "
        f"({o['established_in_families']} within their families; {o['lost']} not under one correction).",
        "",
    ]
    lines += [
        "**The rank of the N x N attention matrix** (first held-out input, mean over heads and seeds; numerical "
        "rank: singular values above 1e-3 or 1e-2 of the largest, untrained -> trained; bound: d for linear "
        "attention and uniform mixing, sum over blocks of min(n_b, d) for MHLA, N for softmax; teacher: the "
        "rank of the groups teacher's matrix)",
        "",
        *_header(
            ["task", "attention", "tokens", "bound", "teacher", "rank 1e-3", "rank 1e-2", "effective rank (trained)"]
        ),
    ]
    lines += [
        _row(
            [
                r["task"],
                SHORT_NAMES[r["student"]],
                r["tokens"],
                r["bound"],
                "" if r["teacher_rank"] is None else r["teacher_rank"],
                f"{r['untrained']['rank_1e-3']['mean']:.1f} -> {r['trained']['rank_1e-3']['mean']:.1f}",
                f"{r['untrained']['rank_1e-2']['mean']:.1f} -> {r['trained']['rank_1e-2']['mean']:.1f}",
                _cell(r["trained"]["effective_rank"], 1),
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
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- reading


def reading_markdown(report: dict[str, Any]) -> str:
    """One plain sentence per finding, each with its interval or corrected test, null results included."""
    summary = report["summary"]
    out = []
    for (task, student), rows in _groups(summary["part_a"], "task", "student").items():
        cells = "; ".join(
            f"{_cell(r['score'])} at {r['tokens']} tokens" for r in sorted(rows, key=lambda r: r["tokens"])
        )
        out.append(f"Part A, {TASK_NAMES[task]}, {NAMES[student]}: {SCORE_NAMES[task]} {cells} (mean [95 % interval]).")
    for d in summary["recall_dropped"]:
        out.append(f"Recall at {d['tokens']} tokens is left out of the comparisons: {d['why']}.")
    for r in summary["sweeps"]:
        losses = ", ".join(f"{loss:.3f} at {lr}" for lr, loss in r["final_loss"].items())
        out.append(
            f"Learning-rate sweep, {TASK_NAMES[r['task']]}, {r['tokens']} tokens, {NAMES[r['student']]}: final "
            f"training loss {losses}; chosen {r['chosen']:g}."
        )
    for d in summary["did_not_train"]:
        out.append(
            f"{_capital(NAMES[d['student']])}, {TASK_NAMES[d['task']]}, {d['tokens']} tokens, did not train (seeds "
            + ", ".join(str(x) for x in d["seeds"])
            + ") and is kept out of the comparisons."
        )
    for g in summary["gap_closed"]:
        out.append(
            f"{_capital(TASK_NAMES[g['task']])}, {g['tokens']} tokens: MHLA closes {_cell(g['share'])} of the gap "
            "between global linear attention and softmax (mean [95 % interval] over seeds)."
        )
    o = summary["overall"]
    out.append(
        f"Under one Holm correction over all {o['size']} comparisons, {o['established_overall']} are established "
        f"({o['established_in_families']} within their families)."
    )
    for family in summary["families"]:
        for c in family["comparisons"]:
            where = _where(c)
            out.append(
                f"{family['family']}, {NAMES[c['a']]} against {NAMES[c['b']]}"
                + (f", {where}" if where else "")
                + f": {comparison_words(c)} (a - b, family of {family['size']})."
            )
    for (task, student), rows in _groups(summary["rank"], "task", "student").items():
        rows = sorted(rows, key=lambda r: r["tokens"])
        cells = ", ".join(
            f"{r['untrained']['rank_1e-2']['mean']:.0f} -> {r['trained']['rank_1e-2']['mean']:.0f} of at most "
            f"{r['bound']} at {r['tokens']} tokens"
            + ("" if r["teacher_rank"] is None else f" (teacher {r['teacher_rank']})")
            for r in rows
        )
        out.append(f"Rank at 1e-2, {TASK_NAMES[task]}, {NAMES[student]}, untrained -> trained: {cells}.")
    return "\n".join(f"- {line}" for line in out) + "\n"


# ---------------------------------------------------------------------------- figures


def write_figures(report: dict[str, Any], folder: Path) -> list[Path]:
    """The three figures of :data:`FIGURES` in ``folder``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = report["summary"]
    paths = [Path(folder) / name for name in FIGURES]
    _plot_part_a(plt, summary["part_a"], lambda r: r["score"], paths[0], lambda task: SCORE_NAMES[task])
    _plot_part_a(
        plt,
        summary["rank"],
        lambda r: r["trained"]["rank_1e-2"],
        paths[1],
        lambda task: "rank at 1e-2, trained (dashed: bound; dotted: untrained)",
        ranks=True,
    )
    _plot_part_b(plt, [f for f in summary["families"] if f["family"].startswith("Part B")], paths[2])
    return paths


def _plot_part_a(plt, rows: list[dict[str, Any]], stat: Callable, path: Path, ylabel, ranks: bool = False) -> None:
    tasks = list(dict.fromkeys(r["task"] for r in rows)) or ["(none)"]
    fig, axes = plt.subplots(1, len(tasks), figsize=(5.2 * len(tasks), 4.0), dpi=110, squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for student, members in _groups((r for r in rows if r["task"] == task), "student").items():
            members = sorted(members, key=lambda r: r["tokens"])
            x = [r["tokens"] for r in members]
            values = [stat(r) for r in members]
            mean = [v["mean"] for v in values]
            low = [v["mean"] - (v["low"] if v["low"] is not None else v["mean"]) for v in values]
            high = [(v["high"] if v["high"] is not None else v["mean"]) - v["mean"] for v in values]
            line = ax.errorbar(x, mean, yerr=[low, high], marker="o", capsize=3, label=SHORT_NAMES[student[0]])
            if ranks:
                colour = line[0].get_color()
                ax.plot(x, [r["bound"] for r in members], "--", color=colour, alpha=0.6)
                ax.plot(x, [r["untrained"]["rank_1e-2"]["mean"] for r in members], ":", color=colour, alpha=0.8)
        ax.set_xscale("log", base=2)
        if ranks:
            ax.set_yscale("log", base=2)
        ax.set_xlabel("tokens")
        ax.set_ylabel(ylabel(task))
        ax.set_title(f"{TASK_NAMES.get(task, task)}: mean and 95 % interval over seeds", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _plot_part_b(plt, families: list[dict[str, Any]], path: Path) -> None:
    families = families or [{"family": "(none)", "comparisons": []}]
    fig, axes = plt.subplots(1, len(families), figsize=(5.5 * len(families), 4.0), dpi=110, squeeze=False)
    for ax, family in zip(axes[0], families):
        diffs = family["comparisons"]
        for i, d in enumerate(diffs):
            ax.plot([i] * len(d["differences"]), d["differences"], "o", color="0.6", markersize=4)
            if d["low"] is not None:
                ax.errorbar(
                    [i + 0.15],
                    [d["mean"]],
                    yerr=[[d["mean"] - d["low"]], [d["high"] - d["mean"]]],
                    fmt="s",
                    color="C3" if d["established"] else "C0",
                    capsize=4,
                )
        ax.axhline(0.0, color="black", linewidth=0.8)
        labels = [f"{d['a']}\n- {d['b']}" + (f"\nt={d['timestep']}" if "timestep" in d else "") for d in diffs]
        ax.set_xticks(range(len(diffs)), labels, fontsize=6)
        ax.set_ylabel("difference (a - b)")
        ax.set_title(f"{family['family']}\nper seed (grey); mean, 95 % interval (red: Holm p < 0.05)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
