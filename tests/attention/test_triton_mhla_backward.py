"""The fused Triton MHLA backward against autograd through the O(N^2) reference, run on this CPU through
Triton's interpreter (CPU tensors always take it; float32 dots, as its bfloat16 ``tl.dot`` is wrong).

Sizes are tiny: the interpreter runs every program instance in Python, and its ``tl.reduce`` with the
kernels' own adder runs element by element. A subprocess checks the other import mode (``TRITON_INTERPRET=1``
set before Triton is imported), and a compile test runs ptxas on the launches at Wan's shapes.
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
from mhla_diffusion.ops import triton_mhla_backward
from mhla_diffusion.ops.block_layout import block_plan
from mhla_diffusion.ops.triton_mhla import fused_traffic
from mhla_diffusion.ops.triton_mhla_backward import (
    fused_backward_traffic,
    mhla_attention_fused_backward,
    recording_backward_launches,
)

EVEN, UNEVEN, EMPTY = ((4, 4, 6), (2, 2, 3)), ((3, 5, 7), (2, 2, 3)), ((1, 4, 6), (2, 2, 3))
GRIDS = {"even": EVEN, "uneven": UNEVEN, "empty-blocks": EMPTY}


def _inputs(grid, heads=2, dim=16, value_dim=16, batch=1, dtype=torch.float64, seed=0, per_head=False, rope=True):
    """Raw (pre-feature-map) ``q, k, v``, a positive float64 mixing, RoPE tables (or ``None``) and the plan."""
    g = torch.Generator().manual_seed(seed)
    n = math.prod(grid[0])
    q, k = (torch.randn(batch, n, heads, dim, generator=g, dtype=dtype) for _ in range(2))
    v = torch.randn(batch, n, heads, value_dim, generator=g, dtype=dtype)
    m = num_blocks(grid[1])
    mixing = (torch.rand((heads, m, m) if per_head else (m, m), generator=g) + 0.1).double()
    cos = sin = None
    if rope:
        cos, sin = WanRotaryPosEmbed(dim, (1, 1, 1), max_seq_len=64)(torch.zeros(1, 1, *grid[0]))
    return q, k, v, mixing, cos, sin, block_plan(*grid)


def _reference(q, k, v, plan, mixing, cos=None, sin=None, normalize="denominator", feature_eps=1e-6, eps=1e-6):
    """The contract: the O(N^2) reference of ``phi(q), phi(k)`` with RoPE after the map, in float64."""
    q, k, v = (t.double() for t in (q, k, v))
    phi_q, phi_k = torch.relu(q) + feature_eps, torch.relu(k) + feature_eps
    rot = {}
    if cos is not None:
        cos, sin = cos.double(), sin.double()
        rot = dict(q_rot=apply_interleaved_rotary(phi_q, cos, sin), k_rot=apply_interleaved_rotary(phi_k, cos, sin))
    return mhla_attention_reference(
        phi_q, phi_k, v, plan.grid, plan.layout, mixing.double(), normalize=normalize, eps=eps, **rot
    )


def _want(grad_out, q, k, v, mixing, cos, sin, plan, normalize):
    """``(dq, dk, dv, dmixing)`` by autograd through :func:`_reference`, in float64."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, mixing)]
    out = _reference(*leaves[:3], plan, leaves[3], cos, sin, normalize)
    return torch.autograd.grad(out, leaves, grad_out.double())


def _check(got, want, inputs, rtol=1e-5):
    """Each gradient in its input's dtype and shape, within ``rtol`` of the largest reference entry."""
    for name, g, w, x in zip(("dq", "dk", "dv", "dmixing"), got, want, inputs):
        assert g.shape == x.shape and g.dtype == x.dtype, name
        scale = w.abs().max().item()
        torch.testing.assert_close(g.double(), w, rtol=rtol, atol=rtol * scale, msg=name)


@pytest.mark.parametrize(
    "grid,rope,normalize,per_head",
    [
        ("even", True, "denominator", False),
        ("uneven", True, "denominator", True),
        ("empty-blocks", True, "none", True),
        ("empty-blocks", False, "denominator", False),
        ("uneven", False, "none", False),
    ],
)
def test_matches_autograd_through_the_reference(grid, rope, normalize, per_head):
    """float64 inputs (computed in float32), float32 dots: the gradients to float32 rounding."""
    q, k, v, mixing, cos, sin, plan = _inputs(GRIDS[grid], seed=3, per_head=per_head, rope=rope)
    grad_out = torch.randn(v.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got = mhla_attention_fused_backward(grad_out, q, k, v, mixing, cos, sin, plan, 1e-6, normalize, 1e-6, torch.float32)
    _check(got, _want(grad_out, q, k, v, mixing, cos, sin, plan, normalize), (q, k, v, mixing))


def test_head_dims_that_are_not_powers_of_two_batch_and_strided_inputs():
    """D = 12, Dv = 20 (padded tiles), batch 2, per-head mixing; q, k, v slices of one projection, RoPE
    tables and the output gradient strided views, float32 inputs under autocast: read where they lie, and
    the mixing's backward still in float32."""
    grid = EMPTY
    n, heads = math.prod(grid[0]), 2
    g = torch.Generator().manual_seed(4)
    qkv = torch.randn(2, n, heads, 12 + 12 + 20, generator=g)
    q, k, v = qkv[..., :12], qkv[..., 12:24], qkv[..., 24:]
    mixing = _inputs(grid, heads=heads, per_head=True, seed=5)[3].float()
    cos, sin = WanRotaryPosEmbed(12, (1, 1, 1), max_seq_len=64)(torch.zeros(1, 1, *grid[0]))
    wide = torch.cat([cos, sin], dim=-1)
    cos, sin = wide[..., :12], wide[..., 12:]
    grad_out = torch.randn(2, n, 20, heads, generator=g).transpose(2, 3)  # (B, N, H, Dv), not contiguous
    plan = block_plan(*grid)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = mhla_attention_fused_backward(
            grad_out, q, k, v, mixing, cos, sin, plan, 1e-6, "denominator", 1e-6, torch.float32
        )
    _check(got, _want(grad_out, q, k, v, mixing, cos, sin, plan, "denominator"), (q, k, v, mixing))


def test_odd_head_dim_without_rope():
    q, k, v, mixing, _, _, plan = _inputs(EVEN, dim=7, value_dim=8, seed=6, rope=False)
    grad_out = torch.randn(v.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    got = mhla_attention_fused_backward(grad_out, q, k, v, mixing, None, None, plan, 1e-6, True, 1e-6, None)
    _check(got, _want(grad_out, q, k, v, mixing, None, None, plan, "denominator"), (q, k, v, mixing))


def test_bf16_inputs():
    """bf16 q, k, v and gradient: bf16 gradients; the summaries and their gradients stored in bf16 (as the
    forward stores them) against the float64 reference of the same bf16 values."""
    q, k, v, mixing, cos, sin, plan = _inputs(UNEVEN, dtype=torch.bfloat16, seed=8)
    mixing = mixing.float()
    grad_out = torch.randn(v.shape, generator=torch.Generator().manual_seed(9)).bfloat16()
    got = mhla_attention_fused_backward(
        grad_out, q, k, v, mixing, cos, sin, plan, 1e-6, "denominator", 1e-6, torch.float32
    )
    want = _want(grad_out, q, k, v, mixing, cos, sin, plan, "denominator")
    assert [t.dtype for t in got] == [torch.bfloat16] * 3 + [torch.float32]
    _check(got, want, (q, k, v, mixing), rtol=3e-2)


def test_meta_tensors_launch_nothing_and_record_the_launch():
    q, k, v = (torch.empty(1, 60, 2, 8, device="meta", dtype=torch.bfloat16) for _ in range(3))
    mixing = torch.empty(4, 4, device="meta")
    cos = sin = torch.empty(1, 60, 1, 8, device="meta")
    plan = block_plan((3, 4, 5), (1, 2, 2), "meta")
    with recording_backward_launches() as launches:
        grads = mhla_attention_fused_backward(
            torch.empty_like(v), q, k, v, mixing, cos, sin, plan, 1e-6, "none", 0, None
        )
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape, mixing.shape]
    assert [g.device.type for g in grads] == ["meta"] * 4
    (launch,) = launches
    assert launch["block_len"] == 18 and launch["padded"] and launch["normalize"] == "none"
    assert not launch["rope_converted"]  # the forward of the same step converted the tables
    assert sum(fused_backward_traffic(**launch).values()) > 0


def test_wrong_output_gradient_gives_a_one_line_error():
    q, k, v, mixing, cos, sin, plan = _inputs(EVEN)
    with pytest.raises(ValueError, match=r"`grad_out` must be the output's gradient of shape \(1, 96, 2, 16\)") as err:
        mhla_attention_fused_backward(v[:, :-1], q, k, v, mixing, cos, sin, plan, 1e-6, "denominator", 1e-6, None)
    assert "\n" not in str(err.value)


def test_backward_count_by_hand():
    """16 tokens, 2 heads of 16 channels, 4 blocks of 4 slots, bf16, float32 RoPE tables read by the kernels,
    denominator; then with an angle plan instead (Wan's tables)."""
    terms = fused_backward_traffic(1, 16, 2, 16, 16, 4, 4, recompute=True, rope_angles=False)
    forward = fused_traffic(1, 16, 2, 16, 16, 4, 4, rope_angles=False)
    qkvo = 16 * 2 * 16 * 2  # one of q, k, v, out, their gradients: 1024 bytes
    tables = 16 * 2 * 8 * 2 * 2  # per head, each token's 8 angles, cos and sin, bf16
    summaries = 2 * 4 * 16 * 16 * 2  # S, S̃, dS̃ or dS: B*H*M x D x Dv, bf16
    key_sums = forward["summaries kernel: z stored"]  # z, z̃, dz̃ or dz: as the forward stores them
    folded = key_sums == 2 * 4 * 16 * 2  # bf16, one more row of the summaries [S | z]; else float32 apart
    assert folded or key_sums == 2 * 4 * 16 * 4
    index = 2 * 4 * 4 * 8  # plan.gather (int64) of every slot, by each (batch x head)'s programs
    # the recomputation: the forward's terms but its output kernel's (and no table conversion: cached)
    recompute = {k: v for k, v in terms.items() if k.startswith("recompute: ")}
    assert recompute == {
        f"recompute: {k}": v for k, v in forward.items() if not k.startswith(("output kernel", "RoPE tables"))
    }
    assert terms["RoPE tables to the summaries' dtype (PyTorch)"] == 0
    converted = fused_backward_traffic(1, 16, 2, 16, 16, 4, 4, recompute=True, rope_converted=True, rope_angles=False)
    assert converted["RoPE tables to the summaries' dtype (PyTorch)"] == 2 * 16 * 8 * 4 + 2 * 16 * 8 * 2
    # W (64 B float32) cast to bf16 (32 B); Wᵀ dS̃: that W and dS̃ read, dS written; dW per (b, h): dS̃ and S
    # read, (B, H, M, M) float32 written (one GEMM with a float32 result), summed. Folded: dz̃ and z ride along as
    # one more row; apart: Wᵀ dz̃ and dz̃ zᵀ in float32, added
    mm = 2 * 4 * 4  # B*H*M*M elements
    if folded:
        joint = summaries + key_sums
        unmix = (64 + 32) + (32 + 2 * joint) + 2 * joint + mm * 2 + (mm * 2 + mm * 4) + (mm * 4 + 16 * 4)
    else:
        unmix = (64 + 32) + 32 + 2 * summaries + 2 * summaries + mm * 4
        unmix += 64 + 2 * key_sums + 2 * key_sums + mm * 4 + (2 * mm * 4 + mm * 4) + (mm * 4 + 16 * 4)
    assert {k: v for k, v in terms.items() if not k.startswith(("recompute: ", "RoPE tables"))} == {
        "query grad kernel: mixed summary": summaries,
        "query grad kernel: mixed key sum": key_sums,
        "query grad kernel: plan index": index,
        "query grad kernel: q": qkvo,
        "query grad kernel: output gradient": qkvo,
        "query grad kernel: RoPE tables": tables,
        "query grad kernel: dq stored": qkvo,
        "query grad kernel: dS̃ stored": summaries,
        "query grad kernel: dz̃ stored": key_sums,
        "mixing backward (PyTorch): Wᵀ dS̃, Wᵀ dz̃, dW": unmix,
        "key grad kernel: dS": summaries,
        "key grad kernel: dz": key_sums,
        "key grad kernel: plan index": index,
        "key grad kernel: k": qkvo,
        "key grad kernel: v": qkvo,
        "key grad kernel: RoPE tables": tables,
        "key grad kernel: dk stored": qkvo,
        "key grad kernel: dv stored": qkvo,
    }
    angles = fused_backward_traffic(1, 16, 2, 16, 16, 4, 4, recompute=True)
    plan = 2 * 4 * 3 * 8 * 4  # the (3, 8) float32 plan, once per (batch x head, block) program
    assert angles["query grad kernel: RoPE angle plan"] == angles["key grad kernel: RoPE angle plan"] == plan
    assert (
        angles["recompute: summaries kernel: RoPE angle plan"] == plan
        and angles["RoPE angle plan from the tables (PyTorch)"] == 0
    )
    same = {k: v for k, v in terms.items() if "RoPE" not in k}
    assert {k: v for k, v in angles.items() if "RoPE" not in k} == same


@pytest.mark.slow
def test_row_sums_in_the_other_interpreter_mode():
    """With ``TRITON_INTERPRET=1`` set before Triton is imported (triton.language's helpers then built for the
    interpreter), the kernels' ``tl.reduce`` with their own adder still runs and the gradients match."""
    script = textwrap.dedent(
        """
        import torch
        from mhla_diffusion import mhla_attention_reference
        from mhla_diffusion.ops.block_layout import block_plan
        from mhla_diffusion.ops.triton_mhla_backward import mhla_attention_fused_backward
        g = torch.Generator().manual_seed(0)
        q, k, v, grad = (torch.randn(1, 12, 1, 16, generator=g, dtype=torch.float64) for _ in range(4))
        plan = block_plan((3, 4), (2, 2))
        mixing = torch.rand(4, 4, generator=g, dtype=torch.float64) + 0.1
        leaves = [t.clone().requires_grad_() for t in (q, k, v, mixing)]
        phi_q, phi_k = leaves[0].relu() + 1e-6, leaves[1].relu() + 1e-6
        out = mhla_attention_reference(phi_q, phi_k, leaves[2], (3, 4), (2, 2), leaves[3])
        want = torch.autograd.grad(out, leaves, grad)
        got = mhla_attention_fused_backward(grad, q, k, v, mixing, None, None, plan, 1e-6, "denominator", 1e-6, None)
        print(all(((a - b).abs().max() <= 1e-5 * b.abs().max()).item() for a, b in zip(got, want)))
        """
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True"]


#: Wan2.1-1.3B's attention: batch 1, 12 heads of 128 channels, bf16, the released 3x5x10 blocks; 81 frames
#: at 480x800 (21x30x50 tokens: even blocks of 7x6x5) and 480x832 (21x30x52: uneven, padded blocks)
WAN_13B = dict(batch=1, heads=12, dim=128, grids=((21, 30, 50), (21, 30, 52)))


def _wan_backward_launches(monkeypatch) -> list[tuple[str, object, tuple, dict, dict]]:
    """The kernel launches of the fused backward at Wan2.1-1.3B's shapes as the custom op makes them, on meta
    tensors: q, k, v ``(1, N, 12, 128)`` bf16 from the projections, the output gradient ``(1, N, 12, 128)``
    bf16 (contiguous, as autograd gives the op's contiguous output's), float32 RoPE tables ``(1, N, 1, 128)``,
    a plan of the released layout, bf16 dots, and the summaries the forward kept (``saved``: made by the
    forward's ``_summary_buffers``, returned by the op's ``_kept_summaries`` and read back by its
    ``_summaries_from``), with the autotuned kernels swapped for a recorder. Per launch: kernel name, the
    autotuner, args, kwargs and the case (grid, normalisation, per-head mixing)."""
    from mhla_diffusion import MHLAConfig
    from mhla_diffusion.ops import fused_op, triton_mhla

    launches = []
    tuned = triton_mhla_backward._tuned_backward

    class Recorder:
        def __init__(self, name, tuner, case):
            self.name, self.tuner, self.case = name, tuner, case

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((self.name, self.tuner, args, kwargs, self.case))

    def recording(name, interpret, tiles):
        kernel, options = tuned(name, interpret, tiles)
        assert not interpret and "BLOCK_T" not in options  # meta tensors take CUDA's path: the autotuner chooses
        return Recorder(name, kernel, dict(case)), options

    case = {}
    monkeypatch.setattr(triton_mhla_backward, "_tuned_backward", recording)
    layout = tuple(MHLAConfig.released_wan().layout)
    assert layout == (3, 5, 10)
    b, h, d = WAN_13B["batch"], WAN_13B["heads"], WAN_13B["dim"]
    for grid in WAN_13B["grids"]:
        n = math.prod(grid)
        q, k, v = (torch.empty(b, n, h * d, device="meta", dtype=torch.bfloat16).unflatten(2, (h, d)) for _ in "qkv")
        grad_out = torch.empty(b, n, h, d, device="meta", dtype=torch.bfloat16)
        cos, sin = (torch.empty(1, n, 1, d, device="meta") for _ in "cs")
        plan = block_plan(grid, layout, "meta")
        m = plan.num_blocks
        for normalize in ("none", "denominator"):
            for per_head in (False, True):
                mixing = torch.empty((h, m, m) if per_head else (m, m), device="meta")
                summaries, key_sums = triton_mhla._summary_buffers(
                    b, h, m, d, d, torch.bfloat16, normalize == "denominator", torch.device("meta")
                )
                kept = fused_op._kept_summaries(summaries, key_sums)
                saved = fused_op._summaries_from(*kept, d, normalize)
                case.update(grid=grid, normalize=normalize, per_head=per_head)
                triton_mhla_backward._fused_backward(
                    grad_out, q, k, v, mixing, cos, sin, plan, 1e-6, normalize, 1e-6, torch.bfloat16, saved
                )
    return launches


@pytest.mark.slow
def test_launched_specialisations_compile_for_ampere_ada_and_hopper_without_spills(tmp_path, monkeypatch):
    """Compile, without a GPU, exactly what the fused backward launches at Wan2.1-1.3B's shapes (both grids,
    both normalisations, shared and per-head mixing: one query and one key kernel each) for sm_80, sm_89 and
    sm_90, bound as Triton binds the captured arguments (:mod:`helpers.triton_compile`), and check in ptxas'
    own log that nothing spills, and in the PTX and Triton's GPU IR that every tile of rows is loaded in 16-byte
    vectors (the 8-byte copies left are the int64 slot indices, one a thread). Prints registers per
    kernel, specialisation and target (``pytest -s``)."""
    triton = pytest.importorskip("triton")
    from helpers.triton_compile import bind_launch, compile_launch, tile_load_widths, unsupported

    reason = unsupported(triton)
    if reason:
        pytest.skip(reason)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # compile for real, not from an earlier run's cache
    launches = _wan_backward_launches(monkeypatch)
    assert [name for name, *_ in launches] == ["_query_grad_kernel", "_key_grad_kernel"] * 8
    report, compiled, keys = [], {}, set()
    for arch in (80, 89, 90):
        for name, tuner, args, launch_kwargs, case, config in (
            (*launch, config) for launch in launches for config in launch[1].configs
        ):
            jit, kwargs = tuner.fn, {**launch_kwargs, **config.all_kwargs()}
            spec, key, _, _ = bind_launch(jit, args, kwargs, arch)
            keys.add(key)
            assert spec["HAS_VALID"] == ("constexpr", case["grid"][2] % 10 != 0)  # 52 columns: uneven blocks
            assert spec["NORMALIZE"] == ("constexpr", case["normalize"] == "denominator")
            assert spec["D"] == spec["DV"] == ("constexpr", 128) and spec["DOT_DTYPE"][1] == triton.language.bfloat16
            tokens = ("sqn", "sqh", "sgn", "sgh") if name == "_query_grad_kernel" else ("skn", "skh", "svn", "svh")
            assert all(spec[s] == ("i32", "D") for s in tokens), spec  # 32-bit, multiples of 16
            channels = ("sqd", "sgd", "sdd") if name == "_query_grad_kernel" else ("skd", "svd", "sdkd", "sdvd")
            assert all(spec[s] == ("constexpr", 1) for s in (*channels, "scd", "ssd")), spec
            if key in compiled:  # the same specialisation from another launch (per-head mixing changes none)
                continue
            launch = compiled[key] = compile_launch(jit, args, kwargs, arch)
            # rows move in 16-byte vectors: no 2-byte global loads of q, g, k, v, the tables or the summaries
            assert not re.search(r"ld\.global(\.\w+)*\.b16\b", launch.ptx), (name, arch)
            assert re.search(r"ld\.global(\.\w+)*\.v4\.b32", launch.ptx), (name, arch)
            # every tile of rows (q, g, k, v, the summaries and their gradients) in 16-byte accesses
            widths = tile_load_widths(launch.ttgir)
            assert len(widths) >= 3 and all(width == 16 for _, width in widths), (name, arch, widths)
            flags = {f: spec[f][1] for f in ("HAS_VALID", "NORMALIZE")}
            report.append(
                f"sm_{arch} {name} {flags} BLOCK_T={kwargs['BLOCK_T']} warps={kwargs['num_warps']}: "
                f"{launch.registers} registers, {launch.spilled} bytes spilled"
            )
    print("\n" + "\n".join(report))
    # the kernels' autotuner choices x (even, uneven) x (no denominator, denominator) x 3 targets
    choices = sum(len(c) for c in triton_mhla_backward._BACKWARD_AUTOTUNE.values())
    assert len(compiled) == len(keys) == choices * 2 * 2 * 3
    assert all(launch.spilled == 0 for launch in compiled.values()), "\n".join(report)


@pytest.mark.slow
def test_the_table_path_compiles_without_spills(tmp_path, monkeypatch):
    """Tables that no angle plan fits are read by all four kernels: the heaviest launches of that path at
    Wan2.1-1.3B's shapes (uneven grid, denominator; each kernel's first autotune choice) compile for sm_90 without
    spills, forward and backward."""
    triton = pytest.importorskip("triton")
    from helpers.triton_compile import compile_launch, unsupported
    from mhla_diffusion.ops import rope_tables, triton_mhla

    reason = unsupported(triton)
    if reason:
        pytest.skip(reason)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    tables = lambda cos, sin, dtype, grid: rope_tables._table_operand(cos, sin, dtype)  # noqa: E731
    for module in (triton_mhla, triton_mhla_backward):
        monkeypatch.setattr(module, "rotary_operand", tables)
    launches = []

    class Recorder:
        def __init__(self, name, tuner):
            self.name, self.tuner = name, tuner

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((self.name, self.tuner, args, kwargs))

    for module, tuner_name in ((triton_mhla, "_tuned"), (triton_mhla_backward, "_tuned_backward")):
        tuned = getattr(module, tuner_name)
        monkeypatch.setattr(
            module,
            tuner_name,
            lambda name, interpret, tiles, tuned=tuned: (
                Recorder(name, tuned(name, interpret, tiles)[0]),
                tuned(name, interpret, tiles)[1],
            ),
        )
    grid, (b, h, d) = WAN_13B["grids"][1], (WAN_13B["batch"], WAN_13B["heads"], WAN_13B["dim"])
    n = math.prod(grid)
    q, k, v, grad_out = (torch.empty(b, n, h, d, device="meta", dtype=torch.bfloat16) for _ in range(4))
    cos, sin = (torch.empty(1, n, 1, d, device="meta") for _ in "cs")
    plan = block_plan(grid, (3, 5, 10), "meta")
    mixing = torch.empty(plan.num_blocks, plan.num_blocks, device="meta")
    triton_mhla._fused_forward(q, k, v, plan, mixing, cos, sin, 1e-6, "denominator", 1e-6, torch.bfloat16)
    triton_mhla_backward._fused_backward(
        grad_out, q, k, v, mixing, cos, sin, plan, 1e-6, "denominator", 1e-6, torch.bfloat16, None
    )
    names = [name for name, *_ in launches]
    assert names == [
        "_summaries_kernel",
        "_output_kernel",
        "_summaries_kernel",
        "_query_grad_kernel",
        "_key_grad_kernel",
    ]
    for name, tuner, args, kwargs in launches[:2] + launches[3:]:
        launch = {**kwargs, **tuner.configs[0].all_kwargs()}
        assert launch["ROPE_ANGLES"] is False and launch["HAS_ROPE"] is True
        compiled = compile_launch(tuner.fn, args, launch, 90)
        assert compiled.spilled == 0, (name, compiled.registers, compiled.spilled)


def test_saved_summaries_skip_the_recompute():
    """Given the forward's ``S, z`` the backward does not launch the summaries kernel again, and given ``S̃, z̃``
    too it does not mix again; the gradients are the same. Counted at Wan's 21x30x50, forward + backward stays
    at 18.3 U with both kept (the custom op's way; 22.3 U with the tables read instead of the angle plan), against
    more with the mixing or the summaries recomputed."""
    from mhla_diffusion.ops import triton_mhla

    q, k, v, mixing, cos, sin, plan = _inputs(EMPTY, seed=10)
    grad_out = torch.randn(v.shape, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    args = (grad_out, q, k, v, mixing, cos, sin, plan, 1e-6, "none", 1e-6, torch.float32)
    rope = triton_mhla.rotary_operand(cos, sin, torch.float32, plan.grid)
    summaries, key_sums = triton_mhla._launch_summaries(k, v, plan, rope, 1e-6, "none", torch.float32)
    saved = (summaries, key_sums)
    mixed = triton_mhla._mix(mixing, summaries, key_sums)
    want = mhla_attention_fused_backward(*args)
    for kept in (saved, (*saved, *mixed)):
        for got, expected in zip(mhla_attention_fused_backward(*args, saved=kept), want):
            torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match=r"`saved` must be \(S, z\) or \(S, z, S̃, z̃\), got 3"):
        mhla_attention_fused_backward(*args, saved=(*saved, mixed[0]))
    with pytest.raises(ValueError, match="`saved` must hold the key sums z exactly"):
        mhla_attention_fused_backward(*args[:9], "denominator", *args[10:], saved=saved)
    unit = 31_500 * 12 * 128 * 2
    wan = (1, 31_500, 12, 128, 128, 150, 210)
    forward = sum(fused_traffic(*wan).values())
    recomputed, remixed, kept = (
        sum(fused_backward_traffic(*wan, **flags).values()) for flags in ({"recompute": True}, {"remix": True}, {})
    )
    remixing = fused_backward_traffic(1, 16, 2, 16, 16, 4, 4, remix=True)
    assert [k for k in remixing if k.startswith("recompute")] == ["recompute: mixing (PyTorch): W S, W z"]
    assert not [k for k in fused_backward_traffic(1, 16, 2, 16, 16, 4, 4) if k.startswith("recompute")]
    print(f"forward {forward / unit:.2f} U; backward {recomputed / unit:.2f}, {remixed / unit:.2f}, {kept / unit:.2f}")
    assert (recomputed - remixed) / unit > 2.5 and (remixed - kept) / unit > 1.2
    assert (forward + kept) / unit < 18.5 < (forward + remixed) / unit
    tables = sum(fused_traffic(*wan, rope_angles=False).values()) + sum(
        fused_backward_traffic(*wan, rope_angles=False).values()
    )
    assert round(tables / unit, 1) == 22.3
