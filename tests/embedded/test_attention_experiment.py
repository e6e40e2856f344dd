"""`mhla reproduce`: the from-scratch comparison of attentions runs end to end in its smoke setting,
resumes a killed run inside the run, and its measures and verdicts are computed as documented."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from mhla_diffusion.cli import main
from mhla_diffusion.models.conversion import get_mhla_conversion
from mhla_diffusion.embedded.attention_experiment import (VARIANTS, ExperimentSettings, _new_model, check_digits_vae,
                                                          effective_rank, geometry_for, mhla_layout, run_experiment,
                                                          summarise)
from mhla_diffusion.embedded import attention_experiment
from mhla_diffusion.embedded.build import settings_with
from mhla_diffusion.embedded.locations import embedded_model, weight_hashes


class _Killed(Exception):
    pass


def test_effective_rank_counts_equal_directions():
    assert effective_rank(torch.eye(6)) == pytest.approx(6.0)
    assert effective_rank(torch.ones(5, 4)) == pytest.approx(1.0)
    assert 1.0 < effective_rank(torch.diag(torch.tensor([3.0, 1.0, 0.0]))) < 2.0
    assert effective_rank(torch.zeros(3, 3)) == 0.0


def test_token_counts_map_to_image_size_and_latent_grid():
    assert [geometry_for(t) for t in (256, 1024, 4096)] == [(32, 16), (64, 32), (128, 64)]
    assert [mhla_layout(side) for side in (4, 8, 16, 32, 64)] == [(2, 2), (2, 2), (4, 4), (4, 4), (8, 8)]
    with pytest.raises(ValueError, match="not a square"):
        geometry_for(1000)


def test_a_vae_other_than_the_experiments_is_refused_by_name(tmp_path):
    from diffusers import AutoencoderKL

    check_digits_vae(AutoencoderKL.load_config(embedded_model("class-to-image", "softmax") / "vae"))
    other = AutoencoderKL(block_out_channels=(8, 8, 8), down_block_types=("DownEncoderBlock2D",) * 3,
                          up_block_types=("UpDecoderBlock2D",) * 3, latent_channels=8, norm_num_groups=4)
    with pytest.raises(ValueError, match=r"compresses 4x into 8 channels.*2x and 4 channels.*VAE_FACTOR"):
        check_digits_vae(other.config)
    other.save_config(tmp_path / "vae")  # given as --vae: refused before the output folder is made
    with pytest.raises(ValueError, match=r"compresses 4x into 8 channels"):
        run_experiment(tmp_path / "out", ExperimentSettings.smoke(), vae=tmp_path / "vae")
    assert not (tmp_path / "out").exists()


def test_variants_differ_only_in_attention():
    s = ExperimentSettings.smoke()
    models = {v: _new_model(s, v, 64, seed=0) for v in VARIANTS}
    assert get_mhla_conversion(models["softmax"]) is None
    assert get_mhla_conversion(models["linear"]).layout == (1, 1)
    mhla = get_mhla_conversion(models["mhla"])
    assert mhla.layout == (2, 2) and not mhla.config.lepe and not mhla.config.gate  # M = 4 <= sqrt(64)
    full = get_mhla_conversion(models["mhla-lepe-gate"]).config
    assert full.lepe and full.gate and full.normalization == "denominator"
    released = get_mhla_conversion(models["mhla-released-dit"]).config
    assert released.normalization == "scalar_mixed_denominator" and released.input_norm and released.lepe
    # the shared parts (patch embedding, MLPs, modulation) start equal for one seed
    for name, p in models["softmax"].named_parameters():
        if "attn" not in name:
            assert torch.equal(p, dict(models["mhla"].named_parameters())[name]), name


def test_verdicts_compare_seed_ranges():
    runs = [dict(tokens=1024, variant=v, seed=seed, fid=fid, accuracy=0.9, precision=0.5, recall=0.5, attention_rank=3.0,
                 steps_per_second=1.0, seconds_per_sample=0.1)
            for v, seed, fid in [("softmax", 0, 10.0), ("softmax", 1, 12.0), ("linear", 0, 20.0), ("linear", 1, 25.0),
                                 ("mhla", 0, 11.0), ("mhla", 1, 13.0)]]
    rows = {r["variant"]: r for r in summarise(runs)}
    assert rows["softmax"]["fid"] == {"mean": 11.0, "min": 10.0, "max": 12.0} and rows["softmax"]["fid_vs_softmax"] is None
    assert rows["linear"]["fid_vs_softmax"]["worse"] and rows["linear"]["fid_vs_softmax"]["difference_of_means"] == 11.5
    assert not rows["mhla"]["fid_vs_softmax"]["apart"]


def test_list_settings_take_comma_separated_values():
    s = settings_with(ExperimentSettings(), ["token_counts=256,1024,4096", "steps=10,10,5", "variants=softmax,mhla"])
    assert s.token_counts == [256, 1024, 4096] and s.steps == [10, 10, 5] and s.variants == ["softmax", "mhla"]
    with pytest.raises(ValueError, match="comma-separated values of type int"):
        settings_with(ExperimentSettings(), ["seeds=a,b"])
    with pytest.raises(ValueError, match="one entry per token count"):
        settings_with(ExperimentSettings(), ["steps=10"]).check()


@pytest.mark.slow
def test_smoke_experiment_writes_table_plot_and_report(tmp_path, capsys, monkeypatch):
    out = tmp_path / "reproduce"
    assert main(["reproduce", "--smoke", "--output", str(out), "--figure", str(tmp_path / "docs" / "fid.png")]) == 0
    report = json.loads((out / "report.json").read_text())
    s = ExperimentSettings.smoke()
    assert len(report["runs"]) == len(VARIANTS) * len(s.token_counts) * len(s.seeds)
    for run in report["runs"]:
        assert run["fid"] >= 0 and 0 <= run["accuracy"] <= 1 and run["steps_per_second"] > 0
        assert len(run["attention_rank_per_layer"]) == s.layers and 0 < run["attention_rank"] <= s.head_dim
    assert report["settings"]["seeds"] == s.seeds
    assert report["seconds"] == pytest.approx(sum(run["seconds"] for run in report["runs"]), abs=0.1)
    table = (out / "table.md").read_text()
    assert table.count("| 64 |") == len(VARIANTS) and "within seed spread" in table
    assert (tmp_path / "docs" / "fid.png").stat().st_size > 1000
    assert "table" not in capsys.readouterr().err
    with pytest.raises(ValueError, match="other settings"):
        run_experiment(out, settings_with(s, ["eval_samples=20"]))
    # the folder is tied to the VAE and judge it used: a rebuilt VAE does not reuse these runs
    vae = embedded_model("class-to-image", "softmax") / "vae"
    assert report["inputs_sha256"]["vae"] == weight_hashes(vae) and report["inputs_sha256"]["judge"]
    rebuilt = tmp_path / "rebuilt" / "digits-c2i-softmax"
    shutil.copytree(vae, rebuilt / "vae")
    (rebuilt / "vae" / "diffusion_pytorch_model.safetensors").write_bytes(b"other weights")
    # --vae / --judge name the folders that are hashed and used
    assert main(["reproduce", "--smoke", "--output", str(out), "--vae", str(rebuilt / "vae")]) == 2
    assert "another VAE or judge" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match="judge folder .* has no judge_config.json"):
        run_experiment(out, s, judge=rebuilt)
    monkeypatch.setattr(attention_experiment, "embedded_model", lambda task, attention: rebuilt)
    with pytest.raises(ValueError, match="another VAE or judge"):
        run_experiment(out, s)


@pytest.mark.slow
def test_killed_run_resumes_inside_the_run_bit_identically(tmp_path):
    s = settings_with(ExperimentSettings.smoke(), ["variants=mhla", "token_counts=16", "steps=4", "seeds=0"])
    plain = run_experiment(tmp_path / "plain", s)["runs"][0]
    seen: list[tuple[str, int]] = []

    def kill_at_3(name: str, step: int) -> None:
        seen.append((name, step))
        if step == 3:
            raise _Killed

    with pytest.raises(_Killed):
        run_experiment(tmp_path / "killed", s, on_step=kill_at_3)
    seen.clear()
    resumed = run_experiment(tmp_path / "killed", s, on_step=lambda name, step: seen.append((name, step)))["runs"][0]
    assert seen == [("mhla-16tok-seed0", 4)]  # checkpoint every step in smoke: only step 4 was left
    for key in ("final_loss", "fid", "accuracy", "attention_rank_per_layer"):
        assert resumed[key] == plain[key], key
    # the run's time adds up both attempts; its checkpoint folder is gone once it finished
    assert len(resumed["attempt_seconds"]) == 2 and resumed["seconds"] == pytest.approx(sum(resumed["attempt_seconds"]))
    assert not (tmp_path / "killed" / "runs" / "mhla-16tok-seed0").exists()
