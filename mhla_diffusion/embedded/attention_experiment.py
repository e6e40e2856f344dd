"""``mhla reproduce``: experiments whose differences between attentions are measured against their own
noise.

* Part A (:mod:`.operator_experiment`): one attention layer (head dim 32) fitted to fixed teachers (a
  sharp local softmax attention; associative recall) on 2-D grids of 64 to 4,096 tokens, by global linear
  attention, MHLA, MHLA with per-head mixing and softmax (up to ``softmax_max_tokens``), over
  ``part_a_seeds``: held-out error (or recall accuracy) with 95 % intervals, and the rank of each trained
  student's N x N attention matrix beside its bound (up to ``rank_max_tokens``).
* Part B (:mod:`.generative_check`): a small DiT denoiser trained from scratch on mirror-symmetric images
  of 1,024 tokens with each arm, over ``part_b_seeds``: held-out denoising loss and sample asymmetry,
  compared arm against arm seed by seed (:func:`~.experiment_statistics.paired_difference`).

Every unit of work (Part A: one task, token count and seed, all students in lockstep; Part B: one arm and
seed) is a :class:`~.stages.Stages` step: ``report.json`` is rewritten as each one finishes, and a rerun
skips finished ones (a Part B run also resumes inside from its checkpoint). The table and figures are
computed from ``report.json`` alone (:mod:`.experiment_report`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from .experiment_report import reading_markdown, summarise, table_markdown, write_figures
from .generative_check import ARMS, train_and_measure
from .operator_experiment import STUDENTS, TASKS, Task, grid_side, train_students
from .stages import Stages

__all__ = ["ExperimentSettings", "estimate_budget", "run_experiment", "write_outputs"]

logger = logging.getLogger(__name__)

SCHEMA = "reproduce-2"  # report.json layout: Part A runs, Part B runs, summary


@dataclass
class ExperimentSettings:
    """Every setting of one experiment (defaults: the committed report; :meth:`smoke`: the tests).

    The step counts are set so that the whole run fits in 150 minutes on 2 CPU cores with the machine to
    itself, with a margin (the committed run took 54 minutes): ``mhla reproduce --budget``
    (:func:`estimate_budget`, one-thread CPU seconds,
    measured on a machine shared with four other jobs) projected about 33 minutes for Part A at 600 steps
    and 67 for Part B at 900 steps, 100 in all; it prints the estimate for any settings."""

    token_counts: list[int] = field(default_factory=lambda: [64, 256, 1024, 4096])
    heads: int = 2
    head_dim: int = 32
    part_a_tasks: list[str] = field(default_factory=lambda: list(TASKS))
    part_a_students: list[str] = field(default_factory=lambda: list(STUDENTS))
    part_a_seeds: list[int] = field(default_factory=lambda: [0, 1, 2, 3, 4])
    part_a_steps: int = 600
    part_a_batch_sizes: list[int] = field(default_factory=lambda: [32, 16, 4, 1])  # per token count
    part_a_lr: float = 3e-3
    part_a_eval_size: int = 16
    softmax_max_tokens: int = 1024
    rank_max_tokens: int = 1024
    part_b_arms: list[str] = field(default_factory=lambda: list(ARMS))
    part_b_tokens: int = 1024
    part_b_seeds: list[int] = field(default_factory=lambda: [0, 1, 2, 3])
    part_b_steps: int = 900
    part_b_batch_size: int = 8
    part_b_layers: int = 3
    part_b_lr: float = 1e-3
    part_b_eval_images: int = 32
    part_b_samples: int = 32
    part_b_sample_steps: int = 20
    checkpoint_every: int = 50

    @classmethod
    def smoke(cls) -> "ExperimentSettings":
        """A few steps on tiny grids: checks the whole chain in well under a minute."""
        return cls(
            token_counts=[16, 64],
            part_a_seeds=[0, 1],
            part_a_steps=3,
            part_a_batch_sizes=[2, 2],
            part_a_eval_size=2,
            softmax_max_tokens=64,
            rank_max_tokens=64,
            part_b_tokens=64,
            part_b_seeds=[0, 1],
            part_b_steps=2,
            part_b_batch_size=2,
            part_b_layers=1,
            part_b_eval_images=2,
            part_b_samples=2,
            part_b_sample_steps=2,
            checkpoint_every=1,
        )

    def check(self) -> None:
        """Raise ``ValueError`` naming the first bad setting and how to fix it."""
        for name, chosen, known in (
            ("part_a_tasks", self.part_a_tasks, TASKS),
            ("part_a_students", self.part_a_students, STUDENTS),
            ("part_b_arms", self.part_b_arms, tuple(ARMS)),
        ):
            unknown = [v for v in chosen if v not in known]
            if unknown or not chosen:
                raise ValueError(f"{name}: {unknown or 'none chosen'} not known; choose from {', '.join(known)}")
        if len(self.part_a_batch_sizes) != len(self.token_counts):
            raise ValueError(
                f"part_a_batch_sizes ({self.part_a_batch_sizes}) needs one entry per token count ({self.token_counts})"
            )
        for tokens in [*self.token_counts, self.part_b_tokens]:
            grid_side(tokens)
        for name in ("part_a_seeds", "part_b_seeds"):
            seeds = getattr(self, name)
            if len(seeds) < 2 or len(set(seeds)) != len(seeds):
                raise ValueError(f"{name} must be at least two distinct seeds (intervals need two), got {seeds}")

    def students_at(self, tokens: int) -> list[str]:
        """The Part A students trained at ``tokens`` (softmax only up to ``softmax_max_tokens``)."""
        return [k for k in self.part_a_students if k != "softmax" or tokens <= self.softmax_max_tokens]


def _part_a_unit(s: ExperimentSettings, task: str, tokens: int, batch_size: int, seed: int) -> dict[str, Any]:
    runs = train_students(
        Task(task, tokens, s.heads, s.head_dim),
        s.students_at(tokens),
        seed,
        s.part_a_steps,
        batch_size,
        s.part_a_lr,
        s.part_a_eval_size,
        s.rank_max_tokens,
    )
    return {"runs": runs}


def _check_output(out: Path, s: ExperimentSettings) -> None:
    """Tie ``out`` to one set of settings: refuse (before writing anything) a folder made with others."""
    settings_file = out / "settings.json"
    wanted = dataclasses.asdict(s)
    if settings_file.is_file() and json.loads(settings_file.read_text()) != wanted:
        raise ValueError(
            f"{out} holds an experiment with other settings ({settings_file}); use another --output "
            "or delete that folder"
        )
    out.mkdir(parents=True, exist_ok=True)
    settings_file.write_text(json.dumps(wanted, indent=2))


def run_experiment(
    out: str | Path, settings: ExperimentSettings | None = None, on_step: Callable[[str, int], None] | None = None
) -> dict[str, Any]:
    """Run Parts A and B in ``out`` (resuming what a killed run left there); rewrites ``out/report.json``
    after each unit and, at the end, writes the table, the reading and the figures (:func:`write_outputs`).
    ``on_step(run, step)`` is called after every Part B training step (tests interrupt with it)."""
    s = settings or ExperimentSettings()
    s.check()
    out = Path(out)
    _check_output(out, s)
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "settings": dataclasses.asdict(s),
        "torch_threads": torch.get_num_threads(),
        "part_a": [],
        "part_b": [],
    }
    units_a = [
        (task, tokens, batch, seed)
        for task in s.part_a_tasks
        for tokens, batch in zip(s.token_counts, s.part_a_batch_sizes)
        for seed in s.part_a_seeds
    ]
    stages = Stages(out, total=len(units_a) + len(s.part_b_arms) * len(s.part_b_seeds), watched=("runs",), noun="unit")
    for task, tokens, batch, seed in units_a:
        unit = stages.run(f"a-{task}-{tokens}tok-seed{seed}", lambda: _part_a_unit(s, task, tokens, batch, seed))
        report["part_a"] += [run | {"unit_seconds": unit["seconds"]} for run in unit["runs"]]
        _save(out, report)
    for seed in s.part_b_seeds:
        for arm in s.part_b_arms:
            name = f"b-{arm}-{s.part_b_tokens}tok-seed{seed}"
            folder = out / "runs" / name
            report["part_b"].append(
                stages.run(
                    name,
                    lambda: train_and_measure(
                        folder, arm, s.part_b_tokens, seed, s, None if on_step is None else (lambda k: on_step(name, k))
                    ),
                )
            )
            shutil.rmtree(folder, ignore_errors=True)  # its checkpoint; the result is in stages/
            _save(out, report)
    report["complete"] = True
    _save(out, report)
    write_outputs(out, report)
    return report


def _save(out: Path, report: dict[str, Any]) -> None:
    """Rewrite ``report.json`` with every finished unit, its summary and the seconds spent so far."""
    report["summary"] = summarise(report)
    report["seconds"] = round(_unit_seconds(report), 1)
    partial = out / "report.json.partial"
    partial.write_text(json.dumps(report, indent=2))
    partial.replace(out / "report.json")


def _unit_seconds(report: dict[str, Any]) -> float:
    """Wall seconds of every finished unit, every attempt included (a Part A unit is counted once, not per student)."""
    part_a = {(r["task"], r["tokens"], r["seed"]): r["unit_seconds"] for r in report["part_a"]}
    return sum(part_a.values()) + sum(r["seconds"] for r in report["part_b"])


def write_outputs(out: Path, report: dict[str, Any]) -> None:
    """``table.md``, ``reading.md`` and the figures in ``out``, all computed from ``report``."""
    (out / "table.md").write_text(table_markdown(report))
    (out / "reading.md").write_text(reading_markdown(report))
    write_figures(report, out)


# ---------------------------------------------------------------------------- the time budget


def estimate_budget(s: ExperimentSettings, probe_steps: int = 2) -> dict[str, Any]:
    """Time ``probe_steps`` training steps of every Part A task, token count and student (a first step's
    one-time costs included: a slight overestimate) and of every Part B arm (after one warm-up step), and
    project the whole run's seconds from them.

    The times are CPU seconds of this process on one torch thread, so that time spent waiting for a core
    does not count (with several threads, threads waiting for a busy core spin and count); on an idle
    machine they approximate the run's wall time with the default threads, which can only speed up the
    large products that dominate. Other work on the machine still slows each step (shared caches and memory
    bandwidth): a projection made under load can come out at twice the run's time on an idle machine, so
    the estimate records the load average while probing (``load_average``, ``cpu_count``). Sampling and
    held-out scoring are projected from the Part B step time (a forward pass is about a third of a training
    step)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        estimate = _estimate(s, probe_steps)
    finally:
        torch.set_num_threads(threads)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {**estimate, "load_average": load, "cpu_count": os.cpu_count()}


def _estimate(s: ExperimentSettings, probe_steps: int) -> dict[str, Any]:
    rows = []
    for task in s.part_a_tasks:
        for tokens, batch in zip(s.token_counts, s.part_a_batch_sizes):
            kinds = s.students_at(tokens)
            runs = train_students(
                Task(task, tokens, s.heads, s.head_dim), kinds, 0, probe_steps, batch, s.part_a_lr, 1, 0
            )
            per_step = sum(r["cpu_seconds_per_step"] for r in runs) + runs[0]["teacher_cpu_seconds_per_step"]
            rows.append(
                {
                    "part": "A",
                    "what": f"{task} {tokens} tokens ({', '.join(kinds)})",
                    "seconds_per_step": per_step,
                    "projected_seconds": per_step * s.part_a_steps * len(s.part_a_seeds),
                }
            )
    for arm in s.part_b_arms:
        per_step = _denoiser_step_seconds(s, arm, probe_steps)
        forwards = (s.part_b_sample_steps * s.part_b_samples + len(ARMS) * s.part_b_eval_images) / s.part_b_batch_size
        rows.append(
            {
                "part": "B",
                "what": f"denoiser {arm} {s.part_b_tokens} tokens",
                "seconds_per_step": per_step,
                "projected_seconds": per_step * (s.part_b_steps + forwards / 3) * len(s.part_b_seeds),
            }
        )
    return {"rows": rows, "total_seconds": sum(r["projected_seconds"] for r in rows)}


def _denoiser_step_seconds(s: ExperimentSettings, arm: str, probe_steps: int) -> float:
    from .generative_check import _noise_prediction, mirror_images, new_denoiser

    side = grid_side(s.part_b_tokens)
    model = new_denoiser(arm, side, s.part_b_layers, s.heads, s.head_dim, 0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=s.part_b_lr)
    x = mirror_images(s.part_b_batch_size, side, torch.Generator().manual_seed(0))
    t = torch.full((s.part_b_batch_size,), 500)
    spent = 0.0
    for step in range(probe_steps + 1):
        began = time.process_time()
        loss = (_noise_prediction(model, x, t) - x).pow(2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step:  # the first is a warm-up
            spent += time.process_time() - began
    return spent / probe_steps


def budget_markdown(estimate: dict[str, Any]) -> str:
    lines = ["| part | what | CPU s / step | projected minutes |", "|---|---|---|---|"]
    lines += [
        f"| {r['part']} | {r['what']} | {r['seconds_per_step']:.3f} | {r['projected_seconds'] / 60:.1f} |"
        for r in estimate["rows"]
    ]
    lines.append(
        f"\nprojected total: {estimate['total_seconds'] / 60:.0f} minutes: each row's CPU seconds per training step "
        "on one torch thread (a few probe steps), times its steps in the run. It assumes the machine to itself: "
        "other work slows every step (shared caches and memory bandwidth) and inflates the projection as it "
        f"would the run; {_load_note(estimate.get('load_average'), estimate.get('cpu_count'))}"
    )
    return "\n".join(lines) + "\n"


def _load_note(load: float | None, cores: int | None) -> str:
    """What the machine's load while probing means for the projection."""
    if load is None or not cores:
        return "this system does not report its load average."
    busy = load > 0.5 * cores
    verdict = "a busy machine: expect the projection to be too long" if busy else "a quiet machine"
    return f"the 1-minute load average while probing was {load:.1f} on {cores} cores ({verdict})."
