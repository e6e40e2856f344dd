"""Data: captions, probing, corrupt files, buckets, frame sampling, resize/crop, the batch sampler,
class folders."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
import torch

from helpers.media import write_image, write_video
from mhla_diffusion.finetune.buckets import BucketBatchSampler, frame_bucket, nearest_resolution
from mhla_diffusion.finetune.image_data import ClassImageDataset, index_class_folder
from mhla_diffusion.finetune.media import MediaError, probe, resize_center_crop
from mhla_diffusion.finetune.video_data import VideoTextDataset, index_video_folder

BUCKETS = [(32, 32), (32, 48), (48, 32)]


def test_probe_reads_frames_and_size_and_rejects_garbage(tmp_path):
    info = probe(write_video(tmp_path / "a.mp4", 7, 32, 48))
    assert (info.num_frames, info.height, info.width, info.is_video) == (7, 32, 48, True)
    (tmp_path / "bad.mp4").write_bytes(b"not a video" * 20)
    with pytest.raises(MediaError, match="bad.mp4"):
        probe(tmp_path / "bad.mp4")


def test_captions_from_sidecars_jsonl_and_csv(tmp_path):
    for name in ("sidecar", "jsonl", "csv"):
        folder = tmp_path / name
        (folder / "sub").mkdir(parents=True)
        write_video(folder / "a.mp4", 9, 32, 32)
        write_video(folder / "sub" / "b.mp4", 9, 32, 32)
        if name == "sidecar":
            (folder / "a.txt").write_text("first clip\n")
            (folder / "sub" / "b.txt").write_text("second clip")
        elif name == "jsonl":
            rows = [{"file_name": "a.mp4", "text": "first clip"}, {"file_name": "sub/b.mp4", "text": "second clip"}]
            (folder / "metadata.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
        else:
            (folder / "metadata.csv").write_text("file_name,caption\na.mp4,first clip\nsub/b.mp4,second clip\n")
        samples, report = index_video_folder(folder, [(32, 32)], [9])
        assert [(s.key, s.caption) for s in samples] == [("a.mp4", "first clip"), ("sub/b.mp4", "second clip")]
        assert report.used == report.found == 2


def test_metadata_sizes_skip_probing(tmp_path):
    (tmp_path / "a.mp4").write_bytes(b"unreadable, but described by metadata")
    (tmp_path / "metadata.jsonl").write_text(
        json.dumps({"file_name": "a.mp4", "prompt": "x", "num_frames": 30, "height": 48, "width": 32})
    )
    samples, _ = index_video_folder(tmp_path, BUCKETS, [9, 17])
    assert samples[0].bucket == (17, 48, 32)


def test_missing_captions_and_empty_folders_fail_before_probing(tmp_path):
    write_video(tmp_path / "a.mp4", 9, 32, 32)
    (tmp_path / "b.mp4").write_bytes(b"garbage")  # would be "corrupt" if it got as far as probing
    (tmp_path / "a.txt").write_text("caption")
    with pytest.raises(ValueError, match=r"1 of 2 files .* have no caption \(e.g. \['b.mp4'\]\)"):
        index_video_folder(tmp_path, [(32, 32)], [9])
    (tmp_path / "metadata.jsonl").write_text(json.dumps({"file_name": "missing.mp4", "text": "x"}))
    with pytest.raises(FileNotFoundError, match="lists 1 files that do not exist"):
        index_video_folder(tmp_path, [(32, 32)], [9])
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no videos or images found"):
        index_video_folder(empty, [(32, 32)], [9])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        index_video_folder(tmp_path / "nowhere", [(32, 32)], [9])


def test_corrupt_and_short_files_are_skipped_and_counted(tmp_path):
    write_video(tmp_path / "long.mp4", 20, 32, 48)
    write_video(tmp_path / "short.mp4", 6, 32, 32)
    write_video(tmp_path / "tiny.mp4", 3, 32, 32)
    write_image(tmp_path / "still.png", 40, 30)
    (tmp_path / "broken.mp4").write_bytes(b"\x00" * 500)
    (tmp_path / "broken.png").write_bytes(b"\x89PNG truncated")
    for stem in ("long", "short", "tiny", "still", "broken"):
        (tmp_path / f"{stem}.txt").write_text(stem)
    samples, report = index_video_folder(tmp_path, BUCKETS, [5, 17], frame_stride=1)
    buckets = {s.key: s.bucket for s in samples}
    assert buckets == {"long.mp4": (17, 32, 48), "short.mp4": (5, 32, 32), "still.png": (1, 48, 32)}
    assert sorted(report.corrupt) == ["broken.mp4", "broken.png"] and report.too_short == ["tiny.mp4"]
    assert report.metrics()["data/skipped_corrupt"] == 2 and report.used == 3 and report.found == 6
    only_bad = tmp_path / "bad"
    only_bad.mkdir()
    (only_bad / "x.mp4").write_bytes(b"junk")
    (only_bad / "x.txt").write_text("x")
    with pytest.raises(ValueError, match="no usable files .* 1 corrupt"):
        index_video_folder(only_bad, BUCKETS, [5])


def test_bucket_rules():
    assert nearest_resolution(1080, 1920, [(480, 832), (480, 480), (832, 480)]) == (480, 832)
    assert nearest_resolution(300, 290, [(480, 832), (480, 480), (832, 480)]) == (480, 480)
    assert frame_bucket(81, 1, [17, 49, 81]) == 81 and frame_bucket(80, 1, [17, 49, 81]) == 49
    assert frame_bucket(97, 2, [17, 49, 81]) == 49  # 49 frames available at stride 2
    assert frame_bucket(10, 1, [17]) is None


def test_clip_decoding_frame_sampling_and_crop(tmp_path):
    write_video(tmp_path / "a.mp4", 20, 32, 48)
    (tmp_path / "a.txt").write_text("a")
    samples, _ = index_video_folder(tmp_path, [(32, 32)], [5])
    start = VideoTextDataset(samples, frame_stride=3, frame_sampling="start")
    item = start[(0, 0)]
    assert item["pixels"].shape == (3, 5, 32, 32) and item["pixels"].min() >= -1 and item["pixels"].max() <= 1
    assert start.frame_indices(samples[0], 0, 0) == [0, 3, 6, 9, 12]
    random = VideoTextDataset(samples, frame_stride=3, frame_sampling="random", seed=5)
    offsets = {random.frame_indices(samples[0], epoch, 0)[0] for epoch in range(12)}
    assert offsets <= set(range(0, 8)) and len(offsets) > 1  # 20 frames, span 13: starts 0..7
    assert random.frame_indices(samples[0], 3, 0) == random.frame_indices(samples[0], 3, 0)


def test_resize_center_crop_keeps_the_centre():
    frame = np.zeros((1, 20, 40, 3), np.uint8)
    frame[:, :, 10:30] = 255  # white centre half of the width
    out = resize_center_crop(frame, 16, 16)  # scale 0.8 -> 16x32, crop columns 8..24 = the white band
    assert out.shape == (3, 1, 16, 16)
    assert torch.allclose(out[:, :, :, 2:-2], torch.ones(1)) and out.min() > -1


def test_sampler_shards_resumes_and_keeps_buckets():
    buckets = ["a"] * 7 + ["b"] * 5 + ["c"] * 3
    full = BucketBatchSampler(buckets, batch_size=2, seed=3)
    epoch0 = list(full)
    assert all(len({buckets[i] for i, _ in batch}) == 1 for batch in epoch0)
    assert Counter(i for batch in epoch0 for i, _ in batch) == Counter(range(15))  # every sample once
    full.set_epoch(1)
    assert [b for b in full] != epoch0
    full.set_epoch(0, start=3)
    assert list(full) == epoch0[3:]
    ranks = [BucketBatchSampler(buckets, batch_size=2, num_replicas=3, rank=r, seed=3) for r in range(3)]
    shards = [[i for batch in r for i, _ in batch] for r in ranks]
    assert len({len(list(r)) for r in ranks}) == 1 and len(ranks[0]) == len(list(ranks[0]))
    assert not set(shards[0]) & set(shards[1]) and not set(shards[1]) & set(shards[2])
    with pytest.raises(ValueError, match="fewer batches"):
        BucketBatchSampler(["a", "a"], batch_size=2, num_replicas=2)


def test_class_folders_ids_and_corrupt_images(tmp_path, image_classes):
    samples, report, ids = index_class_folder(image_classes, num_classes=1000)
    assert ids == {"0": 0, "1": 1, "2": 2} and report.used == 12
    named = tmp_path / "named"
    for name in ("n02", "n01"):
        (named / name).mkdir(parents=True)
        write_image(named / name / "x.png", 20, 20)
    (named / "n01" / "bad.jpg").write_bytes(b"nope")
    samples, report, ids = index_class_folder(named, num_classes=10)
    assert ids == {"n01": 0, "n02": 1} and report.corrupt == ["n01/bad.jpg"]
    assert sorted(s.label for s in samples) == [0, 1]
    assert index_class_folder(named, 10, class_map={"n01": 7, "n02": 3})[2] == {"n01": 7, "n02": 3}
    with pytest.raises(ValueError, match="outside 0..1"):
        index_class_folder(named, num_classes=2, class_map={"n01": 0, "n02": 5})
    flat = tmp_path / "flat"
    flat.mkdir()
    write_image(flat / "x.png", 8, 8)
    with pytest.raises(ValueError, match="no class sub-folders"):
        index_class_folder(flat, 10)


def test_class_images_are_cropped_and_flipped_per_epoch(image_classes):
    samples, _, _ = index_class_folder(image_classes, num_classes=1000)
    dataset = ClassImageDataset(samples, resolution=16, random_flip=True, seed=0)
    item = dataset[(0, 0)]
    assert item["pixels"].shape == (3, 16, 16) and item["label"] == samples[0].label
    coins = [dataset.flipped(epoch, 0) for epoch in range(16)]
    assert any(coins) and not all(coins)
    flipped_epoch = coins.index(True)
    plain = ClassImageDataset(samples, resolution=16, random_flip=False).load(0, flipped_epoch)["pixels"]
    assert torch.equal(dataset.load(0, flipped_epoch)["pixels"], plain.flip(-1))


def test_cache_identity_follows_the_encoders_not_the_folder_name(pipeline_dirs, tmp_path):
    import shutil

    from mhla_diffusion.finetune.latent_cache import encoder_identity

    parts = ("vae", "text_encoder", "tokenizer")
    copy = tmp_path / "fine-tuned"
    shutil.copytree(pipeline_dirs["wan"], copy)
    shutil.rmtree(copy / "transformer")  # a different transformer keeps the cache valid
    assert encoder_identity(str(copy), None, parts) == encoder_identity(str(pipeline_dirs["wan"]), None, parts)
    config = copy / "vae" / "config.json"
    config.write_text(config.read_text().replace('"z_dim": 16', '"z_dim": 17'))
    assert encoder_identity(str(copy), None, parts) != encoder_identity(str(pipeline_dirs["wan"]), None, parts)
    assert encoder_identity("org/model", "main", parts) == {"pretrained_model": "org/model", "revision": "main"}


def test_a_datasets_folder_root_names_its_train_split(tmp_path):
    """A Hugging Face ``datasets`` imagefolder / videofolder root (split folders) given as the data folder."""
    videos = tmp_path / "videos"
    for split in ("train", "test"):
        (videos / split).mkdir(parents=True)
        write_video(videos / split / "a.mp4", 9, 32, 32)
        (videos / split / "metadata.jsonl").write_text(json.dumps({"file_name": "a.mp4", "text": "a clip"}))
    with pytest.raises(ValueError, match=rf"^{videos} looks like a `datasets` folder .*: use {videos / 'train'} as"):
        index_video_folder(videos, [(32, 32)], [9])
    samples, _ = index_video_folder(videos / "train", [(32, 32)], [9])  # the split itself trains
    assert [s.caption for s in samples] == ["a clip"]
    images = tmp_path / "images"  # imagefolder with class labels: <split>/<class>/<image>
    for split in ("train", "validation"):
        for label in ("0", "1"):
            (images / split / label).mkdir(parents=True)
            write_image(images / split / label / "x.png", 16, 16)
    with pytest.raises(ValueError, match=rf"^{images} looks like a `datasets` folder .*: use {images / 'train'} as"):
        index_class_folder(images, num_classes=2)
    assert len(index_class_folder(images / "train", num_classes=2)[0]) == 2
