"""The fused Triton MHLA forward against the O(N^2) reference, run on this CPU through Triton's interpreter.

The public entry (the custom op of :mod:`mhla_diffusion.ops.fused_op`) launches the kernels on CPU tensors when
``TRITON_INTERPRET=1`` is set (an autouse fixture sets it here; without it the op runs the eager operator), and the
kernels take the interpreter for CPU tensors whatever ``TRITON_INTERPRET`` said when Triton was first imported in this
process, so these tests need no GPU and no environment set before the session starts; a subprocess checks the other
import mode. The interpreter's bfloat16 ``tl.dot`` is wrong, so the tests pass ``dot_dtype=torch.float32``. Sizes are
tiny: the interpreter runs every program instance in Python.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

from mhla_diffusion import mhla_attention_reference, num_blocks
from mhla_diffusion.models.processors.base import apply_interleaved_rotary
from mhla_diffusion.ops import rope_tables, triton_mhla
from mhla_diffusion.ops.block_layout import block_plan
from mhla_diffusion.ops.fused_op import mhla_attention_fused
from mhla_diffusion.ops.triton_mhla import fused_available

EVEN, UNEVEN, EMPTY = ((4, 4, 6), (2, 2, 3)), ((5, 6, 7), (2, 2, 3)), ((1, 4, 6), (2, 2, 3))
FP32 = dict(dot_dtype=torch.float32)


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch):
    """CPU calls of the fused op launch the Triton kernels (through the interpreter), not the eager operator."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _inputs(grid, heads=2, dim=16, value_dim=16, batch=1, dtype=torch.float64, seed=0, per_head=False):
    """Raw (pre-feature-map) ``q, k, v`` and a positive mixing for ``grid``'s layout (M from ``num_blocks``)."""
    g = torch.Generator().manual_seed(seed)
    n = math.prod(grid[0])
    q, k = (torch.randn(batch, n, heads, dim, generator=g, dtype=dtype) for _ in range(2))
    v = torch.randn(batch, n, heads, value_dim, generator=g, dtype=dtype)
    m = num_blocks(grid[1])
    mixing = torch.rand((heads, m, m) if per_head else (m, m), generator=g) + 0.1
    return q, k, v, mixing


def _rope(grid: tuple[int, ...], dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Diffusers' Wan RoPE tables ``(1, N, 1, D)`` for a token grid (patch size 1)."""
    rope = WanRotaryPosEmbed(dim, (1, 1, 1), max_seq_len=64)
    return rope(torch.zeros(1, 1, *grid))


def _reference(q, k, v, plan, mixing, cos=None, sin=None, normalize="denominator", feature_eps=1e-6, eps=1e-6):
    """The contract: the O(N^2) reference of ``phi(q), phi(k)`` with RoPE after the map, in float64."""
    q, k, v = (t.double() for t in (q, k, v))
    phi_q, phi_k = torch.relu(q) + feature_eps, torch.relu(k) + feature_eps
    rot = {}
    if cos is not None:
        rot = dict(q_rot=apply_interleaved_rotary(phi_q, cos, sin), k_rot=apply_interleaved_rotary(phi_k, cos, sin))
    return mhla_attention_reference(
        phi_q, phi_k, v, plan.grid, plan.layout, mixing.double(), normalize=normalize, eps=eps, **rot
    )


def _assert_matches(got: torch.Tensor, want: torch.Tensor, rtol: float = 1e-5) -> None:
    scale = want.abs().max().item()
    torch.testing.assert_close(got.double(), want.double(), rtol=rtol, atol=rtol * scale)


@pytest.mark.parametrize("grid", [EVEN, UNEVEN, EMPTY], ids=["even", "uneven", "empty-blocks"])
@pytest.mark.parametrize("rope", [False, True], ids=["no-rope", "rope"])
@pytest.mark.parametrize("normalize", ["denominator", "none"])
def test_matches_reference(grid, rope, normalize):
    q, k, v, mixing = _inputs(grid)
    plan = block_plan(*grid)
    cos, sin = _rope(grid[0], q.shape[-1]) if rope else (None, None)
    out = mhla_attention_fused(q, k, v, plan, mixing, cos=cos, sin=sin, normalize=normalize, **FP32)
    assert out.shape == v.shape and out.dtype == v.dtype
    _assert_matches(out, _reference(q, k, v, plan, mixing, cos, sin, normalize))


def test_per_head_mixing_batch_and_head_dims_of_the_tiny_models():
    """Per-head ``(H, M, M)`` mixing, batch 2, and head dims that are not powers of two (the tiny Wan's 12;
    the value dim 136 spans two value tiles of the summaries kernel)."""
    q, k, v, mixing = _inputs(UNEVEN, heads=2, dim=12, value_dim=136, batch=2, seed=1, per_head=True)
    plan = block_plan(*UNEVEN)
    cos, sin = _rope(UNEVEN[0], 12)
    out = mhla_attention_fused(q, k, v, plan, mixing, cos=cos, sin=sin, **FP32)
    _assert_matches(out, _reference(q, k, v, plan, mixing, cos, sin))


@pytest.mark.parametrize("normalize", ["denominator", "none"])
def test_blocks_of_several_slot_tiles(normalize):
    """Blocks longer than a slot tile (192 slots: 6 tiles of 32), uneven (the second block's last column is
    padding): the loops accumulate S and z over tiles, and the output kernel walks every tile."""
    grid = ((4, 8, 11), (1, 1, 2))
    q, k, v, mixing = _inputs(grid, heads=1, seed=12)
    plan = block_plan(*grid)
    assert plan.block_len == 192 and plan.valid is not None
    assert triton_mhla._tiles(plan.block_len, 16, 16).block_t == 32
    cos, sin = _rope(grid[0], 16)
    out = mhla_attention_fused(q, k, v, plan, mixing, cos=cos, sin=sin, normalize=normalize, **FP32)
    _assert_matches(out, _reference(q, k, v, plan, mixing, cos, sin, normalize))


def test_odd_head_dim_without_rope():
    q, k, v, mixing = _inputs(EVEN, dim=7, value_dim=8, seed=2)
    plan = block_plan(*EVEN)
    out = mhla_attention_fused(q, k, v, plan, mixing, **FP32)
    _assert_matches(out, _reference(q, k, v, plan, mixing))


def test_reads_non_contiguous_inputs_in_place():
    """q, k, v as slices of one fused projection ``(B, N, 3, H, D)``, RoPE tables as views of wider ones."""
    grid, layout = UNEVEN
    n, heads, dim = math.prod(grid), 2, 16
    qkv = torch.randn(1, n, heads, 3, dim, generator=torch.Generator().manual_seed(4))
    q, k, v = qkv.unbind(3)
    assert not q.is_contiguous()
    cos, sin = _rope(grid, dim)
    wide = torch.cat([cos, sin], dim=-1)  # (1, N, 1, 2D): cos and sin are strided views into it
    cos, sin = wide[..., :dim], wide[..., dim:]
    mixing = _inputs(UNEVEN, seed=5)[3]
    plan = block_plan(grid, layout)
    out = mhla_attention_fused(q, k, v, plan, mixing, cos=cos, sin=sin, **FP32)
    assert out.is_contiguous()
    _assert_matches(out, _reference(q, k, v, plan, mixing, cos, sin))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs(dtype):
    """bf16 carries the key sums as a column of the summaries, float16 keeps them apart in float32."""
    q, k, v, mixing = _inputs(UNEVEN, dtype=dtype, seed=6)
    plan = block_plan(*UNEVEN)
    cos, sin = _rope(UNEVEN[0], 16)
    out = mhla_attention_fused(q, k, v, plan, mixing, cos=cos, sin=sin, **FP32)
    assert out.dtype == dtype
    # the reference of the same bf16 values, in float64: only the output's bf16 rounding differs
    _assert_matches(out, _reference(q, k, v, plan, mixing, cos, sin), rtol=1e-2)


def _random_rope(n: int, dim: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE tables ``(1, n, 1, dim)`` of random angles (each pair's channels equal): no grid axis explains them."""
    angle = torch.rand(1, n, 1, dim // 2, generator=torch.Generator().manual_seed(seed)) * 6.0 - 3.0
    angle = angle.repeat_interleave(2, dim=-1)
    return angle.cos(), angle.sin()


def test_wan_tables_become_an_angle_plan_and_other_tables_are_read():
    """Diffusers' Wan tables are computed from the grid (the plan reproduces them within 2e-6 at Wan2.1-1.3B's
    21x30x50 and 21x30x52 tokens, float32); random angles, or Wan's tables on a grid whose axes they do not follow,
    are read."""
    for grid in ((21, 30, 50), (21, 30, 52)):
        cos, sin = _rope(grid, 128)
        plan, deviation = rope_tables._angle_plan(cos, sin, grid)
        assert deviation.item() < 2e-6 and plan.shape == (3, 64) and plan.dtype == torch.float32
    assert plan[2].tolist() == [0.0] * 22 + [1.0] * 21 + [2.0] * 21  # Wan's frames, rows, columns split
    operand = rope_tables.rotary_operand(cos, sin, torch.bfloat16, (21, 30, 52))
    assert operand.angles and (operand.plane, operand.width) == (30 * 52, 52) and torch.equal(operand.first, plan)
    cos, sin = _rope(EVEN[0], 16)
    assert not rope_tables.rotary_operand(cos, sin, torch.float32, EVEN[0][::-1]).angles
    cos, sin = _random_rope(96, 16)
    tables = rope_tables.rotary_operand(cos, sin, torch.bfloat16, EVEN[0])
    assert not tables.angles and torch.equal(tables.second, sin[0, :, 0, 0::2].bfloat16())


@pytest.mark.parametrize("grid", [EVEN, UNEVEN], ids=["even", "uneven"])
def test_tables_that_no_grid_explains_are_read(grid):
    """The table path of the kernels (random angles: no fit), forward and backward against the reference."""
    q, k, v, mixing = _inputs(grid, seed=12)
    plan = block_plan(*grid)
    cos, sin = _random_rope(q.shape[1], 16, seed=3)
    assert not rope_tables.rotary_operand(cos, sin, torch.float32, plan.grid).angles
    leaves = [t.clone().requires_grad_() for t in (q, k, v, mixing)]
    out = mhla_attention_fused(*leaves[:3], plan, leaves[3], cos=cos, sin=sin, **FP32)
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v, mixing)]
    want = _reference(*ref_leaves[:3], plan, ref_leaves[3], cos.double(), sin.double())
    _assert_matches(out, want)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(4), dtype=out.dtype)
    out.backward(grad)
    want.backward(grad.double())
    for got, expected in zip(leaves, ref_leaves):
        _assert_matches(got.grad, expected.grad)


def test_rotary_operand_is_made_once_for_the_same_tables():
    """The angle plan (or the half copy of tables) is made once for the tensors a transformer forward passes to
    all its layers, and made again whenever they may differ: other objects, an in-place write, another dtype or
    grid. Inference tensors (no version counter) are read as tables, converted every call (no fit to repeat)."""
    make = rope_tables._prepared_rotary
    cos, sin = _rope(EVEN[0], 16)
    first, made = make(cos, sin, torch.bfloat16, EVEN[0])
    assert made and first.angles and first.first.dtype == torch.float32
    again, made = make(cos, sin, torch.bfloat16, EVEN[0])
    assert not made and again is first
    assert make(cos.clone(), sin, torch.bfloat16, EVEN[0])[1]  # another object with equal values
    assert make(cos, sin, torch.float16, EVEN[0])[1]
    assert make(cos, sin, torch.float16, (1, 16, 6))[1]
    cos, sin = _rope(EVEN[0], 16)
    make(cos, sin, torch.bfloat16, EVEN[0])
    sin[..., :4].add_(0.25)  # through a view: the shared version counter moves
    changed, made = make(cos, sin, torch.bfloat16, EVEN[0])
    assert made and not changed.angles  # cos² + sin² is no longer 1 in the first pairs: no angle gives them
    with torch.inference_mode():
        cos, sin = _rope(EVEN[0], 16)
    for _ in range(2):
        tables, made = make(cos, sin, torch.bfloat16, EVEN[0])
        assert made and not tables.angles and torch.equal(tables.first, cos[0, :, 0, 0::2].bfloat16())
    views, made = make(cos, sin, torch.float32, EVEN[0])  # already in the dtype: views, nothing converted
    assert views.first.data_ptr() == cos.data_ptr()


def test_rope_tables_are_read_while_a_cuda_graph_is_captured(monkeypatch):
    """No fit (a host sync) while a CUDA graph is captured, and nothing cached: converted tables every call."""
    cos, sin = _rope(EVEN[0], 16)
    rope_tables._prepared_rotary(cos, sin, torch.bfloat16, EVEN[0])  # cached before the capture
    monkeypatch.setattr(rope_tables, "_capturing", lambda device: True)
    first, made = rope_tables._prepared_rotary(cos, sin, torch.bfloat16, EVEN[0])
    assert made and not first.angles and rope_tables._prepared_rotary(cos, sin, torch.bfloat16, EVEN[0])[1]
    assert torch.equal(first.first, cos[0, :, 0, 0::2].bfloat16())


def test_changed_rope_tables_are_never_read_stale():
    """Two fused calls with the same table objects, written in place between them: the second call uses the
    new angles (the kernels compute them from the angle plan cached by the first call until the write).
    Then a write that leaves no plan: the tables are read."""
    q, k, v, mixing = _inputs(UNEVEN, dtype=torch.bfloat16, seed=11)
    plan = block_plan(*UNEVEN)
    cos, sin = _rope(UNEVEN[0], 16)
    mhla_attention_fused(q, k, v, plan, mixing, cos=cos, sin=sin, **FP32)
    angle = torch.atan2(sin, cos) + 0.5
    cos.copy_(angle.cos())
    sin.copy_(angle.sin())
    out = mhla_attention_fused(q, k, v, plan, mixing, cos=cos, sin=sin, **FP32)
    _assert_matches(out, _reference(q, k, v, plan, mixing, cos, sin), rtol=1e-2)
    random_cos, random_sin = _random_rope(cos.shape[1], 16)
    cos.copy_(random_cos)
    sin.copy_(random_sin)
    out = mhla_attention_fused(q, k, v, plan, mixing, cos=cos, sin=sin, **FP32)
    _assert_matches(out, _reference(q, k, v, plan, mixing, cos, sin), rtol=1e-2)


def test_float32_accumulation_under_autocast():
    q, k, v, mixing = (t.float() for t in _inputs(EVEN, seed=7))
    plan = block_plan(*EVEN)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = mhla_attention_fused(q, k, v, plan, mixing, **FP32)
    assert out.dtype == torch.float32
    _assert_matches(out, _reference(q, k, v, plan, mixing))


@pytest.mark.parametrize("normalize", ["denominator", "none"])
def test_backward_matches_autograd_through_the_reference(normalize):
    grid = EMPTY
    q, k, v, mixing = _inputs(grid, seed=8, per_head=True)
    mixing = mixing.double()
    plan = block_plan(*grid)
    cos, sin = _rope(grid[0], 16)
    cos, sin = cos.double(), sin.double()
    weight = torch.randn(v.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)

    def grads(fn):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, mixing)]
        (fn(*leaves) * weight).sum().backward()
        return [t.grad for t in leaves]

    fused = grads(lambda *t: mhla_attention_fused(*t[:3], plan, t[3], cos=cos, sin=sin, normalize=normalize, **FP32))
    want = grads(lambda *t: _reference(*t[:3], plan, t[3], cos, sin, normalize))
    for name, got, ref in zip(("q", "k", "v", "mixing"), fused, want):
        # the fused backward accumulates in float32 (float64 inputs included)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item(), msg=name)


def test_scalar_mixed_denominator_is_left_to_the_eager_operator():
    q, k, v, mixing = _inputs(EVEN)
    with pytest.raises(NotImplementedError, match="scalar_mixed_denominator"):
        mhla_attention_fused(q, k, v, block_plan(*EVEN), mixing, normalize="scalar_mixed_denominator")


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(cos="short"), r"`cos` must be Diffusers' RoPE table of shape \(1, 96, 1, 16\)"),
        (dict(cos="only"), r"`cos` and `sin` must be given together"),
        (dict(dot_dtype=torch.float64), r"`dot_dtype` must be torch.float32"),
        (dict(dot_dtype=torch.bfloat16), r"`dot_dtype=torch.bfloat16` is wrong under Triton's interpreter"),
        (dict(plan="other"), r"`plan` was built for grid \(5, 6, 7\) \(210 tokens\) but q has N=96"),
        (dict(mixing="wrong"), r"`mixing` must have shape \(12, 12\)"),
    ],
)
def test_bad_input_gives_a_one_line_error(change, message):
    q, k, v, mixing = _inputs(EVEN)
    plan = block_plan(*EVEN)
    cos, sin = _rope(EVEN[0], 16)
    kwargs = dict(cos=None, sin=None)
    if change.get("cos") == "short":
        kwargs = dict(cos=cos[:, :-1], sin=sin[:, :-1])
    elif change.get("cos") == "only":
        kwargs = dict(cos=cos, sin=None)
    if "dot_dtype" in change:
        kwargs["dot_dtype"] = change["dot_dtype"]
    if change.get("plan") == "other":
        plan = block_plan(*UNEVEN)
    if change.get("mixing") == "wrong":
        mixing = mixing[:-1]
    with pytest.raises(ValueError, match=message) as error:
        mhla_attention_fused(q, k, v, plan, mixing, **kwargs)
    assert "\n" not in str(error.value)


def test_fused_available(monkeypatch):
    cpu = torch.zeros(1)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not fused_available(cpu)  # CPU tensors only through the interpreter, on request
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert fused_available(cpu)
    with monkeypatch.context() as patch:  # torch.compile keeps the fused path (one custom op)
        patch.setattr(torch.compiler, "is_compiling", lambda: True)
        assert fused_available(cpu)
    monkeypatch.setattr(triton_mhla, "FUSED", False)  # the switch MHLA_FUSED=0 sets
    assert not fused_available(cpu)


@pytest.mark.slow
def test_switch_and_interpreter_mode_from_the_environment():
    """In a fresh process: ``MHLA_FUSED=0`` turns the path off, and with ``TRITON_INTERPRET=1`` set before
    Triton is imported (triton.language's helpers then built for the interpreter) the kernels still match."""
    script = textwrap.dedent(
        """
        import torch
        from mhla_diffusion.ops.block_layout import block_plan
        from mhla_diffusion.ops.fused_op import mhla_attention_fused
        from mhla_diffusion.ops.triton_mhla import FUSED, fused_available
        from mhla_diffusion import mhla_attention_reference
        print(FUSED, fused_available(torch.zeros(1)))
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 12, 1, 16, generator=g) for _ in range(3))
        plan = block_plan((3, 4), (2, 2))
        mixing = torch.rand(4, 4, generator=g) + 0.1
        out = mhla_attention_fused(q, k, v, plan, mixing, dot_dtype=torch.float32)
        want = mhla_attention_reference(q.relu() + 1e-6, k.relu() + 1e-6, v, (3, 4), (2, 2), mixing)
        print((out - want).abs().max().item() < 1e-5)
        """
    )
    env = {**os.environ, "TRITON_INTERPRET": "1", "MHLA_FUSED": "0"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False", "False", "True"]


#: Wan2.1-1.3B's attention: batch 1, 12 heads of 128 channels, bf16, the released 3x5x10 blocks; 81 frames
#: at 480x800 (21x30x50 tokens: even blocks of 7x6x5) and 480x832 (21x30x52: uneven, padded blocks)
WAN_13B = dict(batch=1, heads=12, dim=128, grids=((21, 30, 50), (21, 30, 52)))


def _wan_launches(monkeypatch) -> list[tuple[str, object, tuple, dict]]:
    """The kernel launches of :func:`_fused_forward` at Wan2.1-1.3B's shapes, as CUDA takes them: the
    launchers run on meta tensors of the processor's layout (q, k, v ``(1, N, 12, 128)`` bf16 from the
    projections, float32 RoPE tables ``(1, N, 1, 128)``, a plan of the released layout, bf16 dots), with the
    autotuned kernels swapped for a recorder. Per launch: kernel name, the autotuner, args and kwargs; for
    the released setting (no denominator) and the paper's (denominator) on each grid."""
    from mhla_diffusion import MHLAConfig

    launches = []
    tuned = triton_mhla._tuned

    class Recorder:
        def __init__(self, name, tuner):
            self.name, self.tuner = name, tuner

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((self.name, self.tuner, args, kwargs))

    def recording(name, interpret, tiles):
        kernel, options = tuned(name, interpret, tiles)
        assert not interpret and options == {}  # meta tensors take CUDA's path: the autotuner chooses
        return Recorder(name, kernel), options

    monkeypatch.setattr(triton_mhla, "_tuned", recording)
    layout = tuple(MHLAConfig.released_wan().layout)
    assert layout == (3, 5, 10)
    b, h, d = WAN_13B["batch"], WAN_13B["heads"], WAN_13B["dim"]
    for grid in WAN_13B["grids"]:
        n = math.prod(grid)
        # the projections' (B, N, H * D) outputs unflattened, as the Wan processor passes them
        q, k, v = (torch.empty(b, n, h * d, device="meta", dtype=torch.bfloat16).unflatten(2, (h, d)) for _ in "qkv")
        cos, sin = (torch.empty(1, n, 1, d, device="meta") for _ in "cs")
        plan = block_plan(grid, layout, "meta")
        mixing = torch.empty(plan.num_blocks, plan.num_blocks, device="meta")
        for normalize in ("none", "denominator"):
            triton_mhla._fused_forward(q, k, v, plan, mixing, cos, sin, 1e-6, normalize, 1e-6, torch.bfloat16)
    return launches


@pytest.mark.slow
def test_launched_specialisations_compile_for_ampere_ada_and_hopper_without_spills(tmp_path, monkeypatch):
    """The interpreter accepts more than the compiler: compile, without a GPU, exactly what the fused forward
    launches at Wan2.1-1.3B's shapes, every autotuner config, for sm_80, sm_89 and sm_90, bound as Triton
    binds the captured arguments (:mod:`helpers.triton_compile`), and check in ptxas' own log that nothing
    spills, in the PTX and Triton's GPU IR that every tile of rows is loaded in 16-byte vectors (the 8-byte copies
    left are the int64 slot indices, one a thread), and that pipelined loops copy ahead
    (``cp.async``). Prints registers per kernel, config and target (``pytest -s``)."""
    triton = pytest.importorskip("triton")
    from helpers.triton_compile import bind_launch, compile_launch, tile_load_widths, unsupported

    reason = unsupported(triton)
    if reason:
        pytest.skip(reason)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # compile for real, not from an earlier run's cache
    launches = _wan_launches(monkeypatch)
    assert [name for name, *_ in launches] == ["_summaries_kernel", "_output_kernel"] * 4
    report, compiled = [], set()
    for arch in (80, 89, 90):
        for index, (name, tuner, args, kwargs) in enumerate(launches):
            for config in tuner.configs:
                launch = {**kwargs, **config.all_kwargs()}
                spec, key, _, _ = bind_launch(tuner.fn, args, launch, arch)
                grid = WAN_13B["grids"][index // 4]
                assert spec["HAS_VALID"] == ("constexpr", grid[2] % 10 != 0)  # 52 columns: uneven blocks
                rows = ("skn", "skh", "svn", "svh") if name == "_summaries_kernel" else ("sqn", "sqh", "son", "soh")
                assert all(spec[s] == ("i32", "D") for s in rows), spec  # 32-bit, multiples of 16
                channels = ("skd", "svd") if name == "_summaries_kernel" else ("sqd", "sod")
                assert all(spec[s] == ("constexpr", 1) for s in (*channels, "scd", "ssd", "s_d")), spec
                if key in compiled:  # the same specialisation from another launch
                    continue
                compiled.add(key)
                kernel = compile_launch(tuner.fn, args, launch, arch)
                # rows move in 16-byte vectors (no 2-byte global loads), and the pipelined loops copy ahead
                assert not re.search(r"ld\.global(\.\w+)*\.b16\b", kernel.ptx), (name, arch)
                assert re.search(r"ld\.global(\.\w+)*\.v4\.b32|cp\.async\.cg\.shared\.global.*, 0x10", kernel.ptx)
                assert ("cp.async" in kernel.ptx) == (config.kwargs["NUM_STAGES"] > 1), (name, arch, config)
                # every tile of rows (k, v, q, the summaries) in 16-byte accesses: 8 bf16 channels a thread
                widths = tile_load_widths(kernel.ttgir)
                assert len(widths) >= 2 and all(width == 16 for _, width in widths), (name, arch, widths)
                flags = {k: spec[k][1] for k in ("HAS_VALID", "NORMALIZE", "STORE_Z") if k in spec}
                report.append(
                    f"sm_{arch} {name} {flags} BLOCK_T={config.kwargs['BLOCK_T']} warps={config.num_warps} "
                    f"stages={config.num_stages}: {kernel.registers} registers, {kernel.spilled} bytes spilled"
                )
                assert kernel.spilled == 0, report[-1]
    # 2 kernels x 2 configs x (even, uneven) x (no denominator, denominator) x 3 targets
    assert len(report) == 2 * 2 * 2 * 2 * 3, "\n".join(report)


@pytest.mark.parametrize("setting", ["paper", "released"])
def test_processors_choose_the_fused_kernel_when_it_is_available(tiny_wan, wan_batch, monkeypatch, setting):
    """Where fused_available says so (CUDA; here the interpreter), the Wan processors run the Triton kernels,
    and the transformer's output is the eager operator's."""
    import mhla_diffusion.models.processors.base as base
    from helpers.models import run
    from mhla_diffusion import MHLAConfig, convert_to_mhla

    config = MHLAConfig(layout=(2, 2, 3)) if setting == "paper" else MHLAConfig.released_wan(layout=(2, 2, 3))
    convert_to_mhla(tiny_wan, config)
    eager = run(tiny_wan, wan_batch)
    launched = []

    def fused(*args, **kwargs):
        launched.append(kwargs["normalize"])
        return mhla_attention_fused(*args, **kwargs)

    monkeypatch.setattr(base, "fused_available", lambda tensor: True)
    monkeypatch.setattr(base, "mhla_attention_fused", fused)
    got = run(tiny_wan, wan_batch)
    assert launched and set(launched) == {config.normalization}
    torch.testing.assert_close(got, eager, rtol=1e-4, atol=1e-4)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # where the kernels run on this CPU
    assert triton_mhla.fused_available(wan_batch["hidden_states"])
    monkeypatch.setattr(triton_mhla, "FUSED", False)  # the switch (MHLA_FUSED=0) leaves the eager operator
    assert not triton_mhla.fused_available(wan_batch["hidden_states"])
