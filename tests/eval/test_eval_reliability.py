"""Evaluation never scores garbage silently: image pixel formats, the Inception dtype, Inception Score
warnings, ADM's float16 precision/recall distances, and unreadable weights files."""

from __future__ import annotations

import json
import struct
import zlib

import numpy as np
import pytest
import torch
from PIL import Image

from helpers.cli import parse_eval_command as parse
from helpers.media import random_images, smooth_images, write_folder
from mhla_diffusion.eval import ArrayImages, FolderImages, Reference, evaluate
from mhla_diffusion.eval.inception import InceptionV3Features, load_inception_state_dict
from mhla_diffusion.eval.precision_recall import precision_recall
from mhla_diffusion.pipelines.outputs import float_to_uint8


def read_all(source) -> np.ndarray:
    return np.concatenate(list(source.iter_batches(64)))


# ------------------------------------------------------------------------------------- pixel formats


def test_16_bit_greyscale_png_is_scaled_not_clipped(tmp_path):
    values = np.linspace(0, 65535, 16 * 16).round().astype(np.uint16).reshape(16, 16)
    values[0, :4] = [128, 129, 385, 386]  # round(x / 257) boundaries: 0, 1, 1, 2
    Image.fromarray(values).save(tmp_path / "a.png")
    assert Image.open(tmp_path / "a.png").mode == "I;16"
    images = read_all(FolderImages(tmp_path))
    expected = np.rint(values / 257).astype(np.uint8)
    assert images.shape == (1, 16, 16, 3) and images.dtype == np.uint8
    for channel in range(3):
        np.testing.assert_array_equal(images[0, ..., channel], expected)
    assert len(np.unique(images)) > 200  # not 2 grey levels
    assert list(images[0, 0, :4, 0]) == [0, 1, 1, 2]


def write_png16(path, samples: np.ndarray) -> None:
    """A 16-bit RGB (3 channels) or RGBA (4) PNG, rows filtered with types 0-4 in turn (Pillow cannot write one)."""
    height, width, channels = samples.shape
    bpp = 2 * channels
    raw = [np.frombuffer(row.astype(">u2").tobytes(), np.uint8).astype(np.int64) for row in samples]
    lines = []
    for y, row in enumerate(raw):
        kind = y % 5
        up = raw[y - 1] if y else np.zeros_like(row)
        left = np.concatenate([np.zeros(bpp, np.int64), row[:-bpp]])
        upleft = np.concatenate([np.zeros(bpp, np.int64), up[:-bpp]])
        if kind == 4:  # Paeth
            pa, pb, pc = np.abs(up - upleft), np.abs(left - upleft), np.abs(left + up - 2 * upleft)
            pred = np.where((pa <= pb) & (pa <= pc), left, np.where(pb <= pc, up, upleft))
        else:
            pred = [np.zeros_like(row), left, up, (left + up) // 2][kind]
        lines.append(bytes([kind]) + ((row - pred) % 256).astype(np.uint8).tobytes())

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 16, 2 if channels == 3 else 6, 0, 0, 0)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b"".join(lines)))
        + chunk(b"IEND", b"")
    )


@pytest.mark.parametrize("channels", [3, 4])
def test_16_bit_rgb_png_is_scaled_by_257(tmp_path, channels):
    samples = np.random.default_rng(channels).integers(0, 65536, (10, 12, channels), dtype=np.uint16)
    samples[0, 0, :3] = [128, 129, 65535]  # -> 0, 1, 255 (Pillow's high byte: 0, 0, 255)
    write_png16(tmp_path / "a.png", samples)
    assert Image.open(tmp_path / "a.png").mode == ("RGB" if channels == 3 else "RGBA")
    images = read_all(FolderImages(tmp_path))
    np.testing.assert_array_equal(images[0], np.rint(samples[..., :3] / 257).astype(np.uint8))
    assert list(images[0, 0, 0]) == [0, 1, 255]


def test_float_tiff_in_unit_range_uses_the_project_rounding(tmp_path):
    values = np.random.default_rng(0).uniform(0, 1, (16, 16)).astype(np.float32)
    values[0, :3] = [0.0, 1.0, 0.5]
    Image.fromarray(values).save(tmp_path / "a.tif")
    assert Image.open(tmp_path / "a.tif").mode == "F"
    images = read_all(FolderImages(tmp_path))
    expected = float_to_uint8(values)
    np.testing.assert_array_equal(images[0], np.repeat(expected[..., None], 3, axis=2))
    assert images.max() == 255 and images.mean() > 100  # not black


@pytest.mark.parametrize("skip_corrupt", [False, True])
def test_float_tiff_outside_unit_range_is_refused_with_its_name(tmp_path, skip_corrupt):
    write_folder(tmp_path, random_images(3, 16))
    Image.fromarray(np.full((16, 16), 3.5, np.float32)).save(tmp_path / "hdr.tif")
    source = FolderImages(tmp_path, skip_corrupt=skip_corrupt)
    with pytest.raises(ValueError, match=r"hdr\.tif: float image with values in \[3\.5, 3\.5\].*\[0, 1\]"):
        read_all(source)


def test_32_bit_integer_images_are_refused_before_any_decoding(tmp_path):
    write_folder(tmp_path, random_images(2, 16))
    Image.fromarray(np.full((16, 16), 70000, np.int32)).save(tmp_path / "deep.tif")
    assert Image.open(tmp_path / "deep.tif").mode == "I"
    for skip in (False, True):
        with pytest.raises(ValueError, match=r"1 of 3 images .* cannot convert .*: deep\.tif \(I\)\..*convert them"):
            FolderImages(tmp_path, skip_corrupt=skip)


def test_eval_ref_refuses_an_unconvertible_image(tmp_path, weights_and_standin):
    folder = tmp_path / "imgs"
    write_folder(folder, random_images(4, 16))
    Image.fromarray(np.full((16, 16), -1.0, np.float32)).save(folder / "neg.tif")
    args = parse(
        [
            "eval-ref",
            "--images",
            str(folder),
            "--output",
            str(tmp_path / "ref.npz"),
            "--inception-weights",
            str(weights_and_standin),
            "--quiet",
        ]
    )
    with pytest.raises(ValueError, match=r"neg\.tif: float image"):
        args.func(args)
    assert not (tmp_path / "ref.npz").exists()


# -------------------------------------------------------------------------------- Inception dtype


def test_float64_inception_is_refused_because_torch_fidelity_runs_float32(tmp_path):
    from torch_fidelity.helpers import text_to_dtype

    # The reason (torch-fidelity 0.4): 'float64' silently means float32. If this changes, float64 can come back.
    assert text_to_dtype("float64", "float32") is torch.float32
    with pytest.raises(ValueError, match="internal_dtype must be 'float32'.*float32 only"):
        InceptionV3Features(tmp_path / "missing.pth", internal_dtype="float64")


# ------------------------------------------------------------------------- Inception Score warnings


def test_fewer_samples_than_one_split_are_flagged(standin):
    result = evaluate(
        ArrayImages(smooth_images(12)), Reference("ref", ArrayImages(random_images(12))), standin, progress=False
    )
    assert any("Inception Score over one split of 12 samples" in w for w in result["warnings"]), result["warnings"]


def test_class_grouping_is_flagged_in_any_class_order_only_with_several_splits(standin):
    reference = Reference("ref", ArrayImages(random_images(12)))
    grouped = np.repeat([2, 0, 1], 8)  # grouped by class, classes not in sorted order
    result = evaluate(ArrayImages(smooth_images(24), labels=grouped), reference, standin, split_size=6, progress=False)
    assert any("grouped by class label" in w for w in result["warnings"]), result["warnings"]
    # One split: order cannot change the score, so no grouping warning (even sorted).
    one_split = evaluate(
        ArrayImages(smooth_images(24), labels=np.sort(grouped)), reference, standin, split_size=24, progress=False
    )
    assert not any("class label" in w for w in one_split["warnings"]), one_split["warnings"]
    # Random order over several splits: no warning.
    shuffled = np.random.default_rng(0).permutation(np.repeat(np.arange(4), 6))
    mixed = evaluate(ArrayImages(smooth_images(24), labels=shuffled), reference, standin, split_size=6, progress=False)
    assert not any("class label" in w for w in mixed["warnings"]), mixed["warnings"]


# ---------------------------------------------------------------- precision/recall float16 (ADM)


def adm_float16_distances(u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """ADM's block in plain numpy: float16 values, float32 accumulation, ``max((|u|^2 - 2 u.v) + |v|^2, 0)``."""
    u16, v16 = u.astype(np.float16), v.astype(np.float16)
    norm_u = np.square(u16).astype(np.float32).sum(1).astype(np.float16)
    norm_v = np.square(v16).astype(np.float32).sum(1).astype(np.float16)
    dots = (u16.astype(np.float32) @ v16.astype(np.float32).T).astype(np.float16)
    return np.maximum((norm_u[:, None] - np.float16(2) * dots) + norm_v[None], np.float16(0))


def numpy_precision_recall(ref: np.ndarray, gen: np.ndarray, k: int = 3) -> tuple[float, float]:
    ref_radii = np.sort(adm_float16_distances(ref, ref), axis=1)[:, k]
    gen_radii = np.sort(adm_float16_distances(gen, gen), axis=1)[:, k]
    d = adm_float16_distances(ref, gen)  # (ref, gen)
    return float((d <= ref_radii[:, None]).any(0).mean()), float((d <= gen_radii[None]).any(1).mean())


def pr_features(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    # Large norms, small distances (like Inception pool features): float16 rounds the distances coarsely.
    rng = np.random.default_rng(seed)
    ref = (6 + 0.4 * rng.standard_normal((70, 64))).astype(np.float32)
    gen = (6.05 + 0.45 * rng.standard_normal((90, 64))).astype(np.float32)
    return ref, gen


def test_float16_precision_recall_matches_numpy_adm_reference_and_differs_from_float32():
    from mhla_diffusion.eval.precision_recall import _squared_distances

    ref, gen = pr_features()
    np.testing.assert_array_equal(
        _squared_distances(torch.from_numpy(ref), torch.from_numpy(gen), "float16").numpy(),
        adm_float16_distances(ref, gen).astype(np.float32),
    )
    half = precision_recall(ref, gen, distance_dtype="float16")
    full = precision_recall(ref, gen)
    assert half == numpy_precision_recall(ref, gen)
    assert half != full
    # Blocks give the same result.
    assert precision_recall(ref, gen, distance_dtype="float16", block_size=16) == half


def test_float16_blocks_that_overflow_fall_back_to_float32():
    ref, gen = pr_features()
    big = 300.0  # squared norms ~ 64 * 300^2 > 65504: float16 overflows, float32 is used (as ADM)
    assert precision_recall(ref * big, gen * big, distance_dtype="float16") == precision_recall(ref * big, gen * big)
    with pytest.raises(ValueError, match="distance_dtype"):
        precision_recall(ref, gen, distance_dtype="bfloat16")


def test_eval_command_pr_dtype_float16(tmp_path, weights_and_standin, capsys):
    samples = tmp_path / "samples.npz"
    np.savez(samples, smooth_images(24, seed=6))
    write_folder(tmp_path / "ref", random_images(30, seed=7))
    out = tmp_path / "out.json"
    args = parse(
        [
            "eval",
            "--samples",
            str(samples),
            "--ref",
            str(tmp_path / "ref"),
            "--inception-weights",
            str(weights_and_standin),
            "--pr-dtype",
            "float16",
            "--output",
            str(out),
            "--quiet",
        ]
    )
    assert args.func(args) == 0
    report = json.loads(out.read_text())
    assert report["settings"]["pr_dtype"] == "float16" and report["metrics"]["precision"] is not None
    default = parse(["eval", "--samples", str(samples), "--ref", str(tmp_path / "ref")])
    assert default.pr_dtype == "float32"


# ------------------------------------------------------------------------------ weights file errors


@pytest.mark.parametrize("head", [b"", b"\x80", b"PK\x03\x04", b"<html>"])
def test_random_bytes_as_weights_say_not_a_weights_file_without_torch_hints(tmp_path, head):
    path = tmp_path / "weights.pth"
    path.write_bytes(head + np.random.default_rng(1).integers(0, 256, 4000, dtype=np.uint8).tobytes())
    with pytest.raises(ValueError) as info:
        load_inception_state_dict(path)
    message = str(info.value)
    assert message.startswith(f"{path} is not a PyTorch weights file: ")
    assert "state dict of tensors saved with torch.save (.pth)" in message
    assert "weights_only" not in message and "Weights only" not in message and "arbitrary code" not in message
