"""The judges' and VAEs' shared loop: batches are pure functions of the step, and a run killed after a
checkpoint and started again ends exactly where an uninterrupted run ends."""

from __future__ import annotations

import functools
import pathlib

import numpy as np
import pytest
import torch

from mhla_diffusion.embedded import generate_clips, tiny_video_vae, train_image_judge, train_video_vae
from mhla_diffusion.embedded.worlds.digits import split_digits
from mhla_diffusion.training.loop import LoopProgress, epoch_batch, run_loop, step_generator


class _Stop(Exception):
    pass


def _stop_at(step: int):
    def hook(done: int) -> None:
        if done == step:
            raise _Stop

    return hook


def test_epoch_batches_visit_every_item_once_per_epoch():
    batches = [epoch_batch(step, 4, 10, seed=3) for step in range(5)]  # 20 picks = two epochs of 10
    assert all(len(b) == 4 for b in batches)
    assert np.array_equal(np.bincount(np.concatenate(batches), minlength=10), np.full(10, 2))
    assert np.array_equal(epoch_batch(2, 4, 10, seed=3), batches[2])  # pure
    assert not np.array_equal(epoch_batch(0, 4, 10, seed=4), batches[0])
    assert torch.equal(torch.rand(3, generator=step_generator(0, 5)), torch.rand(3, generator=step_generator(0, 5)))


def _linear_run(tmp_path, progress):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))

    def loss_fn(step: int) -> torch.Tensor:
        x = torch.randn(8, 3, generator=step_generator(1, step))
        return (model(x) - x.sum(1, keepdim=True)).pow(2).mean()

    log = run_loop("linear", 7, loss_fn, model, optimizer, schedule, progress)
    assert log.seconds > 0
    return model, log.losses


def test_killed_loop_resumes_from_its_checkpoint_bit_identically(tmp_path):
    plain, plain_losses = _linear_run(tmp_path, None)
    checkpoint = tmp_path / "loop.pt"
    with pytest.raises(_Stop):
        _linear_run(tmp_path, LoopProgress(checkpoint, every=2, on_step=_stop_at(5)))
    saved = torch.load(checkpoint, weights_only=False)
    assert saved["step"] == 4 and saved["seconds"] > 0  # the last checkpoint before the kill, and its steps' time
    seen = []
    resumed, losses = _linear_run(tmp_path, LoopProgress(checkpoint, every=2, on_step=seen.append))
    assert seen == [5, 6, 7]  # continued inside the run, not from its start
    assert losses == plain_losses
    assert torch.equal(resumed.weight, plain.weight) and torch.equal(resumed.bias, plain.bias)
    assert not checkpoint.with_name("loop.pt.partial").exists()


def test_checkpoint_of_another_run_is_refused(tmp_path):
    checkpoint = tmp_path / "loop.pt"
    _linear_run(tmp_path, LoopProgress(checkpoint, every=3))
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    with pytest.raises(ValueError, match="another linear run"):
        run_loop("linear", 9, lambda step: model.weight.sum(), model, optimizer, schedule, LoopProgress(checkpoint))


def test_checkpoint_without_training_time_is_refused(tmp_path):
    checkpoint = tmp_path / "loop.pt"
    _linear_run(tmp_path, LoopProgress(checkpoint, every=3))
    state = torch.load(checkpoint, weights_only=False)
    del state["seconds"]  # as the loop wrote it before it kept its training time
    torch.save(state, checkpoint)
    with pytest.raises(ValueError, match="older version"):
        _linear_run(tmp_path, LoopProgress(checkpoint, every=3))


@pytest.mark.slow
def test_video_vae_and_judge_resume_bit_identically(tmp_path):
    clips, _, _ = generate_clips(3, seed=3)
    clips = np.ascontiguousarray(clips[:, :5, ::2, ::2])

    def vae_run(progress):
        vae = tiny_video_vae(seed=1, dim_mult=[1, 2, 4], temperal_downsample=[True, True], z_dim=4)
        losses = train_video_vae(
            vae, clips, steps=4, batch_size=2, seed=0, crop_frames=5, crop_size=24, progress=progress
        )
        return vae, losses

    plain, plain_losses = vae_run(None)
    with pytest.raises(_Stop):
        vae_run(LoopProgress(tmp_path / "vae.pt", every=1, on_step=_stop_at(2)))
    resumed, losses = vae_run(LoopProgress(tmp_path / "vae.pt", every=1))
    assert losses == plain_losses
    for (name, a), b in zip(plain.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    assert resumed.config.latents_mean == plain.config.latents_mean

    split = split_digits(seed=0)
    images, labels = split.train_images[:64], split.train_labels[:64]
    judge_run = functools.partial(train_image_judge, images, labels, steps=4, batch_size=16, width=8, embed_dim=16)
    judge = judge_run()
    with pytest.raises(_Stop):
        judge_run(progress=LoopProgress(tmp_path / "judge.pt", every=1, on_step=_stop_at(3)))
    again = judge_run(progress=LoopProgress(tmp_path / "judge.pt", every=1))
    for a, b in zip(judge.state_dict().values(), again.state_dict().values()):
        assert torch.equal(a, b)


def test_a_damaged_or_foreign_checkpoint_is_one_line_and_never_unpickled(tmp_path):
    checkpoint = tmp_path / "loop.pt"
    _linear_run(tmp_path, LoopProgress(checkpoint, every=3))
    state = torch.load(checkpoint, weights_only=True)
    checkpoint.write_bytes(checkpoint.read_bytes()[:200])  # a kill or a full disk mid-copy
    with pytest.raises(ValueError, match=f"{checkpoint} is not a readable PyTorch/safetensors checkpoint"):
        _linear_run(tmp_path, LoopProgress(checkpoint, every=3))
    torch.save(dict(state, note=pathlib.PurePosixPath("not/a/tensor")), checkpoint)
    with pytest.raises(ValueError, match="holds objects other than tensors and plain values"):
        _linear_run(tmp_path, LoopProgress(checkpoint, every=3))
