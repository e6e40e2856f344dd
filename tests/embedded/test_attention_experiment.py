"""`mhla reproduce`: the teachers, students, rank measures, statistics and paired generative check compute what
they document; the smoke run goes end to end, refuses bad settings before writing, and a killed run resumes."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from scipy import stats

from mhla_diffusion.cli import main
from mhla_diffusion.embedded.attention_experiment import ExperimentSettings, estimate_budget, run_experiment
from mhla_diffusion.embedded.build import settings_with
from mhla_diffusion.embedded.experiment_statistics import interval, paired_difference
from mhla_diffusion.embedded.generative_check import ARMS, asymmetry, mirror_images, new_denoiser, sample_scale
from mhla_diffusion.embedded.operator_experiment import (
    RECALL_PAIRS,
    STUDENTS,
    AttentionStudent,
    Task,
    attention_measures,
    mhla_layout,
    rank_bound,
)
from mhla_diffusion.models.conversion import get_mhla_conversion


class _Killed(Exception):
    pass


def _student(kind: str, task: Task) -> AttentionStudent:
    torch.manual_seed(0)
    return AttentionStudent(kind, task.in_dim, task.out_dim, task.side, task.heads, task.head_dim)


@pytest.mark.parametrize("kind", STUDENTS)
def test_attention_matrix_is_what_the_layer_computes(kind):
    task = Task("local", 64, heads=2, head_dim=8)
    student = _student(kind, task)
    x = task.held_out(1).x
    matrix = student.attention_matrix(x[0])  # (H, N, N)
    _, _, v = student._qkv(x)
    by_matrix = student.out(torch.einsum("hnm,mhd->nhd", matrix, v[0]).flatten(1))
    torch.testing.assert_close(by_matrix, student(x)[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(matrix.sum(-1), torch.ones(2, 64), atol=1e-5, rtol=0)  # rows are weights


def test_rank_bounds_and_measured_ranks():
    assert [mhla_layout(side) for side in (8, 16, 32, 64)] == [(2, 2), (4, 4), (4, 4), (8, 8)]  # M <= sqrt(N)
    assert [rank_bound("linear", n, 32) for n in (64, 1024)] == [32, 32]
    # sum over blocks of min(n_b, d): 4 x 16, 16 x 16, 16 x min(64, 32), 64 x min(64, 32)
    assert [rank_bound("mhla", n, 32) for n in (64, 256, 1024, 4096)] == [64, 256, 512, 2048]
    assert rank_bound("softmax", 1024, 32) == 1024
    task = Task("local", 256, heads=1, head_dim=8)
    x = task.held_out(1).x[0]
    linear = attention_measures(_student("linear", task).attention_matrix(x)[0])
    mhla = attention_measures(_student("mhla", task).attention_matrix(x)[0])
    assert linear["numerical_rank"] <= 8 < mhla["numerical_rank"] <= rank_bound("mhla", 256, 8)


def test_attention_measures_of_known_matrices():
    n = 16
    identity = attention_measures(torch.eye(n))
    assert identity["numerical_rank"] == n and identity["effective_rank"] == pytest.approx(n)
    assert identity["row_entropy"] == pytest.approx(0.0, abs=1e-9)
    uniform = attention_measures(torch.full((n, n), 1 / n))
    assert uniform["numerical_rank"] == 1 and uniform["effective_rank"] == pytest.approx(1.0)
    assert uniform["row_entropy"] == pytest.approx(math.log(n))


def test_interval_and_paired_difference():
    values = [1.0, 2.0, 4.0, 3.0, 5.0]
    low, high = stats.t.interval(0.95, 4, loc=np.mean(values), scale=stats.sem(values))
    assert interval(values) == pytest.approx(
        {"n": 5, "mean": 3.0, "sd": np.std(values, ddof=1), "low": low, "high": high}
    )
    a, b = [1.0, 2.0, 3.0, 4.0], [0.5, 1.0, 2.8, 3.9]
    diff = paired_difference(a, b)
    assert diff["p"] == pytest.approx(stats.ttest_rel(a, b).pvalue)
    assert diff["called"] == (abs(diff["mean"]) > 2 * diff["se"])
    assert not paired_difference([1.0, 2.0, 3.0], [1.1, 1.8, 3.05])["called"]  # inside two standard errors
    assert paired_difference([1.0, 2.0], [0.0, 1.0]) | {"differences": None} == {
        "n": 2,
        "mean": 1.0,
        "se": 0.0,
        "t": None,
        "p": 0.0,
        "called": True,
        "differences": None,
    }


def test_recall_queries_ask_for_a_pairs_value():
    task = Task("recall", 64, heads=2, head_dim=8)
    batch = task.batch(3, torch.Generator().manual_seed(0))
    keys = batch.x[..., 3:35].argmax(-1)
    kinds = batch.x[..., :3].argmax(-1)
    values = batch.x[..., 35:51].argmax(-1)
    for b in range(3):
        assert int((kinds[b] == 1).sum()) == int(batch.mask[b].sum()) == RECALL_PAIRS
        pairs = {int(keys[b, i]): int(values[b, i]) for i in torch.nonzero(kinds[b] == 1).flatten()}
        for i in torch.nonzero(batch.mask[b]).flatten():
            assert int(batch.target[b, i]) == pairs[int(keys[b, i])]
        assert batch.x[b, batch.mask[b], 35:51].sum() == 0  # a query does not hold its answer


def test_local_teacher_ignores_distant_tokens():
    task = Task("local", 256, heads=2, head_dim=8)
    content = task.batch(1, torch.Generator().manual_seed(0)).x[..., :32]
    moved = content.clone()
    moved[0, 255] += 10.0  # the far corner from token 0
    before, after = task.local_teacher(content), task.local_teacher(moved)
    torch.testing.assert_close(after[0, 0], before[0, 0], atol=1e-6, rtol=0)  # token 0 does not see it
    assert (after[0, 255] - before[0, 255]).abs().max() > 1e-2  # the token itself does


def test_mirror_images_are_symmetric_and_asymmetry_is_scaled_by_the_data():
    images = mirror_images(512, 32, torch.Generator().manual_seed(0))
    assert asymmetry(images) == 0.0
    assert sample_scale(images, 32) == pytest.approx(1.0, rel=0.1) and sample_scale(3 * images, 32) == pytest.approx(
        3.0, rel=0.1
    )
    unrelated = torch.cat([images[:, :, :, :16], images.roll(1, 0)[:, :, :, 16:]], dim=-1)
    assert 0.8 < asymmetry(unrelated) < 1.3
    assert asymmetry(3 * unrelated + 1) == pytest.approx(asymmetry(unrelated))  # whatever the samples' scale
    assert asymmetry(unrelated - unrelated.flip(-1)) == pytest.approx(2.0)  # antisymmetric


def test_part_b_arms_differ_only_in_attention():
    models = {arm: new_denoiser(arm, 16, 1, 2, 8, seed=0) for arm in ARMS}
    assert get_mhla_conversion(models["softmax"]) is None
    assert get_mhla_conversion(models["linear"]).layout == (1, 1)
    assert get_mhla_conversion(models["mhla"]).layout == (4, 4)  # M = 16 <= sqrt(256)
    lepe = get_mhla_conversion(models["linear-lepe"])
    assert lepe.layout == (1, 1) and lepe.config.lepe and not lepe.config.gate
    shared = dict(models["softmax"].named_parameters())
    for arm in ARMS:
        for name, p in models[arm].named_parameters():
            if "attn" not in name:
                assert torch.equal(p, shared[name]), (arm, name)


@pytest.mark.slow  # trains
def test_smoke_run_covers_every_arm(smoke_reproduction):
    report = json.loads((smoke_reproduction / "report.json").read_text())
    s = ExperimentSettings.smoke()
    for run in report["part_a"]:
        assert run["rank"]["numerical_rank"] <= run["rank_bound"]
        assert (0 <= run["score"] <= 1) if run["task"] == "recall" else run["score"] > 0
    for run in report["part_b"]:
        assert set(run["held_out_loss"]) == {"50", "200", "500", "800"} and run["asymmetry"] >= 0
    assert {r["arm"] for r in report["part_b"]} == set(s.part_b_arms)
    assert "MHLA against global linear attention" in (smoke_reproduction / "reading.md").read_text()


def test_bad_settings_are_refused_in_one_line_before_anything_is_written(tmp_path, capsys):
    out = tmp_path / "out"
    for setting, message in [
        ("part_a_students=linear,bogus", "part_a_students: ['bogus'] not known"),
        ("part_a_batch_sizes=2", "one entry per token count"),
        ("part_b_seeds=0", "at least two distinct seeds"),
        ("token_counts=16,60", "token count 60 is not a square grid"),
    ]:
        assert main(["reproduce", "--smoke", "--output", str(out), "--set", setting]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def _tiny() -> ExperimentSettings:
    return settings_with(
        ExperimentSettings.smoke(),
        [
            "token_counts=16",
            "part_a_batch_sizes=2",
            "part_a_tasks=local",
            "part_a_students=linear",
            "part_b_arms=mhla",
            "part_b_tokens=16",
            "part_b_steps=4",
        ],
    )


@pytest.mark.slow  # trains
def test_a_killed_run_keeps_finished_units_and_resumes_inside_the_run(tmp_path):
    s = _tiny()
    plain = run_experiment(tmp_path / "plain", s)
    seen: list[tuple[str, int]] = []

    def kill_in_second_denoiser(name: str, step: int) -> None:
        seen.append((name, step))
        if name.endswith("seed1") and step == 3:
            raise _Killed

    with pytest.raises(_Killed):
        run_experiment(tmp_path / "killed", s, on_step=kill_in_second_denoiser)
    partial = json.loads((tmp_path / "killed" / "report.json").read_text())
    assert len(partial["part_b"]) == 1 and len(partial["part_a"]) == len(plain["part_a"])  # saved as they finished
    seen.clear()
    resumed = run_experiment(tmp_path / "killed", s, on_step=lambda name, step: seen.append((name, step)))
    assert seen == [("b-mhla-16tok-seed1", 4)]  # one checkpoint per step in smoke: only step 4 was left
    for key in ("part_a", "part_b"):
        for a, b in zip(plain[key], resumed[key]):
            for measure in ("score", "rank", "held_out_loss", "asymmetry", "final_train_loss"):
                assert a.get(measure) == b.get(measure), (key, measure)
    assert len(resumed["part_b"][1]["attempt_seconds"]) == 2
    with pytest.raises(ValueError, match="other settings"):
        run_experiment(tmp_path / "killed", settings_with(s, ["part_a_steps=5"]))


@pytest.mark.slow  # trains
def test_budget_times_every_arm_and_writes_nothing(tmp_path, capsys, monkeypatch):
    s = _tiny()
    estimate = estimate_budget(s, probe_steps=1)
    assert [r["part"] for r in estimate["rows"]] == ["A", "B"]
    assert all(r["seconds_per_step"] > 0 for r in estimate["rows"])
    assert estimate["total_seconds"] == pytest.approx(sum(r["projected_seconds"] for r in estimate["rows"]))
    assert estimate["cpu_count"] >= 1 and estimate["load_average"] >= 0
    monkeypatch.chdir(tmp_path)
    assert main(["reproduce", "--budget", "--smoke", "--set", "part_b_tokens=16"]) == 0
    out = capsys.readouterr().out
    assert "projected total" in out and list(tmp_path.iterdir()) == []
    # what it measures, and that load inflates it (a loaded machine projected 136 min for a 54-min run)
    assert "CPU seconds per training step on one torch thread" in out and "inflates the projection" in out
    assert "1-minute load average while probing was" in out
