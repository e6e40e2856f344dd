"""The fused MHLA forward and backward as custom ops (``torch.ops.mhla.fused_attention`` and
``torch.ops.mhla.fused_attention_backward``), checked on this CPU.

Without ``TRITON_INTERPRET=1`` the ops' CPU implementations run the eager operator, so the op registration
(schema, fake tensors, autograd, AOTAutograd) and ``torch.compile(fullgraph=True)`` of a converted Wan
with the fused path are checked in seconds; with it they run the Triton kernels through the interpreter.
"""

from __future__ import annotations

import math

import pytest
import torch
from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

import mhla_diffusion.models.processors.base as processors
from helpers.models import wan_inputs
from mhla_diffusion import MHLAConfig, convert_to_mhla, num_blocks
from mhla_diffusion.models.tiny import tiny_wan_transformer
from mhla_diffusion.ops import fused_op
from mhla_diffusion.ops.attention import mhla_attention
from mhla_diffusion.ops.block_layout import block_plan
from mhla_diffusion.ops.fused_op import mhla_attention_fused
from mhla_diffusion.ops.triton_mhla import recording_launches

EVEN, UNEVEN, EMPTY = ((4, 4, 6), (2, 2, 3)), ((3, 5, 7), (2, 2, 3)), ((1, 4, 6), (2, 2, 3))
FORWARD = torch.ops.mhla.fused_attention.default
BACKWARD = torch.ops.mhla.fused_attention_backward.default


def _inputs(grid, heads=2, dim=8, value_dim=8, dtype=torch.float64, seed=0, per_head=False, rope=True):
    """Raw ``q, k, v``, a positive mixing (float32, as the processors keep it), the RoPE tables (or ``None``) and
    the plan of ``grid`` = (token grid, layout)."""
    g = torch.Generator().manual_seed(seed)
    n = math.prod(grid[0])
    q, k, v = (torch.randn(1, n, heads, d, generator=g, dtype=dtype) for d in (dim, dim, value_dim))
    m = num_blocks(grid[1])
    mixing = torch.rand((heads, m, m) if per_head else (m, m), generator=g) + 0.1
    cos = sin = None
    if rope:
        cos, sin = (t.to(dtype) for t in WanRotaryPosEmbed(dim, (1, 1, 1), max_seq_len=64)(torch.zeros(1, 1, *grid[0])))
    return q, k, v, mixing, cos, sin, block_plan(*grid)


def _op_arguments(q, k, v, mixing, cos, sin, plan, normalize="denominator"):
    """``torch.ops.mhla.fused_attention``'s positional arguments, as :func:`mhla_attention_fused` passes them."""
    plan_args = (plan.gather, plan.scatter, plan.valid, list(plan.grid), list(plan.layout))
    return (q, k, v, mixing, cos, sin, *plan_args, 1e-6, normalize, 1e-6, torch.float32)


def _eager(q, k, v, mixing, cos, sin, plan, normalize="denominator"):
    """The eager operator on the raw projections (feature map and RoPE applied inside)."""
    rotary = None if cos is None else (cos, sin)
    return mhla_attention(
        q, k, v, plan.grid, plan.layout, mixing, normalize=normalize, plan=plan, feature_eps=1e-6, rotary=rotary
    )


CASES = {
    "uneven-valid-per-head-rope-float64": dict(grid=UNEVEN, per_head=True, dtype=torch.float64),
    "even-no-rope-float32-no-denominator": dict(grid=EVEN, rope=False, dtype=torch.float32, normalize="none"),
    "empty-blocks-rope-float32": dict(grid=EMPTY, dtype=torch.float32),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_opcheck(case, monkeypatch):
    """Schema, fake (meta) implementations, autograd registration and AOTAutograd of both ops."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    setting = dict(CASES[case])
    normalize = setting.pop("normalize", "denominator")
    q, k, v, mixing, cos, sin, plan = _inputs(**setting)
    assert (plan.valid is not None) == (setting["grid"] is not EVEN)
    mixing = mixing.to(q.dtype)
    args = _op_arguments(*(t.requires_grad_() for t in (q, k, v, mixing)), cos, sin, plan, normalize)
    torch.library.opcheck(FORWARD, args)
    grad_out = torch.randn(v.shape, dtype=v.dtype, generator=torch.Generator().manual_seed(1))
    detached = [t.detach() if torch.is_tensor(t) else t for t in args]
    with torch.no_grad():
        _, *kept = FORWARD(*detached)  # the block summaries the forward keeps for the backward
    torch.library.opcheck(BACKWARD, (grad_out, *detached[:6], *kept, *detached[6:]))


@pytest.mark.parametrize("private_guard", [True, False], ids=["dispatch-guard", "public-vjp"])
def test_op_forward_and_backward_equal_the_eager_operator(monkeypatch, private_guard):
    """On CPU without the interpreter the ops are the eager operator and its gradients (to rounding), whether the
    backward recomputes under the dispatcher's private guard or, where PyTorch lacks it, with ``torch.func.vjp``."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(fused_op, "_FORCED_KEYS", fused_op._FORCED_KEYS and private_guard)
    q, k, v, mixing, cos, sin, plan = _inputs(UNEVEN, per_head=True)
    mixing = mixing.double()
    weight = torch.randn(v.shape, dtype=v.dtype, generator=torch.Generator().manual_seed(2))

    def grads(fn):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, mixing)]
        out = fn(*leaves)
        (out * weight).sum().backward()
        return out.detach(), [t.grad for t in leaves]

    got, got_grads = grads(lambda *t: mhla_attention_fused(*t[:3], plan, t[3], cos=cos, sin=sin))
    want, want_grads = grads(lambda *t: _eager(*t, cos, sin, plan))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for name, a, b in zip("q k v mixing".split(), got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10 * b.abs().max().item(), msg=name)


def test_interpreter_runs_the_kernels_and_matches_the_eager_operator(monkeypatch):
    """With ``TRITON_INTERPRET=1`` the CPU op launches the Triton kernels (here through the interpreter) and
    matches the eager operator; the backward (the fused Triton backward where it exists) matches eager
    gradients. Without it no kernel is launched."""
    launches, backward_launches = [], []
    kernels, triton_backward = fused_op._fused_forward, fused_op._triton_backward()

    def counted(*args):
        launches.append(1)
        return kernels(*args)

    def counted_backward(*args, saved=None):
        backward_launches.append(saved is not None)  # the forward's summaries, kept
        return triton_backward(*args, saved=saved)

    monkeypatch.setattr(fused_op, "_fused_forward", counted)
    monkeypatch.setattr(fused_op, "_triton_backward", lambda: triton_backward and counted_backward)
    q, k, v, mixing, cos, sin, plan = (t.float() if torch.is_tensor(t) else t for t in _inputs(EMPTY, seed=3))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, mixing)]
    mhla_attention_fused(*leaves[:3], plan, leaves[3], cos=cos, sin=sin).sum().backward()
    assert not launches and not backward_launches
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    weight = torch.randn(v.shape, generator=torch.Generator().manual_seed(4))

    def grads(fn):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, mixing)]
        out = fn(*leaves)
        (out * weight).sum().backward()
        return out.detach(), [t.grad for t in leaves]

    got, got_grads = grads(lambda *t: mhla_attention_fused(*t[:3], plan, t[3], cos=cos, sin=sin))
    assert launches == [1] and backward_launches == ([True] if triton_backward else [])
    want, want_grads = grads(lambda *t: _eager(*t, cos, sin, plan))
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale)
    for name, a, b in zip("q k v mixing".split(), got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * b.abs().max().item(), msg=name)


def test_meta_tensors_inside_a_recording_launch_nothing():
    """Counting traffic: on meta tensors the entry records the launch and returns an empty output (no op call)."""
    q, k, v, mixing = (t.to("meta") for t in _inputs(EVEN, rope=False)[:4])
    with recording_launches() as launches:
        out = mhla_attention_fused(q, k, v, block_plan(*EVEN, device="meta"), mixing)
    assert out.device.type == "meta" and out.shape == v.shape and out.dtype == v.dtype
    assert [(r["tokens"], r["num_blocks"], r["block_len"]) for r in launches] == [(96, 12, 8)]


# ----------------------------------------------------------------------------- compiled converted Wan


def _converted_wan(config: MHLAConfig) -> torch.nn.Module:
    """A 2-layer tiny converted Wan whose MHLA parameters are away from their init (so they matter)."""
    model = tiny_wan_transformer(num_layers=2)
    convert_to_mhla(model, config)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if ".processor." in name:
                parameter.add_(0.2 * torch.rand(parameter.shape, generator=g))
    return model


def _op_calls(graph: torch.fx.Graph, op) -> int:
    """Call nodes of ``op`` (an overload; its packet counts too) in ``graph``."""
    targets = {op, op.overloadpacket}
    return sum(node.op == "call_function" and node.target in targets for node in graph.nodes)


class _Recorder:
    """AOTAutograd with eager forward and backward graphs, kept for inspection."""

    def __init__(self) -> None:
        self.forward: list[torch.fx.GraphModule] = []
        self.backward: list[torch.fx.GraphModule] = []
        self.dynamo: list[torch.fx.GraphModule] = []
        aot = aot_autograd(fw_compiler=self._keep(self.forward), bw_compiler=self._keep(self.backward))

        def backend(gm: torch.fx.GraphModule, example_inputs):
            self.dynamo.append(gm)
            return aot(gm, example_inputs)

        self.backend = backend

    @staticmethod
    def _keep(graphs: list):
        def compiler(gm: torch.fx.GraphModule, example_inputs):
            graphs.append(gm)
            return make_boxed_func(gm.forward)

        return compiler


@pytest.mark.parametrize(
    "config",
    [MHLAConfig(layout=(2, 2, 2)), MHLAConfig.released_wan(layout=(2, 2, 3), per_head_mixing=True)],
    ids=["paper", "released-per-head"],
)
def test_compiled_wan_keeps_the_fused_op_forward_and_backward(config, monkeypatch):
    """``torch.compile(fullgraph=True)`` of a converted Wan with the fused path chosen: Dynamo's graph holds one
    ``mhla::fused_attention`` per MHLA layer (no graph break: fullgraph), AOTAutograd's forward graph the same and
    its backward graph one ``mhla::fused_attention_backward`` per layer; the output and every gradient equal the
    eager model's (eager operator)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the op's CPU implementation: the eager operator
    model = _converted_wan(config)
    layers = sum(isinstance(module, processors.MHLAProcessor) for module in model.modules())
    assert layers == 2
    inputs = wan_inputs(3, 5, 7)  # uneven blocks (valid mask) under both layouts
    hidden = inputs["hidden_states"]
    weight = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(5))

    def step(run_model):
        model.zero_grad(set_to_none=True)
        x = hidden.clone().requires_grad_()
        out = run_model(**{**inputs, "hidden_states": x}).sample
        (out * weight).sum().backward()
        grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
        return out.detach(), x.grad, grads

    want, want_input_grad, want_grads = step(model)  # the eager operator (fused path not available on CPU)
    assert any(".processor.mixing" in name for name in want_grads)

    monkeypatch.setattr(processors, "fused_available", lambda tensor: True)
    recorder = _Recorder()
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=recorder.backend)
    got, got_input_grad, got_grads = step(compiled)

    assert len(recorder.dynamo) == 1 and _op_calls(recorder.dynamo[0].graph, FORWARD) == layers
    assert [_op_calls(gm.graph, FORWARD) for gm in recorder.forward] == [layers]
    assert [_op_calls(gm.graph, BACKWARD) for gm in recorder.backward] == [layers]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_input_grad, want_input_grad, rtol=1e-4, atol=1e-5)
    assert got_grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-5 * grad.abs().max().item(), msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_fake_kept_summaries_are_laid_out_as_the_real_ones(dtype):
    """What ``torch.compile`` is told the forward keeps (shapes and dtypes of the summaries and key sums) is what the
    kernels' buffers are, for every dtype (half ones keep float32 key sums apart)."""
    from mhla_diffusion.ops.triton_mhla import _summary_buffers

    q = torch.empty(1, 24, 2, 16, dtype=dtype)
    storage, sums = fused_op._kept_shapes(q, q, q, [1, 2, 2], "denominator")
    summaries, key_sums = _summary_buffers(1, 2, 4, 16, 16, dtype, True, "cpu")
    folded = dtype == torch.float32  # [Sᵀ; zᵀ]: the key sums one more row of the (transposed) summaries
    assert storage == ((1, 2, 4, 16 + folded, 16), dtype) and summaries.dtype == dtype
    assert key_sums.dtype == torch.float32
    assert sums == (((0,), dtype) if folded else (tuple(key_sums.shape), torch.float32))
