"""The README section "Attentions compared" (short) and ``docs/reproduce.md`` (full), written from a
``mhla reproduce`` report of schema ``reproduce-3`` alone.

Every number in them is a setting or a summary value of the report (``tests/embedded/test_reproduce_docs.py``
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
    comparison_words,
)

__all__ = ["README_HEADING", "readme_section", "replace_readme_section", "reproduce_doc", "write_docs"]

README_HEADING = "## Attentions compared"
DOC_LINK = "docs/reproduce.md"
WIDTH = 115  # the README's and docs' line width
#: the students whose ranks the README names (the page names all)
README_RANK_STUDENTS = ("mhla-uniform", "mhla", "softmax")
_GLUE = "\x00"  # a space that textwrap does not break at


def _glued(line: str) -> str:
    """``line`` with the spaces around `` - ``, `` + ``, `` * ``, `` > `` and before a number ending in ``.`` or
    ``)`` made unbreakable, so that no wrapped line starts with what Markdown reads as a list item or quote."""
    line = re.sub(r" ([-+*>]) ", lambda m: f"{_GLUE}{m.group(1)}{_GLUE}", line)
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


def _capital(text: str) -> str:
    return text[:1].upper() + text[1:]


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


def _short_pair(family: dict[str, Any], a: str, b: str) -> str | None:
    """The calls of ``a - b`` over token counts, briefly: where established (with the differences), where not."""
    found = [c for c in family["comparisons"] if c["a"] == a and c["b"] == b]
    if not found:
        return None
    called = [c for c in found if c["established"]]
    rest = [c for c in found if not c["established"]]
    parts = []
    if called:
        parts.append(
            "established at "
            + ", ".join(f"{c['tokens']} ({c['mean']:+.2g}, Holm p = {c['p_holm']:.2g})" for c in called)
        )
    if rest:
        parts.append(
            "not established at "
            + ", ".join(
                f"{c['tokens']} ({c['mean']:+.2g}" + ("" if c["mdd"] is None else f", MDD {c['mdd']:.2g}") + ")"
                for c in rest
            )
        )
    return "; ".join(parts)


def _score_range(summary: dict[str, Any], task: str, student: str) -> str | None:
    rows = sorted(
        (r for r in summary["part_a"] if r["task"] == task and r["student"] == student), key=lambda r: r["tokens"]
    )
    if not rows:
        return None
    return ", ".join(f"{r['score']['mean']:.3f} at {r['tokens']}" for r in rows)


def _rank_line(summary: dict[str, Any], task: str, students: tuple[str, ...] | None = None) -> str | None:
    rows = [r for r in summary["rank"] if r["task"] == task and (students is None or r["student"] in students)]
    if not rows:
        return None
    parts = []
    for student in dict.fromkeys(r["student"] for r in rows):
        cells = ", ".join(
            f"{r['untrained']['rank_1e-2']['mean']:.0f} -> {r['trained']['rank_1e-2']['mean']:.0f} "
            f"(1e-3: {r['untrained']['rank_1e-3']['mean']:.0f} -> {r['trained']['rank_1e-3']['mean']:.0f}) of "
            f"{r['bound']} at {r['tokens']}"
            for r in sorted((r for r in rows if r["student"] == student), key=lambda r: r["tokens"])
        )
        parts.append(f"{SHORT_NAMES[student]} {cells}")
    return "; ".join(parts)


def _part_b_means(summary: dict[str, Any], measure: str, digits: int) -> str:
    return ", ".join(f"{SHORT_NAMES[r['arm']]} {r[measure]['mean']:.{digits}f}" for r in summary["part_b"])


def readme_section(report: dict[str, Any]) -> str:
    """The README's "Attentions compared" section (heading included, ending in a blank line)."""
    _check(report)
    s, summary = report["settings"], report["summary"]
    lines = [
        README_HEADING,
        "",
        f"`mhla reproduce` fits one attention layer to three fixed teachers (a local softmax attention, a "
        f"non-local teacher whose attention matrix has rank {s['groups']}, associative recall with "
        f"{s['recall_pairs']} pairs; head dimension {s['head_dim']}) with controls that separate locality from "
        "rank: global linear attention with LePE, MHLA with uniform mixing (which is global linear attention), "
        "with shuffled non-local mixing, with local mixing frozen and learned, and softmax. It then trains a small "
        "DiT denoiser from scratch on mirror-symmetric images with softmax, linear attention and MHLA, paired by "
        "seed:",
        "",
        "```bash",
        f"mhla reproduce            # the full run: {_minutes(report['seconds'])} minutes with "
        f"{report['torch_threads']} torch threads; writes runs/reproduce/",
        "mhla reproduce --budget   # projected minutes, from one-thread CPU time per step; load inflates it",
        "```",
        "",
        f"What the committed run ([docs/reproduce/](docs/reproduce/table.md), {len(s['part_a_seeds'])} seeds in "
        f"Part A, {len(s['part_b_seeds'])} in Part B) shows. Differences are paired by seed and called only where "
        "the Holm-corrected p within their family is below 0.05; MDD is the difference the design detects with "
        "80 % power:",
        "",
    ]
    for task in s["part_a_tasks"]:
        family = _family(summary, f"Part A, {TASK_NAMES[task]}")
        if family is None:
            continue
        bits = []
        for a, b, question in PART_A_PAIRS[:4]:
            line = _short_pair(family, a, b)
            if line:
                bits.append(f"{_capital(question)} ({SHORT_NAMES[a]} - {SHORT_NAMES[b]}): {line}")
        lines.append(
            f"- **{TASK_NAMES[task][0].upper() + TASK_NAMES[task][1:]}** ({SCORE_NAMES[task]}). "
            + ". ".join(bits)
            + "."
        )
    if summary["recall_dropped"]:
        lines.append(
            "- **Recall left out** at "
            + "; ".join(f"{d['tokens']} tokens ({d['why']})" for d in summary["recall_dropped"])
            + "."
        )
    for task in s["part_a_tasks"]:
        rank = _rank_line(summary, task, README_RANK_STUDENTS)
        if rank and task != "recall":
            lines.append(f"- **Rank at 1e-2, {TASK_NAMES[task]}**, untrained -> trained of its bound: {rank}.")
    family = _family(summary, "Part B, held-out denoising loss")
    if family:
        parts = [
            f"{SHORT_NAMES[c['a']]} - {SHORT_NAMES[c['b']]}: {comparison_words(c)}"
            for c in family["comparisons"]
            if (c["a"], c["b"]) in (("mhla", "linear"), ("mhla", "linear-lepe"))
        ]
        lines.append(
            f"- **Denoising mirror-symmetric images ({s['part_b_tokens']} tokens)**, held-out loss "
            f"{_part_b_means(summary, 'mean_held_out_loss', 3)}; " + "; ".join(parts) + "."
        )
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


def reproduce_doc(report: dict[str, Any]) -> str:
    """The whole ``docs/reproduce.md``: the design (from the settings), how to run it, and the results (from the
    summary), each comparison with its corrected p."""
    _check(report)
    s, summary = report["settings"], report["summary"]
    seeds_a, seeds_b = len(s["part_a_seeds"]), len(s["part_b_seeds"])
    kinds = ", ".join(NAMES[k] for k in s["part_a_students"])
    lines = [
        "# Attentions compared (`mhla reproduce`)",
        "",
        "`mhla reproduce` runs two experiments whose differences are judged against their own noise. This page is "
        "written from the committed run's `report.json` by `mhla reproduce --docs` (so is the README section).",
        "",
        f"**Part A, the operator in isolation.** One attention layer ({s['heads']} heads of dimension "
        f"{s['head_dim']}) is fitted to a fixed teacher on square token grids, {seeds_a} seeds per cell. Three "
        f"teachers: a sharp local softmax attention (local teacher; {_tokens(s['local_tokens'])} tokens); a "
        f"teacher that is not local, each token's output the mean over the tokens sharing its tag of "
        f"{s['groups']} (groups teacher: its attention matrix has rank {s['groups']} by construction; "
        f"{_tokens(s['groups_tokens'])} tokens); and associative recall with {s['recall_pairs']} key-value pairs "
        f"(keys from {s['recall_keys']}; {_tokens(s['recall_tokens'])} tokens), reported only where softmax "
        f"recalls at least {s['recall_softmax_floor']:.0%} on average. Students: {kinds} (softmax up to "
        f"{s['softmax_max_tokens']} tokens). MHLA with uniform mixing computes global linear attention; shuffled "
        "mixing gives MHLA's blocks the same weights with no relation to distance, so blocks without locality "
        "against no blocks isolates the rank MHLA's blocks add, and local against shuffled mixing its locality. "
        "The students of one task, token count and seed train on the same batches. Reported: the held-out "
        "relative error against the teacher (recall accuracy for recall) as mean and 95 % interval; and, for "
        f"N <= {s['rank_max_tokens']}, each student's N x N attention matrix before and after training: its "
        "numerical rank at tolerances 1e-3 and 1e-2, effective rank and row entropy, beside its bound.",
        "",
        f"**Part B, a generative check where long range matters by construction.** Mirror-symmetric images of "
        f"{s['part_b_tokens']} tokens, generated, never downloaded; a small DiT-shaped denoiser trained from "
        f"scratch with {', '.join(NAMES[a] for a in s['part_b_arms'])}, {seeds_b} seeds, paired by seed. Measured: "
        "held-out denoising loss at fixed timesteps and noise, and the asymmetry of generated samples "
        "(1 - corr(x, mirror(x))) beside their contrast against the data's.",
        "",
        "**Statistics.** Differences are paired by seed: mean, 95 % t interval and the paired t test. The "
        "comparisons are grouped in named families (one per Part A task, over all its token counts; one per "
        "Part B measure) and Holm-corrected within each; a difference is called only where its corrected p is "
        "below 0.05. For every comparison not established, MDD is the smallest true difference the paired t test "
        "would detect with 80 % power at the level Holm's first step asks of its family.",
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
        "and time; rewritten after each finished unit, so a killed run resumes where it was), `table.md`, "
        "`reading.md` and three figures, all computed from `report.json` alone. `--set NAME=VALUE` changes a "
        "setting (`mhla reproduce --help` lists them); a folder made with other settings is refused.",
        "",
        "## Results",
        "",
        "The committed run is [reproduce/](reproduce/): its [table](reproduce/table.md), its "
        f"[reading](reproduce/reading.md), the figures below and `report.json` ({_minutes(report['seconds'])} "
        "minutes of units). `tests/embedded/test_reproduce_results.py` checks that the table, reading, figures, "
        "this page and the README section are the ones computed from that report.",
        "",
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
        title = TASK_NAMES[task][0].upper() + TASK_NAMES[task][1:]
        lines.append(f"**Part A, {TASK_NAMES[task]}** ({SCORE_NAMES[task]}).")
        scores = [f"{SHORT_NAMES[k]} {line}" for k in s["part_a_students"] if (line := _score_range(summary, task, k))]
        lines.append(f"{title}, mean score by token count: " + "; ".join(scores) + ".")
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
