"""Run-folder rules and atomic checkpoints, without training."""

from __future__ import annotations

import os

import pytest
import torch

from mhla_diffusion import MHLAConfig, convert_to_mhla
from mhla_diffusion.finetune.checkpointing import (
    RUN_CONFIG,
    check_run_dir,
    list_checkpoints,
    resolve_resume,
    save_checkpoint,
)
from mhla_diffusion.finetune.engine import _cpu_copy, clean_parameter_name, step_generator
from mhla_diffusion.finetune.trainable import add_lora, set_trainable
from mhla_diffusion.models.tiny import tiny_wan_transformer


class FakeAccelerator:
    """What save_checkpoint uses of an Accelerator; ``save_state`` writes a file, or fails half-way."""

    is_main_process = True

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail

    def wait_for_everyone(self) -> None:
        pass

    def save_state(self, folder: str) -> None:
        from pathlib import Path

        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / "model.safetensors").write_text("weights")
        if self.fail:
            raise KeyboardInterrupt


def test_checkpoints_are_atomic_and_pruned(tmp_path):
    for step in (2, 4, 6):
        save_checkpoint(FakeAccelerator(), tmp_path, step, total_limit=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [4, 6]
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(FakeAccelerator(fail=True), tmp_path, 8, total_limit=2)
    assert (tmp_path / "checkpoints" / ".tmp-step-00000008").is_dir()  # the half-written one ...
    assert resolve_resume(tmp_path, "latest").name == "step-00000006"  # ... is never resumed from
    save_checkpoint(FakeAccelerator(), tmp_path, 8, total_limit=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [6, 8]
    assert not (tmp_path / "checkpoints" / ".tmp-step-00000008").exists()
    save_checkpoint(FakeAccelerator(), tmp_path, 6, total_limit=None)  # re-saving a step replaces it
    assert [s for s, _ in list_checkpoints(tmp_path)] == [6, 8]
    assert resolve_resume(tmp_path, None) is None


def test_run_dir_modes(tmp_path):
    assert check_run_dir(tmp_path / "new", None, False) == "new"
    run = tmp_path / "run"
    run.mkdir()
    assert check_run_dir(run, None, False) == "new"  # empty
    (run / "cache").mkdir()
    assert check_run_dir(run, None, False, ignore=("cache",)) == "new"
    (run / RUN_CONFIG).write_text("seed: 1\n")
    with pytest.raises(FileExistsError, match="already holds a training run"):
        check_run_dir(run, None, False)
    assert check_run_dir(run, None, True) == "overwrite"
    assert check_run_dir(run, "latest", False) == "resume"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        check_run_dir(run, str(tmp_path / "nope"), False)
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError):
        check_run_dir(tmp_path / "file", None, False)


def test_cpu_copy_rebuilds_mhla_and_lora(tmp_path):
    model = tiny_wan_transformer(num_layers=2)
    convert_to_mhla(model, MHLAConfig(layout=(1, 2, 2), gate=True))
    add_lora(model, rank=2, alpha=2, target_modules=["to_q", "to_v"])
    assert set_trainable(model, "lora")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or ".processor." in name:
                p.add_(0.1)
    # FSDP-style names: a wrapper prefix on the root and on the wrapped block
    wrapped_names = {
        "_fsdp_wrapped_module." + k.replace("blocks.0.", "blocks.0._fsdp_wrapped_module.", 1): v
        for k, v in model.state_dict().items()
    }
    copy = _cpu_copy(model, wrapped_names)
    assert (
        clean_parameter_name("module._fsdp_wrapped_module.blocks.0.attn1.to_q.weight") == "blocks.0.attn1.to_q.weight"
    )
    inputs = dict(
        hidden_states=torch.randn(1, 16, 3, 4, 4),
        timestep=torch.tensor([10]),
        encoder_hidden_states=torch.randn(1, 5, 32),
    )
    with torch.no_grad():
        torch.testing.assert_close(copy.eval()(**inputs).sample, model.eval()(**inputs).sample)


def test_step_generators_depend_on_seed_process_step_and_micro_batch():
    draw = lambda *key: torch.rand(3, generator=step_generator(*key, torch.device("cpu")))  # noqa: E731
    assert torch.equal(draw(1, 0, 5, 0), draw(1, 0, 5, 0))
    others = [draw(2, 0, 5, 0), draw(1, 1, 5, 0), draw(1, 0, 6, 0), draw(1, 0, 5, 1)]
    assert all(not torch.equal(draw(1, 0, 5, 0), other) for other in others)


def _plant(root, name: str, content: str = "weights") -> None:
    (root / name).mkdir(parents=True)
    (root / name / "model.safetensors").write_text(content)


@pytest.mark.parametrize(
    "leftovers, kept",
    [
        ((".old-step-00000004",), {".old-step-00000004": "step-00000004"}),  # cut between the renames
        ((".old-step-00000004", "step-00000004"), {"step-00000004": "step-00000004"}),  # cut during the delete
        ((".tmp-step-00000004",), {}),  # cut while writing
        ((".old-step-00000004", ".tmp-step-00000004"), {".old-step-00000004": "step-00000004"}),
        ((".pruned-step-00000002",), {}),  # cut while pruning
    ],
)
def test_recovery_and_resave_tolerate_every_leftover(tmp_path, leftovers, kept):
    from mhla_diffusion.finetune.checkpointing import recover_checkpoints

    root = tmp_path / "checkpoints"
    for name in leftovers:
        _plant(root, name, content=name)
    actions = recover_checkpoints(tmp_path)
    assert len(actions) == sum(name.startswith(".") for name in leftovers)
    assert sorted(p.name for p in root.iterdir()) == sorted(kept.values())
    for planted, now in kept.items():
        assert (root / now / "model.safetensors").read_text() == planted  # the complete save is the one kept
    assert recover_checkpoints(tmp_path) == []

    for name in leftovers:  # the same leftovers planted again: a re-save goes through without recovery
        if not (root / name).exists():
            _plant(root, name, content=name)
    save_checkpoint(FakeAccelerator(), tmp_path, 4, total_limit=None)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [4]
    assert sorted(p.name for p in root.iterdir()) == sorted(["step-00000004"] + [n for n in leftovers if "pruned" in n])


def test_pruning_never_leaves_a_partial_checkpoint(tmp_path, monkeypatch):
    import shutil

    for step in (2, 4):
        save_checkpoint(FakeAccelerator(), tmp_path, step, total_limit=None)
    real_rmtree = shutil.rmtree

    def cut(path, *args, **kwargs):
        if "pruned" in str(path) and not kwargs.get("ignore_errors"):
            (path / "model.safetensors").unlink()  # half deleted, then killed
            raise KeyboardInterrupt
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", cut)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(FakeAccelerator(), tmp_path, 6, total_limit=2)
    monkeypatch.setattr(shutil, "rmtree", real_rmtree)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [4, 6]  # the half-deleted step 2 is not listed


def test_cache_leftovers_of_stopped_writers_are_removed(tmp_path):
    from mhla_diffusion.finetune.checkpointing import _alive
    from mhla_diffusion.finetune.latent_cache import remove_leftovers

    dead = 4_000_000  # a PID no process holds (Linux PIDs stay below pid_max, 4194304 at most)
    while _alive(dead):
        dead -= 1
    entry = tmp_path / "latents" / "ab"
    entry.mkdir(parents=True)
    (entry / "abc.safetensors").write_text("complete")
    (entry / f".abd.safetensors.{dead}.tmp").write_text("half")
    live = entry / f".abe.safetensors.{os.getpid()}.tmp"  # a run that shares the cache is still writing it
    live.write_text("being written")
    (tmp_path / f".index.json.{dead}.tmp").write_text("{")
    assert len(remove_leftovers(tmp_path)) == 2
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == sorted(["abc.safetensors", live.name])
