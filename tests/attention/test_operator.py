"""The fast MHLA operator against the O(N^2) reference and against global linear attention."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from helpers.attention import check_operator_gradients, make_inputs
from mhla_diffusion import mhla_attention, mhla_attention_reference, mixing_init, num_blocks

CASES = [
    # grid, layout (1-D, 2-D, 3-D; divisible and not)
    ((7,), (3,)),
    ((12,), (4,)),
    ((4, 4), (2, 2)),
    ((5, 6), (2, 4)),
    ((7, 3), (3, 3)),
    ((3, 5, 7), (2, 2, 3)),
    ((2, 4, 6), (2, 2, 3)),
    ((5, 4, 3), (3, 1, 2)),
    ((3, 4, 5), (3, 4, 5)),  # every token its own block
]


@pytest.mark.parametrize("grid,layout", CASES)
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("rotated", [False, True])
@pytest.mark.parametrize("per_head", [False, True])
def test_matches_reference(grid, layout, normalize, rotated, per_head):
    q, k, v, q_rot, k_rot = make_inputs(grid, seed=len(grid) + sum(layout))
    m = num_blocks(layout)
    g = torch.Generator().manual_seed(1)
    mixing = torch.randn((3, m, m) if per_head else (m, m), generator=g, dtype=torch.float64)
    if normalize:  # keep the denominator away from zero: positive weights as after init
        mixing = mixing.abs() + 0.1
    rot = dict(q_rot=q_rot, k_rot=k_rot) if rotated else {}
    fast = mhla_attention(q, k, v, grid, layout, mixing, normalize=normalize, **rot)
    slow = mhla_attention_reference(q, k, v, grid, layout, mixing, normalize=normalize, **rot)
    assert fast.shape == v.shape and fast.dtype == v.dtype
    torch.testing.assert_close(fast, slow, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("chunk_bytes", [1, 200, 600, 5000, 1 << 30])
@pytest.mark.parametrize(
    "grid,layout",
    [((4, 6), (2, 3)), ((2, 4, 6), (2, 2, 3)), ((5, 7), (2, 3)), ((3, 4, 7), (2, 3, 2)), ((2, 5), (3, 2))],
)
@pytest.mark.parametrize("feature_eps", [None, 1e-3])
def test_cpu_chunks_match_reference(monkeypatch, chunk_bytes, grid, layout, feature_eps):
    """The folded path on a CPU regroups a cache-sized chunk at a time: one token of all heads (1 byte),
    part of a block (200 bytes: two tokens, the block's summary accumulated over its parts), one block (600),
    several blocks (5000: more blocks than heads, one product per head) and everything at once (1 GiB).
    On grids that the layout does not divide (the last three, the last with an empty block) a chunk is a run
    of whole blocks read by index, with their padded slots."""
    import mhla_diffusion.ops.attention as attention
    import mhla_diffusion.ops.folded_cpu as folded_cpu

    monkeypatch.setattr(folded_cpu, "CPU_CHUNK_BYTES", chunk_bytes)
    monkeypatch.setattr(folded_cpu, "CPU_MIN_PART_TOKENS", 1)  # let these tiny grids be cut as finely as asked
    folded = []
    monkeypatch.setattr(attention, "_folded_blocks", lambda *a, f=attention._folded_blocks: folded.append(1) or f(*a))
    q, k, v, _, _ = make_inputs(grid, seed=3)
    if feature_eps is not None:  # raw projections
        q, k = q - 0.5, k - 0.5
    m = num_blocks(layout)
    mixing = torch.rand((3, m, m), generator=torch.Generator().manual_seed(2), dtype=torch.float64) + 0.1
    fast = mhla_attention(q, k, v, grid, layout, mixing, feature_eps=feature_eps)
    if feature_eps is not None:
        q, k = q.relu() + feature_eps, k.relu() + feature_eps
    slow = mhla_attention_reference(q, k, v, grid, layout, mixing)
    torch.testing.assert_close(fast, slow, rtol=1e-10, atol=1e-10)
    assert folded == [1]


def test_cpu_uneven_blocks_return_the_values_dtype():
    """float64 features with float32 values on an uneven grid: computed in float64, returned in float32."""
    q, k, v, _, _ = make_inputs((5, 7), seed=5)
    mixing = mixing_init((2, 3))
    fast = mhla_attention(q, k, v.float(), (5, 7), (2, 3), mixing)
    assert fast.dtype == torch.float32
    slow = mhla_attention_reference(q, k, v, (5, 7), (2, 3), mixing).float()
    torch.testing.assert_close(fast, slow, rtol=1e-6, atol=1e-6)


def test_cpu_parts_keep_a_minimum_length(monkeypatch):
    """A block larger than the chunk is cut no finer than CPU_MIN_PART_TOKENS allows: one block of 4x6
    tokens with a 1-byte chunk and a 2-token minimum is cut into its 4 rows of 6, not into 24 single tokens."""
    import mhla_diffusion.ops.folded_cpu as folded_cpu

    monkeypatch.setattr(folded_cpu, "CPU_CHUNK_BYTES", 1)
    monkeypatch.setattr(folded_cpu, "CPU_MIN_PART_TOKENS", 2)
    products = []
    counted = folded_cpu._blocks_by_heads_bmm
    monkeypatch.setattr(
        folded_cpu, "_blocks_by_heads_bmm", lambda *a, **kw: products.append(a[0].shape) or counted(*a, **kw)
    )
    q, k, v, _, _ = make_inputs((4, 6), seed=4)
    one = torch.ones(1, 1, dtype=torch.float64)
    fast = mhla_attention(q, k, v, (4, 6), (1, 1), one)
    torch.testing.assert_close(fast, mhla_attention_reference(q, k, v, (4, 6), (1, 1), one), rtol=1e-10, atol=1e-10)
    # 2 batch entries x 4 rows, for the keys and again for the queries; each product over 6 tokens
    assert len(products) == 16 and all(shape[-1] == 6 or shape[-2] == 6 for shape in products)


def test_uneven_blocks_follow_floor_rule():
    """A hand-checked 1-D case: grid 5 cut into 2 blocks -> tokens {0,1,2} and {3,4}."""
    q = torch.ones(1, 5, 1, 1, dtype=torch.float64)
    k = torch.ones(1, 5, 1, 1, dtype=torch.float64)
    v = torch.arange(5, dtype=torch.float64).view(1, 5, 1, 1)
    mixing = torch.eye(2, dtype=torch.float64)  # each block sees only itself
    out = mhla_attention(q, k, v, (5,), (2,), mixing, normalize=True, eps=0.0)
    expected = torch.tensor([1.0, 1.0, 1.0, 3.5, 3.5], dtype=torch.float64)  # block means
    torch.testing.assert_close(out.flatten(), expected)


def test_layout_of_ones_is_global_linear_attention():
    grid = (3, 4, 5)
    q, k, v, q_rot, k_rot = make_inputs(grid)
    out = mhla_attention(q, k, v, grid, (1, 1, 1), torch.ones(1, 1, dtype=torch.float64), q_rot=q_rot, k_rot=k_rot)
    # global linear attention: q̂ (Σ k̂ vᵀ) / (q · Σ k + eps)
    state = torch.einsum("bnhd,bnhe->bhde", k_rot, v)
    numerator = torch.einsum("bnhd,bhde->bnhe", q_rot, state)
    denominator = torch.einsum("bnhd,bhd->bnh", q, k.sum(1)) + 1e-6
    torch.testing.assert_close(out, numerator / denominator[..., None], rtol=1e-12, atol=1e-12)


def test_gradcheck_float64():
    grid, layout = (3, 4), (2, 3)
    tensors = check_operator_gradients(grid, layout, normalize=True)
    q_only = [tensors[0], tensors[1], tensors[2]]
    assert torch.autograd.gradcheck(
        lambda q, k, v: mhla_attention(q, k, v, grid, layout, tensors[5].detach(), normalize=False), q_only
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_finite_and_close(dtype):
    grid, layout = (4, 6, 8), (2, 3, 4)
    q, k, v, _, _ = make_inputs(grid, heads=2, dim=16, value_dim=16, batch=1, dtype=torch.float32)
    mixing = mixing_init(layout)
    out = mhla_attention(q.to(dtype), k.to(dtype), v.to(dtype), grid, layout, mixing.to(dtype))
    assert out.dtype == dtype and torch.isfinite(out).all()
    exact = mhla_attention(q, k, v, grid, layout, mixing)
    torch.testing.assert_close(out.float(), exact, rtol=3e-2, atol=3e-2)


class _LargestTensor(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_never_forms_token_by_token_matrix():
    grid, layout = (4, 16, 16), (2, 4, 4)
    n = math.prod(grid)
    q, k, v, q_rot, k_rot = make_inputs(grid, heads=1, dim=2, value_dim=2, batch=1, dtype=torch.float32)
    with _LargestTensor() as spy:
        mhla_attention(q, k, v, grid, layout, mixing_init(layout), q_rot=q_rot, k_rot=k_rot)
    assert spy.largest < n * n // 100, f"largest intermediate {spy.largest} elements for N={n}"


@pytest.mark.parametrize(
    "kwargs,argument",
    [
        (dict(layout=(0, 2)), "`layout`"),  # no block on axis 0 (more blocks than tokens is fine: empty blocks)
        (dict(layout=(2,)), "`layout`"),  # wrong number of axes
        (dict(grid=(2, 5)), "`grid`"),  # product != N
        (dict(mixing=torch.ones(3, 3)), "`mixing`"),
        (dict(mixing=torch.ones(5, 4, 4)), "`mixing`"),
    ],
)
def test_bad_inputs_name_the_argument(kwargs, argument):
    q, k, v, _, _ = make_inputs((2, 4), dtype=torch.float32)
    args = dict(grid=(2, 4), layout=(2, 2), mixing=torch.ones(4, 4))
    args.update(kwargs)
    with pytest.raises(ValueError, match=argument):
        mhla_attention(q, k, v, args["grid"], args["layout"], args["mixing"])


def test_bad_tensor_shapes_name_the_argument():
    q, k, v, q_rot, _ = make_inputs((2, 4), dtype=torch.float32)
    mixing = torch.ones(4, 4)
    with pytest.raises(ValueError, match="`k`"):
        mhla_attention(q, k[:, :, :2], v, (2, 4), (2, 2), mixing)
    with pytest.raises(ValueError, match="`v`"):
        mhla_attention(q, k, v[:, :4], (2, 4), (2, 2), mixing)
    with pytest.raises(ValueError, match="`q_rot`"):
        mhla_attention(q, k, v, (2, 4), (2, 2), mixing, q_rot=q_rot[..., :2])
