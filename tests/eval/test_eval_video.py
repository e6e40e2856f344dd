"""``mhla eval-video``: FVD with a TorchScript I3D file, CLIP score with a local CLIP folder, judge metrics.

The networks are stand-ins with the real interfaces and random weights: a scripted module called as
StyleGAN-V calls ``i3d_torchscript.pt``, and a tiny ``CLIPModel`` + ``CLIPProcessor`` saved to a folder
with a tokenizer built from a vocabulary written here. Videos are moving-shapes clips written as mp4: the
dataset's own clips for the judge, and the same shapes drawn for 17 frames for FVD (which reads 16).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from mhla_diffusion.cli import main
from mhla_diffusion.embedded.worlds.moving_shapes import DIRECTIONS, FRAME_SIZE, NUM_FRAMES, render_clip, shape_clip
from mhla_diffusion.eval.fvd import FVD_FRAMES, FVD_SIZE, I3DFeatures, preprocess_clips
from mhla_diffusion.eval.video_files import read_video
from mhla_diffusion.pipelines.outputs import OutputPlan, save_video


class TinyI3D(nn.Module):
    """The I3D call signature: ``(x (N, 3, T, H, W), rescale, resize, return_features) -> (N, D)``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.project = nn.Linear(3 * 4 * 8 * 8, 6)

    def forward(
        self, x: torch.Tensor, rescale: bool = False, resize: bool = False, return_features: bool = False
    ) -> torch.Tensor:
        if rescale or resize or not return_features:
            raise RuntimeError("eval-video must call rescale=False, resize=False, return_features=True")
        if x.shape[1] != 3 or x.shape[2] != 16 or x.shape[3] != 224 or x.shape[4] != 224:
            raise RuntimeError("expected (N, 3, 16, 224, 224)")
        if bool(x.min() < -1.0) or bool(x.max() > 1.0):
            raise RuntimeError("expected values in [-1, 1]")
        pooled = torch.nn.functional.avg_pool3d(x, (4, 28, 28))
        return self.project(pooled.flatten(1))


@pytest.fixture(scope="module")
def i3d_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("i3d") / "i3d_torchscript.pt"
    torch.jit.save(torch.jit.script(TinyI3D().eval()), str(path))
    return path


def _clip_folder(folder: Path) -> Path:
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer

    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    tokens = ["<|startoftext|>", "<|endoftext|>"] + letters + [c + "</w>" for c in letters]
    (folder / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(tokens)}))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    tokenizer = CLIPTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"))
    processor = CLIPProcessor(
        image_processor=CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}),
        tokenizer=tokenizer,
    )
    torch.manual_seed(0)
    config = CLIPConfig(
        text_config=dict(
            vocab_size=len(tokens),
            hidden_size=32,
            intermediate_size=37,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=64,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=1,
        ),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=37,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
        ),
        projection_dim=16,
    )
    out = folder / "clip"
    CLIPModel(config).save_pretrained(out)
    processor.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def clip_folder(tmp_path_factory) -> Path:
    return _clip_folder(tmp_path_factory.mktemp("clip"))


def _clip(k: int, count: int, seed: int, num_frames: int) -> tuple[np.ndarray, str]:
    """Clip ``k`` of the moving-shapes dataset, or its shape and motion drawn for ``num_frames`` frames."""
    clip = shape_clip(k, count, seed)
    if num_frames == NUM_FRAMES:
        return clip.frames, clip.caption
    dx, dy = DIRECTIONS[clip.attributes["direction"]]
    middle = (FRAME_SIZE - 1) / 2
    start = (middle - dx * (num_frames - 1) / 2, middle - dy * (num_frames - 1) / 2)  # 1 px a frame through the middle
    a = clip.attributes
    frames, _ = render_clip(
        a["shape"], a["colour"], a["direction"], start=start, radius=8.0, speed=1.0, num_frames=num_frames
    )
    return frames, clip.caption


def _write_videos(
    folder: Path, count: int, seed: int, sidecars: bool = True, num_frames: int = FVD_FRAMES + 1
) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    captions = []
    for index in range(count):
        clip, caption = _clip(index, count, seed, num_frames)
        captions.append(caption)
        save_video(clip, OutputPlan(folder / f"{index:03d}.mp4", folder / f"{index:03d}.json"), "mp4", fps=8)
        if sidecars:
            (folder / f"{index:03d}.json").write_text(json.dumps({"prompt": caption, "seed": index}))
    return captions


@pytest.fixture(scope="module")
def videos(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("videos") / "samples"
    _write_videos(folder, 4, seed=3)
    return folder


@pytest.fixture(scope="module")
def judge_videos(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("judge-videos") / "samples"
    _write_videos(folder, 4, seed=3, num_frames=NUM_FRAMES)
    return folder


def test_preprocessing_gives_i3d_input_in_range():
    clips = np.random.default_rng(0).integers(0, 256, (2, 17, 48, 64, 3), dtype=np.uint8)
    x = preprocess_clips(clips)
    assert x.shape == (2, 3, FVD_FRAMES, FVD_SIZE, FVD_SIZE) and x.dtype == torch.float32
    assert float(x.min()) >= -1.0 and float(x.max()) <= 1.0
    with pytest.raises(ValueError, match="16 frames"):
        preprocess_clips(clips[:, :8])


def test_mp4_round_trip(videos):
    frames = read_video(videos / "000.mp4")
    assert frames.shape == (FVD_FRAMES + 1, FRAME_SIZE, FRAME_SIZE, 3) and frames.dtype == np.uint8


def test_fvd_and_clip_end_to_end(videos, i3d_file, clip_folder, tmp_path, capsys):
    output, ref_npz = tmp_path / "result.json", tmp_path / "ref.npz"
    code = main(
        [
            "eval-video",
            "--samples",
            str(videos),
            "--ref",
            str(videos),
            "--i3d-weights",
            str(i3d_file),
            "--clip-model",
            str(clip_folder),
            "--save-ref",
            str(ref_npz),
            "--output",
            str(output),
            "--device",
            "cpu",
        ]
    )
    assert code == 0, capsys.readouterr().err
    result = json.loads(output.read_text())
    assert abs(result["metrics"]["fvd"]) < 1e-6  # a set against itself
    assert result["metrics"]["clip_score"] >= 0
    assert result["networks"]["i3d"]["feature_dim"] == 6 and len(result["networks"]["i3d"]["weights_sha256"]) == 64
    assert [row["file"] for row in result["per_video"]] == [f"{i:03d}.mp4" for i in range(4)]
    assert all("prompt" in row and "clip_score" in row for row in result["per_video"])
    # The saved reference gives the same FVD without reading the reference videos again.
    code = main(
        [
            "eval-video",
            "--samples",
            str(videos),
            "--ref",
            str(ref_npz),
            "--i3d-weights",
            str(i3d_file),
            "--metrics",
            "fvd",
            "--output",
            str(tmp_path / "again.json"),
            "--device",
            "cpu",
        ]
    )
    assert code == 0
    again = json.loads((tmp_path / "again.json").read_text())
    assert again["reference"]["statistics"] == "npz" and abs(again["metrics"]["fvd"]) < 1e-6
    assert again["metrics"]["clip_score"] is None
    assert [row["prompt"] for row in again["per_video"]] == [row["prompt"] for row in result["per_video"]]


def test_judge_metrics_of_the_embedded_models_clips(judge_videos, videos, tmp_path, capsys):
    output = tmp_path / "judge.json"
    assert (
        main(
            [
                "eval-video",
                "--samples",
                str(judge_videos),
                "--ref",
                str(judge_videos),
                "--judge",
                "embedded",
                "--metrics",
                "judge",
                "--output",
                str(output),
            ]
        )
        == 0
    ), capsys.readouterr().err
    judge = json.loads(output.read_text())["judge"]
    assert set(judge["accuracy"]) == {"shape", "colour", "direction", "all"} and np.isfinite(judge["fid"])
    assert judge["accuracy"]["all"] >= 0.75  # real clips: the judge reads nearly all of them
    assert (
        main(
            [
                "eval-video",
                "--samples",
                str(videos),
                "--judge",
                "embedded",
                "--metrics",
                "judge",
                "--output",
                str(tmp_path / "fvd-length.json"),
            ]
        )
        == 2
    )  # FVD-length clips are not the judge's
    assert f"the embedded video judge takes clips of {NUM_FRAMES} frames" in capsys.readouterr().err


def test_judge_on_three_clips_says_why_precision_recall_are_missing_and_warns(tmp_path, capsys, caplog):
    folder = tmp_path / "three"
    captions = _write_videos(folder, 3, seed=7, num_frames=NUM_FRAMES)
    output = tmp_path / "judge.json"
    assert (
        main(
            [
                "eval-video",
                "--samples",
                str(folder),
                "--judge",
                "embedded",
                "--metrics",
                "judge",
                "--output",
                str(output),
            ]
        )
        == 0
    )
    err = capsys.readouterr().err
    result = json.loads(output.read_text())
    judge = result["judge"]
    assert judge["precision"] is None and judge["recall"] is None
    assert "k=3" in judge["precision_recall_note"] and "got 3 samples" in judge["precision_recall_note"]
    assert len(judge["warnings"]) == 1 and "judge FID on 3 sample clips" in judge["warnings"][0]
    assert "more than 64 clips (the reproduction table uses 480 clips)" in judge["warnings"][0]  # 64-d judge features
    assert f"warning: {judge['warnings'][0]}" in err
    assert "Inception Score" not in err + caplog.text  # not asked for (--metrics judge), so not warned about
    network = result["networks"]["judge"]
    assert network["name"] == "video-judge" and network["pool_dim"] == 64 and len(network["weights_sha256"]) == 64
    assert [row["prompt"] for row in result["per_video"]] == captions  # from the generation sidecars


def test_fvd_of_different_sets_is_positive(videos, i3d_file, tmp_path):
    other = tmp_path / "other"
    _write_videos(other, 4, seed=11, sidecars=False)
    from mhla_diffusion.eval.video import fvd_of_folders

    result = fvd_of_folders(videos, other, I3DFeatures(i3d_file))
    assert result["fvd"] > 1e-6 and result["reference"]["count"] == 4


def test_prompts_file_replaces_sidecars(tmp_path, clip_folder):
    folder = tmp_path / "plain"
    captions = _write_videos(folder, 2, seed=5, sidecars=False)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(captions) + "\n")
    output = tmp_path / "out.json"
    base = ["eval-video", "--samples", str(folder), "--metrics", "clip", "--clip-model", str(clip_folder)]
    assert main([*base, "--output", str(output), "--device", "cpu"]) == 2  # no sidecars, no --prompts
    assert main([*base, "--prompts", str(prompts), "--output", str(output), "--device", "cpu"]) == 0
    assert [row["prompt"] for row in json.loads(output.read_text())["per_video"]] == captions


def test_missing_networks_name_the_file_and_option(videos, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("MHLA_I3D_WEIGHTS", raising=False)
    monkeypatch.delenv("MHLA_CLIP_MODEL", raising=False)
    out = str(tmp_path / "x.json")
    assert (
        main(["eval-video", "--samples", str(videos), "--ref", str(videos), "--metrics", "fvd", "--output", out]) == 2
    )
    err = capsys.readouterr().err
    assert "i3d_torchscript.pt" in err and "--i3d-weights" in err and "MHLA_I3D_WEIGHTS" in err
    assert (
        main(
            [
                "eval-video",
                "--samples",
                str(videos),
                "--metrics",
                "clip",
                "--clip-model",
                str(tmp_path / "none"),
                "--output",
                out,
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "--clip-model" in err and "does not exist" in err
    assert main(["eval-video", "--samples", str(videos), "--metrics", "fvd", "--output", out]) == 2
    assert "--ref" in capsys.readouterr().err
    assert not Path(out).exists()
