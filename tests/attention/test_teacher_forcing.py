"""Teacher forcing for block-causal MHLA (:mod:`mhla_diffusion.ops.teacher_forcing`): the noisy copy's output in one
pass equals, chunk by chunk, the stream's denoising step against a state advanced with the clean chunks before it
(float64, 1e-10), for every fold, per-head mixing, both normalisations, a first chunk of its own length, and the
processors' feature path with RoPE; and it sees nothing it should not."""

from __future__ import annotations

import math

import pytest
import torch

from helpers.attention import make_inputs
from mhla_diffusion import mhla_causal_step, mhla_causal_teacher_forcing
from mhla_diffusion.benchmarks.attention_traffic import rotary_tables
from mhla_diffusion.ops.teacher_forcing import teacher_forcing_offsets

HEADS = 3
FOLDS = {"sum": {}, "decay": {"decay": 0.6}, "mean": {"mean_fold": True}}
# (grid, layout, latent frames per chunk): one temporal block row per latent frame, as in a stream
CASES = {
    "chunks of 2": ((8, 3, 4), (8, 2, 2), [2, 2, 2, 2]),
    "a first chunk of 1": ((9, 3, 4), (9, 2, 2), [1, 4, 4]),
    "uneven spatial blocks": ((7, 5, 3), (7, 2, 2), [3, 1, 3]),
    "one chunk": ((4, 2, 2), (4, 1, 2), [4]),
}


def _mixing(layout, window, per_head, seed=1):
    s = math.prod(layout[1:])
    shape = (HEADS, window + 2, s, s) if per_head else (window + 2, s, s)
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) + 0.1


def _streamed(noisy, clean, grid, layout, mixing, frames, **options):
    """The stream: each chunk's noisy tokens denoised against the state, then its clean tokens advance the state."""
    per_frame = math.prod(grid[1:])
    rotary = options.pop("rotary", None)
    rotated = {name: options.pop(name, None) for name in ("q_rot", "k_rot", "context_k_rot")}
    outs, state, start = [], None, 0
    for f in frames:
        tokens = slice(start * per_frame, (start + f) * per_frame)
        shape = ((f, *grid[1:]), (f, *layout[1:]), mixing)
        extra = {} if rotary is None else {"rotary": tuple(t[:, tokens] for t in rotary)}
        q, k, v = (x[:, tokens] for x in noisy)
        noisy_rot = {} if rotated["q_rot"] is None else {"q_rot": rotated["q_rot"][:, tokens]}
        noisy_rot.update({} if rotated["k_rot"] is None else {"k_rot": rotated["k_rot"][:, tokens]})
        out, _ = mhla_causal_step(q, k, v, *shape, state, **options, **extra, **noisy_rot)
        outs.append(out)
        q, k, v = (x[:, tokens] for x in clean)
        clean_rot = {}
        if rotated["k_rot"] is not None:  # the clean queries' rotation does not reach the state: any will do
            clean_rot = {"q_rot": rotated["context_k_rot"][:, tokens], "k_rot": rotated["context_k_rot"][:, tokens]}
        _, state = mhla_causal_step(q, k, v, *shape, state, **options, **extra, **clean_rot)
        start += f
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("window", [0, 1, 5])
@pytest.mark.parametrize("fold", sorted(FOLDS))
def test_one_pass_equals_the_stream_chunk_by_chunk(case, window, fold):
    grid, layout, frames = CASES[case]
    noisy = make_inputs(grid, heads=HEADS, seed=window)
    clean = make_inputs(grid, heads=HEADS, seed=window + 10)
    for per_head, normalize, rotated in ((False, True, False), (True, True, True), (True, False, False)):
        mixing = _mixing(layout, window, per_head)
        options = dict(**FOLDS[fold], normalize=normalize)
        rot = dict(q_rot=noisy[3], k_rot=noisy[4], context_k_rot=clean[4]) if rotated else {}
        forced = mhla_causal_teacher_forcing(*noisy[:3], *clean[1:3], grid, layout, mixing, frames, **options, **rot)
        streamed = _streamed(noisy[:3], clean[:3], grid, layout, mixing, frames, **options, **rot)
        torch.testing.assert_close(forced, streamed, rtol=0, atol=1e-10)


@pytest.mark.parametrize("fold", sorted(FOLDS))
def test_the_processors_feature_path_with_rope(fold):
    """Raw projections, the operator's own feature map and RoPE tables shared by both copies (same positions)."""
    grid, layout, frames = (6, 3, 4), (6, 2, 2), [1, 2, 3]
    noisy = make_inputs(grid, heads=HEADS, dim=6, seed=4)
    clean = make_inputs(grid, heads=HEADS, dim=6, seed=5)
    noisy = (noisy[3], noisy[4], noisy[2])  # q, k of both signs
    clean = (clean[3], clean[4], clean[2])
    rotary = tuple(t.double() for t in rotary_tables(math.prod(grid), 6, generator=torch.Generator().manual_seed(7)))
    mixing = _mixing(layout, 1, per_head=True)
    options = dict(**FOLDS[fold], feature_eps=1e-3, rotary=rotary)
    forced = mhla_causal_teacher_forcing(*noisy, *clean[1:], grid, layout, mixing, frames, **options)
    streamed = _streamed(noisy, clean, grid, layout, mixing, frames, **options)
    torch.testing.assert_close(forced, streamed, rtol=0, atol=1e-10)


def test_a_chunk_sees_the_clean_past_and_its_own_noisy_rows_only():
    """Changing the clean copy of the last chunk, or the noisy copy of an earlier chunk, changes nothing; changing
    the clean copy of an earlier chunk changes the later chunks only."""
    grid, layout, frames = (6, 2, 3), (6, 1, 1), [2, 2, 2]
    q, k, v, _, _ = make_inputs(grid, heads=HEADS, seed=2)
    ck, cv = make_inputs(grid, heads=HEADS, seed=3)[1:3]
    mixing = _mixing(layout, 1, per_head=False)
    per_chunk = 2 * 6

    def run(q, k, v, ck, cv):
        return mhla_causal_teacher_forcing(q, k, v, ck, cv, grid, layout, mixing, frames)

    base = run(q, k, v, ck, cv)
    last, first = slice(2 * per_chunk, 3 * per_chunk), slice(0, per_chunk)
    ck2, cv2 = ck.clone(), cv.clone()
    ck2[:, last], cv2[:, last] = ck2[:, last] + 1.0, -cv2[:, last]
    torch.testing.assert_close(run(q, k, v, ck2, cv2), base, rtol=0, atol=0)  # no chunk reads the last clean chunk
    k2, v2 = k.clone(), v.clone()
    k2[:, first], v2[:, first] = k2[:, first] + 1.0, -v2[:, first]
    changed = run(q, k2, v2, ck, cv)
    torch.testing.assert_close(changed[:, per_chunk:], base[:, per_chunk:], rtol=0, atol=0)  # later chunks: clean past
    ck3, cv3 = ck.clone(), cv.clone()
    ck3[:, first], cv3[:, first] = ck3[:, first] + 1.0, -cv3[:, first]
    changed = run(q, k, v, ck3, cv3)
    torch.testing.assert_close(changed[:, first], base[:, first], rtol=0, atol=0)
    assert not torch.allclose(changed[:, per_chunk:], base[:, per_chunk:])


def test_offsets_of_a_first_chunk_and_two_chunks():
    offsets = teacher_forcing_offsets([1, 2])
    assert offsets.tolist() == [
        # clean rows 0 1 2 | noisy rows 0 1 2
        [-1, -1, -1, 0, -1, -1],  # row 0 (chunk 0): its own noisy row
        [1, -1, -1, -1, 0, -1],  # row 1 (chunk 1): clean row 0, its own noisy row
        [2, -1, -1, -1, 1, 0],  # row 2 (chunk 1): clean row 0, noisy rows 1 and 2
    ]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"chunk_rows": [2, 2]}, "add up to the layout's 6"),
        ({"chunk_rows": [0, 6]}, "positive numbers"),
        ({"context_v": "short"}, "must have the noisy copy's shapes"),
        ({"rotated": True}, "`context_k_rot` exactly when"),
    ],
)
def test_bad_arguments_name_the_problem(change, message):
    grid, layout = (6, 2, 3), (6, 1, 1)
    q, k, v, q_rot, k_rot = make_inputs(grid, heads=HEADS, seed=2)
    context_v = v[:, :-1] if change.get("context_v") == "short" else v
    rot = dict(q_rot=q_rot, k_rot=k_rot) if change.get("rotated") else {}
    chunk_rows = change.get("chunk_rows", [3, 3])
    with pytest.raises(ValueError, match=message):
        mhla_causal_teacher_forcing(q, k, v, k, context_v, grid, layout, _mixing(layout, 1, False), chunk_rows, **rot)
