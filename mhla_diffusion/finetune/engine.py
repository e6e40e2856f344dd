"""The training loop both trainers share: Accelerate setup, run folder, optimizers and LR schedule,
optional attention-transfer stage, end-to-end steps, checkpoints, resume, logging, validation and
the final save. A task (``train_wan`` / ``train_dit``) supplies data, model and loss as
:class:`TaskParts`.

Reproducibility: the data order depends only on ``(seed, epoch)``; the random numbers of a step
(timesteps, noise, caption / class dropout) come from a generator seeded by
``(seed, data-parallel group, step, micro-batch)`` (the processes of a context-parallel group draw
alike); Accelerate's checkpoints restore model, optimizers, LR schedules, EMA, RNG states and
:class:`TrainingState` (step and data position). So a run resumed
from a checkpoint ends with the same weights as one that was never interrupted.
"""

from __future__ import annotations

import hashlib
import logging
import math
import signal
import time
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Hashable, Iterator

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm

from ..models.context_parallel import context_parallel_paused, enable_training_context_parallel
from ..models.conversion import convert_to_mhla, get_mhla_conversion
from ..utils.options import zero_notes
from .attention_transfer import AttentionTransfer
from .buckets import BucketBatchSampler
from .checkpointing import (
    RunDirGuard,
    RunLock,
    TrainingState,
    check_resume_checkpoint,
    check_resume_options,
    check_run_dir,
    prepare_run_dir,
    recover_checkpoints,
    resolve_resume,
    save_checkpoint,
    save_trainable_only,
    truncate_metrics,
    write_run_config,
)
from .interrupt import StopRequest, TrainingInterrupted
from .latent_cache import remove_leftovers
from .options import TrainOptions
from .tracking import make_trackers
from .trainable import set_trainable
from .validation_fid import ValidationFID, prepare_validation_fid

__all__ = [
    "TaskParts",
    "Task",
    "clean_parameter_name",
    "make_accelerator",
    "reset_accelerate_state",
    "resolve_dtype",
    "run_task",
    "step_generator",
]

logger = logging.getLogger(__name__)

#: ``batch_loss(model, batch, generator) -> (loss, {metric: value})``; ``model`` is the prepared model.
BatchLoss = Callable[[nn.Module, dict[str, Any], torch.Generator], tuple[torch.Tensor, dict[str, Any]]]


@dataclass
class TaskParts:
    """What a task hands to :func:`run_task`."""

    transformer: nn.Module  # converted to MHLA, or as loaded for attention: softmax (LoRA adapter already attached)
    dataset: Dataset  # items requested as (index, epoch)
    buckets: list[Hashable]  # bucket key per sample: one bucket per batch
    collate_fn: Callable[[list], dict[str, Any]]
    batch_loss: BatchLoss
    save_final: Callable[[nn.Module, str], Path]  # (model with final weights, folder name) -> folder; main process
    validate: Callable[[nn.Module, int], None] | None = None  # (unwrapped model, step); main process
    after_optimizer_step: Callable[[nn.Module], None] | None = None  # e.g. clamp mixing (unwrapped model)
    ema_decay: float = 0.0  # > 0: EMA of the trainable parameters (saved as `final`, raw weights as `final-no-ema`)
    ema_warmup: bool = False
    data_metrics: dict[str, int] | None = None
    finish: Callable[[nn.Module], None] | None = None  # after the final save (e.g. write a pipeline folder)
    enter_stage: Callable[[str], None] | None = None  # told "transfer" or "train" as a stage begins
    # (unwrapped model, sample indices) -> uint8 (n, H, W, 3) images for validation FID; every process
    fid_samples: Callable[[nn.Module, list[int]], Any] | None = None


class Task:
    """A trainer: options plus :meth:`setup`, which builds :class:`TaskParts` once the Accelerator exists."""

    options: TrainOptions

    def setup(self, accelerator) -> TaskParts:  # pragma: no cover - interface
        raise NotImplementedError


# ---------------------------------------------------------------------- helpers


def resolve_dtype(name: str, accelerator, wrapped: bool = True) -> torch.dtype:
    """``auto`` -> the mixed-precision dtype. For the ``wrapped`` (trained) model that is float32 under
    FSDP, whose flat parameters need one dtype; frozen encoders outside the wrapper never need that."""
    from accelerate.utils import DistributedType

    if name != "auto":
        return getattr(torch, name)
    if wrapped and accelerator.distributed_type == DistributedType.FSDP:
        return torch.float32
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(accelerator.mixed_precision, torch.float32)


def step_generator(seed: int, rank: int, step: int, micro: int, device: torch.device) -> torch.Generator:
    """A generator seeded by ``(seed, process, optimizer step, micro-batch)``."""
    digest = hashlib.sha256(f"{seed}/{rank}/{step}/{micro}".encode()).digest()
    generator = torch.Generator(device=device)
    generator.manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
    return generator


def clean_parameter_name(name: str) -> str:
    """Parameter name without DDP / FSDP / activation-checkpoint wrapper prefixes."""
    for prefix in ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod."):
        name = name.replace(prefix, "")
    return name[len("module.") :] if name.startswith("module.") else name


def make_accelerator(options: TrainOptions, logging_dir: Path, find_unused_parameters: bool = False):
    """An ``Accelerator`` with the run's precision, accumulation and trackers (FSDP/DDP from accelerate's config)."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs, ProjectConfiguration

    trackers = make_trackers(options.report_to, logging_dir, Path(options.output_dir).name)
    kwargs = [DistributedDataParallelKwargs(find_unused_parameters=True)] if find_unused_parameters else []
    return Accelerator(
        mixed_precision=options.mixed_precision,
        gradient_accumulation_steps=options.gradient_accumulation_steps,
        log_with=trackers or None,
        project_config=ProjectConfiguration(project_dir=options.output_dir, logging_dir=str(logging_dir)),
        kwargs_handlers=kwargs,
    )


def _batches(
    sampler: BucketBatchSampler, dataset: Dataset, collate, workers: int, state: TrainingState, device: torch.device
) -> Iterator[dict[str, Any]]:
    """Endless batches from ``state``'s data position, advancing it as batches are consumed."""
    while True:
        sampler.set_epoch(state.epoch, state.batch_in_epoch)
        loader = DataLoader(
            dataset,
            batch_sampler=sampler,
            collate_fn=collate,
            num_workers=workers,
            pin_memory=device.type == "cuda",
            worker_init_fn=_ignore_sigint if workers else None,
        )
        for batch in loader:
            state.batch_in_epoch += 1
            yield {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}
        state.epoch += 1
        state.batch_in_epoch = 0


def _ignore_sigint(worker_id: int) -> None:
    """Data workers share the terminal's Ctrl-C; the main process decides when to stop (:class:`StopRequest`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _cpu_copy(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> nn.Module:
    """A CPU model of the same architecture (MHLA layers if any, LoRA adapter) holding ``state_dict``.

    Used under FSDP, whose local model holds only shards.
    """
    # FSDP2 swaps the model's class for a generated torch.distributed subclass: build the original one.
    cls = next(c for c in type(model).__mro__ if not c.__module__.startswith("torch.distributed"))
    copy = cls.from_config(model.config)
    conversion = get_mhla_conversion(model)
    if conversion is not None:  # None: an attention: softmax run
        convert_to_mhla(copy, conversion.config)
    peft_config = getattr(model, "peft_config", None)
    if peft_config:
        copy.add_adapter(peft_config["default"])
    copy.load_state_dict({clean_parameter_name(k): v for k, v in state_dict.items()}, strict=True)
    return copy


# ---------------------------------------------------------------------- the run


def reset_accelerate_state() -> None:
    """Forget Accelerate's process-wide singletons (``AcceleratorState``, ``PartialState``,
    ``GradientState``), so the next :class:`Accelerator` of this process takes its own settings
    (mixed precision, accumulation steps) instead of failing on or inheriting the last run's."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def run_task(task: Task, on_step_end: Callable[[int, dict[str, Any]], None] | None = None) -> Path:
    """Run a training task end to end; returns the final output folder.

    ``on_step_end(step, logs)`` is called after every optimizer step (used by tests to interrupt a run).
    Runs may follow each other in one Python process: Accelerate's state is reset when a run ends
    (or fails), and every run seeds its own random numbers.
    """
    try:
        return _run_task(task, on_step_end)
    finally:
        reset_accelerate_state()


def _run_task(task: Task, on_step_end: Callable[[int, dict[str, Any]], None] | None) -> Path:
    options = task.options
    output_dir = Path(options.output_dir)
    cache_name = "cache" if options.cache_dir is None else ""
    mode = check_run_dir(
        output_dir, options.resume, options.overwrite_output_dir, ignore=(cache_name,) if cache_name else ()
    )
    resume_changes: list[str] = []
    if mode == "resume" and (resolve_resume(output_dir, options.resume) is not None or _has_leftovers(output_dir)):
        resume_changes = check_resume_options(output_dir, options.to_dict())  # before anything is loaded or written
    check_resume_checkpoint(options.resume, options.to_dict())
    fid = prepare_validation_fid(options)  # reference and Inception weights checked before any work
    guard = RunDirGuard(output_dir, keep=(cache_name,) if cache_name else ())  # before anything is written
    try:
        return _start(task, options, mode, resume_changes, on_step_end, fid, guard)
    except BaseException:
        guard.restore()  # a start that fails before its first step leaves output_dir as it found it
        raise


def _start(
    task: Task,
    options: TrainOptions,
    mode: str,
    resume_changes: list[str],
    on_step_end: Callable[[int, dict[str, Any]], None] | None,
    fid: ValidationFID | None,
    guard: RunDirGuard,
) -> Path:
    """The run under the run lock (``guard`` learns when it holds it, and when the first step is done)."""
    output_dir = Path(options.output_dir)
    accelerator = make_accelerator(
        options, output_dir / "logs", find_unused_parameters=options.attention_transfer_steps > 0
    )
    lock = RunLock(output_dir)
    if accelerator.is_main_process:  # the other processes share the main process's run
        lock.acquire()
        guard.armed = True  # the main process undoes a failed start, holding the lock
        if off := zero_notes(options):  # a 0 that switches something off is said once, at start
            logger.info("off (set to 0): %s", "; ".join(off))
    try:
        if accelerator.is_main_process:  # under the lock: no live run's save is in flight
            if mode == "resume":
                recover_checkpoints(output_dir)
            if getattr(options, "cache_latents", False):
                remove_leftovers(options.resolved_cache_dir())
        accelerator.wait_for_everyone()
        return _train(task, options, accelerator, mode, resume_changes, on_step_end, fid, guard)
    finally:
        lock.release()


def _has_leftovers(output_dir: Path) -> bool:
    """Whether a cut checkpoint save left a folder that :func:`recover_checkpoints` may restore."""
    return any((output_dir / "checkpoints").glob(".old-step-*"))


def _train(
    task: Task,
    options: TrainOptions,
    accelerator,
    mode: str,
    resume_changes: list[str],
    on_step_end: Callable[[int, dict[str, Any]], None] | None,
    fid: ValidationFID | None = None,
    guard: RunDirGuard | None = None,
) -> Path:
    from accelerate.utils import DistributedType, set_seed
    from diffusers.optimization import get_scheduler
    from diffusers.training_utils import EMAModel, cast_training_params

    output_dir = Path(options.output_dir)
    set_seed(options.seed)
    if options.allow_tf32 and torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    is_fsdp = accelerator.distributed_type == DistributedType.FSDP
    sharded_state = accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)

    parts = task.setup(accelerator)  # data and model checks fail here, before the run folder is touched
    if accelerator.is_main_process:
        prepare_run_dir(output_dir, mode, options.to_dict())
    accelerator.wait_for_everyone()
    model = parts.transformer
    # data parallelism across groups of `context_parallel_degree` processes that split each batch's tokens
    layout = enable_training_context_parallel(model, getattr(options, "context_parallel_degree", 1))
    if fid is not None and parts.fid_samples is None:
        raise ValueError(f"{type(task).__name__} cannot sample for validation FID: drop validation_fid_reference")
    if parts.ema_decay and sharded_state:
        raise ValueError(
            "EMA is not supported with FSDP/DeepSpeed (the EMA would hold one shard): use DDP or ema_decay: 0"
        )

    # ---- which parameters train in which stage
    e2e_names = set_trainable(model, options.trainable)
    transfer = None
    transfer_names: list[str] = []
    if options.attention_transfer_steps:
        transfer = AttentionTransfer(model, options.transfer_params(), options.attention_transfer_teacher_forcing)
        transfer_names = transfer.parameter_names()
    union = set(e2e_names) | set(transfer_names)
    for name, param in model.named_parameters():
        param.requires_grad_(name in union)
    cast_training_params(model, torch.float32)  # trained weights in float32 even when the base is bf16
    if options.gradient_checkpointing:
        model.enable_gradient_checkpointing()
    logger.info(
        "trainable: %s (%d tensors, %.2fM parameters)",
        options.trainable,
        len(e2e_names),
        sum(p.numel() for n, p in model.named_parameters() if n in set(e2e_names)) / 1e6,
    )

    # ---- prepare: model first (FSDP needs the wrapped parameters for the optimizers)
    prepared = accelerator.prepare(model)
    unwrapped = accelerator.unwrap_model(prepared)
    params = {clean_parameter_name(n): p for n, p in prepared.named_parameters()}
    optimizer = torch.optim.AdamW(
        [params[n] for n in e2e_names],
        lr=options.learning_rate,
        betas=(options.adam_beta1, options.adam_beta2),
        eps=options.adam_epsilon,
        weight_decay=options.weight_decay,
    )
    # Accelerate steps a prepared scheduler once per process per optimizer step.
    scheduler = get_scheduler(
        options.lr_scheduler,
        optimizer,
        num_warmup_steps=options.lr_warmup_steps * accelerator.num_processes,
        num_training_steps=options.max_train_steps * accelerator.num_processes,
    )
    optimizer, scheduler = accelerator.prepare(optimizer, scheduler)
    transfer_optimizer = None
    if transfer is not None:
        transfer.to(accelerator.device)
        transfer_optimizer = accelerator.prepare(
            torch.optim.AdamW(
                [params[n] for n in transfer_names],
                lr=options.attention_transfer_lr,
                betas=(options.adam_beta1, options.adam_beta2),
                eps=options.adam_epsilon,
                weight_decay=0.0,
            )
        )
    state = TrainingState()
    accelerator.register_for_checkpointing(state)
    ema = None
    if parts.ema_decay:
        ema_params = [params[n] for n in e2e_names]
        ema = EMAModel(
            ema_params,
            decay=parts.ema_decay,
            min_decay=0.0 if parts.ema_warmup else parts.ema_decay,
            use_ema_warmup=parts.ema_warmup,
        )
        accelerator.register_for_checkpointing(ema)
    if options.trainable != "all" and not sharded_state:
        save_trainable_only(accelerator, unwrapped, sorted(union))

    resume_from = resolve_resume(output_dir, options.resume)
    if resume_from is not None:
        accelerator.load_state(str(resume_from))
        logger.info(
            "resumed from %s at step %d (epoch %d, batch %d)",
            resume_from,
            state.global_step,
            state.epoch,
            state.batch_in_epoch,
        )
        if accelerator.is_main_process:
            if resume_changes:
                logger.info("resuming with changed options: %s", "; ".join(resume_changes))
            write_run_config(output_dir, options.to_dict())  # the record changes only once the checkpoint loaded
            truncate_metrics(output_dir / "logs", state.global_step)
    elif mode == "resume" and accelerator.is_main_process:  # resume=latest before the first checkpoint: a new start
        write_run_config(output_dir, options.to_dict())
        truncate_metrics(output_dir / "logs", -1)
    accelerator.wait_for_everyone()
    global_batch = options.train_batch_size * layout.data_parallel_size * options.gradient_accumulation_steps
    if layout.context_parallel_degree == 1:
        logger.info(
            "processes: %d (%s); global batch %d = %d per process x %d processes x %d accumulation steps",
            accelerator.num_processes,
            accelerator.distributed_type,
            global_batch,
            options.train_batch_size,
            accelerator.num_processes,
            options.gradient_accumulation_steps,
        )
    else:
        logger.info(
            "processes: %d (%s) = %d data-parallel groups x %d context-parallel processes (each clip's tokens "
            "split across a group); global batch %d = %d per group x %d groups x %d accumulation steps",
            accelerator.num_processes,
            accelerator.distributed_type,
            layout.data_parallel_size,
            layout.context_parallel_degree,
            global_batch,
            options.train_batch_size,
            layout.data_parallel_size,
            options.gradient_accumulation_steps,
        )

    accelerator.init_trackers(options.tracker_project_name, config=_flat_config(options.to_dict()))
    if state.global_step == 0:
        accelerator.log({**(parts.data_metrics or {}), "num_processes": accelerator.num_processes}, step=0)

    sampler = BucketBatchSampler(
        parts.buckets, options.train_batch_size, layout.data_parallel_size, layout.data_parallel_rank, options.seed
    )  # a context-parallel group shares its batches
    batches = _batches(
        sampler, parts.dataset, parts.collate_fn, options.dataloader_num_workers, state, accelerator.device
    )
    transfer_steps, total = options.attention_transfer_steps, options.attention_transfer_steps + options.max_train_steps
    progress = tqdm(
        total=total,
        initial=state.global_step,
        disable=not accelerator.is_local_main_process,
        unit="step",
        desc=_stage_at(state.global_step, transfer_steps),
        dynamic_ncols=True,
    )
    stage = None
    last_validated = last_fid = -1
    started, started_step = time.perf_counter(), state.global_step

    with StopRequest() as stop:  # SIGINT / SIGTERM: finish the step, save, exit (docs/finetune.md)
        while state.global_step < total:
            wanted = _stage_at(state.global_step, transfer_steps)
            if wanted != stage:
                stage = wanted
                _enter_stage(stage, unwrapped, union, transfer_names, e2e_names, options.gradient_checkpointing)
                progress.set_description(stage, refresh=False)  # one bar: relabelled at its next step, not redrawn
                if parts.enter_stage is not None:
                    parts.enter_stage(stage)
                if stage == "train" and transfer_steps and state.global_step == transfer_steps and ema is not None:
                    ema.shadow_params = [p.clone().detach() for p in (params[n] for n in e2e_names)]
            stage_optimizer = transfer_optimizer if stage == "transfer" else optimizer
            losses, extras = [], {}
            for micro in range(options.gradient_accumulation_steps):
                batch = next(batches)
                generator = step_generator(
                    options.seed, layout.data_parallel_rank, state.global_step, micro, accelerator.device
                )
                with accelerator.accumulate(prepared):
                    with transfer if stage == "transfer" else nullcontext():
                        loss, metrics = parts.batch_loss(prepared, batch, generator)
                        if stage == "transfer":  # the output is the softmax model's here: only the layer losses count
                            metrics, loss = transfer.layer_metrics(), transfer.loss()
                    accelerator.backward(loss * layout.loss_scale if layout.context_parallel_degree > 1 else loss)
                    if accelerator.sync_gradients and options.max_grad_norm > 0:
                        extras["grad_norm"] = accelerator.clip_grad_norm_(prepared.parameters(), options.max_grad_norm)
                    stage_optimizer.step()
                    if stage == "train":
                        scheduler.step()
                    stage_optimizer.zero_grad(set_to_none=True)
                losses.append(loss.detach())
                for key, value in metrics.items():
                    extras.setdefault(key, []).append(torch.as_tensor(value, device=accelerator.device).float())
            state.global_step += 1
            if guard is not None:
                guard.stepped = True  # from here on a failure keeps what the run wrote (checkpoints, logs)
            if parts.after_optimizer_step is not None:
                parts.after_optimizer_step(unwrapped)
            if ema is not None and stage == "train":
                ema.step([params[n] for n in e2e_names])

            logs = {
                "loss" if stage == "train" else "transfer/loss": accelerator.reduce(
                    torch.stack(losses).mean(), "mean"
                ).item()
            }
            for key, value in extras.items():
                value = (
                    torch.stack(value).mean()
                    if isinstance(value, list)
                    else torch.as_tensor(value, device=accelerator.device)
                )
                logs[key] = accelerator.reduce(value.float(), "mean").item()
            logs["lr"] = (transfer_optimizer if stage == "transfer" else optimizer).param_groups[0]["lr"]
            logs["epoch"] = state.epoch
            elapsed = time.perf_counter() - started
            logs["steps_per_s"] = (state.global_step - started_step) / elapsed if elapsed > 0 else math.nan
            accelerator.log(logs, step=state.global_step)
            progress.update(1)
            progress.set_postfix(loss=f"{next(iter(logs.values())):.4f}", lr=f"{logs['lr']:.2e}")

            checkpoint = None
            if (
                options.checkpointing_steps
                and state.global_step % options.checkpointing_steps == 0
                and state.global_step < total
            ):
                checkpoint = save_checkpoint(
                    accelerator, output_dir, state.global_step, options.checkpoints_total_limit
                )
            if (
                parts.validate is not None
                and options.validation_steps
                and state.global_step % options.validation_steps == 0
            ):
                _validate(accelerator, parts, unwrapped, ema, e2e_names, params, state.global_step, is_fsdp)
                last_validated = state.global_step
            if fid is not None and fid.due(state.global_step):
                _validation_fid(accelerator, parts, fid, unwrapped, ema, e2e_names, params, state.global_step, is_fsdp)
                last_fid = state.global_step
            if on_step_end is not None:
                on_step_end(state.global_step, logs)
            stop.step = state.global_step
            if state.global_step < total and (signum := stop.requested(accelerator)):
                progress.close()
                if checkpoint is None:
                    checkpoint = save_checkpoint(
                        accelerator, output_dir, state.global_step, options.checkpoints_total_limit
                    )
                raise TrainingInterrupted(signum, state.global_step, checkpoint)
    progress.close()

    # ---- final outputs
    if options.checkpointing_steps:
        save_checkpoint(accelerator, output_dir, state.global_step, options.checkpoints_total_limit)
    final = _save_final(accelerator, parts, prepared, unwrapped, ema, e2e_names, params, is_fsdp)
    if parts.validate is not None and last_validated != state.global_step:
        _validate(accelerator, parts, unwrapped, ema, e2e_names, params, state.global_step, is_fsdp)
    if fid is not None and last_fid != state.global_step:
        _validation_fid(accelerator, parts, fid, unwrapped, ema, e2e_names, params, state.global_step, is_fsdp)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return final


def _stage_at(step: int, transfer_steps: int) -> str:
    """The stage optimizer step ``step`` belongs to: ``"transfer"`` (attention transfer) or ``"train"``."""
    return "transfer" if step < transfer_steps else "train"


def _enter_stage(
    stage: str, model: nn.Module, union: set[str], transfer_names: list[str], e2e_names: list[str], checkpointing: bool
) -> None:
    """Freeze what the stage does not train; no activation checkpointing while distilling layer by layer."""
    active = set(transfer_names if stage == "transfer" else e2e_names)
    for name, param in model.named_parameters():
        if name in union:
            param.requires_grad_(name in active)
    if stage == "transfer":
        model.disable_gradient_checkpointing()
    elif checkpointing:
        model.enable_gradient_checkpointing()


def _with_ema(ema, params: dict, names: list[str]):
    """Context: the EMA weights in the model inside, the trained weights back after."""
    stack = ExitStack()
    if ema is not None:
        tensors = [params[n] for n in names]
        ema.store(tensors)
        ema.copy_to(tensors)
        stack.callback(ema.restore, tensors)
    return stack


def _validate(
    accelerator, parts: TaskParts, unwrapped: nn.Module, ema, names, params, step: int, is_fsdp: bool
) -> None:
    if is_fsdp:
        logger.warning(
            "validation samples are skipped under FSDP (the local model holds shards); sample from a checkpoint"
        )
        return
    if accelerator.is_main_process:
        was_training = unwrapped.training
        unwrapped.eval()
        # the main process samples alone: the whole sequence, without the other processes of its group
        with _with_ema(ema, params, names), torch.no_grad(), accelerator.autocast(), context_parallel_paused(unwrapped):
            parts.validate(unwrapped, step)
        unwrapped.train(was_training)
    accelerator.wait_for_everyone()


def _validation_fid(
    accelerator,
    parts: TaskParts,
    fid: ValidationFID,
    unwrapped: nn.Module,
    ema,
    names,
    params,
    step: int,
    is_fsdp: bool,
) -> None:
    """FID / sFID of the model (EMA weights when there are) on every process; logged at ``step``."""
    if is_fsdp:
        logger.warning(
            "validation FID is skipped under FSDP (the local model holds shards); evaluate a checkpoint "
            "with `mhla eval-sample` and `mhla eval`"
        )
        return
    was_training = unwrapped.training
    unwrapped.eval()
    started = time.perf_counter()
    with _with_ema(ema, params, names):
        values = fid.run(accelerator, parts.fid_samples, unwrapped)
    unwrapped.train(was_training)
    if accelerator.is_main_process:
        logger.info(
            "step %d: FID %.4g, sFID %.4g (%d samples, %.1f s)",
            step,
            values["validation/fid"],
            values["validation/sfid"],
            fid.num_samples,
            time.perf_counter() - started,
        )
    accelerator.log(values, step=step)
    accelerator.wait_for_everyone()


def _save_final(accelerator, parts: TaskParts, prepared, unwrapped, ema, names, params, is_fsdp: bool) -> Path:
    accelerator.wait_for_everyone()
    unwrapped.disable_gradient_checkpointing()
    output: Path | None = None
    if is_fsdp:
        state_dict = accelerator.get_state_dict(prepared)  # gathered on the main process
        if accelerator.is_main_process:
            output = parts.save_final(_cpu_copy(unwrapped, state_dict), "final")
    elif accelerator.is_main_process:
        if ema is not None:
            parts.save_final(unwrapped, "final-no-ema")
        with _with_ema(ema, params, names):
            output = parts.save_final(unwrapped, "final")
            if parts.finish is not None:
                with context_parallel_paused(unwrapped):  # a copy of the model (fused LoRA) holds no process group
                    parts.finish(unwrapped)
    accelerator.wait_for_everyone()
    return output if output is not None else Path(accelerator.project_dir) / "final"


def _flat_config(options: dict[str, Any]) -> dict[str, Any]:
    """Tracker-friendly config: scalars only (lists and dicts as strings)."""
    return {k: v if isinstance(v, (int, float, str, bool)) or v is None else str(v) for k, v in options.items()}
