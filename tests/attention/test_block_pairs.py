"""The pair form of the numerator (:mod:`mhla_diffusion.ops.block_pairs`): chosen for blocks of a token or two, and
equal to the token-pair reference and to the block form on random inputs (float64), for the plain operator, the
block-causal one and teacher forcing, with empty and uneven blocks, per-head mixing, both normalisations, RoPE on
the processors' feature path, in half precision and in the gradients."""

from __future__ import annotations

import math

import pytest
import torch

from helpers.attention import make_inputs
from mhla_diffusion import (
    causal_mixing_init,
    mhla_attention,
    mhla_causal_attention,
    mhla_causal_teacher_forcing,
    mixing_init,
)
from mhla_diffusion.benchmarks.attention_traffic import rotary_tables
from mhla_diffusion.ops import attention, block_pairs, causal
from mhla_diffusion.ops.naive import mhla_attention_reference, mhla_causal_attention_reference

# (grid, layout): one token a block; empty blocks (more blocks than tokens on an axis); uneven blocks of 1-2 tokens
CASES = {
    "one token a block": ((3, 4, 4), (3, 4, 4)),
    "empty blocks": ((2, 3, 5), (2, 4, 5)),
    "uneven blocks": ((4, 5, 3), (4, 3, 2)),
}


@pytest.fixture(params=["pairs", "summaries"])
def form(request, monkeypatch):
    """Force one form of the numerator in every operator that chooses one."""
    calls = []

    def pays(*args):
        calls.append(args)
        return request.param == "pairs"

    monkeypatch.setattr(attention, "pair_form_pays", pays)
    monkeypatch.setattr(causal, "pair_form_pays", pays)
    yield request.param
    assert calls, "no operator asked which form to use"


def _options(rotated, inputs):
    return dict(q_rot=inputs[3], k_rot=inputs[4]) if rotated else {}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("normalize", [True, False])
def test_the_operator_equals_the_reference(form, case, normalize):
    grid, layout = CASES[case]
    inputs = make_inputs(grid, dim=6, value_dim=5)
    m = math.prod(layout)
    for mixing, rotated in ((mixing_init(layout, dtype=torch.float64), False), (torch.randn(3, m, m).double(), True)):
        options = dict(normalize=normalize, **_options(rotated, inputs))
        out = mhla_attention(*inputs[:3], grid, layout, mixing, **options)
        torch.testing.assert_close(out, mhla_attention_reference(*inputs[:3], grid, layout, mixing, **options))


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("fold", [{}, {"decay": 0.7}, {"mean_fold": True}])
def test_the_causal_operator_equals_the_reference(form, case, fold):
    grid, layout = CASES[case]
    inputs = make_inputs(grid, dim=6, value_dim=5, seed=1)
    mixing = causal_mixing_init(layout[1:], 1, dtype=torch.float64) + 0.05
    out = mhla_causal_attention(*inputs[:3], grid, layout, mixing, **fold, **_options(True, inputs))
    reference = mhla_causal_attention_reference(*inputs[:3], grid, layout, mixing, **fold, **_options(True, inputs))
    torch.testing.assert_close(out, reference)


def test_the_feature_path_with_rope_equals_the_reference(form):
    grid, layout = (3, 4, 4), (3, 4, 4)
    q, k, v, _, _ = make_inputs(grid, dim=6)
    q, k = q - 0.5, k - 0.5  # raw projections of both signs
    rotary = tuple(t.double() for t in rotary_tables(math.prod(grid), 6, generator=torch.Generator().manual_seed(3)))
    mixing = causal_mixing_init(layout[1:], 1, dtype=torch.float64)
    out = mhla_causal_attention(q, k, v, grid, layout, mixing, feature_eps=1e-3, rotary=rotary)
    phi_q, phi_k = q.relu() + 1e-3, k.relu() + 1e-3
    rot = dict(q_rot=_rotate(phi_q, rotary), k_rot=_rotate(phi_k, rotary))
    reference = mhla_causal_attention_reference(phi_q, phi_k, v, grid, layout, mixing, **rot)
    torch.testing.assert_close(out, reference)


def _rotate(x, rotary):
    cos, sin = rotary
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack(
        (even * cos[..., 0::2] - odd * sin[..., 0::2], odd * cos[..., 0::2] + even * sin[..., 0::2]), -1
    ).flatten(-2)


@pytest.mark.parametrize("fold", [{}, {"mean_fold": True}])
def test_teacher_forcing_is_the_same_in_both_forms(monkeypatch, fold):
    grid, layout, chunks = (5, 3, 3), (5, 3, 2), [1, 2, 2]
    noisy, clean = make_inputs(grid, dim=6, seed=2), make_inputs(grid, dim=6, seed=3)
    mixing = torch.rand(3, 3, 6, 6, dtype=torch.float64) + 0.1  # per head, window 1
    outs = {}
    for form in ("pairs", "summaries"):
        monkeypatch.setattr(causal, "pair_form_pays", lambda *a, form=form: form == "pairs")
        for normalize in (True, False):
            rot = dict(q_rot=noisy[3], k_rot=noisy[4], context_k_rot=clean[4])
            outs[form, normalize] = mhla_causal_teacher_forcing(
                *noisy[:3], *clean[1:3], grid, layout, mixing, chunks, normalize=normalize, **fold, **rot
            )
    for normalize in (True, False):
        torch.testing.assert_close(outs["pairs", normalize], outs["summaries", normalize], rtol=0, atol=1e-12)


def test_gradients_are_the_same_in_both_forms(monkeypatch):
    grid, layout = (3, 3, 4), (3, 3, 2)
    inputs = make_inputs(grid, dim=6, seed=4)
    mixing = causal_mixing_init(layout[1:], 1, dtype=torch.float64) + 0.05
    grads = {}
    for form in ("pairs", "summaries"):
        for module in (attention, causal):
            monkeypatch.setattr(module, "pair_form_pays", lambda *a, form=form: form == "pairs")
        leaves = [t.clone().requires_grad_() for t in (*inputs, mixing)]
        q, k, v, q_rot, k_rot, w = leaves
        out = mhla_causal_attention(q, k, v, grid, layout, w, q_rot=q_rot, k_rot=k_rot, mean_fold=True)
        out.pow(2).sum().backward()
        grads[form] = [t.grad for t in leaves]
    for a, b in zip(grads["pairs"], grads["summaries"]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_are_as_close_to_float64_as_the_block_form(monkeypatch, dtype):
    grid, layout = (3, 4, 4), (3, 4, 4)
    inputs = make_inputs(grid, dim=16, value_dim=16, seed=5)
    mixing = causal_mixing_init(layout[1:], 1, dtype=torch.float64)
    exact = mhla_causal_attention(*inputs[:3], grid, layout, mixing)
    errors = {}
    for form in ("pairs", "summaries"):
        for module in (attention, causal):
            monkeypatch.setattr(module, "pair_form_pays", lambda *a, form=form: form == "pairs")
        out = mhla_causal_attention(*(x.to(dtype) for x in inputs[:3]), grid, layout, mixing.to(dtype))
        assert out.dtype == dtype
        errors[form] = (out.double() - exact).abs().max().item()
    assert errors["pairs"] <= 1.5 * errors["summaries"] + 1e-3, errors


def test_the_pair_form_is_chosen_for_blocks_of_a_token_or_two(monkeypatch):
    """At the embedded long-video model's size (32 channels a head) blocks of one or two tokens take the pair form,
    blocks of four or more the summaries; a score matrix over the budget takes the summaries."""
    pays = block_pairs.pair_form_pays
    assert pays(8, (324, 1), (648, 1), 32, 32) and pays(8, (162, 2), (324, 2), 32, 32)
    assert not pays(8, (81, 4), (162, 4), 32, 32) and not pays(8, (36, 9), (36, 9), 32, 32)
    assert not pays(8, (32_000, 1), (32_000, 1), 32, 32)  # 8 x 32,000^2 scores
    used = []
    real = block_pairs.pair_numerator
    monkeypatch.setattr(attention, "pair_numerator", lambda *a: used.append(1) or real(*a))  # the causal ops' too
    grid = (3, 4, 4)
    q, k, v, _, _ = make_inputs(grid, dim=32, value_dim=32, batch=1, dtype=torch.float32)
    mhla_causal_attention(q, k, v, grid, grid, causal_mixing_init(grid[1:], 1))
    assert used
    used.clear()
    mhla_attention(q, k, v, grid, (1, 2, 2), mixing_init((1, 2, 2)))  # blocks of 12 tokens
    assert not used
