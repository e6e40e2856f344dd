"""The fused Triton MHLA forward against the O(N^2) reference, run on this CPU through Triton's interpreter.

CPU tensors always take the interpreter (whatever ``TRITON_INTERPRET`` said when Triton was first imported
in this process), so these tests need no GPU and no environment set before the session starts; a
subprocess checks the other import mode. The interpreter's bfloat16 ``tl.dot`` is wrong, so the tests pass
``dot_dtype=torch.float32``. Sizes are tiny: the interpreter runs every program instance in Python.
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
from mhla_diffusion.ops import triton_mhla
from mhla_diffusion.ops.block_layout import block_plan
from mhla_diffusion.ops.triton_mhla import fused_available, mhla_attention_fused

EVEN, UNEVEN, EMPTY = ((4, 4, 6), (2, 2, 3)), ((5, 6, 7), (2, 2, 3)), ((1, 4, 6), (2, 2, 3))
FP32 = dict(dot_dtype=torch.float32)


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


def test_bf16_inputs():
    q, k, v, mixing = _inputs(UNEVEN, dtype=torch.bfloat16, seed=6)
    plan = block_plan(*UNEVEN)
    cos, sin = _rope(UNEVEN[0], 16)
    out = mhla_attention_fused(q, k, v, plan, mixing, cos=cos, sin=sin, **FP32)
    assert out.dtype == torch.bfloat16
    # the reference of the same bf16 values, in float64: only the output's bf16 rounding differs
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
        # the backward recomputes in the inputs' dtype (float64 here): it matches to rounding
        torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-9 * ref.abs().max().item(), msg=name)


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
    with monkeypatch.context() as patch:  # while torch.compile traces, the eager operator is the one compiled
        patch.setattr(torch.compiler, "is_compiling", lambda: True)
        assert not fused_available(cpu)
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
        from mhla_diffusion.ops.triton_mhla import FUSED, fused_available, mhla_attention_fused
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


def _signature(kernel, pointers: dict[str, str], constexprs: dict) -> dict[str, str]:
    """Triton signature of one of the module's kernels: pointer types by name, the rest 32-bit ints
    (``feature_eps``/``eps`` float32), ``constexpr`` for the compile-time parameters."""
    import inspect

    floats = {"feature_eps", "eps"}
    return {
        name: "constexpr" if name in constexprs else pointers.get(name, "fp32" if name in floats else "i32")
        for name in inspect.signature(kernel).parameters
    }


@pytest.mark.slow
def test_kernels_compile_for_a_hopper_gpu(tmp_path, monkeypatch):
    """The interpreter accepts more than the compiler: compile both kernels ahead of time, without a GPU,
    for sm_90 with the tiles and warps Wan's launch takes (bf16 inputs, dots, RoPE tables and summaries,
    D = Dv = 128, uneven blocks of 240 slots, denominator), and check with ptxas that no register spills."""
    triton = pytest.importorskip("triton")
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if "nvidia" not in triton.backends.backends:
        pytest.skip("this Triton has no NVIDIA backend to compile with")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # compile for real, not from an earlier run's cache
    tiles = triton_mhla._tiles(240, 128, 128)
    assert (tiles.block_dh, tiles.block_dv, tiles.value_tiles, tiles.num_warps) == (64, 128, 1, 8)
    common = dict(
        BLOCK_T=tiles.block_t, BLOCK_DH=tiles.block_dh, HAS_VALID=True, HAS_ROPE=True, DOT_DTYPE=tl.bfloat16, IEEE=False
    )
    pointers = dict(cos_ptr="*bf16", sin_ptr="*bf16", gather_ptr="*i64", valid_ptr="*u8", s_ptr="*bf16", z_ptr="*fp32")
    kernels = [
        (
            triton_mhla._summaries_kernel,
            dict(k_ptr="*bf16", v_ptr="*bf16"),
            dict(BLOCK_DV=tiles.block_dv, STORE_Z=True),
        ),
        (triton_mhla._output_kernel, dict(q_ptr="*bf16", o_ptr="*bf16"), dict(BLOCK_DV=tiles.out_dv, NORMALIZE=True)),
    ]
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    for fn, own_pointers, own in kernels:
        constexprs = {**common, **own}
        source = ASTSource(triton.jit(fn), _signature(fn, {**pointers, **own_pointers}, constexprs), constexprs)
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=tiles.num_warps))
        assert compiled.asm["cubin"], fn.__name__
        if os.path.exists(ptxas):
            ptx = tmp_path / f"{fn.__name__}.ptx"
            ptx.write_text(compiled.asm["ptx"])
            done = subprocess.run(
                [ptxas, "-v", "-arch=sm_90a", str(ptx), "-o", os.devnull], capture_output=True, text=True, timeout=120
            )
            assert done.returncode == 0, done.stderr[-2000:]
            assert re.search(r"(?<!\d)0 bytes spill stores", done.stderr), (fn.__name__, done.stderr)


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
