"""``mhla reproduce``: experiments whose differences between attentions are measured against their own
noise.

* Part A (:mod:`.operators`): one attention layer (head dim 32) fitted to fixed teachers (a sharp
  local softmax attention; a non-local teacher whose attention matrix has rank 64; associative recall with 64
  pairs) on 2-D grids, by the controls that separate locality from rank: global linear attention with LePE,
  MHLA with uniform mixing frozen (global linear attention), with shuffled (non-local) mixing frozen, with
  locality-initialised mixing frozen and learned, and softmax (up to ``softmax_max_tokens``), over
  ``part_a_seeds``: held-out error (or recall accuracy) with 95 % intervals, and the rank of each student's
  N x N attention matrix before and after training beside its bound (up to ``rank_max_tokens``). Each task has
  its own token counts, batch sizes, steps and learning rate (``<task>_tokens`` ...).
* Part B (:mod:`.generative`): a small DiT denoiser trained from scratch on mirror-symmetric images
  of 1,024 tokens with each arm, over ``part_b_seeds``: held-out denoising loss and sample asymmetry,
  compared arm against arm seed by seed.

Comparisons are paired by seed and grouped in named families; a difference is called only where its
Holm-corrected p is below 0.05 (:mod:`.statistics`, :mod:`.report`).

Every unit of work (Part A: one task, token count and seed, all students in lockstep; Part B: one arm and
seed) is a :class:`~.stages.Stages` step: ``report.json`` is rewritten as each one finishes, and a rerun
skips finished ones (a Part B run also resumes inside from its checkpoint). The table, reading and figures are
computed from ``report.json`` alone (:mod:`.report`), and so are the README section and
``docs/reproduce.md`` (:mod:`.docs`).
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

from ..embedded.stages import Stages
from .generative import ARMS, train_and_measure
from .operators import (
    GROUPS,
    RECALL_KEYS,
    RECALL_PAIRS,
    STUDENTS,
    TASKS,
    Task,
    check_task_tokens,
    grid_side,
    train_students,
)
from .report import reading_markdown, summarise, table_markdown, write_figures

__all__ = ["SCHEMA", "ExperimentSettings", "PartAPlan", "estimate_budget", "run_experiment", "write_outputs"]

logger = logging.getLogger(__name__)

SCHEMA = "reproduce-3"  # report.json layout: Part A runs (three tasks, ranks before and after), Part B, summary


@dataclass(frozen=True)
class PartAPlan:
    """One Part A cell's training: task, token count, batch size, steps and learning rate."""

    task: str
    tokens: int
    batch_size: int
    steps: int
    lr: float


@dataclass
class ExperimentSettings:
    """Every setting of one experiment (defaults: the run issue 50 asks for; :meth:`smoke`: the tests).

    Part A: per task, the token counts, a batch size and a step count per token count, and a learning rate.
    Recall and groups run at 256 and 1,024 tokens only: softmax, which must learn them, cost 1.4 s a step at
    4,096 tokens (batch 1, one CPU thread, held-out scoring included), and a rank-64 teacher needs two tokens per
    tag. The step counts come from probes (one thread, seed 0, 16 held-out grids, an idle machine):

    * recall, 64 pairs, learning rate 1e-2: softmax at 100 % by step 185 at 256 tokens (batch 16) and by 375 at
      1,024 (batch 4; at 3e-3 it was at 60 % after 600 steps); global linear attention and MHLA at 38-40 %
      after 300 steps. Steps 400 and 800 leave room for seeds that learn later.
    * groups (rank 64), 1e-2: softmax's relative error 0.03 by step 400 at 256 tokens (0.77 at 300) and 0.05 by
      400 at 1,024; at 256 tokens global linear attention and MHLA at 0.87 after 600 steps (0.866: a token's
      own share alone), and at 0.18-0.20 on a rank-16 teacher (16 tags): the rank, not the optimiser, stops
      them. 600 steps at both sizes.

    Time: about 3,500 one-thread CPU seconds for Part A (per-step costs of these probes and of the committed
    reproduce-2 run, times the steps; the rank measures, before and after training, 0.45 s a student and
    measurement at 1,024 tokens, about 5 s a unit), which on 2 threads
    takes about half as long in wall time (the committed run's Part A units: wall / one-thread CPU 0.48-0.55),
    so about 32 minutes; Part B unchanged, 40 minutes in the committed run; about 72 minutes in all, within the
    90 issue 50 allows. ``mhla reproduce --budget`` prints the projected time of any settings."""

    heads: int = 2
    head_dim: int = 32
    part_a_tasks: list[str] = field(default_factory=lambda: list(TASKS))
    part_a_students: list[str] = field(
        default_factory=lambda: ["linear-lepe", "mhla-uniform", "mhla-shuffled", "mhla-frozen", "mhla", "softmax"]
    )
    part_a_seeds: list[int] = field(default_factory=lambda: [0, 1, 2, 3, 4])
    local_tokens: list[int] = field(default_factory=lambda: [64, 256, 1024, 4096])
    local_batch_sizes: list[int] = field(default_factory=lambda: [32, 16, 4, 1])
    local_steps: list[int] = field(default_factory=lambda: [600, 600, 600, 600])
    local_lr: float = 3e-3
    groups_tokens: list[int] = field(default_factory=lambda: [256, 1024])
    groups_batch_sizes: list[int] = field(default_factory=lambda: [16, 4])
    groups_steps: list[int] = field(default_factory=lambda: [600, 600])
    groups_lr: float = 1e-2
    groups: int = GROUPS
    recall_tokens: list[int] = field(default_factory=lambda: [256, 1024])
    recall_batch_sizes: list[int] = field(default_factory=lambda: [16, 4])
    recall_steps: list[int] = field(default_factory=lambda: [400, 800])
    recall_lr: float = 1e-2
    recall_pairs: int = RECALL_PAIRS
    recall_keys: int = RECALL_KEYS
    recall_softmax_floor: float = 0.9  # recall is compared only where softmax's mean accuracy reaches it
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
        """A few steps on tiny grids (small groups and recall tasks): checks the whole chain in well under a
        minute."""
        return cls(
            part_a_seeds=[0, 1],
            local_tokens=[16, 64],
            local_batch_sizes=[2, 2],
            local_steps=[3, 3],
            groups_tokens=[16],
            groups_batch_sizes=[2],
            groups_steps=[3],
            groups=4,
            recall_tokens=[16],
            recall_batch_sizes=[2],
            recall_steps=[3],
            recall_pairs=4,
            recall_keys=8,
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

    def part_a_plan(self, task: str) -> list[PartAPlan]:
        """The cells of ``task``: one per token count, with its batch size, steps and the task's learning rate."""
        return [
            PartAPlan(task, n, batch, steps, getattr(self, f"{task}_lr"))
            for n, batch, steps in zip(
                getattr(self, f"{task}_tokens"), getattr(self, f"{task}_batch_sizes"), getattr(self, f"{task}_steps")
            )
        ]

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
        if self.recall_keys < self.recall_pairs:
            raise ValueError(f"recall_keys ({self.recall_keys}) must be at least recall_pairs ({self.recall_pairs})")
        for task in self.part_a_tasks:
            tokens = getattr(self, f"{task}_tokens")
            if not tokens:
                raise ValueError(
                    f"{task}_tokens: no token counts; give one or more, or leave {task} out of part_a_tasks"
                )
            for what in ("batch_sizes", "steps"):
                values = getattr(self, f"{task}_{what}")
                if len(values) != len(tokens):
                    raise ValueError(
                        f"{task}_{what} ({values}) needs one entry per token count of {task}_tokens ({tokens})"
                    )
            for n in tokens:
                check_task_tokens(task, n, self.groups, self.recall_pairs)
        grid_side(self.part_b_tokens)
        for name in ("part_a_seeds", "part_b_seeds"):
            seeds = getattr(self, name)
            if len(seeds) < 2 or len(set(seeds)) != len(seeds):
                raise ValueError(f"{name} must be at least two distinct seeds (intervals need two), got {seeds}")

    def students_at(self, tokens: int) -> list[str]:
        """The Part A students trained at ``tokens`` (softmax only up to ``softmax_max_tokens``)."""
        return [k for k in self.part_a_students if k != "softmax" or tokens <= self.softmax_max_tokens]

    def task(self, name: str, tokens: int) -> Task:
        """The Part A task ``name`` at ``tokens`` with these settings' sizes."""
        return Task(
            name, tokens, self.heads, self.head_dim, groups=self.groups, pairs=self.recall_pairs, keys=self.recall_keys
        )


def _part_a_unit(s: ExperimentSettings, plan: PartAPlan, seed: int) -> dict[str, Any]:
    runs = train_students(
        s.task(plan.task, plan.tokens),
        s.students_at(plan.tokens),
        seed,
        plan.steps,
        plan.batch_size,
        plan.lr,
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
    units_a = [(plan, seed) for task in s.part_a_tasks for plan in s.part_a_plan(task) for seed in s.part_a_seeds]
    stages = Stages(out, total=len(units_a) + len(s.part_b_arms) * len(s.part_b_seeds), watched=("runs",), noun="unit")
    for plan, seed in units_a:
        unit = stages.run(f"a-{plan.task}-{plan.tokens}tok-seed{seed}", lambda: _part_a_unit(s, plan, seed))
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
        for plan in s.part_a_plan(task):
            kinds = s.students_at(plan.tokens)
            runs = train_students(s.task(task, plan.tokens), kinds, 0, probe_steps, plan.batch_size, plan.lr, 1, 0)
            per_step = sum(r["cpu_seconds_per_step"] for r in runs) + runs[0]["teacher_cpu_seconds_per_step"]
            rows.append(
                {
                    "part": "A",
                    "what": f"{task} {plan.tokens} tokens, batch {plan.batch_size} ({', '.join(kinds)})",
                    "seconds_per_step": per_step,
                    "projected_seconds": per_step * plan.steps * len(s.part_a_seeds),
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
    from .generative import _noise_prediction, mirror_images, new_denoiser

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
