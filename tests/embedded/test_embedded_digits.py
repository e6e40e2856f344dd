"""scikit-learn digits as a class-to-image folder: split determinism and the DiT trainer's format."""

from __future__ import annotations

import numpy as np
import pytest

from mhla_diffusion.embedded import NUM_DIGIT_CLASSES, split_digits, write_digits_folder
from mhla_diffusion.finetune.image_data import ClassImageDataset, index_class_folder


def test_split_is_deterministic_stratified_and_disjoint(digit_split):
    a, b, other = digit_split, split_digits(0), split_digits(1)
    assert np.array_equal(a.test_indices, b.test_indices) and np.array_equal(a.train_images, b.train_images)
    assert not np.array_equal(a.test_indices, other.test_indices)
    total = len(a.train_indices) + len(a.test_indices)
    assert set(a.train_indices).isdisjoint(a.test_indices) and len(set(a.train_indices) | set(a.test_indices)) == total
    assert a.train_images.shape[1:] == (32, 32, 3) and a.train_images.dtype == np.uint8
    assert (a.train_images[..., 0] == a.train_images[..., 2]).all()  # grey in RGB
    for c in range(NUM_DIGIT_CLASSES):
        n_test, n_all = (a.test_labels == c).sum(), (a.test_labels == c).sum() + (a.train_labels == c).sum()
        assert n_test == round(0.2 * n_all)
    with pytest.raises(ValueError, match="held_out_fraction"):
        split_digits(0, held_out_fraction=1.0)


def test_folder_reads_back_through_the_dit_data_loader(tmp_path, digit_split):
    split = digit_split
    pick = np.arange(0, 40, 2)
    folder = write_digits_folder(
        tmp_path / "digits", split.test_images[pick], split.test_labels[pick], indices=split.test_indices[pick]
    )
    samples, report, ids = index_class_folder(folder, num_classes=NUM_DIGIT_CLASSES)
    assert report.used == len(pick)
    assert all(ids[name] == int(name) for name in ids)
    dataset = ClassImageDataset(samples, resolution=32, random_flip=False)
    by_key = {s.key: i for i, s in enumerate(samples)}
    for j in (0, 7, 19):
        key = f"{split.test_labels[pick[j]]}/{split.test_indices[pick[j]]:04d}.png"
        item = dataset[(by_key[key], 0)]
        assert item["label"] == split.test_labels[pick[j]]
        image = ((item["pixels"].permute(1, 2, 0) + 1) * 127.5).round().numpy().astype(np.uint8)
        assert np.array_equal(image, split.test_images[pick[j]])
    with pytest.raises(FileExistsError):
        write_digits_folder(folder, split.test_images[:2], split.test_labels[:2])
    with pytest.raises(ValueError, match="labels"):
        write_digits_folder(tmp_path / "bad", split.test_images[:2], split.test_labels[:3])
