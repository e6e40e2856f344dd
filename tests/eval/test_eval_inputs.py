"""Inputs: ADM .npz reading/writing (streamed), folders of images, corrupt-file handling."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from helpers.media import random_images, write_folder
from mhla_diffusion.eval.frechet import GaussianStats
from mhla_diffusion.eval.images import ArrayImages, FolderImages, NpzImages, open_images
from mhla_diffusion.eval.npz import AdmNpzWriter, iter_npz_batches, npz_array_info, read_npz_stats


def test_writer_streams_an_npz_that_numpy_reads_back(tmp_path):
    images = random_images(7, size=(5, 6), seed=1)
    labels = np.arange(7) % 3
    path = tmp_path / "samples.npz"
    with AdmNpzWriter(path) as writer:
        writer.begin_images(7, (5, 6))
        writer.write_images(images[:3])
        writer.write_images(images[3:])
        writer.add_array("arr_1", labels)
    with np.load(path) as data:
        np.testing.assert_array_equal(data["arr_0"], images)
        np.testing.assert_array_equal(data["arr_1"], labels)
    info = npz_array_info(path)
    assert info.shape == (7, 5, 6, 3) and info.dtype == np.uint8
    batches = list(iter_npz_batches(path, batch_size=3))
    assert [len(b) for b in batches] == [3, 3, 1]
    np.testing.assert_array_equal(np.concatenate(batches), images)


def test_compressed_npz_from_numpy_is_streamed_too(tmp_path):
    images = random_images(5, size=4, seed=2)
    path = tmp_path / "compressed.npz"
    np.savez_compressed(path, images)
    source = open_images(path)
    assert isinstance(source, NpzImages) and len(source) == 5 and source.image_size == (4, 4)
    np.testing.assert_array_equal(np.concatenate(list(source.iter_batches(2))), images)


def test_reference_statistics_round_trip(tmp_path):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(30, 4))
    fid = GaussianStats(x.mean(0), np.cov(x, rowvar=False))
    sfid = GaussianStats(x[:, :2].mean(0), np.cov(x[:, :2], rowvar=False))
    path = tmp_path / "ref.npz"
    np.savez(path, mu=fid.mu, sigma=fid.sigma, mu_s=sfid.mu, sigma_s=sfid.sigma)
    stats = read_npz_stats(path)
    np.testing.assert_array_equal(stats["fid"].sigma, fid.sigma)
    np.testing.assert_array_equal(stats["sfid"].mu, sfid.mu)
    half = tmp_path / "half.npz"
    np.savez(half, mu=fid.mu)
    with pytest.raises(ValueError, match="only one of mu and sigma"):
        read_npz_stats(half)


def test_writer_never_overwrites_and_leaves_nothing_on_failure(tmp_path):
    path = tmp_path / "out.npz"
    path.write_bytes(b"user data")
    with pytest.raises(FileExistsError, match="already exists"):
        AdmNpzWriter(path)
    assert path.read_bytes() == b"user data"
    fresh = tmp_path / "fresh.npz"
    with pytest.raises(ValueError, match="2 images written, 3 announced"):
        with AdmNpzWriter(fresh) as writer:
            writer.begin_images(3, (4, 4))
            writer.write_images(random_images(2, size=4))
    assert list(tmp_path.iterdir()) == [path]
    with pytest.raises(ValueError, match="uint8 images of shape"):
        with AdmNpzWriter(fresh) as writer:
            writer.begin_images(1, (4, 4))
            writer.write_images(np.zeros((1, 4, 4, 3), np.float32))


def test_npz_images_must_be_uint8_nhwc(tmp_path):
    floats = tmp_path / "floats.npz"
    np.savez(floats, np.zeros((2, 4, 4, 3), np.float32))
    with pytest.raises(ValueError, match="dtype float32.*uint8"):
        open_images(floats)
    nchw = tmp_path / "nchw.npz"
    np.savez(nchw, np.zeros((2, 3, 4, 4), np.uint8))
    with pytest.raises(ValueError, match=r"\(N, H, W, 3\) \(NHWC\)"):
        open_images(nchw)
    stats_only = tmp_path / "stats.npz"
    np.savez(stats_only, mu=np.zeros(2))
    with pytest.raises(ValueError, match="no images \\(arr_0\\)"):
        NpzImages(stats_only)
    not_zip = tmp_path / "broken.npz"
    not_zip.write_bytes(b"nope")
    with pytest.raises(ValueError, match="not a zip archive"):
        open_images(not_zip)


def test_folder_images_in_name_order_as_rgb(tmp_path):
    images = random_images(5, size=(6, 8), seed=4)
    write_folder(tmp_path / "imgs", images)
    Image.fromarray(images[0, :, :, 0]).save(tmp_path / "imgs" / "00005.png")  # grayscale -> RGB
    (tmp_path / "imgs" / ".00001.png.123.tmp").write_bytes(b"partial")  # hidden: ignored
    (tmp_path / "imgs" / "notes.txt").write_text("not an image")
    source = open_images(tmp_path / "imgs")
    assert isinstance(source, FolderImages) and len(source) == 6 and source.image_size == (6, 8)
    read = np.concatenate(list(source.iter_batches(4)))
    np.testing.assert_array_equal(read[:5], images)
    np.testing.assert_array_equal(read[5], np.repeat(images[0, :, :, :1], 3, axis=2))


def make_corrupt_folder(folder):
    write_folder(folder, random_images(4, size=8, seed=5))
    (folder / "00001.png").write_bytes(b"not a png at all")
    data = (folder / "00003.png").read_bytes()
    (folder / "00003.png").write_bytes(data[: len(data) // 2])  # truncated


def test_corrupt_images_are_an_error_that_lists_them(tmp_path):
    make_corrupt_folder(tmp_path / "imgs")
    with pytest.raises(ValueError) as error:
        open_images(tmp_path / "imgs")
    message = str(error.value)
    assert "2 of 4 images" in message and "00001.png" in message and "00003.png" in message
    assert "--skip-corrupt" in message


def test_corrupt_images_are_skipped_and_reported_with_the_flag(tmp_path, caplog):
    make_corrupt_folder(tmp_path / "imgs")
    source = open_images(tmp_path / "imgs", skip_corrupt=True)
    assert len(source) == 2 and source.skipped == ["00001.png", "00003.png"]
    assert "skipping 2 unreadable images" in caplog.text
    assert sum(len(b) for b in source.iter_batches(8)) == 2


def test_folder_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        open_images(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no image files"):
        open_images(tmp_path / "empty")
    write_folder(tmp_path / "mixed", random_images(2, size=8))
    Image.fromarray(random_images(1, size=(8, 9))[0]).save(tmp_path / "mixed" / "zz.png")
    with pytest.raises(ValueError, match="different sizes.*8x8 \\(2 images\\), 8x9 \\(1 images\\)"):
        open_images(tmp_path / "mixed")
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(ValueError, match="folder of images or an ADM .npz"):
        open_images(tmp_path / "file.txt")


def test_array_images_validate():
    with pytest.raises(ValueError, match="uint8 images"):
        ArrayImages(np.zeros((2, 4, 4, 3), np.float32))
    source = ArrayImages(random_images(5, size=4))
    assert [len(b) for b in source.iter_batches(2)] == [2, 2, 1]
