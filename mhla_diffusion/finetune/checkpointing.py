"""Run folders and checkpoints.

* A run folder is marked by ``run_config.yaml``. A new run refuses a folder that already holds
  anything; ``overwrite_output_dir`` deletes an earlier *run* (never a folder without the marker),
  ``resume`` continues it.
* Checkpoints are Accelerate states (model or trainable weights, optimizers, LR schedulers, RNG
  states of every process, EMA, data position) written to ``checkpoints/.tmp-step-N`` and renamed to
  ``checkpoints/step-N`` once complete; only the newest ``checkpoints_total_limit`` are kept.
* Resuming compares the new options with the run's recorded ones first (:func:`check_resume_options`):
  only :data:`RESUME_MAY_CHANGE` may differ; ``run_config.yaml`` is rewritten once the checkpoint loaded.
* One process holds a run folder at a time: :class:`RunLock` (``.run.lock``, the holder's host and PID).
* A start that fails before its first step leaves the folder as it found it (:class:`RunDirGuard`); a
  ``resume`` folder is checked to be a checkpoint of this trainer before anything is written
  (:func:`check_resume_checkpoint`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors.torch import save_file

from ..loaders.weight_files import read_checkpoint_file

__all__ = [
    "RESUME_MAY_CHANGE",
    "RUN_CONFIG",
    "RunDirGuard",
    "RunLock",
    "TrainingState",
    "check_resume_checkpoint",
    "check_resume_options",
    "check_run_dir",
    "list_checkpoints",
    "prepare_run_dir",
    "recover_checkpoints",
    "resolve_resume",
    "save_checkpoint",
    "save_trainable_only",
    "truncate_metrics",
    "write_run_config",
]

logger = logging.getLogger(__name__)

RUN_CONFIG = "run_config.yaml"
TRAINABLE_WEIGHTS = "trainable_weights.safetensors"
LOCK_FILE = ".run.lock"
#: Options that may differ when a run resumes: how long it runs, what it logs, checkpoints and samples,
#: and how it reads data. Everything else (model, attention, mhla*, trainable, lora_*, sizes and
#: buckets, data and cache settings, seed, batch and accumulation, optimizer and LR schedule: the
#: checkpoint restores the optimizer's and scheduler's state, so a new learning_rate would not apply)
#: must equal the recorded run's.
RESUME_MAY_CHANGE = frozenset(
    {
        "resume",
        "overwrite_output_dir",
        "output_dir",
        "max_train_steps",
        "report_to",
        "tracker_project_name",
        "checkpointing_steps",
        "checkpoints_total_limit",
        "save_pipeline",
        "dataloader_num_workers",
        "cache_dir",
        "gradient_checkpointing",
        "allow_tf32",
        "inception_weights",
    }
)
RUN_OUTPUTS = ("checkpoints", "final", "final-no-ema", "pipeline", "logs", "validation", RUN_CONFIG)
_PREFIX = "step-"
_TMP, _OLD, _PRUNED = ".tmp-", ".old-", ".pruned-"  # leftovers of a cut save (recover_checkpoints)


@dataclass
class TrainingState:
    """Where the run is: optimizer steps done, and this epoch's data position (per process)."""

    global_step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0  # micro-batches this process has consumed in `epoch`

    def state_dict(self) -> dict[str, int]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, int]) -> None:
        for key, value in state.items():
            setattr(self, key, int(value))


# ---------------------------------------------------------------------- run folder


def check_run_dir(output_dir: str | Path, resume: str | None, overwrite: bool, ignore: tuple[str, ...] = ()) -> str:
    """Read-only check of ``output_dir`` (safe on every process). Returns ``new``, ``resume`` or ``overwrite``.

    ``ignore`` names entries that do not count as content (e.g. a cache folder kept between runs).
    """
    folder = Path(output_dir)
    if folder.exists() and not folder.is_dir():
        raise NotADirectoryError(f"output_dir {folder} exists and is not a folder")
    ignore = (*ignore, LOCK_FILE)
    content = [p.name for p in folder.iterdir() if p.name not in ignore] if folder.is_dir() else []
    is_run = (folder / RUN_CONFIG).is_file()
    if resume is not None:
        if resume != "latest" and not Path(resume).is_dir():
            raise FileNotFoundError(f"--resume {resume} does not exist. {CHECKPOINT_FORM}")
        if content and not is_run:
            raise ValueError(
                f"output_dir {folder} is not a training run folder (no {RUN_CONFIG}); cannot resume into it"
            )
        if resume == "latest" and not list_checkpoints(folder) and (folder / "final").exists():
            raise FileExistsError(
                f"nothing to resume in {folder}: it holds a finished run without checkpoints (checkpointing_steps: 0); "
                "pass --overwrite_output_dir true to train it again from the start, or choose another output_dir"
            )
        return "resume"
    if not content:
        return "new"
    if not is_run:
        raise FileExistsError(
            f"output_dir {folder} is not empty and is not a training run folder (no {RUN_CONFIG}): choose another "
            "output_dir; it is never deleted"
        )
    if overwrite:
        return "overwrite"
    raise FileExistsError(
        f"output_dir {folder} already holds a training run: pass --resume latest to continue it, "
        "--overwrite_output_dir true to replace it, or choose another output_dir"
    )


#: What a checkpoint folder looks like, for the errors about ``resume``.
CHECKPOINT_FORM = (
    "A checkpoint folder is <output_dir>/checkpoints/step-N (saved every checkpointing_steps), holding Accelerate's "
    "state files: custom_checkpoint_0.pkl (step and data position), random_states_0.pkl, the optimizer and the "
    "weights (model.safetensors, or trainable_weights.safetensors); pass one, or --resume latest"
)
#: Accelerate's state files every checkpoint of these trainers holds (``TrainingState`` is registered first).
_STATE_FILES = ("custom_checkpoint_0.pkl", "random_states_0.pkl")
#: Names the weights of a checkpoint start with: the whole model (``model.safetensors``, ``pytorch_model.bin``,
#: FSDP's ``pytorch_model_fsdp_0``, DeepSpeed's ``pytorch_model``) or the trained parameters only.
_WEIGHT_PREFIXES = ("model", "pytorch_model", TRAINABLE_WEIGHTS)


def check_resume_checkpoint(resume: str | None, options: dict[str, Any]) -> None:
    """Read-only: ``resume`` (a folder) must be a checkpoint of this trainer, before anything is written.

    ``ValueError`` naming the folder, what is missing and what a checkpoint folder looks like
    (:data:`CHECKPOINT_FORM`): a folder without Accelerate's state files or weights, or a checkpoint of a run
    whose recorded options (``run_config.yaml`` of ``<run>/checkpoints/step-N``) this trainer does not have.
    """
    if resume is None or resume == "latest":
        return  # latest: a complete checkpoints/step-N of output_dir (renamed into place once saved), or none
    folder = Path(resume)
    names = {p.name for p in folder.iterdir()}
    missing = [name for name in _STATE_FILES if name not in names]
    if not any(name.startswith(_WEIGHT_PREFIXES) for name in names):
        missing.append("weights")
    if missing:
        raise ValueError(f"--resume {folder} is not a checkpoint (no {', '.join(missing)}). {CHECKPOINT_FORM}")
    record = folder.parent.parent / RUN_CONFIG
    if folder.parent.name == "checkpoints" and record.is_file():
        recorded = yaml.safe_load(record.read_text()) or {}
        foreign = sorted(set(recorded) - set(options)) if isinstance(recorded, dict) else []
        if foreign:
            raise ValueError(
                f"--resume {folder} is a checkpoint of another trainer's run: {record} records options this "
                f"trainer does not have ({', '.join(foreign[:3])}); resume it with that trainer, or pass a "
                "checkpoint of this one"
            )


def _may_change(name: str) -> bool:
    return name in RESUME_MAY_CHANGE or name.startswith("validation_")


def check_resume_options(output_dir: str | Path, options: dict[str, Any]) -> list[str]:
    """Read-only: compare ``options`` with the run's recorded ``run_config.yaml`` before resuming.

    Raises ``ValueError`` listing every changed option that would change the saved state's shapes or
    meaning (``name: old -> new``); returns the allowed changes (for the log).
    """
    config = Path(output_dir) / RUN_CONFIG
    if not config.is_file():
        return []
    before = yaml.safe_load(config.read_text()) or {}
    changed = sorted(k for k in set(before) | set(options) if before.get(k) != options.get(k))
    describe = lambda k: f"{k}: {before.get(k)!r} -> {options.get(k)!r}"  # noqa: E731
    refused = [describe(k) for k in changed if not _may_change(k)]
    if refused:
        raise ValueError(
            f"cannot resume {output_dir} with changed options ({'; '.join(refused)}): the checkpoint was saved with "
            f"the recorded ones ({config}). Resume with the same values, or start a new run (another output_dir, or "
            "--overwrite_output_dir true). Options that may change on resume: max_train_steps, checkpointing_*, "
            "logging (report_to, tracker_project_name), validation_*, save_pipeline, dataloader_num_workers, "
            "cache_dir, gradient_checkpointing, allow_tf32"
        )
    return [describe(k) for k in changed if k != "resume"]


def write_run_config(output_dir: str | Path, options: dict[str, Any]) -> None:
    """Record the run's options (main process)."""
    (Path(output_dir) / RUN_CONFIG).write_text(yaml.safe_dump(options, sort_keys=False))


def prepare_run_dir(output_dir: str | Path, mode: str, options: dict[str, Any]) -> None:
    """Main process only: clear an overwritten run, create the folder, record the options (a resumed run's
    record is rewritten only once its checkpoint loaded: :func:`write_run_config`)."""
    folder = Path(output_dir)
    if mode == "overwrite":
        for name in RUN_OUTPUTS:
            path = folder / name
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
    folder.mkdir(parents=True, exist_ok=True)
    if mode == "resume" and (folder / RUN_CONFIG).is_file():
        return
    write_run_config(folder, options)


def truncate_metrics(logging_dir: str | Path, step: int) -> None:
    """Drop ``metrics.jsonl`` rows after ``step`` (main process, on resume): each step is logged once."""
    path = Path(logging_dir) / "metrics.jsonl"
    if not path.is_file():
        return
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            row_step = json.loads(line).get("step")
        except json.JSONDecodeError:  # a line cut by a crash
            dropped += 1
            continue
        if row_step is not None and row_step > step:
            dropped += 1
            continue
        kept.append(line)
    if dropped:
        temporary = path.with_suffix(".jsonl.tmp")
        temporary.write_text("".join(line + "\n" for line in kept))
        os.replace(temporary, path)
        logger.info("metrics.jsonl: dropped %d rows after step %d (they are logged again)", dropped, step)


class RunDirGuard:
    """What a start writes into ``output_dir`` before its first optimizer step, undone if it fails there.

    Made before anything is written (main process); :meth:`restore` (when :attr:`stepped` is still false)
    removes the entries that were not there (``run_config.yaml``, ``logs/`` of Accelerate and the trackers, a
    created folder and its created parents), puts back a ``run_config.yaml`` it rewrote, and keeps the names in
    ``keep`` (a latent cache, which a corrected rerun reuses and the run-folder check ignores).
    """

    def __init__(self, output_dir: str | Path, keep: tuple[str, ...] = ()) -> None:
        self.folder = Path(output_dir)
        self.keep = keep
        self.stepped = False
        self.armed = False  # set once this start holds the run lock: a folder in use by another run is not ours
        self.before = {p.name for p in self.folder.iterdir()} if self.folder.is_dir() else set()
        record = self.folder / RUN_CONFIG
        self.record = record.read_bytes() if record.is_file() else None
        created, path = None, self.folder.absolute()
        while not path.exists():
            created, path = path, path.parent
        self.created_root = created  # the topmost folder this start will create, if any

    def restore(self) -> list[str]:
        """Undo this start's writes (nothing once a step ran, or without the run lock); returns the removed names,
        logged in one line."""
        if self.stepped or not self.armed:
            return []
        removed = []
        if self.folder.is_dir():
            for path in sorted(self.folder.iterdir()):
                if path.name in self.before or path.name in self.keep or path.name == LOCK_FILE:
                    continue
                shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
                removed.append(path.name)
            if self.record is not None:
                (self.folder / RUN_CONFIG).write_bytes(self.record)
        path = self.folder.absolute()
        while self.created_root is not None and path.is_relative_to(self.created_root):
            if path.is_dir() and any(path.iterdir()):
                break  # holds what this start keeps (a lock still held, the cache)
            if path.is_dir():
                path.rmdir()
            path = path.parent
        if removed:
            logger.info(
                "the run failed before its first step: removed what it wrote to %s (%s)",
                self.folder,
                ", ".join(removed),
            )
        return removed


# ---------------------------------------------------------------------- lock


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


class RunLock:
    """``<output_dir>/.run.lock`` holding ``{"host", "pid"}`` of the (main) process that trains the run.

    Refused while that process lives; a lock of a dead process on this host is stale and taken over.
    A lock from another host cannot be checked: it is refused, naming the file to delete.
    """

    def __init__(self, output_dir: str | Path) -> None:
        self.path = Path(output_dir) / LOCK_FILE
        self.held = False
        self._created_folder = False

    def acquire(self) -> None:
        self._created_folder = not self.path.parent.exists()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        me = {"host": socket.gethostname(), "pid": os.getpid()}
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._check_holder(me)
                continue
            with os.fdopen(fd, "w") as handle:
                handle.write(json.dumps(me) + "\n")
            self.held = True
            return
        raise RuntimeError(f"could not take the run lock {self.path}")

    def _check_holder(self, me: dict[str, Any]) -> None:
        """Raise while the holder lives; remove a stale lock."""
        try:
            holder = json.loads(self.path.read_text() or "{}")
        except (OSError, json.JSONDecodeError):
            holder = {}
        host, pid = holder.get("host"), holder.get("pid")
        if host == me["host"] and isinstance(pid, int) and not _alive(pid):
            logger.warning(
                "taking over the stale run lock %s of process %d on %s (no longer running)", self.path, pid, host
            )
            self.path.unlink(missing_ok=True)
            return
        if host is None or pid is None:  # being written right now, or unreadable
            raise RuntimeError(
                f"{self.path.parent} is locked by another run ({self.path} is unreadable): "
                f"if no run trains this folder, delete {self.path}"
            )
        where = "this host" if host == me["host"] else f"host {host}"
        raise RuntimeError(
            f"{self.path.parent} is in use by another training run (process {pid} on {where}, lock {self.path}): "
            f"wait for it to end or stop it (kill -TERM its launcher; a launcher killed with -9 leaves its workers "
            f"running: stop them, e.g. kill -TERM {pid} and the other ranks), or choose another output_dir"
            + (f"; if that process is gone, delete {self.path}" if host != me["host"] else "")
        )

    def release(self) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False
            if self._created_folder and not any(self.path.parent.iterdir()):  # a run that failed at setup
                self.path.parent.rmdir()


# ---------------------------------------------------------------------- checkpoints


def list_checkpoints(output_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints ``(step, folder)`` of a run, oldest first."""
    root = Path(output_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        if path.is_dir() and path.name.startswith(_PREFIX) and path.name[len(_PREFIX) :].isdigit():
            found.append((int(path.name[len(_PREFIX) :]), path))
    return sorted(found)


def resolve_resume(output_dir: str | Path, resume: str | None) -> Path | None:
    """The checkpoint folder to resume from (``None``: start fresh; ``latest`` with no checkpoint yet)."""
    if resume is None:
        return None
    if resume == "latest":
        found = list_checkpoints(output_dir)
        if not found:
            logger.info("resume=latest: no checkpoint in %s yet, starting a new run", output_dir)
            return None
        return found[-1][1]
    return Path(resume)


def _step_name(step: int) -> str:
    return f"{_PREFIX}{step:08d}"


def save_checkpoint(accelerator, output_dir: str | Path, step: int, total_limit: int | None) -> Path:
    """Write the Accelerate state atomically as ``checkpoints/step-{step:08d}`` and prune old ones.

    Every move tolerates what a kill at any earlier moment of this or an earlier save can leave
    (see :func:`recover_checkpoints`): the state is written to ``.tmp-step-N``; a step saved again
    moves its old folder to ``.old-step-N`` (replacing a leftover of that name) before the new one
    takes its name; pruned checkpoints are renamed to ``.pruned-step-N`` before they are deleted, so
    a half-deleted checkpoint never looks complete.
    """
    root = Path(output_dir) / "checkpoints"
    final = root / _step_name(step)
    temporary = root / f"{_TMP}{final.name}"
    if accelerator.is_main_process:
        shutil.rmtree(temporary, ignore_errors=True)
        root.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(temporary))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        stale = root / f"{_OLD}{final.name}"
        if final.exists():  # re-saving a step after resuming from an older checkpoint
            shutil.rmtree(stale, ignore_errors=True)  # a leftover of an earlier cut re-save
            os.replace(final, stale)
        os.replace(temporary, final)
        shutil.rmtree(stale, ignore_errors=True)
        if total_limit is not None:
            for _, old in list_checkpoints(output_dir)[:-total_limit]:
                _delete_checkpoint(old)
    accelerator.wait_for_everyone()
    return final


def _delete_checkpoint(folder: Path) -> None:
    """Rename, then delete: a kill during the delete leaves ``.pruned-step-N``, never a partial ``step-N``."""
    doomed = folder.with_name(f"{_PRUNED}{folder.name}")
    shutil.rmtree(doomed, ignore_errors=True)
    os.replace(folder, doomed)
    shutil.rmtree(doomed)


def recover_checkpoints(output_dir: str | Path) -> list[str]:
    """Set ``<output_dir>/checkpoints`` right after a kill during :func:`save_checkpoint` (main process,
    holding the run lock, before a resume picks its checkpoint). Returns the actions, each logged in one line.

    * ``.old-step-N`` without ``step-N`` (cut between the two renames of a re-save) is renamed back: it
      is the complete earlier save of that step;
    * ``.old-step-N`` beside ``step-N`` (cut during the delete) is removed;
    * ``.tmp-step-N`` (a save that never completed) and ``.pruned-step-N`` (a cut prune) are removed.
    """
    root = Path(output_dir) / "checkpoints"
    if not root.is_dir():
        return []
    actions = []
    for path in sorted(root.iterdir()):
        if not path.is_dir() or not path.name.startswith(_OLD):
            continue
        final = root / path.name[len(_OLD) :]
        if final.exists():
            shutil.rmtree(path)
            actions.append(f"removed {path} (a leftover of re-saving {final.name}, which is complete)")
        else:
            os.replace(path, final)
            actions.append(f"restored {final} from {path.name} (a re-save of that step was cut between its renames)")
    leftovers = ((_TMP, "a checkpoint save that never completed"), (_PRUNED, "a cut prune of an old checkpoint"))
    for prefix, why in leftovers:
        for path in sorted(root.glob(f"{prefix}*")):
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
            actions.append(f"removed {path} ({why})")
    for action in actions:
        logger.warning("checkpoints: %s", action)
    return actions


def save_trainable_only(accelerator, model: torch.nn.Module, names: list[str]) -> None:
    """Make checkpoints hold only the parameters ``names`` that train in some stage (not a frozen base).

    The base weights are reloaded from ``pretrained_model`` on resume; this registers Accelerate
    save/load hooks that replace the model file by ``trainable_weights.safetensors`` and load it
    strictly. Not for FSDP/DeepSpeed, whose sharded states Accelerate must write itself.
    """
    wanted = set(names)

    def trainable() -> dict[str, torch.nn.Parameter]:
        return {name: p for name, p in model.named_parameters() if name in wanted}

    def save_hook(models, weights, output_dir):
        if accelerator.is_main_process:
            tensors = {name: p.detach().contiguous().cpu() for name, p in trainable().items()}
            save_file(tensors, os.path.join(output_dir, TRAINABLE_WEIGHTS))
        weights.clear()  # Accelerate writes no model file

    def load_hook(models, input_dir):
        models.clear()  # Accelerate loads no model file
        path = os.path.join(input_dir, TRAINABLE_WEIGHTS)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} is missing: the checkpoint is incomplete or from a full-model run")
        saved, params = read_checkpoint_file(path), trainable()
        if set(saved) != set(params):
            missing, extra = sorted(set(params) - set(saved)), sorted(set(saved) - set(params))
            raise ValueError(
                f"checkpoint {input_dir} does not match the trainable parameters (missing {missing[:5]}, unexpected "
                f"{extra[:5]}): resume with the same trainable / mhla / lora options"
            )
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(saved[name].to(p.device, p.dtype))

    accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)
