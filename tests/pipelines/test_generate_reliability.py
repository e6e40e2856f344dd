"""`mhla text-to-video` / `class-to-image` on odd input: non-finite numbers, sizes beyond the model's position
table, output folders that cannot be written, seeds, prompts the tokenizer does not know, file names of
non-ASCII prompts; and the file modes of `mhla convert`'s output."""

from __future__ import annotations

import json
import math
import os
import random
import stat

import pytest

from helpers.cli import class_to_image, text_to_video
from mhla_diffusion.cli import main
from mhla_diffusion.pipelines.outputs import OutputPlan, slugify, write_settings


def t2v(dirs, out, *extra, weights=True):
    """One-step :func:`~helpers.cli.text_to_video` (these tests check input handling, not samples)."""
    return text_to_video(dirs, out, *extra, steps=1, weights=weights)


# ---------------------------------------------------------------- 1. non-finite numbers


@pytest.mark.parametrize("flag", ["--guidance-scale", "--flow-shift"])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_text_to_video_refuses_non_finite_numbers(pipeline_dirs, tmp_path, capsys, flag, value):
    with pytest.raises(SystemExit) as exit:
        t2v(pipeline_dirs, tmp_path, "--prompt", "a cat", f"{flag}={value}")
    assert exit.value.code == 2
    err = capsys.readouterr().err  # the message states the range too (>= 0 / > 0)
    assert f"argument {flag}: expected a finite number" in err and f"got '{value}'" in err
    assert not any(tmp_path.iterdir())


def test_class_to_image_refuses_non_finite_guidance(pipeline_dirs, tmp_path, capsys):
    with pytest.raises(SystemExit):
        class_to_image(pipeline_dirs, tmp_path, "--class", "goldfish", "--guidance-scale", "nan")
    assert "argument --guidance-scale: expected a finite number >= 0, got 'nan'" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_settings_are_always_valid_json(tmp_path):
    plan = OutputPlan(tmp_path / "a.mp4", tmp_path / "a.json")
    for bad in ({"guidance_scale": math.nan}, {"scheduler": {"flow_shift": math.inf}}, {"sizes": [1.0, -math.inf]}):
        with pytest.raises(ValueError, match="must be finite numbers"):
            write_settings(plan, bad)
        assert not plan.settings.exists()
    write_settings(plan, {"guidance_scale": 5.0, "path": tmp_path})
    assert json.loads(plan.settings.read_text(), parse_constant=lambda c: pytest.fail(f"non-JSON {c}"))


# ---------------------------------------------------------------- 2. sizes beyond the position table


def test_cli_names_the_embedded_models_largest_size(tmp_path, capsys):
    # the embedded text-to-video model: rope_max_seq_len 64 tokens of 4 px -> 256 px at most; refused before loading
    assert main(["text-to-video", "--prompt", "a cat", "--height", "1024", "--output-dir", str(tmp_path)]) == 2
    assert "height 1024 is larger than the model supports: at most 256" in capsys.readouterr().err


def test_pipeline_call_names_the_largest_size(pipeline_dirs):
    from mhla_diffusion.pipelines.wan import MHLAWanPipeline
    from mhla_diffusion.utils.geometry import VideoGeometry

    pipe = MHLAWanPipeline.from_pretrained(pipeline_dirs["wan"], mhla_weights=pipeline_dirs["wan_mhla"])
    largest = VideoGeometry.from_pipeline(pipe).max_size()
    too_high = largest[1] + pipe.geometry.generation_multiple[0]
    with pytest.raises(ValueError, match=f"height {too_high} is larger than the model supports: at most {largest[1]}"):
        pipe(
            "a cat",
            num_frames=5,
            height=too_high,
            width=32,
            num_inference_steps=1,
            max_sequence_length=16,
            output_type="np",
        )


# ---------------------------------------------------------------- 3. unwritable output folders


def test_an_output_folder_that_cannot_be_created_is_refused_first(pipeline_dirs, tmp_path, capsys, monkeypatch):
    from mhla_diffusion.cli import generate

    if os.path.isdir("/proc/x") or not os.path.isdir("/proc"):
        pytest.skip("needs Linux's /proc")
    monkeypatch.setattr(
        generate, "_load", lambda *a, **k: pytest.fail("the model loaded before the folder was checked")
    )
    assert t2v(pipeline_dirs, "/proc/x", "--prompt", "a cat") == 2
    err = capsys.readouterr().err
    assert "cannot write to --output-dir /proc/x (No such file or directory); choose another --output-dir" in err
    assert "Errno" not in err
    assert class_to_image(pipeline_dirs, "/proc/x/images", "--class", "goldfish") == 2
    assert "cannot write to --output-dir /proc/x/images" in capsys.readouterr().err


def test_planning_leaves_no_folder_behind(tmp_path):
    from mhla_diffusion.pipelines.outputs import plan_outputs

    plan_outputs(tmp_path / "new" / "deeper", ["a"], "mp4")
    assert not (tmp_path / "new").exists()


# ---------------------------------------------------------------- 4. seeds


@pytest.mark.parametrize("value", ["-5", "4294967296", "1.5", "x"])
def test_seeds_outside_the_demos_range_are_refused(pipeline_dirs, tmp_path, capsys, value):
    with pytest.raises(SystemExit) as exit:
        t2v(pipeline_dirs, tmp_path, "--prompt", "a cat", "--seed", value)
    assert exit.value.code == 2
    assert f"argument --seed: expected an integer from 0 to 4294967295, got '{value}'" in capsys.readouterr().err


def test_largest_seed_is_accepted(pipeline_dirs, tmp_path):
    assert t2v(pipeline_dirs, tmp_path, "--prompt", "a cat", "--seed", "4294967295", "--format", "gif") == 0
    assert (tmp_path / "000-a-cat-seed4294967295-mhla.gif").is_file()


# ---------------------------------------------------------------- 5. unknown words, non-ASCII file names


def test_words_the_tokenizer_does_not_know_are_named(pipeline_dirs, tmp_path, capsys):
    # the tiny pipeline's word-level tokenizer knows "a", "red", "circle", not "zebra" or an emoji
    assert t2v(pipeline_dirs, tmp_path, "--prompt", "a red zebra circle \U0001f993", "--format", "gif") == 0
    err = capsys.readouterr().err
    assert (
        "warning: prompt 1 has words the model's tokenizer does not know, generated without them: 'zebra', '\U0001f993'"
    ) in err
    assert t2v(pipeline_dirs, tmp_path, "--prompt", "a red circle", "--format", "gif") == 0
    assert "does not know" not in capsys.readouterr().err


@pytest.mark.parametrize(
    "text,slug",
    [
        ("a red circle moving left", "a-red-circle-moving-left"),
        ("\U0001f431\U0001f436", "prompt"),
        ("猫が走る \U0001f431", "猫が走る"),
        ("नमस्ते दुनिया", "नमस्ते-दुनिया"),
        ("Ça va? été_x", "ça-va-été-x"),
        ("  ", "prompt"),
    ],
)
def test_file_names_keep_letters_of_any_script(text, slug):
    assert slugify(text) == slug


def test_an_emoji_prompt_gets_a_readable_file_name(pipeline_dirs, tmp_path):
    assert t2v(pipeline_dirs, tmp_path, "--prompt", "\U0001f431 кот", "--prompt", "\U0001f431", "--format", "gif") == 0
    assert sorted(p.name for p in tmp_path.glob("*.gif")) == ["000-кот-seed0-mhla.gif", "001-prompt-seed0-mhla.gif"]


# ---------------------------------------------------------------- 7. file modes of `mhla convert`


def test_convert_output_files_share_one_mode(tmp_path, capsys):
    for extra, out in (([], tmp_path / "mhla"), (["--include-base"], tmp_path / "full")):
        assert main(["convert", "--tiny", "wan", "--no-check", "--output", str(out), *extra]) == 0
        modes = {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in out.iterdir() if p.is_file()}
        assert len(modes) >= 2 and len(set(modes.values())) == 1, modes
        umask = os.umask(0)
        os.umask(umask)
        assert set(modes.values()) == {oct(0o666 & ~umask)}


# ---------------------------------------------------------------- 8. checkpoint files that are not checkpoints


@pytest.mark.parametrize("name", ["random.pt", "random.safetensors"])
def test_a_corrupt_transformer_file_is_one_line_naming_it(pipeline_dirs, tmp_path, capsys, name):
    checkpoint, out = tmp_path / name, tmp_path / "out"
    checkpoint.write_bytes(random.Random(0).randbytes(4096))  # e.g. a truncated download
    assert t2v(pipeline_dirs, out, "--transformer", str(checkpoint), "--prompt", "a cat", weights=False) == 2
    assert capsys.readouterr().err == (
        f"mhla text-to-video: error: {checkpoint} is not a readable PyTorch/safetensors "
        "checkpoint (corrupt or truncated?)\n"
    )
    assert not out.exists() or not any(out.iterdir())
