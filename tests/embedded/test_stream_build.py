"""`mhla build-embedded --stream` in its smoke setting: every stage runs, the models, the judge, the long-video
report and its strip come out; a rerun resumes; a setting of a finished stage cannot change; the report's table is
computed from its JSON."""

from __future__ import annotations

import json
import shutil

import pytest

from mhla_diffusion.cli import main
from mhla_diffusion.embedded.builds.long_video_report import CLI_PROMPT, METHODS, report_markdown
from mhla_diffusion.embedded.builds.stream_build import STREAM_MODELS, StreamBuildSettings


@pytest.fixture(scope="module")
def stream_smoke(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream-build")
    args = ["build-embedded", "--stream", "--smoke", "--work-dir", str(root / "work"), "--output", str(root / "out")]
    assert main([*args, "--figure", str(root / "docs" / "strip.png")]) == 0
    return root, args


@pytest.mark.slow
def test_the_smoke_build_exports_models_judge_report_and_strip(stream_smoke):
    from mhla_diffusion.embedded.judges.judge_io import load_judge
    from mhla_diffusion.pipelines import MHLAWanStreamingPipeline

    root, _ = stream_smoke
    out = root / "out"
    for folder in STREAM_MODELS:
        pipe = MHLAWanStreamingPipeline.from_pretrained(out / folder)
        assert pipe.config["_mhla_generation_defaults"]["chunk_frames"] == StreamBuildSettings.smoke().chunk_frames
        assert pipe.make_stream() is not None  # block-causal: MHLA state or softmax KV cache
    assert load_judge(out / "judges" / "long-video").config["num_frames"] == 9  # reads 9-frame windows
    assert (root / "docs" / "strip.png").read_bytes() == (out / "long-video-strip.png").read_bytes()
    report = json.loads((out / "long_video_report.json").read_text())
    assert list(report["methods"]) == list(METHODS)
    assert (out / "long_video_report.md").read_text() == report_markdown(report)
    s = StreamBuildSettings.smoke()
    for key, method in report["methods"].items():
        assert method["summary"]["videos"] == s.eval_prompts
        for video in method["videos"]:
            assert video["num_frames"] == s.eval_frames
    stream, cache = report["methods"]["stream-mhla"], report["methods"]["stream-softmax"]
    # the MHLA stream carries a state of constant size; the KV cache grows with the video
    assert stream["peak_8x_vs_1x"] <= 1.1 < cache["peak_8x_vs_1x"]
    assert report["command"]["prompt"] == CLI_PROMPT and report["command"]["judge"]["num_frames"] == s.eval_frames
    build = json.loads((out / "stream_build_report.json").read_text())
    assert set(build["stages"]) >= {"data", "judge", "mhla", "softmax", "evaluate"}
    assert build["weights_sha256"] and all(len(h) == 64 for h in build["weights_sha256"].values())


@pytest.mark.slow
def test_a_rerun_resumes_and_finished_settings_cannot_change(stream_smoke, capsys):
    root, args = stream_smoke
    stages = root / "work" / "stages"
    before = {p.name: p.read_text() for p in stages.glob("*.json")}
    shutil.rmtree(root / "out")
    assert main([*args, "--no-export"]) == 0  # every stage already done
    assert {p.name: p.read_text() for p in stages.glob("*.json")} == before
    capsys.readouterr()
    assert main([*args, "--set", "steps=3"]) == 2
    err = capsys.readouterr().err
    assert "steps 2 -> 3" in err and "--work-dir" in err
    assert main([*args, "--set", "no_such=1"]) == 2


@pytest.mark.slow
def test_the_diagnosis_reads_both_models_at_2x_and_8x_and_with_oracle_context(stream_smoke, capsys):
    from mhla_diffusion.embedded.builds.long_video_diagnosis import DIAGNOSED_RUNS, LENGTH_FACTORS, diagnosis_markdown

    root, args = stream_smoke
    work = root / "work"
    capsys.readouterr()
    # lengths from 9-frame clips (17 and 65 frames) keep the test short; the pilot's other settings stay
    assert main(["build-embedded", "--stream", "--diagnose", "--work-dir", str(work), "--set", "train_frames=9"]) == 0
    printed = capsys.readouterr().out
    results = {run: json.loads((work / "diagnosis" / f"{run}.json").read_text()) for run in DIAGNOSED_RUNS}
    assert diagnosis_markdown(results) in printed
    s = StreamBuildSettings.smoke()
    for result in results.values():
        assert [r["frames"] for r in result["lengths"].values()] == [f * 8 + 1 for f in LENGTH_FACTORS]
        for reading in result["lengths"].values():
            assert reading["videos"] == s.eval_prompts and 0 <= reading["windows_match"] <= 1
        oracle = result["oracle"]["rows"][0]
        # the given chunks: the first chunk and one more (1 + 2 (c - 1) + 2 c frames for the VAE's factor 2)
        chunk, first = s.chunk_frames, s.first_chunk_frames or s.chunk_frames
        assert oracle["given_frames"] == 1 + 2 * (first - 1) + 2 * chunk
        assert oracle["made_frames"] % (2 * chunk) == 0 and oracle["made_frames"] >= max(9, 2 * 2 * chunk)
        assert oracle["real_border_jump_px"] > 0 and set(oracle["guess_error_px"]) == {"hold", "straight_on"}
    assert main(["build-embedded", "--diagnose", "--work-dir", str(work)]) == 2  # needs --stream
    assert main(["build-embedded", "--stream", "--diagnose", "--work-dir", str(root / "none")]) == 2


def test_evaluation_prompts_cover_every_shape_colour_and_direction():
    from mhla_diffusion.embedded.builds.long_video_report import evaluation_prompts
    from mhla_diffusion.embedded.worlds.moving_shapes import ATTRIBUTES, parse_caption

    prompts = evaluation_prompts(12)
    assert len(set(prompts)) == 12
    for name, values in ATTRIBUTES.items():
        assert {parse_caption(p)[name] for p in prompts} == set(values)
    assert len(set(evaluation_prompts(48))) == 48
    with pytest.raises(ValueError, match="eval_prompts must be 1..48"):
        evaluation_prompts(49)


def test_the_student_start_is_the_non_streaming_student_made_causal(tmp_path):
    import torch
    from safetensors.torch import load_file

    from mhla_diffusion.embedded.builds.stream_build import causal_student_start
    from mhla_diffusion.embedded.locations import EMBEDDED_ROOT
    from mhla_diffusion.models.conversion import get_mhla_conversion
    from mhla_diffusion.pipelines import MHLAWanStreamingPipeline

    s = StreamBuildSettings(causal_fold="decay", mhla_start="student")
    folder = causal_student_start(EMBEDDED_ROOT, tmp_path / "start", s)
    pipe = MHLAWanStreamingPipeline.from_pretrained(folder)
    config = get_mhla_conversion(pipe.transformer).config
    assert (config.causal, config.causal_window, config.causal_fold, config.gate, config.lepe) == (
        True,
        2,
        "decay",
        True,
        False,
    )
    student = load_file(EMBEDDED_ROOT / "shapes-t2v-mhla" / "transformer" / "diffusion_pytorch_model.safetensors")
    own = pipe.transformer.state_dict()
    for key, value in student.items():
        if ".processor.lepe" in key:
            assert key not in own
        elif key.endswith(".processor.mixing"):  # (S, S) -> every offset 0 .. K and the fold
            assert own[key].shape == (4, 36, 36) and torch.equal(own[key], value.expand(4, -1, -1))
        else:
            assert torch.equal(own[key], value), key
    assert pipe.make_stream() is not None
    with pytest.raises(ValueError, match=r"the student's layout \[1, 6, 6\] is not the stream's \[1, 3, 3\]"):
        causal_student_start(EMBEDDED_ROOT, tmp_path / "other", StreamBuildSettings(layout=[1, 3, 3]))
