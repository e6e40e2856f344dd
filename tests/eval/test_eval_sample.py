"""The sampler for evaluation: labels, seeds, shards, resume after a kill, packing, the `eval-sample` command."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from helpers.cli import parse_eval_command as parse
from mhla_diffusion import MHLAConfig, convert_to_mhla, save_mhla
from mhla_diffusion.eval.sample import (
    MANIFEST_NAME,
    SamplingConfig,
    class_labels,
    pack_samples,
    sample_for_evaluation,
    sample_path,
    sample_seed,
    shard_indices,
    to_uint8,
)
from mhla_diffusion.models.tiny import tiny_dit_pipeline, tiny_dit_transformer

CONFIG = SamplingConfig(num_samples=7, num_classes=5, num_inference_steps=2, guidance_scale=1.5, pipeline="tiny-dit")
#: ``mhla eval-sample``'s options for :data:`CONFIG`'s samples (its guidance is the command's default).
SAMPLING = ("--num-samples", "7", "--num-classes", "5", "--num-inference-steps", "2", "--quiet")


def process(rank: int = 0, world: int = 1) -> SimpleNamespace:
    """What the sampler reads from accelerate's PartialState, for process ``rank`` of ``world``."""
    return SimpleNamespace(
        process_index=rank, num_processes=world, is_main_process=rank == 0, device=None, wait_for_everyone=lambda: None
    )


class KilledAfter:
    """A pipeline that dies (like a preempted job) on its ``calls + 1``-th call."""

    def __init__(self, pipe, calls: int) -> None:
        self.pipe, self.calls = pipe, calls

    def __call__(self, **kwargs):
        if self.calls == 0:
            raise RuntimeError("killed")
        self.calls -= 1
        return self.pipe(**kwargs)

    def to(self, device):
        return self


def pixels(folder: Path) -> dict[str, np.ndarray]:
    return {p.name: np.asarray(Image.open(p)) for p in sorted(folder.glob("*.png"))}


@pytest.fixture(scope="module")
def pipe():
    return tiny_dit_pipeline()


@pytest.fixture(scope="module")
def uninterrupted(pipe, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("full") / "samples"
    assert sample_for_evaluation(pipe, folder, CONFIG, batch_size=3, state=process(), progress=False)["generated"] == 7
    return folder


def test_class_labels_uniform_and_balanced():
    uniform = class_labels(2000, 10, "uniform", seed=0)
    assert uniform.dtype == np.int64 and uniform.min() == 0 and uniform.max() == 9
    np.testing.assert_array_equal(uniform, class_labels(2000, 10, "uniform", seed=0))
    assert not np.array_equal(uniform, class_labels(2000, 10, "uniform", seed=1))
    balanced = class_labels(1003, 10, "balanced", seed=0)
    counts = np.bincount(balanced, minlength=10)
    assert counts.max() - counts.min() <= 1 and counts.sum() == 1003
    assert (np.diff(balanced) < 0).any()  # shuffled: not sorted by class (the IS split pitfall)
    with pytest.raises(ValueError, match="class mode"):
        class_labels(10, 2, "sorted")


def test_per_sample_seeds_and_shards():
    seeds = {sample_seed(s, i) for s in range(3) for i in range(1000)}
    assert len(seeds) == 3000
    shards = [list(shard_indices(10, r, 3)) for r in range(3)]
    assert sorted(sum(shards, [])) == list(range(10)) and shards[1] == [1, 4, 7]


def test_pixel_rounding_follows_dit():
    x = np.array([[[[0.0, 0.5 / 255, 1.49 / 255]]], [[[1.0, 1.2, -0.1]]]])
    np.testing.assert_array_equal(to_uint8(x).reshape(-1), [0, 1, 1, 255, 255, 0])
    image = Image.fromarray(np.full((2, 3), 7, np.uint8))
    assert to_uint8([image]).shape == (1, 2, 3, 3)


def test_killed_run_resumes_to_the_same_samples(pipe, uninterrupted, tmp_path):
    folder = tmp_path / "samples"
    with pytest.raises(RuntimeError, match="killed"):
        sample_for_evaluation(KilledAfter(pipe, calls=1), folder, CONFIG, batch_size=2, state=process(), progress=False)
    before = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in folder.glob("*.png")}
    assert sorted(before) == ["000000.png", "000001.png"]
    counts = sample_for_evaluation(pipe, folder, CONFIG, batch_size=4, state=process(), progress=False)
    assert counts == {"owned": 7, "existing": 2, "generated": 5}
    for name, (mtime, data) in before.items():  # finished samples are not redone
        assert (folder / name).stat().st_mtime_ns == mtime and (folder / name).read_bytes() == data
    resumed, reference = pixels(folder), pixels(uninterrupted)
    assert sorted(resumed) == sorted(reference) == [f"{i:06d}.png" for i in range(7)]
    for name in reference:
        np.testing.assert_array_equal(resumed[name], reference[name])
    assert not list(folder.glob(".*"))  # no temporary files left behind


def test_deleted_samples_are_regenerated_identically(pipe, uninterrupted, tmp_path):
    folder = tmp_path / "copy"
    shutil.copytree(uninterrupted, folder)
    for i in (1, 5):
        sample_path(folder, i, CONFIG.num_samples).unlink()
    counts = sample_for_evaluation(pipe, folder, CONFIG, batch_size=1, state=process(), progress=False)
    assert counts["generated"] == 2
    for name, image in pixels(uninterrupted).items():
        np.testing.assert_array_equal(pixels(folder)[name], image)


def test_processes_split_the_work_and_agree_with_one_process(pipe, uninterrupted, tmp_path):
    folder = tmp_path / "sharded"
    done = [
        sample_for_evaluation(pipe, folder, CONFIG, batch_size=2, state=process(rank, 3), progress=False)
        for rank in range(3)
    ]
    assert [d["generated"] for d in done] == [3, 2, 2]
    for name, image in pixels(uninterrupted).items():
        np.testing.assert_array_equal(pixels(folder)[name], image)


def test_other_settings_in_the_same_folder_are_refused(pipe, uninterrupted):
    other = dataclasses.replace(CONFIG, seed=1)
    with pytest.raises(ValueError, match="other settings \\(seed: folder has 0, asked 1\\)"):
        sample_for_evaluation(pipe, uninterrupted, other, state=process(), progress=False)


def test_pack_streams_samples_and_labels_into_an_adm_npz(uninterrupted, tmp_path):
    out = pack_samples(uninterrupted, tmp_path / "packed.npz", progress=False)
    with np.load(out) as data:
        images, labels = data["arr_0"], data["arr_1"]
    assert images.shape == (7, 16, 16, 3) and images.dtype == np.uint8
    np.testing.assert_array_equal(images, np.stack(list(pixels(uninterrupted).values())))
    np.testing.assert_array_equal(labels, class_labels(7, 5, "uniform", 0))
    with pytest.raises(FileExistsError):
        pack_samples(uninterrupted, out, progress=False)


def test_pack_refuses_an_incomplete_folder(uninterrupted, tmp_path):
    folder = tmp_path / "partial"
    shutil.copytree(uninterrupted, folder)
    sample_path(folder, 3, 7).unlink()
    with pytest.raises(ValueError, match="1 of 7 samples are missing .*000003.png"):
        pack_samples(folder, progress=False)
    assert not (tmp_path / "partial.npz").exists()


def test_eval_sample_command_with_mhla_weights(pipe, uninterrupted, tmp_path, capsys):
    pipe.save_pretrained(tmp_path / "pipeline")
    mhla = tiny_dit_transformer()
    convert_to_mhla(mhla, MHLAConfig())
    with torch.no_grad():  # move the MHLA output away from the softmax one so the weights visibly matter
        for name, param in mhla.named_parameters():
            if "processor" in name:
                param.add_(0.5)
    save_mhla(mhla, tmp_path / "mhla")

    base = ["eval-sample", "--pipeline", str(tmp_path / "pipeline"), *SAMPLING, "--batch-size", "4"]
    args = parse(base + ["--output-dir", str(tmp_path / "softmax")])
    assert args.func(args) == 0
    with np.load(tmp_path / "softmax.npz") as data:
        softmax = data["arr_0"]
    np.testing.assert_array_equal(softmax, np.stack(list(pixels(uninterrupted).values())))

    args = parse(base + ["--output-dir", str(tmp_path / "mhla_samples"), "--mhla-weights", str(tmp_path / "mhla")])
    assert args.func(args) == 0
    assert "wrote" in capsys.readouterr().out
    manifest = json.loads((tmp_path / "mhla_samples" / MANIFEST_NAME).read_text())
    assert manifest["mhla_weights"] == str((tmp_path / "mhla").resolve())
    with np.load(tmp_path / "mhla_samples.npz") as data:
        assert data["arr_0"].shape == (7, 16, 16, 3)
        assert not np.array_equal(data["arr_0"], softmax)
    with pytest.raises(FileExistsError, match="mhla_samples.npz already exists"):
        args.func(args)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("torchrun") is None or not torch.distributed.is_available(), reason="needs torchrun")
def test_two_real_processes_share_the_samples_and_resume(pipe, uninterrupted, tmp_path):
    """torchrun (what `accelerate launch --multi_gpu` runs) with 2 CPU processes on the gloo backend."""
    pipe.save_pretrained(tmp_path / "pipeline")
    out = tmp_path / "samples"
    command = [
        "torchrun",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "mhla_diffusion.eval",
        "eval-sample",
        "--pipeline",
        str(tmp_path / "pipeline"),
        "--output-dir",
        str(out),
        *SAMPLING,
        "--batch-size",
        "2",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    sample_path(out, 4, 7).parent.mkdir(parents=True)
    config = dataclasses.replace(CONFIG, pipeline=str((tmp_path / "pipeline").resolve()))
    (out / MANIFEST_NAME).write_text(json.dumps(config.manifest()))
    for i in (0, 3):  # left by an earlier, killed run
        shutil.copy(sample_path(uninterrupted, i, 7), sample_path(out, i, 7))
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert "process 0/2: 3 generated, 1 already there" in run.stdout  # rank 0 owns 0, 2, 4, 6
    assert "process 1/2: 2 generated, 1 already there" in run.stdout  # rank 1 owns 1, 3, 5
    with np.load(tmp_path / "samples.npz") as data:
        np.testing.assert_array_equal(data["arr_0"], np.stack(list(pixels(uninterrupted).values())))
