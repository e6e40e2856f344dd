"""Running the stages within the session's budget, each in its own time-limited process on CUDA (:data:`STAGES`,
:func:`run_session`)."""

from __future__ import annotations

import dataclasses
import datetime
import math
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from .common import FORMAT, FULL, SMOKE, StageContext, _error_line, load_session, save_session
from .correctness import stage_correctness, stage_gradients
from .endtoend import stage_endtoend
from .environment import stage_versions
from .profile import stage_families, stage_profile
from .timing import stage_timing
from .training import stage_training


@dataclass(frozen=True)
class Stage:
    name: str
    run: Callable[[StageContext], None]
    #: seconds of budget a stage needs to be started; later stages' needs are kept back from earlier stages
    needs_s: int
    #: the most seconds it may take (in its own process on CUDA: stopped there)
    limit_s: int


STAGES = (
    Stage("versions", stage_versions, 10, 45),
    Stage("correctness", stage_correctness, 20, 75),
    Stage("endtoend", stage_endtoend, 90, 240),
    Stage("gradients", stage_gradients, 15, 45),
    Stage("timing", stage_timing, 40, 100),
    Stage("training", stage_training, 30, 75),
    Stage("profile", stage_profile, 10, 30),
    Stage("families", stage_families, 5, 45),
)
STAGE_NAMES = tuple(stage.name for stage in STAGES)


def stage_limit(stage: Stage, left_s: float, later_needs_s: float) -> float | None:
    """Seconds ``stage`` may run with ``left_s`` of the budget left, keeping back what the later stages need to
    start; ``None`` when that is under the stage's own need (it is skipped)."""
    limit = min(stage.limit_s, left_s - later_needs_s)
    return limit if limit >= stage.needs_s else None


def kept_back(later: list[Stage], budget_s: float) -> float:
    """Seconds kept for the ``later`` stages: their needs, except those of stages that need more than the
    whole budget (they can never start, so nothing is kept for them)."""
    return float(sum(stage.needs_s for stage in later if stage.needs_s <= budget_s))


def plan_budget(budget_s: float, names: tuple[str, ...], stages: tuple[Stage, ...] | None = None) -> list[dict]:
    """The worst case of a session of ``names`` within ``budget_s``: every stage runs to its limit
    (:func:`stage_limit`, :func:`kept_back`). One entry per stage, in order: ``stage``, ``needs_s``,
    ``starts_after_s`` and ``limit_s`` (``None``: it could be skipped)."""
    chosen = [stage for stage in stages or STAGES if stage.name in names]
    used, plan = 0.0, []
    for i, stage in enumerate(chosen):
        limit = stage_limit(stage, budget_s - used, kept_back(chosen[i + 1 :], budget_s))
        plan.append({"stage": stage.name, "needs_s": stage.needs_s, "starts_after_s": used, "limit_s": limit})
        used += limit or 0.0
    return plan


#: Seconds before its limit at which a stage's own deadline falls (it skips optional parts past it).
DEADLINE_MARGIN_S = 10.0
#: The script an isolated stage runs in (``--stage NAME``).
ENTRY = Path(__file__).resolve().parents[1] / "gpu_session.py"


def run_stage_here(out: Path, name: str, smoke: bool, deadline: float = math.inf) -> int:
    """Run stage ``name`` in this process, its entry saved as it goes; 0, or 1 when it raised."""
    session = load_session(out)
    stage = next(s for s in STAGES if s.name == name)
    device = torch.device("cpu" if smoke else "cuda")
    ctx = StageContext(out, session, name, SMOKE if smoke else FULL, device, smoke, deadline)
    session["stages"][name] = {"status": "running"}
    ctx.save()
    started = time.perf_counter()
    status = 0
    try:
        stage.run(ctx)
        ctx.data["status"] = "ok"
    except Exception as error:
        ctx.data.update(status="error", error=_error_line(error), traceback=traceback.format_exc()[-3000:])
        status = 1
    ctx.data["seconds"] = time.perf_counter() - started
    ctx.save()
    return status


def run_stage_isolated(out: Path, name: str, smoke: bool, limit_s: float) -> None:
    """Run stage ``name`` in a fresh process stopped after ``limit_s`` seconds (its own deadline falls
    :data:`DEADLINE_MARGIN_S` earlier); a killed or crashed stage keeps what it saved and is marked
    ``timeout`` / ``error``."""
    deadline = time.time() + limit_s - min(DEADLINE_MARGIN_S, 0.1 * limit_s)
    command = [sys.executable, str(ENTRY), str(out), "--stage", name, "--deadline", str(deadline)]
    command += ["--smoke"] if smoke else []
    started = time.perf_counter()
    try:
        done = subprocess.run(command, timeout=limit_s, check=False)
        problem = None if done.returncode in (0, 1) else f"the stage's process ended with exit code {done.returncode}"
    except subprocess.TimeoutExpired:
        problem = f"stopped after {limit_s:.0f} s (its time limit in this session)"
    if problem:
        session = load_session(out)
        entry = session["stages"].setdefault(name, {})
        entry.update(
            status="timeout" if "stopped" in problem else "error", error=problem, seconds=time.perf_counter() - started
        )
        save_session(out, session)


def new_session(smoke: bool, budget_s: float, names: tuple[str, ...]) -> dict[str, Any]:
    sizes = SMOKE if smoke else FULL
    return {
        "format": FORMAT,
        "smoke": smoke,
        "device": "cpu" if smoke else "cuda",
        "torch": torch.__version__,
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "budget_s": budget_s,
        "requested": list(names),
        "plan": plan_budget(budget_s, names),
        "sizes": dataclasses.asdict(sizes),
        "stages": {},
    }


def run_session(out: Path, smoke: bool, budget_s: float, stages: tuple[str, ...], isolate: bool) -> dict[str, Any]:
    """Every stage in ``stages`` (in :data:`STAGES` order) within ``budget_s`` seconds; the session dict.

    Each stage gets :func:`stage_limit` of what is left (later requested stages' needs kept back); one that
    cannot get its need is recorded as skipped, saying why."""
    started = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    chosen = [stage for stage in STAGES if stage.name in stages]
    session = new_session(smoke, budget_s, tuple(stage.name for stage in chosen))
    save_session(out, session)
    print(f"[gpu_session] plan within {budget_s:.0f} s: {session['plan']}", file=sys.stderr, flush=True)
    for i, stage in enumerate(chosen):
        left = budget_s - (time.monotonic() - started)
        later = kept_back(chosen[i + 1 :], budget_s)
        limit = stage_limit(stage, left, later)
        if limit is None:
            session = load_session(out)
            session["stages"][stage.name] = {
                "status": "skipped",
                "notes": [
                    f"skipped: {left:.0f} s of the session's {budget_s:.0f} s were left, {later:.0f} s of them "
                    f"kept for the later stages; the stage needs about {stage.needs_s} s"
                ],
            }
            save_session(out, session)
            continue
        print(f"[gpu_session] {stage.name}: up to {limit:.0f} s ({left:.0f} s left)", file=sys.stderr, flush=True)
        if isolate:
            run_stage_isolated(out, stage.name, smoke, limit)
        else:
            run_stage_here(out, stage.name, smoke, time.time() + limit)
    return load_session(out)
