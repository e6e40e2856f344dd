"""A model id the hub cannot give ends every entry point in one line naming the id, the component, why and what
to do (issue 46, kind 2): with ``HF_HUB_OFFLINE=1`` (the suite's setting) and an id that is in no cache. The
network guard (``tests/conftest.py``) makes sure nothing is fetched; the gated / missing / unreachable wordings
are checked on the hub client's own exceptions."""

from __future__ import annotations

import re

import httpx
import pytest
from huggingface_hub import constants, errors

from mhla_diffusion.cli import main as mhla
from mhla_diffusion.eval.__main__ import main as eval_module
from mhla_diffusion.finetune.entry import main as trainer
from mhla_diffusion.loaders.loading import ModelUnavailable, check_hub_model, hub_errors, hub_failure
from mhla_diffusion.web.app import main as app

UNCACHED = "mhla-tests/never-cached-model"
OFFLINE = "the hub is switched off (HF_HUB_OFFLINE=1) and it is not in the local Hugging Face cache"
WHAT_TO_DO = (
    f"download it first (`hf download {UNCACHED}` where the hub is reachable), pass a local folder, or unset "
    "HF_HUB_OFFLINE"
)


def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


@pytest.fixture(autouse=True)
def _offline():
    assert constants.HF_HUB_OFFLINE, "tests run with HF_HUB_OFFLINE=1 (tests/conftest.py)"


COMMANDS = {
    "text-to-video": (mhla, ["text-to-video", "--model", UNCACHED, "--prompt", "a cat"], "--model"),
    "image-to-video": (mhla, ["image-to-video", "--model", UNCACHED, "--image", "x.png", "--prompt", "a"], "--model"),
    "class-to-image": (mhla, ["class-to-image", "--model", UNCACHED, "--class", "1"], "--model"),
    "convert": (mhla, ["convert", "--model", UNCACHED], "--model"),
    "eval-sample": (mhla, ["eval-sample", "--pipeline", UNCACHED, "--output-dir", "OUT"], "--pipeline"),
    "python -m mhla_diffusion.eval": (
        eval_module,
        ["eval-sample", "--pipeline", UNCACHED, "--output-dir", "OUT"],
        "--pipeline",
    ),
    "mhla web": (mhla, ["web", "--t2v-model", UNCACHED], "--t2v-model"),
    "app.py": (app, ["--c2i-model", UNCACHED], "--c2i-model"),
}


@pytest.mark.parametrize("name", COMMANDS)
def test_command_line_entry_points(name, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    entry, argv, option = COMMANDS[name]
    argv = [str(tmp_path / "out") if a == "OUT" else a for a in argv]
    assert entry(argv) == 2
    line = _one_line(capsys.readouterr().err)
    assert (
        f"{option} {UNCACHED} (model_index.json or config.json) could not be fetched: {OFFLINE}; {WHAT_TO_DO}" in line
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "trainer_name, options, option",
    [
        ("wan", ["--pretrained_model", UNCACHED], "pretrained_model"),
        ("dit", ["--pretrained_model", UNCACHED], "pretrained_model"),
        ("dit", ["--model_size", "DiT-S/2", "--vae_model", UNCACHED], "vae_model"),
    ],
)
def test_trainers(trainer_name, options, option, tmp_path, capsys):
    run = tmp_path / "run"
    argv = [*options, "--data_dir", str(tmp_path), "--output_dir", str(run)]
    assert trainer(trainer_name, argv) == 2
    line = _one_line(capsys.readouterr().err)
    assert (
        line
        == f"error: {option} {UNCACHED} (model_index.json or config.json) could not be fetched: {OFFLINE}; {WHAT_TO_DO}"
    )
    assert not run.exists()


def test_the_issues_example_the_dit_recipe_vae(tmp_path, capsys):
    # finetune/configs/dit_s2_256_from_scratch_mhla.yaml trains with stabilityai/sd-vae-ft-ema, in no test cache
    argv = ["--config", "finetune/configs/dit_s2_256_from_scratch_mhla.yaml", "--data_dir", str(tmp_path)]
    assert trainer("dit", [*argv, "--output_dir", str(tmp_path / "run")]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith(
        "error: vae_model stabilityai/sd-vae-ft-ema (model_index.json or config.json) could not be fetched: "
    )
    assert OFFLINE in line and "unset HF_HUB_OFFLINE" in line


def test_the_web_demo_loading_on_first_request(tmp_path):
    from mhla_diffusion.web.config import DemoConfig, TaskModels, UIDefaults
    from mhla_diffusion.web.models import ModelStore

    defaults = UIDefaults(9, 32, 32, 8, 2, 1.0, 2, 1.0)
    config = DemoConfig(
        video=TaskModels("text-to-video", UNCACHED),
        image=TaskModels("class-to-image", UNCACHED),
        defaults=defaults,
        device="cpu",
        preload=False,
    )
    with pytest.raises(
        ModelUnavailable,
        match="^" + re.escape(f"--t2v-model {UNCACHED} (model_index.json) could not be fetched: {OFFLINE}"),
    ):
        ModelStore(config).pipeline("text-to-video")


# ---------------------------------------------------------------- the other reasons, on the hub client's errors


def _http_error(cls: type, status: int, message: str, url: str) -> Exception:
    return cls(message, response=httpx.Response(status, request=httpx.Request("GET", url)))


URL = "https://huggingface.co/owner/name/resolve/main/vae/config.json"


@pytest.mark.parametrize(
    "error, reason, fix",
    [
        (
            _http_error(errors.GatedRepoError, 403, f"403 Client Error. Cannot access gated repo for url {URL}.", URL),
            "access to it is gated on the hub",
            "accept its terms on https://huggingface.co/owner/name and log in",
        ),
        (
            _http_error(errors.RepositoryNotFoundError, 404, f"Repository Not Found for url: {URL}.", URL),
            "the hub has no such model (or revision), or it is private",
            "check the id",
        ),
        (
            _http_error(errors.RemoteEntryNotFoundError, 404, f"Entry Not Found for url: {URL}.", URL)
            if hasattr(errors, "RemoteEntryNotFoundError")
            else errors.EntryNotFoundError(f"Entry Not Found for url: {URL}."),
            "the hub's copy lacks that file",
            "pass a local folder",
        ),
    ],
)
def test_gated_missing_repo_and_missing_file(error, reason, fix):
    def load():
        try:
            raise error
        except Exception:
            raise OSError("owner/name does not appear to have a file named config.json.")  # as Diffusers wraps it

    with pytest.raises(ModelUnavailable) as caught:
        with hub_errors({"owner/name": "--model"}):
            load()
    line = str(caught.value)
    assert line.startswith("--model owner/name (vae/config.json) could not be fetched: ") and "\n" not in line
    assert reason in line and fix in line


def test_an_unreachable_hub(monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # online, but the connection fails
    try:
        try:
            raise ConnectionError(
                "HTTPSConnectionPool(host='huggingface.co', port=443): Max retries exceeded with url: "
                "/owner/name/resolve/main/model_index.json"
            )
        except ConnectionError:
            raise errors.LocalEntryNotFoundError("An error happened while trying to locate the file on the Hub")
    except Exception as error:
        failure = hub_failure(error, {"owner/name": "pretrained_model"})
    assert str(failure).startswith(
        "pretrained_model owner/name (model_index.json) could not be fetched: the hub could not be reached and it is "
        "not in the local Hugging Face cache; download it first (`hf download owner/name` where the hub is reachable)"
    )


def test_other_errors_pass_through():
    with pytest.raises(ValueError, match="a bad layout"):
        with hub_errors({"owner/name": "--model"}):
            raise ValueError("a bad layout")
    assert hub_failure(OSError("disk full"), {"owner/name": "--model"}) is None


def test_a_cached_model_needs_no_hub(tmp_path, monkeypatch):
    # a VAE-only repo in the cache (config.json, no model_index.json): offline it is found, not refused
    snapshot = tmp_path / "models--mhla-tests--cached-vae" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "models--mhla-tests--cached-vae" / "refs").mkdir()
    (tmp_path / "models--mhla-tests--cached-vae" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    check_hub_model("mhla-tests/cached-vae", "vae_model")
    with pytest.raises(ModelUnavailable, match=re.escape(f"vae_model {UNCACHED} (model_index.json or config.json)")):
        check_hub_model(UNCACHED, "vae_model")
