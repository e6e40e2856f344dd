"""End to end with the stand-in network: evaluate(), reference files, and the `eval` / `eval-ref` commands."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from helpers.cli import parse_eval_command as parse
from helpers.features import StandInFeatures
from helpers.media import random_images, smooth_images, write_folder
from mhla_diffusion.eval import ArrayImages, Reference, evaluate, load_reference, make_reference
from mhla_diffusion.eval.frechet import frechet_distance, gaussian_stats
from mhla_diffusion.eval.inception import INCEPTION_WEIGHTS_ENV
from mhla_diffusion.eval.inception_score import inception_score
from mhla_diffusion.eval.npz import AdmNpzWriter


def features_of(net: StandInFeatures, images: np.ndarray) -> dict[str, np.ndarray]:
    with torch.no_grad():
        out = net(torch.from_numpy(images).permute(0, 3, 1, 2))
    return {
        "pool": out["pool"].double().numpy(),
        "spatial": out["spatial"].reshape(len(images), -1).double().numpy(),
        "logits": out["logits_unbiased"].double().numpy(),
    }


def test_identical_sets_score_zero_distance_and_full_coverage(standin):
    # More images than sFID dimensions (112): with rank-deficient covariances the round-off of the zero
    # eigenvalues enters through their square roots (~1e-7 here), as it does for scipy's sqrtm.
    images = smooth_images(130, seed=0)
    result = evaluate(
        ArrayImages(images), Reference("same", ArrayImages(images.copy())), standin, batch_size=32, progress=False
    )
    m = result["metrics"]
    assert abs(m["fid"]) < 1e-9 and abs(m["sfid"]) < 1e-7
    assert (m["precision"], m["recall"]) == (1.0, 1.0)
    assert result["samples"]["count"] == 130 and result["reference"]["images"] == 130


def test_metrics_equal_an_independent_adm_style_computation(standin):
    """np.cov statistics of the features of each whole set, ADM's way, against the streamed pipeline."""
    gen, ref = smooth_images(45, seed=1), random_images(50, seed=2)
    result = evaluate(
        ArrayImages(gen), Reference("ref", ArrayImages(ref)), standin, batch_size=7, split_size=20, progress=False
    )
    fg, fr = features_of(standin, gen), features_of(standin, ref)
    m = result["metrics"]
    assert m["fid"] == pytest.approx(frechet_distance(gaussian_stats(fg["pool"]), gaussian_stats(fr["pool"])), rel=1e-6)
    assert m["sfid"] == pytest.approx(
        frechet_distance(gaussian_stats(fg["spatial"]), gaussian_stats(fr["spatial"])), rel=1e-6
    )
    assert m["inception_score"] == pytest.approx(inception_score(fg["logits"], split_size=20), rel=1e-6)
    assert m["fid"] > 0.1 and 0 <= m["precision"] < 1


def test_reference_file_round_trip_gives_the_same_distances(standin, tmp_path):
    gen, ref = smooth_images(30, seed=3), random_images(36, seed=4)
    write_folder(tmp_path / "ref_images", ref)
    ref_npz = tmp_path / "ref.npz"
    summary = make_reference(
        load_reference(tmp_path / "ref_images").images, standin, ref_npz, pr_images=10, batch_size=8, progress=False
    )
    assert summary["images"] == 36 and summary["arr_0"] == 10
    with np.load(ref_npz) as data:
        assert (
            data["arr_0"].shape == (10, 16, 16, 3) and data["mu"].shape == (16,) and data["sigma_s"].shape == (112, 112)
        )
        subset = data["arr_0"]
    assert all(any((img == r).all() for r in ref) for img in subset)  # the subset holds reference images

    # the same batch size as the file's: a CPU's convolution kernels may round a feature differently in another
    # batch size (FIDs 1.3e-9 apart relative, measured on an AMD EPYC), which is not what this test is about
    from_folder = evaluate(
        ArrayImages(gen), load_reference(tmp_path / "ref_images"), standin, batch_size=8, progress=False
    )
    from_file = evaluate(ArrayImages(gen), load_reference(ref_npz), standin, batch_size=8, progress=False)
    assert from_file["reference"]["statistics"] == "stored in the file"
    for key in ("fid", "sfid", "inception_score"):
        assert from_file["metrics"][key] == pytest.approx(from_folder["metrics"][key], rel=1e-9)
    assert from_file["reference"]["images"] == 10  # P/R used arr_0 only
    with pytest.raises(FileExistsError):
        make_reference(ArrayImages(ref), standin, ref_npz, progress=False)


def test_statistics_only_reference_skips_precision_recall(standin, tmp_path):
    ref = random_images(20, seed=5)
    path = tmp_path / "stats.npz"
    make_reference(ArrayImages(ref), standin, path, pr_images=0, progress=False)
    reference = load_reference(path)
    assert reference.images is None
    result = evaluate(ArrayImages(smooth_images(20)), reference, standin, progress=False)
    assert result["metrics"]["precision"] is None and result["metrics"]["fid"] > 0
    assert any("precision/recall skipped" in w for w in result["warnings"])


def test_stored_statistics_of_another_network_are_refused_before_any_work(tmp_path):
    path = tmp_path / "adm_ref.npz"
    np.savez(path, mu=np.zeros(2048), sigma=np.eye(2048), mu_s=np.zeros(2023), sigma_s=np.eye(2023))

    class Exploding(StandInFeatures):
        def forward(self, images):
            raise AssertionError("no image may be processed")

    with pytest.raises(ValueError, match="stored fid statistics are 2048-d but the feature network gives 16-d"):
        evaluate(ArrayImages(random_images(10)), load_reference(path), Exploding(), progress=False)


def test_class_sorted_samples_are_flagged(standin, tmp_path):
    path = tmp_path / "sorted.npz"
    with AdmNpzWriter(path) as writer:
        writer.begin_images(12, (16, 16))
        writer.write_images(smooth_images(12))
        writer.add_array("arr_1", np.repeat([0, 1, 2], 4))
    result = evaluate(
        load_reference(path).images,
        Reference("ref", ArrayImages(random_images(12))),
        standin,
        split_size=4,
        progress=False,
    )
    assert any("grouped by class label" in w for w in result["warnings"])


# ----------------------------------------------------------------------------------------------- CLI


@pytest.fixture
def cli_setup(tmp_path, weights_and_standin):
    """Samples (.npz), reference (folder), a weights file, and the stand-in in place of Inception."""
    samples = tmp_path / "samples.npz"
    np.savez(samples, smooth_images(24, seed=6))
    write_folder(tmp_path / "ref", random_images(30, seed=7))
    return samples, tmp_path / "ref", weights_and_standin


def test_eval_command_prints_a_table_and_writes_json(cli_setup, tmp_path, capsys):
    samples, ref, weights = cli_setup
    base = ["eval", "--samples", str(samples), "--ref", str(ref), "--inception-weights", str(weights), "--quiet"]
    args = parse([*base, "--batch-size", "8"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    for label in ("Inception Score", "FID", "sFID", "Precision", "Recall", "samples: 24"):
        assert label in out
    report = json.loads((tmp_path / "samples_eval.json").read_text())
    direct = evaluate(
        load_reference(samples).images, load_reference(ref), StandInFeatures(), batch_size=8, progress=False
    )
    for key, value in direct["metrics"].items():
        assert report["metrics"][key] == pytest.approx(value, rel=1e-9)
        assert f"{value:.4f}" in out
    assert report["settings"]["batch_size"] == 8 and report["feature_extractor"]["name"] == "stand-in"

    with pytest.raises(FileExistsError, match="--overwrite"):
        args.func(args)
    again = parse([*base, "--overwrite", "--no-pr", "--output", str(tmp_path / "out" / "m.json")])
    assert again.func(again) == 0
    assert json.loads((tmp_path / "out" / "m.json").read_text())["metrics"]["precision"] is None


def test_eval_command_missing_weights_fails_before_reading_images(cli_setup, tmp_path, monkeypatch):
    samples, ref, _ = cli_setup
    monkeypatch.delenv(INCEPTION_WEIGHTS_ENV, raising=False)
    (ref / "00003.png").write_bytes(b"corrupt")  # would be reported if images were read first
    args = parse(["eval", "--samples", str(samples), "--ref", str(ref), "--quiet"])
    with pytest.raises(FileNotFoundError, match="weights-inception-2015-12-05-6726825d.pth"):
        args.func(args)


def test_eval_command_corrupt_reference_images(cli_setup, tmp_path, capsys):
    samples, ref, weights = cli_setup
    (ref / "00003.png").write_bytes(b"corrupt")
    base = ["eval", "--samples", str(samples), "--ref", str(ref), "--inception-weights", str(weights), "--quiet"]
    args = parse(base)
    with pytest.raises(ValueError, match="1 of 30 images .* cannot be read: 00003.png"):
        args.func(args)
    assert not (tmp_path / "samples_eval.json").exists()
    args = parse(base + ["--skip-corrupt"])
    assert args.func(args) == 0
    assert "skipped 1 unreadable reference images: 00003.png" in capsys.readouterr().out
    report = json.loads((tmp_path / "samples_eval.json").read_text())
    assert report["reference"]["skipped"] == ["00003.png"] and report["reference"]["images"] == 29


def test_eval_ref_command_writes_a_reference_and_refuses_to_overwrite(cli_setup, tmp_path, capsys):
    _, ref, weights = cli_setup
    out = tmp_path / "my_ref.npz"
    args = parse(
        [
            "eval-ref",
            "--images",
            str(ref),
            "--output",
            str(out),
            "--inception-weights",
            str(weights),
            "--pr-images",
            "5",
            "--quiet",
        ]
    )
    assert args.func(args) == 0
    assert "over 30 images, 5 images as arr_0" in capsys.readouterr().out
    reference = load_reference(out)
    assert set(reference.stats) == {"fid", "sfid"} and len(reference.images) == 5
    with pytest.raises(FileExistsError):
        args.func(args)


def test_eval_command_rejects_missing_inputs(cli_setup, tmp_path):
    _, ref, weights = cli_setup
    args = parse(
        ["eval", "--samples", str(tmp_path / "nope.npz"), "--ref", str(ref), "--inception-weights", str(weights)]
    )
    with pytest.raises(FileNotFoundError, match="--samples .*nope.npz does not exist"):
        args.func(args)
    with pytest.raises(SystemExit):
        parse(["eval", "--samples", "x", "--ref", "y", "--batch-size", "0"])
