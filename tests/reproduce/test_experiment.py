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
from mhla_diffusion.models.conversion import get_mhla_conversion
from mhla_diffusion.ops.attention import mhla_attention
from mhla_diffusion.ops.mixing import mixing_init
from mhla_diffusion.reproduce.experiment import ExperimentSettings, estimate_budget, run_experiment
from mhla_diffusion.reproduce.generative import ARMS, asymmetry, mirror_images, new_denoiser, sample_scale
from mhla_diffusion.reproduce.operators import (
    FEATURE_EPS,
    STUDENTS,
    AttentionStudent,
    Task,
    attention_measures,
    block_layout,
    choose_rates,
    loss_curve,
    mhla_layout,
    rank_bound,
    shuffled_mixing,
    token_permutation,
)
from mhla_diffusion.reproduce.statistics import (
    holm,
    interval,
    minimal_detectable_difference,
    paired_difference,
)
from mhla_diffusion.utils.options import settings_with


class _Killed(Exception):
    pass


def _student(kind: str, task: Task) -> AttentionStudent:
    torch.manual_seed(0)
    return AttentionStudent(kind, task.in_dim, task.out_dim, task.side, task.heads, task.head_dim)


@pytest.mark.parametrize("kind", STUDENTS)
def test_attention_matrix_is_what_the_layer_computes(kind):
    task = Task("local", 64, heads=2, head_dim=8)
    student = _student(kind, task)
    if student.lepe is not None:  # a LePE that is not zero, so that its term counts
        torch.nn.init.normal_(student.lepe.weight, std=0.3)
    x = task.held_out(1).x
    matrix = student.attention_matrix(x[0])  # (H, N, N)
    _, _, v = student._qkv(x)
    by_matrix = torch.einsum("hnm,mhd->nhd", matrix, v[0]).flatten(1) + student.lepe_term(v)[0]
    torch.testing.assert_close(student.out(by_matrix), student(x)[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(matrix.sum(-1), torch.ones(2, 64), atol=1e-5, rtol=0)  # rows are weights


def test_lepe_term_is_a_depthwise_3x3_convolution_over_the_grid():
    task = Task("local", 16, heads=1, head_dim=2)
    student = _student("linear-lepe", task)
    torch.nn.init.normal_(student.lepe.weight)
    v = torch.randn(1, 16, 1, 2)
    grid = v[0, :, 0, :].reshape(4, 4, 2)
    padded = torch.nn.functional.pad(grid.permute(2, 0, 1), (1, 1, 1, 1))  # (C, 6, 6)
    w, b = student.lepe.weight[:, 0], student.lepe.bias  # (C, 3, 3)
    expected = torch.zeros(4, 4, 2)
    for r in range(4):
        for c in range(4):
            expected[r, c] = (padded[:, r : r + 3, c : c + 3] * w).sum(dim=(1, 2)) + b
    torch.testing.assert_close(student.lepe_term(v)[0], expected.reshape(16, 2), atol=1e-5, rtol=1e-5)
    assert _student("mhla", task).lepe is None and not _student("mhla", task).lepe_term(v).any()


def test_permuted_mhla_is_mhla_on_the_tokens_in_a_fixed_random_order():
    task = Task("local", 256, heads=2, head_dim=8)
    permuted, plain = _student("mhla-permuted", task), _student("mhla", task)
    plain.load_state_dict(permuted.state_dict())  # the same weights and mixing
    x = task.held_out(2).x
    order = token_permutation(256)
    assert torch.equal(permuted.order, order) and sorted(order.tolist()) == list(range(256))
    # the plain student on the reordered input, its output put back in grid order
    expected = torch.zeros_like(plain(x))
    expected[:, order] = plain(x[:, order])
    torch.testing.assert_close(permuted(x), expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(permuted(x), plain(x), atol=1e-3)  # blocks of other tokens: another function


def test_wide_head_linear_attention_is_global_linear_attention_with_mhlas_rank_bound():
    task = Task("local", 256, heads=2, head_dim=8, block_side=8)
    student = AttentionStudent("linear-wide", task.in_dim, task.out_dim, task.side, 2, 8, task.layout)
    assert student.key_dim == rank_bound("mhla", 256, 8, task.layout) == 4 * 8  # 2x2 blocks of 64 tokens
    x = task.held_out(2).x
    q, k, v = student._qkv(x)
    assert q.shape == (2, 256, 2, 32) and v.shape == (2, 256, 2, 8)
    fq, fk = torch.relu(q) + FEATURE_EPS, torch.relu(k) + FEATURE_EPS  # plain einsum global linear attention
    numerator = torch.einsum("bnhd,bmhd,bmhe->bnhe", fq, fk, v)
    denominator = torch.einsum("bnhd,bmhd->bnh", fq, fk)[..., None] + 1e-6
    torch.testing.assert_close(student(x), student.out((numerator / denominator).flatten(2)), atol=1e-5, rtol=1e-5)


def test_teachers_are_drawn_per_seed():
    s = ExperimentSettings()
    for name in ("local", "groups"):
        one, other, again = (s.task(name, 256, seed) for seed in (0, 1, 0))
        batch = one.batch(1, torch.Generator().manual_seed(0))
        assert torch.equal(again.batch(1, torch.Generator().manual_seed(0)).target, batch.target)
        assert not torch.allclose(other.batch(1, torch.Generator().manual_seed(0)).target, batch.target)
        assert one.layout == (2, 2)  # 8x8-token blocks


def test_learning_rates_are_chosen_by_the_lowest_final_training_loss_ties_to_the_smaller():
    runs = [
        {"student": "a", "lr": 1e-2, "loss_curve": [2.0, 1.0]},
        {"student": "a", "lr": 3e-3, "loss_curve": [2.0, 0.5]},
        {"student": "b", "lr": 1e-2, "loss_curve": [2.0, 0.7]},
        {"student": "b", "lr": 3e-3, "loss_curve": [2.0, 0.7]},
        {"student": "c", "lr": 1e-2, "loss_curve": [2.0, 0.1]},
        {"student": "c", "lr": 3e-3, "loss_curve": [0.0, 0.2]},  # only the last tenth counts
    ]
    assert choose_rates(runs) == {"a": 3e-3, "b": 3e-3, "c": 1e-2}


def test_uniform_mixing_computes_global_linear_attention():
    # every query block reads (1/M) sum_b S_b over (1/M) sum_b z_b + eps: global linear attention whose
    # denominator eps is M times larger (it matters only for a query whose features are all near eps)
    task = Task("local", 256, heads=2, head_dim=8)
    uniform, linear = _student("mhla-uniform", task), _student("linear", task)
    assert uniform.layout == (4, 4) and linear.layout == (1, 1)
    x = task.held_out(2).x
    q, k, v = uniform._qkv(x)
    one_block = mhla_attention(q, k, v, (16, 16), (1, 1), torch.ones(1, 1), feature_eps=FEATURE_EPS, eps=16e-6)
    torch.testing.assert_close(uniform(x), uniform.out(one_block.flatten(2)), atol=1e-5, rtol=1e-5)
    same = (uniform(x) - linear(x)).abs().amax(-1) < 1e-5  # per token
    assert same.float().mean() > 0.99


def test_mixing_of_each_kind_and_what_trains():
    task = Task("local", 256, heads=2, head_dim=8)
    local = mixing_init((4, 4))
    students = {kind: _student(kind, task) for kind in STUDENTS}
    torch.testing.assert_close(students["mhla-frozen"].mixing, local)
    torch.testing.assert_close(students["mhla"].mixing.detach(), local)
    torch.testing.assert_close(students["mhla-uniform"].mixing, torch.full((16, 16), 1 / 16))
    shuffled = students["mhla-shuffled"].mixing
    assert torch.equal(shuffled, shuffled_mixing((4, 4)))
    columns = [next(j for j in range(16) if torch.equal(shuffled[:, i], local[:, j])) for i in range(16)]
    assert sorted(columns) == list(range(16)) and all(i != j for i, j in enumerate(columns))  # a derangement
    trained = {kind for kind, st in students.items() if any(n == "mixing" for n, _ in st.named_parameters())}
    assert trained == {"mhla", "mhla-per-head", "mhla-permuted", "mhla-lepe"}
    assert {k for k, st in students.items() if st.lepe} == {"linear-lepe", "mhla-lepe"}
    assert torch.equal(shuffled_mixing((1, 1)), torch.ones(1, 1))


def test_rank_bounds_and_measured_ranks():
    assert [mhla_layout(side) for side in (8, 16, 32, 64)] == [(2, 2), (4, 4), (4, 4), (8, 8)]  # M <= sqrt(N)
    assert [block_layout(side, 8) for side in (16, 32, 64)] == [(2, 2), (4, 4), (8, 8)]  # fixed 8x8-token blocks
    assert block_layout(32, None) == mhla_layout(32)
    with pytest.raises(ValueError, match="do not tile a 20x20 grid"):
        block_layout(20, 8)
    for kind in ("linear", "linear-lepe", "mhla-uniform"):
        assert [rank_bound(kind, n, 32) for n in (16, 64, 1024)] == [16, 32, 32]
    # sum over blocks of min(n_b, d): 4 x 16, 16 x 16, 16 x min(64, 32), 64 x min(64, 32)
    for kind in ("mhla", "mhla-frozen", "mhla-shuffled", "mhla-per-head", "mhla-permuted", "mhla-lepe", "linear-wide"):
        assert [rank_bound(kind, n, 32) for n in (64, 256, 1024, 4096)] == [64, 256, 512, 2048]
        assert [rank_bound(kind, n, 32, block_layout(math.isqrt(n), 8)) for n in (256, 1024)] == [128, 512]
    assert rank_bound("softmax", 1024, 32) == 1024
    with pytest.raises(ValueError, match="unknown student"):
        rank_bound("bogus", 64, 32)
    task = Task("local", 256, heads=1, head_dim=8)
    x = task.held_out(1).x[0]
    for kind in ("linear", "mhla-uniform", "mhla", "mhla-shuffled"):
        measured = attention_measures(_student(kind, task).attention_matrix(x)[0])
        assert measured["rank_1e-2"] <= measured["rank_1e-3"] <= rank_bound(kind, 256, 8), kind
    assert attention_measures(_student("mhla-shuffled", task).attention_matrix(x)[0])["rank_1e-3"] > 8


def test_attention_measures_of_known_matrices():
    n = 16
    identity = attention_measures(torch.eye(n))
    assert identity["rank_1e-3"] == identity["rank_1e-2"] == n and identity["effective_rank"] == pytest.approx(n)
    assert identity["row_entropy"] == pytest.approx(0.0, abs=1e-9)
    uniform = attention_measures(torch.full((n, n), 1 / n))
    assert uniform["rank_1e-3"] == uniform["rank_1e-2"] == 1 and uniform["effective_rank"] == pytest.approx(1.0)
    assert uniform["row_entropy"] == pytest.approx(math.log(n))
    # singular values 1, 5e-3, 5e-4 (an orthogonal rotation of a diagonal): rank 2 at 1e-3, 1 at 1e-2
    q, _ = torch.linalg.qr(torch.randn(3, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64))
    graded = attention_measures(q @ torch.diag(torch.tensor([1.0, 5e-3, 5e-4], dtype=torch.float64)) @ q.T)
    assert (graded["rank_1e-3"], graded["rank_1e-2"]) == (2, 1)


def test_loss_curve_is_the_mean_of_each_tenth():
    assert loss_curve(list(range(20))) == [0.5 + 2 * i for i in range(10)]
    assert loss_curve([1.0, 3.0]) == [1.0, 3.0] and loss_curve([]) == []


def test_interval_and_paired_difference():
    values = [1.0, 2.0, 4.0, 3.0, 5.0]
    low, high = stats.t.interval(0.95, 4, loc=np.mean(values), scale=stats.sem(values))
    assert interval(values) == pytest.approx(
        {"n": 5, "mean": 3.0, "sd": np.std(values, ddof=1), "low": low, "high": high}
    )
    a, b = [1.0, 2.0, 3.0, 4.0], [0.5, 1.0, 2.8, 3.9]
    diff = paired_difference(a, b)
    d = np.subtract(a, b)
    assert diff["p"] == pytest.approx(stats.ttest_rel(a, b).pvalue)
    assert diff["t"] == pytest.approx(stats.ttest_rel(a, b).statistic)
    assert (diff["low"], diff["high"]) == pytest.approx(stats.t.interval(0.95, 3, loc=d.mean(), scale=stats.sem(d)))
    assert diff["se"] == pytest.approx(stats.sem(d)) and diff["sd"] == pytest.approx(np.std(d, ddof=1))
    assert "called" not in diff  # calls are made on Holm-corrected p (reproduce/report.py), not here
    same = paired_difference([1.0, 2.0], [0.0, 1.0])
    assert (same["se"], same["p"], same["t"], same["low"], same["high"]) == (0.0, 0.0, None, 1.0, 1.0)
    with pytest.raises(ValueError, match="equally long"):
        paired_difference([1.0, 2.0, 3.0], [1.0, 2.0])


def test_holm_against_a_hand_computation():
    # sorted: 0.005 x 4 = 0.02; 0.01 x 3 = 0.03; 0.03 x 2 = 0.06; 0.04 x 1 = 0.04 -> 0.06 (never below the last)
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.01, None, 0.5]) == [pytest.approx(0.02), None, pytest.approx(0.5)]  # None: not in the family
    assert holm([0.6, 0.7]) == [1.0, 1.0]  # capped at 1, monotone
    assert holm([]) == [] and holm([0.2]) == [0.2]
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        holm([0.1, 1.5])


def test_minimal_detectable_difference_against_closed_forms_and_a_simulation():
    # large n: the normal approximation (z_0.975 + z_0.8) sd / sqrt(n)
    z = stats.norm.ppf(0.975) + stats.norm.ppf(0.8)
    assert minimal_detectable_difference(2.0, 10_000) == pytest.approx(z * 2.0 / 100, rel=1e-3)
    assert minimal_detectable_difference(0.0, 5) == 0.0
    # n = 5: the share of simulated paired t tests at level alpha that reject, at the true difference MDD
    rng = np.random.default_rng(0)
    for alpha in (0.05, 0.05 / 8):
        mdd = minimal_detectable_difference(1.0, 5, alpha=alpha)
        d = rng.normal(mdd, 1.0, size=(40_000, 5))
        t_stat = d.mean(1) / (d.std(1, ddof=1) / math.sqrt(5))
        rejected = np.abs(t_stat) > stats.t.ppf(1 - alpha / 2, 4)
        assert rejected.mean() == pytest.approx(0.8, abs=0.01), alpha
    assert minimal_detectable_difference(1.0, 5, alpha=0.05 / 8) > minimal_detectable_difference(1.0, 5)
    with pytest.raises(ValueError, match="two seeds"):
        minimal_detectable_difference(1.0, 1)


def test_recall_queries_ask_for_a_pairs_value():
    task = Task("recall", 64, heads=2, head_dim=8, pairs=16, keys=40)
    assert task.in_dim == 3 + 40 + 16 + 32
    batch = task.batch(3, torch.Generator().manual_seed(0))
    kinds = batch.x[..., :3].argmax(-1)
    keys = batch.x[..., 3:43].argmax(-1)
    values = batch.x[..., 43:59].argmax(-1)
    for b in range(3):
        assert int((kinds[b] == 1).sum()) == int(batch.mask[b].sum()) == 16
        pairs = {int(keys[b, i]): int(values[b, i]) for i in torch.nonzero(kinds[b] == 1).flatten()}
        assert len(pairs) == 16  # distinct keys
        for i in torch.nonzero(batch.mask[b]).flatten():
            assert int(batch.target[b, i]) == pairs[int(keys[b, i])]
        assert batch.x[b, batch.mask[b], 43:59].sum() == 0  # a query does not hold its answer
    with pytest.raises(ValueError, match="cannot hold 64 pairs"):
        Task("recall", 64, heads=2, head_dim=8, pairs=64)


def test_groups_teacher_has_the_stated_rank_and_is_not_local():
    task = Task("groups", 256, heads=2, head_dim=8, groups=24)
    assert task.teacher_rank == 24 and task.in_dim == 32 + 24 + 32
    g = torch.Generator().manual_seed(0)
    batch = task.batch(2, g)
    content, tags = batch.x[..., :32], batch.x[..., 32:56].argmax(-1)
    counts = torch.bincount(tags[0], minlength=24)
    assert counts.min() >= 256 // 24 and counts.max() <= 256 // 24 + 1  # every tag, balanced
    for b in range(2):
        matrix = task.teacher_matrix(tags[b])
        assert int(torch.linalg.matrix_rank(matrix)) == 24  # the stated rank
        torch.testing.assert_close(matrix.sum(-1), torch.ones(256, dtype=torch.float64))
        by_matrix = (matrix.float() @ content[b]) @ task.teacher["v"]
        torch.testing.assert_close(batch.target[b], by_matrix, atol=1e-5, rtol=1e-5)
    # token 0 sees the farthest token of its own tag and no token of another tag
    same = torch.nonzero(tags[0] == tags[0, 0]).flatten()
    far = int(same[-1]) if int(same[-1]) != 0 else int(same[0])
    other = int(torch.nonzero(tags[0] != tags[0, 0]).flatten()[0])
    for token, moves in ((far, True), (other, False)):
        moved = content.clone()
        moved[0, token] += 10.0
        changed = task.groups_teacher(moved, tags)[0, 0] - task.groups_teacher(content, tags)[0, 0]
        assert bool(changed.abs().max() > 1e-2) == moves
    with pytest.raises(ValueError, match="fewer than two tokens"):
        Task("groups", 64, heads=2, head_dim=8, groups=64)


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
    assert {(r["task"], r["student"]) for r in report["part_a"]} == {
        (task, kind) for task in s.part_a_tasks for kind in getattr(s, f"{task}_students")
    }
    assert {(r["student"], r["lr"]) for r in report["sweeps"]} == {
        (kind, lr) for kind in s.recall_students for lr in s.recall_lrs
    }
    chosen = {r["student"]: r["chosen"] for r in report["summary"]["sweeps"]}
    assert all(r["lr"] == chosen[r["student"]] for r in report["part_a"] if r["task"] == "recall")
    for run in report["part_a"]:
        for ranks in (run["rank"], run["rank_untrained"]):
            assert ranks["rank_1e-2"] <= ranks["rank_1e-3"] <= run["rank_bound"]
        assert (0 <= run["score"] <= 1) if run["task"] == "recall" else run["score"] > 0
        assert len(run["loss_curve"]) == 3  # one point per step: 3 steps
        assert run["teacher_rank"] == (s.groups if run["task"] == "groups" else None)
    for run in report["part_b"]:
        assert set(run["held_out_loss"]) == {"50", "200", "500", "800"} and run["asymmetry"] >= 0
    assert {r["arm"] for r in report["part_b"]} == set(s.part_b_arms)
    reading = (smoke_reproduction / "reading.md").read_text()
    assert "Part A, local teacher, MHLA (local mixing, learned) against MHLA with uniform mixing" in reading
    assert "Holm p = " in reading and "Part B, held-out denoising loss per timestep" in reading


def test_bad_settings_are_refused_in_one_line_before_anything_is_written(tmp_path, capsys):
    out = tmp_path / "out"
    for setting, message in [
        ("local_students=linear,bogus", "local_students: ['bogus'] not known"),
        ("recall_lrs=0.01,0.01", "recall_lrs ([0.01, 0.01]) must be one or more distinct positive"),
        ("sweep_seed=1", "sweep_seed (1) is one of part_a_seeds"),
        ("block_side=3", "blocks of 3x3 tokens do not tile a 4x4 grid"),
        ("local_batch_sizes=2", "one entry per token count of local_tokens"),
        ("recall_steps=3,3", "one entry per token count of recall_tokens"),
        ("part_b_seeds=0", "at least two distinct seeds"),
        ("local_tokens=16,60", "token count 60 is not a square grid"),
        ("groups=9", "fewer than two tokens to each of 9 tags"),
        ("recall_keys=2", "recall_keys (2) must be at least recall_pairs"),
    ]:
        assert main(["reproduce", "--smoke", "--output", str(out), "--set", setting]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def _tiny() -> ExperimentSettings:
    return settings_with(
        ExperimentSettings.smoke(),
        [
            "local_tokens=16",
            "local_batch_sizes=2",
            "local_steps=3",
            "part_a_tasks=local",
            "local_students=mhla-uniform",
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
            for measure in ("score", "rank", "rank_untrained", "held_out_loss", "asymmetry", "final_train_loss"):
                assert a.get(measure) == b.get(measure), (key, measure)
    assert len(resumed["part_b"][1]["attempt_seconds"]) == 2
    with pytest.raises(ValueError, match="other settings"):
        run_experiment(tmp_path / "killed", settings_with(s, ["local_steps=5"]))


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
