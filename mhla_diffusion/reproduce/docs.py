"""The README section "Attentions compared" (short) and ``docs/reproduce.md`` (full), written from a
``mhla reproduce`` report of schema ``reproduce-3`` alone.

Every number in them is a setting or a summary value of the report (``tests/reproduce/test_reproduce_docs.py``
checks each one), and every comparison is worded by its Holm-corrected p
(:func:`~.report.comparison_words`): "lower" / "higher" only where established, else "not
established" with the minimal detectable difference. ``mhla reproduce --docs`` rewrites both files from the
report in ``--output``."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path
from typing import Any

from .report import (
    FIGURES,
    NAMES,
    PART_A_PAIRS,
    SCORE_NAMES,
    SHORT_NAMES,
    TASK_NAMES,
    _capital,
    _groups,
    comparison_words,
)

__all__ = [
    "README_HEADING",
    "conclusion",
    "readme_section",
    "recommendation",
    "replace_readme_section",
    "reproduce_doc",
    "write_docs",
]

README_HEADING = "## Attentions compared"
DOC_LINK = "docs/reproduce.md"
WIDTH = 115  # the README's and docs' line width
_GLUE = "\x00"  # a space that textwrap does not break at


def _glued(line: str) -> str:
    """``line`` with the spaces around `` - ``, `` + ``, `` * ``, `` > ``, before a ``%`` and before a number ending
    in ``.`` or ``)`` made unbreakable, so that no wrapped line starts with what Markdown reads as a list item or
    quote (or with a lone ``%``)."""
    line = re.sub(r" ([-+*>]) ", lambda m: f"{_GLUE}{m.group(1)}{_GLUE}", line)
    line = re.sub(r"(\d) %", lambda m: f"{m.group(1)}{_GLUE}%", line)  # "80 %" stays on one line
    return re.sub(r"(\S) (\d+[.)])(?= |$)", lambda m: f"{m.group(1)}{_GLUE}{m.group(2)}", line)


def _wrap(lines: list[str]) -> str:
    """``lines`` joined, each prose line or bullet wrapped at :data:`WIDTH` (bullets indented by two); code
    blocks, headings, tables and images stay as they are."""
    out, code = [], False
    for line in lines:
        if line.startswith("```"):
            code = not code
        if code or line.startswith(("```", "#", "|", "![")) or len(line) <= WIDTH:
            out.append(line)
            continue
        bullet = line.startswith("- ")
        body = _glued(line[2:] if bullet else line)
        wrapped = textwrap.wrap(
            body,
            WIDTH,
            initial_indent="- " if bullet else "",
            subsequent_indent="  " if bullet else "",
            break_long_words=False,
            break_on_hyphens=False,
        )
        out += [piece.replace(_GLUE, " ") for piece in wrapped]
    return "\n".join(out)


def _check(report: dict[str, Any]) -> None:
    from .experiment import SCHEMA

    if report.get("schema") != SCHEMA or not report.get("complete"):
        raise ValueError(
            f"the docs are written from a complete report of schema {SCHEMA!r}; this one has schema "
            f"{report.get('schema')!r} and complete={report.get('complete')!r} (finish the run first)"
        )


def _teacher(task: str) -> str:
    """The task's name without its parenthesis (``groups teacher``)."""
    return TASK_NAMES[task].split(" (")[0]


def _tokens(values: list[int]) -> str:
    values = [str(v) for v in values]
    return values[0] if len(values) == 1 else ", ".join(values[:-1]) + " and " + values[-1]


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.0f}"


def _family(summary: dict[str, Any], prefix: str) -> dict[str, Any] | None:
    return next((f for f in summary["families"] if f["family"] == prefix), None)


def _pair_line(family: dict[str, Any], a: str, b: str) -> str | None:
    """The comparisons ``a - b`` of ``family`` at every token count, each with its call, in one line."""
    found = [c for c in family["comparisons"] if c["a"] == a and c["b"] == b]
    if not found:
        return None
    return "; ".join(f"{c['tokens']} tokens: {comparison_words(c)}" for c in found)


def _numbers(c: dict[str, Any], holm: bool = False) -> str:
    """A comparison's numbers, briefly: the difference; the corrected p where established (or with ``holm``);
    ``practically nil`` / ``equivalent`` where the interval lies within the margin; the MDD where not established."""
    parts = [f"{c['mean']:+.2g}"]
    if c["established"] or holm:
        parts.append(f"Holm p = {c['p_holm']:.2g}")
    if c["equivalent"]:
        parts.append(f"{'practically nil: within' if c['established'] else 'equivalent within'} ±{c['margin']:g}")
    if not c["established"] and c["mdd"] is not None:
        parts.append(f"MDD {c['mdd']:.2g}")
    return ", ".join(parts)


def _short_pair(family: dict[str, Any], a: str, b: str, holm: bool = False) -> str | None:
    """The calls of ``a - b`` over token counts, briefly: the token counts where established, then those where not,
    each with :func:`_numbers`."""
    found = [c for c in family["comparisons"] if c["a"] == a and c["b"] == b]
    if not found:
        return None
    parts = []
    for call in ("established", "not established"):
        cells = [c for c in found if c["established"] == (call == "established")]
        if cells:
            parts.append(f"{call} at " + ", ".join(f"{c['tokens']} ({_numbers(c, holm)})" for c in cells))
    return "; ".join(parts)


def _score_range(summary: dict[str, Any], task: str, student: str) -> str | None:
    rows = sorted(
        (r for r in summary["part_a"] if r["task"] == task and r["student"] == student), key=lambda r: r["tokens"]
    )
    if not rows:
        return None
    return ", ".join(f"{r['score']['mean']:.3f} at {r['tokens']}" for r in rows)


def _rank_line(summary: dict[str, Any], task: str, untrained: bool = True) -> str | None:
    """Every student's numerical rank at 1e-2 (``untrained``: untrained -> trained, with the 1e-3 ranks) of its
    bound, at each token count."""
    rows = [r for r in summary["rank"] if r["task"] == task]
    if not rows:
        return None
    parts = []
    for student in dict.fromkeys(r["student"] for r in rows):
        cells = ", ".join(
            (
                f"{r['untrained']['rank_1e-2']['mean']:.0f} -> {r['trained']['rank_1e-2']['mean']:.0f} "
                f"(1e-3: {r['untrained']['rank_1e-3']['mean']:.0f} -> {r['trained']['rank_1e-3']['mean']:.0f})"
                if untrained
                else f"{r['trained']['rank_1e-2']['mean']:.0f}"
            )
            + f" of {r['bound']} at {r['tokens']}"
            for r in sorted((r for r in rows if r["student"] == student), key=lambda r: r["tokens"])
        )
        parts.append(f"{SHORT_NAMES[student]} {cells}")
    return "; ".join(parts)


def _trained_ranks(summary: dict[str, Any], task: str) -> str | None:
    """Every student's trained rank at 1e-2 over its bound at each token count, briefly (``MHLA 120/128, 400/512``)."""
    rows = [r for r in summary["rank"] if r["task"] == task]
    if not rows:
        return None
    return ", ".join(
        f"{SHORT_NAMES[student]} "
        + " ".join(
            f"{r['trained']['rank_1e-2']['mean']:.0f}/{r['bound']}"
            for r in sorted((r for r in rows if r["student"] == student), key=lambda r: r["tokens"])
        )
        for student in dict.fromkeys(r["student"] for r in rows)
    )


def _part_b_means(summary: dict[str, Any], measure: str, digits: int) -> str:
    return ", ".join(f"{SHORT_NAMES[r['arm']]} {r[measure]['mean']:.{digits}f}" for r in summary["part_b"])


def _tally(summary: dict[str, Any], a: str, b: str, tasks: tuple[str, ...]) -> list[dict[str, Any]]:
    return [t for t in summary["tallies"] if t["a"] == a and t["b"] == b and t["task"] in tasks]


def _tally_words(tallies: list[dict[str, Any]], side: str) -> str:
    """``local teacher 2 of 2 token counts, groups teacher 0 of 2`` for ``side`` (``a_better`` / ``b_better``)."""
    return ", ".join(f"{_teacher(t['task'])} {t[side]} of {t['cells']}" for t in tallies)


TEACHERS = ("local", "groups")


def conclusion(summary: dict[str, Any]) -> list[str]:
    """What the controls support, from the tallies of the local and groups teachers: locality (MHLA against the
    same blocks on permuted tokens), rank without locality (blocks of permuted tokens and wide heads, each against
    global linear attention): the verdict, the sizes of its established effects, and the tallies, as sentences that
    state only established calls."""
    locality = _tally(summary, "mhla", "mhla-permuted", TEACHERS)
    permuted = _tally(summary, "mhla-permuted", "mhla-uniform", TEACHERS)
    wide = _tally(summary, "linear-wide", "mhla-uniform", TEACHERS)
    if not locality or not permuted or not wide:
        return []

    def where(tallies: list[dict[str, Any]]) -> str:
        return " and ".join(_teacher(t["task"]) for t in tallies if t["a_better"])

    local_gain, blocks_gain, wide_gain = where(locality), where(permuted), where(wide)
    lead = {
        (True, False): "The controls point to locality, not to the rank MHLA's blocks add",
        (False, True): "The controls point to the rank MHLA's blocks add, not to locality",
        (True, True): "The controls show both locality and the rank MHLA's blocks add",
        (False, False): "Neither locality nor the rank MHLA's blocks add is established",
    }[bool(local_gain), bool(blocks_gain)]
    clauses = [
        f"on the grid, MHLA is established ahead of the same blocks on permuted tokens on the {local_gain}"
        if local_gain
        else "on the grid, MHLA is established ahead of the same blocks on permuted tokens nowhere",
        f"those blocks without spatial meaning (MHLA's rank bound) are established ahead of global linear "
        f"attention on the {blocks_gain}"
        if blocks_gain
        else "those blocks without spatial meaning (MHLA's rank bound) are established ahead of global linear "
        "attention nowhere beyond the margin",
        f"rank without blocks (wide heads with the same bound) is established ahead of global linear attention on "
        f"the {wide_gain}"
        if wide_gain
        else "nor is rank without blocks (wide heads with the same bound)",
    ]
    verdict = f"{lead}: " + "; ".join(clauses) + "."
    return [
        verdict,
        _effect_sizes(summary),
        f"Cells established in favour of MHLA against MHLA permuted: {_tally_words(locality, 'a_better')}; of "
        f"MHLA permuted against global linear attention: {_tally_words(permuted, 'a_better')}; of wide heads "
        f"against global linear attention: {_tally_words(wide, 'a_better')}.",
    ]


def _effect_sizes(summary: dict[str, Any]) -> str:
    """The established effects beyond the margin of locality (MHLA against the same blocks on permuted tokens) and
    of rank without locality (blocks of permuted tokens, wide heads, each against global linear attention), with
    the teacher and token count of each: ``Sizes (a - b): ...``; empty where none is."""
    parts = []
    for label, pairs in (
        ("locality", (("mhla", "mhla-permuted"),)),
        ("rank", (("mhla-permuted", "mhla-uniform"), ("linear-wide", "mhla-uniform"))),
    ):
        cells = [
            f"{SHORT_NAMES[c['a']]} - {SHORT_NAMES[c['b']]} {c['mean']:+.2g} ({_teacher(c['task'])}, {c['tokens']})"
            for task in TEACHERS
            if (family := _family(summary, f"Part A, {TASK_NAMES[task]}")) is not None
            for c in family["comparisons"]
            if (c["a"], c["b"]) in pairs and c["established"] and not c["equivalent"]
        ]
        parts.append(f"{label}: " + (", ".join(cells) if cells else "none beyond the margin"))
    return "Sizes (a - b, relative error): " + "; ".join(parts) + "."


def recommendation(summary: dict[str, Any]) -> str | None:
    """What to convert to, from MHLA + LePE against linear + LePE on every task: established calls only."""
    tallies = _tally(summary, "mhla-lepe", "linear-lepe", ("local", "groups", "recall"))
    if not tallies:
        return None
    ahead = [t for t in tallies if t["a_better"]]
    behind = [t for t in tallies if t["b_better"]]
    names = lambda ts: ", ".join(_teacher(t["task"]) for t in ts)  # noqa: E731
    if ahead and not behind:
        return (
            f"Convert to MHLA + LePE rather than linear attention + LePE: it is established ahead on the "
            f"{names(ahead)} and behind nowhere."
        )
    if behind and not ahead:
        return (
            f"Linear attention + LePE is the conversion these tasks support: MHLA + LePE is established behind it "
            f"on the {names(behind)} and ahead nowhere."
        )
    if ahead and behind:
        return (
            f"No single recommendation: MHLA + LePE is established ahead of linear attention + LePE on the "
            f"{names(ahead)} and behind it on the {names(behind)}."
        )
    return "MHLA + LePE and linear attention + LePE are not told apart on any task: either converts as well."


def _percent(x: float) -> str:
    """``x`` as a percentage to a tenth, without a sign on zero (``-0.0%``)."""
    text = f"{x:.1%}"
    return "0.0%" if text == "-0.0%" else text


def _gap_words(summary: dict[str, Any]) -> str | None:
    rows = summary["gap_closed"]
    if not rows:
        return None
    return "; ".join(
        f"{_teacher(g['task'])} at {g['tokens']} tokens "
        f"{_percent(g['share']['mean'])} [{_percent(g['share']['low'])}, {_percent(g['share']['high'])}]"
        if g["share"]["low"] is not None
        else f"{_teacher(g['task'])} at {g['tokens']} tokens {_percent(g['share']['mean'])}"
        for g in rows
    )


def _recall_words(summary: dict[str, Any], rates: bool = True) -> list[str]:
    """The recall sweep's chosen rates (with ``rates``) and the students that did not train."""
    out = []
    for (task, tokens), rows in _groups(summary["sweeps"], "task", "tokens").items():
        out.append(f"{tokens} tokens: " + ", ".join(f"{SHORT_NAMES[r['student']]} {r['chosen']:g}" for r in rows))
    chosen = "; ".join(out)
    stuck = summary["did_not_train"]
    parts = []
    if chosen and rates:
        parts.append(f"learning rates chosen on the sweep seed: {chosen}")
    if stuck:
        parts.append(
            "did not train (kept out of the calls): "
            + ", ".join(f"{SHORT_NAMES[d['student']]} at {d['tokens']}" for d in stuck)
        )
    else:
        parts.append("every student left the chance plateau on every seed")
    return parts


#: the Part A pairs the README names per teacher, grouped by the question they answer; the last flag: the group
#: that decides what to convert to (every call with its Holm p, then :func:`recommendation`)
README_PAIRS = (
    ("Locality", (("mhla", "mhla-permuted"), ("mhla", "linear-wide"), ("mhla-frozen", "mhla-shuffled")), False),
    ("Rank without locality", (("mhla-permuted", "mhla-uniform"), ("linear-wide", "mhla-uniform")), False),
    ("MHLA against global linear attention", (("mhla", "mhla-uniform"),), False),
    ("What to convert to", (("mhla-lepe", "linear-lepe"),), True),
)


def _pairs_words(summary: dict[str, Any], pairs: tuple[tuple[str, str], ...], holm: bool = False) -> str:
    out = []
    for task in ("local", "groups", "recall"):
        family = _family(summary, f"Part A, {TASK_NAMES[task]}")
        if family is None:
            continue
        bits = [
            f"{SHORT_NAMES[a]} - {SHORT_NAMES[b]} {line}" for a, b in pairs if (line := _short_pair(family, a, b, holm))
        ]
        if bits:
            out.append(f"{_capital(_teacher(task))}: " + "; ".join(bits))
    return ". ".join(out)


def _brief(c: dict[str, Any]) -> str:
    """One comparison in a few words: its call and :func:`_numbers`."""
    return f"{'established' if c['established'] else 'not established'} ({_numbers(c)})"


def _part_b_words(summary: dict[str, Any], s: dict[str, Any]) -> str | None:
    wanted = (("mhla", "linear"), ("mhla", "linear-lepe"))
    parts = []
    for name, label in (("Part B, held-out denoising loss", "loss"), ("Part B, sample asymmetry", "asymmetry")):
        family = _family(summary, name)
        if family is not None:
            parts += [
                f"{label} {SHORT_NAMES[c['a']]} - {SHORT_NAMES[c['b']]} {_brief(c)}"
                for c in family["comparisons"]
                if (c["a"], c["b"]) in wanted
            ]
    if not parts:
        return None
    return (
        f"**Denoising mirror-symmetric images ({s['part_b_tokens']} tokens).** Held-out loss "
        f"{_part_b_means(summary, 'mean_held_out_loss', 3)}; sample asymmetry (0: symmetric) "
        f"{_part_b_means(summary, 'asymmetry', 2)}; " + "; ".join(parts) + "."
    )


def _overall_words(summary: dict[str, Any]) -> str:
    o = summary["overall"]
    return (
        f"Of {o['size']} comparisons, {o['established_in_families']} are established within their families and "
        f"{o['established_overall']} under one Holm correction over all of them."
    )


def readme_section(report: dict[str, Any]) -> str:
    """The README's "Attentions compared" section (heading included, ending in a blank line): the conclusion the
    controls support first, then each question's calls with their sizes."""
    _check(report)
    s, summary = report["settings"], report["summary"]
    lines = [
        README_HEADING,
        "",
        f"`mhla reproduce` fits one attention layer to a local teacher, a non-local teacher of rank {s['groups']} "
        "and associative recall, with controls that separate locality from rank (MHLA's blocks on permuted "
        "tokens, linear attention with heads as wide as MHLA's rank bound, shuffled mixing, LePE with and without "
        "MHLA, softmax), then trains a small DiT denoiser on mirror-symmetric images:",
        "",
        "```bash",
        f"mhla reproduce            # the full run: {_minutes(report['seconds'])} minutes with "
        f"{report['torch_threads']} torch threads; writes runs/reproduce/",
        "mhla reproduce --budget   # projected minutes, from one-thread CPU time per step; load inflates it",
        "```",
        "",
        f"The committed run ([docs/reproduce/](docs/reproduce/table.md); {len(s['part_a_seeds'])} seeds, a teacher "
        f"each, in Part A, {len(s['part_b_seeds'])} in Part B): differences paired by seed, called where the "
        "Holm-corrected p in their family is below 0.05; MDD: detected with 80 % power; equivalent: the interval "
        f"within margins fixed before the run (relative error ±{s['local_margin']:g}, recall "
        f"±{s['recall_margin']:g}, Part B loss ±{s['part_b_loss_margin']:g}, asymmetry "
        f"±{s['part_b_asymmetry_margin']:g}).",
        "",
    ]
    lead = conclusion(summary)
    if lead:
        lines += [f"**{lead[0]}**", ""]
    advice = recommendation(summary)
    for title, pairs, converts in README_PAIRS:
        words = _pairs_words(summary, pairs, holm=converts)
        if words:
            extra = f" {advice}" if advice and converts else ""
            lines.append(f"- **{title}** (a - b). {words}.{extra}")
    gap = _gap_words(summary)
    if gap:
        lines.append(f"- **How much of the gap to softmax MHLA closes** (relative error): {gap}.")
    recall = _recall_words(summary, rates=False)
    if recall:
        lines.append(
            f"- **Recall**: learning rates from a sweep on a held-out seed (see {DOC_LINK}); " + "; ".join(recall) + "."
        )
    ranks = [f"{_capital(_teacher(t))}: {line}" for t in TEACHERS if (line := _trained_ranks(summary, t))]
    if ranks:
        lines.append("- **Trained rank at 1e-2 / its bound**, per token count: " + ". ".join(ranks) + ".")
    part_b = _part_b_words(summary, s)
    if part_b:
        lines.append(f"- {part_b}")
    lines.append(f"- {_overall_words(summary)}")
    lines += ["", f"Every number, the figures and how the experiment is built: [{DOC_LINK}]({DOC_LINK}).", ""]
    return _wrap(lines)


def replace_readme_section(readme: str, section: str) -> str:
    """``readme`` with its "Attentions compared" section (up to the next ``## `` heading) replaced by ``section``."""
    start = readme.find(README_HEADING + "\n")
    if start < 0:
        raise ValueError(f"README has no '{README_HEADING}' section to replace")
    end = readme.find("\n## ", start + len(README_HEADING))
    end = len(readme) if end < 0 else end + 1
    return readme[:start] + section + readme[end:]


def _students(s: dict[str, Any], task: str) -> str:
    return ", ".join(SHORT_NAMES[k] for k in s[f"{task}_students"])


def _plans(s: dict[str, Any], task: str) -> str:
    """``1000 steps at 256, 600 at 1024`` for ``task``."""
    steps = [f"{n}" for n in s[f"{task}_steps"]]
    return ", ".join(
        f"{st} steps at {n}" if i == 0 else f"{st} at {n}" for i, (st, n) in enumerate(zip(steps, s[f"{task}_tokens"]))
    )


def reproduce_doc(report: dict[str, Any]) -> str:
    """The whole ``docs/reproduce.md``: the design (from the settings), how to run it, and the results (from the
    summary): the conclusion first, then every comparison with its corrected p."""
    _check(report)
    s, summary = report["settings"], report["summary"]
    seeds_a, seeds_b = len(s["part_a_seeds"]), len(s["part_b_seeds"])
    batches = sorted({b for task in s["part_a_tasks"] for b in s[f"{task}_batch_sizes"]})
    lines = [
        "# Attentions compared (`mhla reproduce`)",
        "",
        "`mhla reproduce` runs two experiments whose differences are judged against their own noise. This page is "
        "written from the committed run's `report.json` by `mhla reproduce --docs` (so is the README section).",
        "",
        f"**Part A, the operator in isolation.** One attention layer ({s['heads']} heads of dimension "
        f"{s['head_dim']}) is fitted to a teacher on square token grids, {seeds_a} seeds per cell; the local and "
        "groups teachers are drawn anew for every seed, so seeds vary the teacher as well as the initial weights "
        "and batches. Three tasks: a sharp local softmax attention (local teacher; "
        f"{_tokens(s['local_tokens'])} tokens); a teacher that is not local, each token's output the mean over "
        f"the tokens sharing its tag of {s['groups']} (groups teacher: its attention matrix has rank "
        f"{s['groups']} by construction; {_tokens(s['groups_tokens'])} tokens); and associative recall with "
        f"{s['recall_pairs']} key-value pairs (keys from {s['recall_keys']}; {_tokens(s['recall_tokens'])} "
        f"tokens), compared only where softmax recalls at least {s['recall_softmax_floor']:.0%} on average.",
        "",
        f"Students of the local and groups teachers: {_students(s, 'local')}. Of recall: "
        f"{_students(s, 'recall')} (recall needs a learning-rate sweep and more steps, and the wide heads cost "
        "more than softmax on the largest grids). What they are: "
        + "; ".join(f"{SHORT_NAMES[k]}: {NAMES[k]}" for k in dict.fromkeys(s["local_students"] + s["recall_students"]))
        + ". MHLA with uniform mixing computes global linear attention. Blocks on permuted tokens have MHLA's "
        "number and size of blocks and its learned mixing, but each block is a fixed random set of tokens: against "
        "MHLA they isolate locality, against global linear attention the rank blocks add without it. Wide heads "
        "give global linear attention MHLA's rank bound without blocks. Shuffled mixing (frozen) gives the blocks "
        "the locality-initialised weights with no relation to distance.",
        "",
        f"Held fixed across token counts: the batch size ({', '.join(str(b) for b in batches)}) and the MHLA "
        f"blocks ({s['block_side']}x{s['block_side']} tokens, so their number grows with N; the local teacher's "
        "width is fixed in tokens too). What still moves with N: the number of blocks and the rank bound, and "
        f"the steps (local: {_plans(s, 'local')}; groups: {_plans(s, 'groups')}; recall: {_plans(s, 'recall')}). "
        "Within a token count, what else differs between two students: wide heads have wider query and key "
        "projections (more parameters), and LePE adds a depthwise convolution. "
        "Learning rates: "
        + "; ".join(
            f"{task} "
            + (
                f"swept over {', '.join(f'{lr:g}' for lr in s[f'{task}_lrs'])}"
                if len(s[f"{task}_lrs"]) > 1
                else f"{s[f'{task}_lrs'][0]:g}"
            )
            for task in s["part_a_tasks"]
        )
        + f". A sweep trains every student once per rate on seed {s['sweep_seed']} (not reported), and each "
        "student then uses, at each token count, the rate with the lowest training loss over the last tenth of the "
        "steps; this rule was fixed before the run. A student that ends any seed with its training loss above "
        f"{s['chance_fraction']:g} of the chance loss did not train and is kept out of the comparisons. Reported: "
        "the held-out relative error against the teacher (recall accuracy for recall) as mean and 95 % interval; "
        f"and, for N <= {s['rank_max_tokens']}, each student's N x N attention matrix before and after training: "
        "its numerical rank at tolerances 1e-3 and 1e-2, effective rank and row entropy, beside its bound.",
        "",
        f"**Part B, a generative check where long range matters by construction.** Mirror-symmetric images of "
        f"{s['part_b_tokens']} tokens, generated, never downloaded; a small DiT-shaped denoiser trained from "
        f"scratch for {s['part_b_steps']} steps with {', '.join(NAMES[a] for a in s['part_b_arms'])}, {seeds_b} "
        "seeds, paired by seed. Measured: held-out denoising loss at fixed timesteps and noise, and the asymmetry "
        "of generated samples (1 - corr(x, mirror(x))) beside their contrast against the data's.",
        "",
        "**Statistics.** Differences are paired by seed: mean, 95 % t interval and the paired t test. The "
        "comparisons are grouped in named families (one per Part A task, over all its token counts; one per "
        "Part B measure) and Holm-corrected within each; a difference is called only where its corrected p is "
        "below 0.05; how many calls survive one correction over all comparisons is given too. For every "
        "comparison not established, MDD is the smallest true difference the paired t test would detect with "
        "80 % power at the level Holm's first step asks of its family. Smallest effects of interest, fixed before "
        f"the run: relative error ±{s['local_margin']:g} (local) and ±{s['groups_margin']:g} (groups), recall "
        f"accuracy ±{s['recall_margin']:g}, Part B loss ±{s['part_b_loss_margin']:g} and asymmetry "
        f"±{s['part_b_asymmetry_margin']:g}; a comparison whose 95 % interval lies within them is equivalent "
        "(not established) or practically nil (established).",
        "",
        "## Run it",
        "",
        "```bash",
        "mhla reproduce --budget        # times a few steps of every arm: the projected minutes; writes nothing",
        f"mhla reproduce                 # the full run ({_minutes(report['seconds'])} minutes of units); resumable",
        "mhla reproduce --smoke --output /tmp/reproduce-smoke   # tiny grids and a few steps per run (in the tests)",
        "mhla reproduce --docs --output docs/reproduce          # rewrite this page and the README section",
        "```",
        "",
        "`runs/reproduce/` (or `--output`) receives `report.json` (every setting, seed, per-run number, loss curve "
        "and time, the sweeps included; rewritten after each finished unit, so a killed run resumes where it was), "
        "`table.md`, `reading.md` and three figures, all computed from `report.json` alone. `--set NAME=VALUE` "
        "changes a setting (`mhla reproduce --help` lists them); a folder made with other settings is refused.",
        "",
        "## Results",
        "",
        "The committed run is [reproduce/](reproduce/): its [table](reproduce/table.md), its "
        f"[reading](reproduce/reading.md), the figures below and `report.json` ({_minutes(report['seconds'])} "
        "minutes of units). `tests/reproduce/test_reproduce_results.py` checks that the table, reading, figures, "
        "this page and the README section are the ones computed from that report.",
        "",
    ]
    lead = conclusion(summary)
    if lead:
        lines += [f"**{lead[0]}**", *lead[1:], ""]
    advice = recommendation(summary)
    if advice:
        lines += [f"**Recommendation.** {advice}", ""]
    gap = _gap_words(summary)
    if gap:
        lines += [f"**How much of the gap to softmax MHLA closes** (relative error): {gap}.", ""]
    lines += [_overall_words(summary), ""]
    lines += [
        f"![Part A: held-out score against the token count, mean and 95 % interval](reproduce/{FIGURES[0]})",
        "",
        f"![Part A: rank at 1e-2 of the attention matrix, trained (dotted: untrained), with its bound]"
        f"(reproduce/{FIGURES[1]})",
        "",
        f"![Part B: paired differences per seed, mean and 95 % interval; red where established]"
        f"(reproduce/{FIGURES[2]})",
        "",
    ]
    for task in s["part_a_tasks"]:
        family = _family(summary, f"Part A, {TASK_NAMES[task]}")
        title = _capital(TASK_NAMES[task])
        lines.append(f"**Part A, {TASK_NAMES[task]}** ({SCORE_NAMES[task]}).")
        scores = [f"{SHORT_NAMES[k]} {line}" for k in s[f"{task}_students"] if (line := _score_range(summary, task, k))]
        lines.append(f"{title}, mean score by token count: " + "; ".join(scores) + ".")
        if task == "recall":
            lines += [_capital("; ".join(_recall_words(summary))) + "."]
        if family is not None:
            lines.append(f"Family of {family['size']} comparisons (a - b):")
            lines.append("")
            for a, b, question in PART_A_PAIRS:
                line = _pair_line(family, a, b)
                if line:
                    lines.append(f"- {_capital(question)} ({SHORT_NAMES[a]} - {SHORT_NAMES[b]}): {line}.")
        lines.append("")
    if summary["recall_dropped"]:
        lines += [
            "Recall is left out of the comparisons at "
            + "; ".join(f"{d['tokens']} tokens ({d['why']})" for d in summary["recall_dropped"])
            + ".",
            "",
        ]
    lines.append(
        "**The rank of the attention matrix** (numerical rank at 1e-2, untrained -> trained, with the 1e-3 ranks "
        "in brackets, of its bound; mean over heads and seeds):"
    )
    lines.append("")
    for task in s["part_a_tasks"]:
        rank = _rank_line(summary, task)
        if rank:
            lines.append(f"- {TASK_NAMES[task]}: {rank}.")
    lines.append("")
    timesteps = ", ".join(summary["part_b"][0]["held_out_loss"]) if summary["part_b"] else ""
    lines.append(
        f"**Part B, mirror-symmetric images, {s['part_b_tokens']} tokens.** Held-out denoising loss (mean over "
        f"t = {timesteps}): {_part_b_means(summary, 'mean_held_out_loss', 4)}; sample asymmetry: "
        f"{_part_b_means(summary, 'asymmetry', 3)}."
    )
    lines.append("")
    for family in summary["families"]:
        if not family["family"].startswith("Part B"):
            continue
        lines.append(f"{family['family']}, a family of {family['size']} (a - b):")
        lines.append("")
        for c in family["comparisons"]:
            where = f" at t = {c['timestep']}" if "timestep" in c else ""
            lines.append(f"- {SHORT_NAMES[c['a']]} - {SHORT_NAMES[c['b']]}{where}: {comparison_words(c)}.")
        lines.append("")
    return _wrap(lines)


def write_docs(report: dict[str, Any], root: str | Path) -> list[Path]:
    """Rewrite ``root/README.md``'s "Attentions compared" section and ``root/docs/reproduce.md`` from
    ``report``; returns both paths."""
    root = Path(root)
    readme, doc = root / "README.md", root / DOC_LINK
    readme.write_text(replace_readme_section(readme.read_text(), readme_section(report)))
    doc.write_text(reproduce_doc(report))
    return [readme, doc]
