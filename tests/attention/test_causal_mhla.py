"""Block-causal MHLA (:mod:`mhla_diffusion.ops.causal`): one pass against the O(N^2) reference, chunk by chunk
with the carried state against one pass, the state's constant size, gradients, and the plain operator with a
block-causal mask."""

from __future__ import annotations

import math

import pytest
import torch

from helpers.attention import make_inputs
from mhla_diffusion import (
    CausalMHLAState,
    causal_mixing_init,
    causal_mixing_matrix,
    mhla_attention,
    mhla_causal_attention,
    mhla_causal_attention_reference,
    mhla_causal_step,
)
from mhla_diffusion.benchmarks.attention_traffic import rotary_tables
from mhla_diffusion.models.processors.base import apply_interleaved_rotary

HEADS = 3

CASES = {
    "even": ((4, 4, 6), (4, 2, 3)),
    "even 2-D": ((6, 4), (3, 2)),
    "time only": ((5,), (5,)),
    "uneven": ((7, 5, 3), (3, 2, 2)),  # rows of 3, 2, 2 frames; uneven spatial blocks
    "empty row": ((2, 4, 3), (3, 2, 2)),  # 2 frames in 3 rows: the middle row is empty
    "empty places": ((4, 1, 3), (2, 2, 2)),  # one token row for two spatial block rows
}

# (grid, layout, frames per chunk): every chunk's own rows are the whole clip's rows
CHUNKED = {
    "even": ((8, 3, 4), (4, 2, 2), [2, 2, 2, 2]),
    "even, chunks of several rows": ((8, 3, 4), (4, 2, 2), [2, 4, 2]),
    "uneven spatial": ((10, 5, 5), (5, 2, 3), [4, 2, 4]),
    "uneven rows": ((7, 4, 3), (3, 2, 2), [3, 4]),  # rows of 3, 2, 2 frames
    "empty places": ((6, 1, 3), (6, 2, 2), [1, 2, 3]),
    "time only": ((9,), (9,), [1, 3, 1, 4]),
}

#: How the rows older than the window are folded: summed, weighed by a decay (one, or one per head), averaged.
FOLDS = {
    "sum": {},
    "decay 0.6": {"decay": 0.6},
    "per-head decay": {"decay": torch.tensor([0.3, 0.7, 1.0], dtype=torch.float64)},
    "mean": {"mean_fold": True},
}


def _mixing(layout, window, per_head, seed=1):
    """Random positive causal mixing ``(K + 2, S, S)`` (or per head) in float64, away from the init's symmetry."""
    s = math.prod(layout[1:])
    shape = (HEADS, window + 2, s, s) if per_head else (window + 2, s, s)
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) + 0.1


def _row_counts(grid, layout):
    """Frames of each temporal block row of the whole clip, from the floor rule (``ceil(b * G / L)`` starts)."""
    starts = [-(-b * grid[0] // layout[0]) for b in range(layout[0] + 1)]
    return [b - a for a, b in zip(starts, starts[1:])]


def _run_chunks(q, k, v, grid, layout, mixing, frames, state=None, **kwargs):
    """``mhla_causal_step`` over consecutive chunks of ``frames`` frames each; ``(output, final state)``."""
    rows = _row_counts(grid, layout)
    per_frame = math.prod(grid[1:])
    outs, start_frame, start_row = [], 0, 0
    rotary = kwargs.pop("rotary", None)
    tensors = {"q_rot": kwargs.pop("q_rot", None), "k_rot": kwargs.pop("k_rot", None)}
    for f in frames:
        chunk_rows = 0
        while sum(rows[start_row : start_row + chunk_rows]) < f:
            chunk_rows += 1
        assert sum(rows[start_row : start_row + chunk_rows]) == f, "chunks must be whole rows"
        tokens = slice(start_frame * per_frame, (start_frame + f) * per_frame)
        extra = {name: t[:, tokens] for name, t in tensors.items() if t is not None}
        if rotary is not None:
            extra["rotary"] = tuple(t[:, tokens] for t in rotary)
        out, state = mhla_causal_step(
            q[:, tokens],
            k[:, tokens],
            v[:, tokens],
            (f, *grid[1:]),
            (chunk_rows, *layout[1:]),
            mixing,
            state,
            **kwargs,
            **extra,
        )
        outs.append(out)
        start_frame, start_row = start_frame + f, start_row + chunk_rows
    return torch.cat(outs, dim=1), state


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("window", [0, 1, 5])
@pytest.mark.parametrize("fold", sorted(FOLDS))
@pytest.mark.parametrize("normalize", [True, False])
def test_one_pass_matches_reference(case, window, fold, normalize):
    grid, layout = CASES[case]
    q, k, v, q_rot, k_rot = make_inputs(grid, heads=HEADS, seed=len(grid) + window)
    for per_head, rotated in ((False, False), (True, True)):
        mixing = _mixing(layout, window, per_head)
        rot = dict(q_rot=q_rot, k_rot=k_rot) if rotated else {}
        args = (q, k, v, grid, layout, mixing)
        fast = mhla_causal_attention(*args, **FOLDS[fold], normalize=normalize, **rot)
        slow = mhla_causal_attention_reference(*args, **FOLDS[fold], normalize=normalize, **rot)
        assert fast.shape == v.shape and torch.isfinite(fast).all()
        torch.testing.assert_close(fast, slow, rtol=1e-10, atol=1e-10)


def test_reference_sees_only_its_own_and_earlier_rows():
    """Changing the keys and values of the last temporal row leaves every earlier row's output unchanged,
    and changes the last row's; with a window of 0 and a zero fold, the first row's output ignores the second."""
    grid, layout = (6, 2, 3), (3, 1, 1)
    q, k, v, _, _ = make_inputs(grid, heads=HEADS, seed=2)
    mixing = _mixing(layout, 1, per_head=False)
    last = slice(4 * 6, 6 * 6)
    k2, v2 = k.clone(), v.clone()
    k2[:, last], v2[:, last] = k2[:, last] + 1.0, -v2[:, last]
    for operator in (mhla_causal_attention, mhla_causal_attention_reference):
        before = operator(q, k, v, grid, layout, mixing)
        after = operator(q, k2, v2, grid, layout, mixing)
        torch.testing.assert_close(after[:, : last.start], before[:, : last.start], rtol=0, atol=0)
        assert not torch.allclose(after[:, last], before[:, last])


@pytest.mark.parametrize("case", sorted(CHUNKED))
@pytest.mark.parametrize("window", [0, 1, 8])
@pytest.mark.parametrize("fold", sorted(FOLDS))
def test_chunks_with_the_carried_state_equal_one_pass(case, window, fold):
    grid, layout, frames = CHUNKED[case]
    q, k, v, q_rot, k_rot = make_inputs(grid, heads=HEADS, seed=window + len(frames))
    for per_head, normalize, rotated in ((False, True, False), (True, True, True), (True, False, False)):
        mixing = _mixing(layout, window, per_head)
        options = dict(**FOLDS[fold], normalize=normalize)
        rot = dict(q_rot=q_rot, k_rot=k_rot) if rotated else {}
        whole = mhla_causal_attention(q, k, v, grid, layout, mixing, **options, **rot)
        chunked, state = _run_chunks(q, k, v, grid, layout, mixing, frames, **options, **rot)
        torch.testing.assert_close(chunked, whole, rtol=0, atol=1e-10)
        assert state.rows == layout[0]


@pytest.mark.parametrize("rope", [False, True])
def test_chunks_equal_one_pass_on_the_processors_feature_path(rope):
    """Raw projections with the operator's own feature map (``feature_eps``) and Wan's RoPE tables, sliced per
    chunk, as a streaming processor would pass them."""
    grid, layout, frames = (6, 3, 4), (3, 2, 2), [2, 4]
    _, _, v, q, k = make_inputs(grid, heads=HEADS, dim=6, seed=4)  # q, k of both signs
    mixing = _mixing(layout, 1, per_head=True)
    rotary = tuple(rotary_tables(q.shape[1], q.shape[3], generator=torch.Generator().manual_seed(7))) if rope else None
    rotary = None if rotary is None else tuple(t.double() for t in rotary)
    options = dict(decay=0.5, feature_eps=1e-3, rotary=rotary)
    whole = mhla_causal_attention(q, k, v, grid, layout, mixing, **options)
    phi_q, phi_k = q.relu() + 1e-3, k.relu() + 1e-3
    rot = (
        {}
        if rotary is None
        else dict(q_rot=apply_interleaved_rotary(phi_q, *rotary), k_rot=apply_interleaved_rotary(phi_k, *rotary))
    )
    want = mhla_causal_attention_reference(phi_q, phi_k, v, grid, layout, mixing, decay=0.5, **rot)
    torch.testing.assert_close(whole, want, rtol=1e-10, atol=1e-10)
    chunked, _ = _run_chunks(q, k, v, grid, layout, mixing, frames, **options)
    torch.testing.assert_close(chunked, whole, rtol=0, atol=1e-10)


@pytest.mark.parametrize("normalize", [True, False])
def test_state_size_does_not_change_from_2_to_64_rows(normalize):
    spatial, spatial_layout, window = (3, 4), (2, 2), 2
    batch, dim, value_dim = 2, 4, 5
    mixing = _mixing((1, *spatial_layout), window, per_head=False)
    sizes = {}
    for rows in (2, 64):
        grid = (rows, *spatial)
        q, k, v, _, _ = make_inputs(grid, heads=HEADS, dim=dim, value_dim=value_dim, batch=batch, seed=rows)
        frames = [1 + i % 3 for i in range(rows)]
        frames = frames[: next(i for i in range(rows + 1) if sum(frames[:i]) >= rows)]
        frames[-1] -= sum(frames) - rows
        _, state = _run_chunks(q, k, v, grid, (rows, *spatial_layout), mixing, frames, normalize=normalize)
        assert state.rows == rows
        sizes[rows] = state.nbytes
    s = math.prod(spatial_layout)
    per_row = batch * HEADS * s * dim * (value_dim + (1 if normalize else 0))  # S (D x Dv) and z (D) per block
    assert sizes[2] == sizes[64] == (window + 1) * per_row * torch.float64.itemsize


def test_gradients_match_the_reference():
    grid, layout = (5, 3, 4), (5, 2, 2)  # 5 rows, window 1: offsets and a decayed fold all take part
    inputs = make_inputs(grid, heads=HEADS, batch=2, seed=9)
    mixing = _mixing(layout, 1, per_head=True)
    decay = torch.tensor([0.4, 0.8, 0.9], dtype=torch.float64)
    weights = torch.linspace(-1, 1, math.prod(inputs[2].shape), dtype=torch.float64).view(inputs[2].shape)

    def grads(run):
        leaves = [t.clone().requires_grad_(True) for t in (*inputs, mixing, decay)]
        q, k, v, q_rot, k_rot, w, gamma = leaves
        (run(q, k, v, w, dict(q_rot=q_rot, k_rot=k_rot, decay=gamma)) * weights).sum().backward()
        return [t.grad for t in leaves]

    slow = grads(lambda q, k, v, w, kw: mhla_causal_attention_reference(q, k, v, grid, layout, w, **kw))
    fast = grads(lambda q, k, v, w, kw: mhla_causal_attention(q, k, v, grid, layout, w, **kw))
    chunked = grads(lambda q, k, v, w, kw: _run_chunks(q, k, v, grid, layout, w, [2, 1, 2], **kw)[0])
    for name, f, c, s in zip(("q", "k", "v", "q_rot", "k_rot", "mixing", "decay"), fast, chunked, slow):
        assert s is not None and s.abs().max() > 0, name
        torch.testing.assert_close(f, s, rtol=1e-9, atol=1e-9, msg=name)
        torch.testing.assert_close(c, s, rtol=1e-9, atol=1e-9, msg=f"chunked {name}")


def test_gradcheck_of_a_step_with_a_carried_state():
    grid, layout = (2, 2, 3), (2, 1, 2)
    q, k, v, _, _ = make_inputs(grid, heads=2, dim=3, value_dim=2, batch=1, seed=5)
    mixing = _mixing(layout, 1, per_head=False) * 0.5
    state = CausalMHLAState.of(
        torch.rand(1, 2, 2, 2, 3, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(1)),
        torch.rand(1, 2, 2, 2, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(2)),
        4,
    )
    leaves = [t.clone().requires_grad_() for t in (q, k, v, mixing, state.summaries, state.key_sums)]

    def step(q, k, v, w, summaries, key_sums):
        out, new = mhla_causal_step(q, k, v, grid, layout, w, CausalMHLAState.of(summaries, key_sums, 4), decay=0.7)
        return out, new.summaries, new.key_sums

    assert torch.autograd.gradcheck(step, leaves, eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("case", ["even", "uneven", "empty row"])
@pytest.mark.parametrize("per_head", [False, True])
def test_a_window_covering_the_clip_is_the_plain_operator_with_a_causal_mask(case, per_head):
    """K >= rows - 1 and no decay: the plain operator with the (M, M) mixing built here from the per-offset
    matrices for every pair of rows, the later rows masked out."""
    grid, layout = CASES[case]
    rows, s = layout[0], math.prod(layout[1:])
    q, k, v, q_rot, k_rot = make_inputs(grid, heads=HEADS, seed=11)
    mixing = _mixing(layout, rows - 1, per_head)
    full = torch.zeros((*mixing.shape[:-3], rows * s, rows * s), dtype=torch.float64)
    mask = torch.zeros(rows * s, rows * s, dtype=torch.bool)
    for r in range(rows):
        for r_key in range(rows):
            full[..., r * s : (r + 1) * s, r_key * s : (r_key + 1) * s] = mixing[..., abs(r - r_key), :, :]
            mask[r * s : (r + 1) * s, r_key * s : (r_key + 1) * s] = r_key <= r
    masked = full * mask
    plain = mhla_attention(q, k, v, grid, layout, masked, q_rot=q_rot, k_rot=k_rot)
    causal = mhla_causal_attention(q, k, v, grid, layout, mixing, q_rot=q_rot, k_rot=k_rot)
    torch.testing.assert_close(causal, plain, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(causal_mixing_matrix(mixing, rows), masked, rtol=0, atol=0)
    unmasked = mhla_attention(q, k, v, grid, layout, full, q_rot=q_rot, k_rot=k_rot)
    assert not torch.allclose(unmasked, causal)  # the mask matters on this input


def test_a_step_leaves_its_state_alone():
    """A pipeline denoises one chunk many times against the same state: every call gives the same output."""
    grid, layout = (2, 3, 4), (1, 2, 2)
    q, k, v, _, _ = make_inputs(grid, heads=HEADS, seed=6)
    mixing = _mixing(layout, 1, per_head=False)
    _, state = mhla_causal_step(q, k, v, grid, layout, mixing)
    kept = (state.summaries.clone(), state.key_sums.clone())
    first, after = mhla_causal_step(q * 2, k, v, grid, layout, mixing, state)
    again, _ = mhla_causal_step(q * 2, k, v, grid, layout, mixing, state)
    torch.testing.assert_close(again, first, rtol=0, atol=0)
    assert torch.equal(state.summaries, kept[0]) and torch.equal(state.key_sums, kept[1])
    assert state.rows == 1 and after.rows == 2


@pytest.mark.parametrize("fold", sorted(FOLDS))
def test_a_denoising_read_equals_the_advancing_step_and_builds_no_state(fold):
    """``advance=False`` mixes the carried rows where they lie: the same output as the step that builds the next
    state, from a state several rows into the fold (its stored F / c scaled back)."""
    grid, layout = (9, 3, 4), (9, 2, 2)
    q, k, v, _, _ = make_inputs(grid, heads=HEADS, seed=8)
    mixing = _mixing(layout, 1, per_head=True)
    _, state = _run_chunks(q[:, :72], k[:, :72], v[:, :72], (6, 3, 4), (6, 2, 2), mixing, [2, 3, 1], **FOLDS[fold])
    assert state.folded_rows == 5
    chunk = slice(72, 108)
    args = (q[:, chunk], k[:, chunk], v[:, chunk], (3, 3, 4), (3, 2, 2), mixing, state)
    read, nothing = mhla_causal_step(*args, advance=False, **FOLDS[fold])
    stepped, after = mhla_causal_step(*args, **FOLDS[fold])
    assert nothing is None and after.rows == 9
    torch.testing.assert_close(read, stepped, rtol=1e-12, atol=1e-12)
    whole = mhla_causal_attention(q, k, v, grid, layout, mixing, **FOLDS[fold])
    torch.testing.assert_close(read, whole[:, chunk], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("fold", sorted(FOLDS))
def test_heads_a_group_at_a_time_equal_all_heads_at_once(fold):
    """``heads_per_chunk`` splits the heads, their mixing, decays and state: the same outputs and next state as
    every head at once."""
    grid, layout = (6, 4, 4), (6, 2, 2)
    q, k, v, _, _ = make_inputs(grid, heads=HEADS, dim=8, value_dim=8, seed=9)
    mixing = _mixing(layout, 1, per_head=True)
    runs = {}
    for group in (1, 2, HEADS):
        out, state = _run_chunks(q, k, v, grid, layout, mixing, [2, 1, 3], heads_per_chunk=group, **FOLDS[fold])
        read, _ = mhla_causal_step(q[:, :16], k[:, :16], v[:, :16], (1, 4, 4), (1, 2, 2), mixing, state,
                                   advance=False, heads_per_chunk=group, **FOLDS[fold])  # fmt: skip
        runs[group] = (out, state.summaries, state.key_sums, read)
    for group in (1, 2):
        for a, b in zip(runs[group], runs[HEADS]):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="heads_per_chunk"):
        mhla_causal_step(q, k, v, grid, layout, mixing, heads_per_chunk=0)


def test_the_default_head_groups():
    """Small chunk summaries run every head at once; large ones a group whose summaries are no larger than the
    chunk's values (Wan2.1-1.3B: 12 heads of 128, 3x5 blocks a latent frame)."""
    from mhla_diffusion.ops.causal import _head_group

    assert _head_group(24, 3, 4, 8, 8) == 3
    assert _head_group(390, 12, 15, 128, 128) == 2  # a chunk of 1 latent frame: 15 blocks of 26 tokens
    assert _head_group(3 * 1560, 12, 45, 128, 128) == 9  # 3 latent frames at 480p


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float16])
def test_a_narrow_state_halves_the_bytes_and_stays_close(state_dtype):
    """Recent rows in 2 bytes, the fold in float16 scaled per block, key sums float32: half the bytes (plus a scale
    per block), and a stream of 64 rows within 1e-2 of the float32 state's for every fold."""
    from mhla_diffusion.benchmarks.stream_state import storage_error

    grid, layout = (2, 8, 8), (2, 2, 2)
    q, k, v, _, _ = make_inputs(grid, heads=2, dim=32, value_dim=32, batch=1, dtype=torch.float32)
    mixing = causal_mixing_init(layout[1:], 2)
    _, wide = mhla_causal_step(q, k, v, grid, layout, mixing)
    _, narrow = mhla_causal_step(q, k, v, grid, layout, mixing, state_dtype=state_dtype)
    assert narrow.recent.dtype == state_dtype and narrow.fold.dtype == torch.float16
    assert narrow.key_sums.dtype == wide.key_sums.dtype == torch.float32
    summary_bytes = [sum(t.numel() * t.element_size() for t in (x.fold, x.recent)) for x in (narrow, wide)]
    assert 2 * summary_bytes[0] == summary_bytes[1] and 0.5 < narrow.nbytes / wide.nbytes < 0.52  # D = 32: key sums
    _, again = mhla_causal_step(q, k, v, grid, layout, mixing, narrow)  # a carried narrow state stays narrow
    assert again.recent.dtype == state_dtype and again.fold_scale is not None
    for fold in ("sum", "mean", "decay"):
        errors = storage_error(fold, [state_dtype], rows=(16, 64))[state_dtype]
        assert 0 < max(errors.values()) < 1e-2, (fold, errors)
    with pytest.raises(ValueError, match="state_dtype"):
        mhla_causal_step(q, k, v, grid, layout, mixing, state_dtype=torch.int8)


def test_a_bfloat16_state_of_the_default_fold_holds_at_1024_rows():
    """The sum fold re-rounds its fold every row; stored as float16 scaled (with F / c) it stays within 1e-2 of the
    float32 state after 1,024 rows."""
    from mhla_diffusion.benchmarks.stream_state import storage_error

    assert storage_error("sum", [torch.bfloat16], rows=(1024,), heads=1, head_dim=16)[torch.bfloat16][1024] < 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_keep_a_float32_state(dtype):
    grid, layout = (6, 4, 6), (3, 2, 3)
    q, k, v, _, _ = make_inputs(grid, heads=2, dim=16, value_dim=16, batch=1, dtype=torch.float32)
    mixing = causal_mixing_init(layout[1:], 1)
    exact = mhla_causal_attention(q, k, v, grid, layout, mixing, decay=0.5)
    half = [t.to(dtype) for t in (q, k, v)]
    out, state = _run_chunks(*half, grid, layout, mixing, [2, 2, 2], decay=0.5)
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert state.summaries.dtype == state.key_sums.dtype == torch.float32
    torch.testing.assert_close(out.float(), exact, rtol=3e-2, atol=3e-2)


def test_init_favours_near_blocks():
    spatial, window = (3, 4), 3
    init = causal_mixing_init(spatial, window)
    s = math.prod(spatial)
    assert init.shape == (window + 2, s, s) and init.dtype == torch.float32
    diagonal = init.diagonal(dim1=-2, dim2=-1)  # (K + 2, S): a block's own place, offset by Δ rows
    assert (diagonal[:-1] > diagonal[1:]).all()  # farther back in time, less weight
    assert (init[0] <= diagonal[0][:, None]).all()  # within the row, a block weighs itself most
    # the same distances as the present init: its weights on (K + 2) rows, seen from a block of the last row
    from mhla_diffusion import mixing_init

    full = mixing_init((window + 2, *spatial))
    last = full[-s:]
    for delta in range(window + 2):
        key_row = window + 1 - delta
        torch.testing.assert_close(init[delta], last[:, key_row * s : (key_row + 1) * s], rtol=0, atol=0)
    assert causal_mixing_init((), 0).shape == (2, 1, 1)  # a grid with only a time axis


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(mixing=torch.rand(3, 4, 3)), "`mixing`"),
        (dict(mixing=torch.rand(2, 3, 4, 4)), "heads"),
        (dict(mixing=torch.rand(1, 4, 4)), "K \\+ 2 >= 2"),
        (dict(decay=1.5), "`decay`"),
        (dict(decay=torch.rand(2)), "`decay`"),
        (dict(normalize="scalar_mixed_denominator"), "scalar_mixed_denominator"),
        (dict(decay=0.5, mean_fold=True), "give one of them"),
    ],
)
def test_bad_arguments_name_the_problem(change, message):
    grid, layout = (2, 2, 4), (2, 1, 4)
    q, k, v, _, _ = make_inputs(grid, heads=HEADS, dtype=torch.float32)
    args = dict(mixing=torch.rand(3, 4, 4), decay=None, normalize=True)
    args.update(change)
    mixing = args.pop("mixing")
    for operator in (mhla_causal_attention, mhla_causal_step, mhla_causal_attention_reference):
        with pytest.raises(ValueError, match=message):
            operator(q, k, v, grid, layout, mixing, **args)


def test_a_state_from_another_stream_is_refused():
    grid, layout = (2, 2, 4), (2, 1, 4)
    q, k, v, _, _ = make_inputs(grid, heads=HEADS, dtype=torch.float32)
    _, state = mhla_causal_step(q, k, v, grid, layout, torch.rand(3, 4, 4))
    with pytest.raises(ValueError, match="same stream"):
        mhla_causal_step(q, k, v, grid, layout, torch.rand(4, 4, 4), state)  # another window
    with pytest.raises(ValueError, match="same normalize"):
        mhla_causal_step(q, k, v, grid, layout, torch.rand(3, 4, 4), state, normalize=False)
    with pytest.raises(ValueError, match="`state` must be a CausalMHLAState"):
        mhla_causal_step(q, k, v, grid, layout, torch.rand(3, 4, 4), state.summaries)
    with pytest.raises(ValueError, match="causal window K"):
        causal_mixing_init((1, 4), -1)


@pytest.mark.parametrize("window", [0, 2])
def test_the_mean_fold_keeps_its_scale_where_the_sum_grows(window):
    """A stream of identical frames (no RoPE: every row's summaries are the same): with the mean fold a query's output
    at row 64 is its output at row 8, however many rows were folded; with the sum fold the folded past outweighs the
    window more and more, and the output drifts."""
    frame, rows = (2, 3), 64
    q1, k1, v1, _, _ = make_inputs((1, *frame), heads=HEADS, seed=5)
    q, k, v = (x.repeat(1, rows, 1, 1) for x in (q1, k1, v1))
    layout = (rows, 1, 2)
    mixing = _mixing(layout, window, per_head=False)
    per_row = math.prod(frame)

    def row(out: torch.Tensor, r: int) -> torch.Tensor:
        return out[:, (r - 1) * per_row : r * per_row]

    mean = mhla_causal_attention(q, k, v, (rows, *frame), layout, mixing, mean_fold=True)
    summed = mhla_causal_attention(q, k, v, (rows, *frame), layout, mixing)
    torch.testing.assert_close(row(mean, 64), row(mean, 8), rtol=0, atol=1e-12)
    assert (row(summed, 64) - row(summed, 8)).abs().max() > 1e-3
    # the stream carries the same: chunk by chunk equals the one pass at row 64
    chunked, state = _run_chunks(q, k, v, (rows, *frame), layout, mixing, [1, 7, 24, 32], mean_fold=True)
    torch.testing.assert_close(chunked, mean, rtol=0, atol=1e-12)
    assert state.rows == rows
