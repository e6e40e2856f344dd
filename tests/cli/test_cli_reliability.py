"""`mhla` commands given a device this machine lacks, a device string that is none, or a `--set` name that no
setting has: one line before anything loads or is written, no traceback."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from mhla_diffusion.cli import main

NO_CUDA = "no CUDA device is available on this machine (torch.cuda.is_available() is False): use --device cpu"


def commands(out) -> dict[str, list[str]]:
    """Every command that takes --device, with the other arguments it needs (the output under ``out``)."""
    return {
        "text-to-video": ["text-to-video", "--prompt", "a cat", "--output-dir", str(out)],
        "image-to-video": [
            "image-to-video",
            "--model",
            str(out / "model"),
            "--image",
            str(out / "cat.png"),
            "--prompt",
            "a cat",
            "--output-dir",
            str(out),
        ],
        "class-to-image": ["class-to-image", "--class", "1", "--output-dir", str(out)],
        "eval": [
            "eval",
            "--samples",
            str(out / "samples"),
            "--ref",
            str(out / "ref.npz"),
            "--output",
            str(out / "r.json"),
        ],
        "eval-video": ["eval-video", "--samples", str(out / "samples"), "--output", str(out / "r.json")],
        "bench": ["bench", "--case", "4x4", "--no-block", "--repeats", "1", "--output", str(out / "bench.md")],
        "web": ["web"],
    }


def refused(capsys, argv: list[str]) -> str:
    """stderr of ``mhla argv``, which must stop while parsing (exit 2) without a traceback."""
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err  # one line: no usage block
    return err


@pytest.mark.parametrize("command", list(commands(Path("."))))
def test_cuda_on_a_machine_without_it_is_refused_before_anything_loads(tmp_path, capsys, monkeypatch, command):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "out"
    err = refused(capsys, [*commands(out)[command], "--device", "cuda"])
    assert err.startswith(f"mhla {command}: error: argument --device: {NO_CUDA}")
    assert not out.exists()


@pytest.mark.parametrize("command", ["text-to-video", "eval", "bench", "web"])
def test_a_device_string_that_is_none_names_the_valid_forms(tmp_path, capsys, command):
    out = tmp_path / "out"
    err = refused(capsys, [*commands(out)[command], "--device", "tpu9"])
    assert (
        f"mhla {command}: error: argument --device: 'tpu9' is not a device: use cpu, cuda, cuda:N (N: the GPU's "
        "index) or another accelerator's name (mps, xpu, ...)"
    ) in err
    assert not out.exists()


def test_cpu_and_a_present_gpu_are_accepted(monkeypatch):
    from mhla_diffusion.cli.arguments import parse_device

    assert parse_device("cpu") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert parse_device("cuda:1") == "cuda:1"
    with pytest.raises(Exception, match=r"cuda:2: this machine has 2 CUDA device\(s\), cuda:0 to cuda:1"):
        parse_device("cuda:2")


@pytest.mark.parametrize(
    "command,name,close",
    [("build-embedded", "video_teacher_step", "video_teacher_steps"), ("reproduce", "part_a_seed", "part_a_seeds")],
)
def test_an_unknown_setting_is_one_short_line_with_a_close_name(tmp_path, capsys, command, name, close):
    out, work = tmp_path / "out", tmp_path / "work"
    places = ["--output", str(out)] + (["--work-dir", str(work)] if command == "build-embedded" else [])
    assert main([command, "--set", f"{name}=1", *places]) == 2
    assert capsys.readouterr().err == (
        f"mhla {command}: error: unknown setting `{name}` (did you mean `{close}`?); `--help` lists every setting\n"
    )
    assert not out.exists() and not work.exists()


def test_a_setting_with_no_close_name_is_one_short_line(tmp_path, capsys):
    out, work = tmp_path / "out", tmp_path / "work"
    assert main(["build-embedded", "--set", "nonsense=1", "--output", str(out), "--work-dir", str(work)]) == 2
    assert (
        capsys.readouterr().err
        == "mhla build-embedded: error: unknown setting `nonsense`; `--help` lists every setting\n"
    )
    assert not out.exists() and not work.exists()


def test_help_lists_every_setting(capsys):
    from mhla_diffusion.cli.arguments import dataclass_field_names
    from mhla_diffusion.embedded.builds.build_settings import BuildSettings
    from mhla_diffusion.reproduce.experiment import ExperimentSettings

    for command, module, settings in (
        ("build-embedded", "mhla_diffusion.embedded.builds.build_settings", BuildSettings),
        ("reproduce", "mhla_diffusion.reproduce.experiment", ExperimentSettings),
    ):
        names = [f.name for f in dataclasses.fields(settings)]
        assert dataclass_field_names(module, settings.__name__) == names
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert ", ".join(names) in text
