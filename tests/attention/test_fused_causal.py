"""A stream's chunk on the fused kernels (``torch.ops.mhla.fused_causal_chunk``, ops/fused_causal.py): under
``TRITON_INTERPRET=1`` the Triton kernels equal the eager causal step (float32, 1e-5) with and without carried rows
and for every fold; without it the op's CPU implementation is the eager one, so a compiled causal model's stream
keeps the op in its graph."""

from __future__ import annotations

import math

import pytest
import torch
from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

import mhla_diffusion.models.processors.base as processors
from helpers.models import wan_inputs
from mhla_diffusion import MHLAConfig, causal_mixing_init, convert_to_mhla, mhla_causal_step
from mhla_diffusion.models.streaming import CausalStream
from mhla_diffusion.models.tiny import tiny_wan_transformer
from mhla_diffusion.ops import fused_causal

OP = (torch.ops.mhla.fused_causal_chunk, torch.ops.mhla.fused_causal_chunk.default)
FOLDS = {"sum": {}, "decay": {"decay": 0.8}, "mean": {"mean_fold": True}}


def _chunks(frames=(2, 1, 3), spatial=(3, 5), heads=2, dim=16, seed=0):
    """Raw q, k, v of consecutive chunks of ``frames`` latent frames (float32) and each chunk's RoPE tables."""
    g = torch.Generator().manual_seed(seed)
    rope = WanRotaryPosEmbed(dim, (1, 1, 1), max_seq_len=64)
    out, start = [], 0
    for f in frames:
        n = f * math.prod(spatial)
        q, k, v = (torch.randn(1, n, heads, dim, generator=g) for _ in range(3))
        cos, sin = rope(torch.zeros(1, 1, start + f, *spatial))
        cut = slice(start * math.prod(spatial), None)
        out.append((q, k, v, (f, *spatial), (cos[:, cut], sin[:, cut])))
        start += f
    return out


@pytest.mark.parametrize(("fold", "normalize"), [("sum", True), ("decay", True), ("mean", False)])
def test_interpreter_kernels_equal_the_eager_step(fold, normalize, monkeypatch):
    """Every chunk of a stream (the first with no carried rows, then with them; uneven 3x5 tokens in 2x2 blocks;
    per-head mixing) equals the eager step, and so does the state it leaves."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    launches = []
    kernels = fused_causal._fused_causal_forward
    monkeypatch.setattr(fused_causal, "_fused_causal_forward", lambda *a: launches.append(1) or kernels(*a))
    mixing = causal_mixing_init((2, 2), 1).expand(2, -1, -1, -1) * torch.rand(2, 1, 1, 1) + 0.05
    options = dict(feature_eps=1e-6, normalize=normalize, **FOLDS[fold])
    states = {True: None, False: None}
    for q, k, v, grid, rotary in _chunks():
        layout = (grid[0], 2, 2)
        outs = {}
        for fused in (True, False):
            outs[fused], states[fused] = mhla_causal_step(
                q, k, v, grid, layout, mixing, states[fused], rotary=rotary, fused=fused, **options
            )
        scale = outs[False].abs().max().item()
        torch.testing.assert_close(outs[True], outs[False], rtol=1e-5, atol=1e-5 * scale)
        torch.testing.assert_close(states[True].summaries, states[False].summaries, rtol=1e-5, atol=1e-5)
    assert len(launches) == 3  # a launch per chunk (small summaries: every head at once)


def test_a_compiled_causal_model_keeps_the_op_in_its_graph(monkeypatch):
    """``torch.compile`` of a block-causal MHLA Wan inside a stream's chunk, with the fused path chosen: its graph
    holds one ``mhla::fused_causal_chunk`` per causal layer, and the chunk's output equals the eager model's."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the op's CPU implementation: the eager step
    model = tiny_wan_transformer(num_layers=2).eval()
    convert_to_mhla(model, MHLAConfig(layout=(1, 2, 2), causal=True, causal_window=1))
    inputs = wan_inputs(3, 5, 7)
    first, chunk = inputs["hidden_states"][:, :, :1], inputs["hidden_states"][:, :, 1:2]
    text, t = inputs["encoder_hidden_states"], inputs["timestep"]

    def run(forward):
        stream = CausalStream(model)
        with torch.no_grad():
            with stream.chunk(advance=True):
                forward(first, t, text)
            with stream.chunk():
                return forward(chunk, t, text)

    want = run(lambda *a: model(*a, return_dict=False)[0])
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    monkeypatch.setattr(processors, "fused_available", lambda tensor: True)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    got = run(lambda *a: compiled(*a, return_dict=False)[0])
    calls = [sum(node.target in OP for node in gm.graph.nodes) for gm in graphs]
    assert calls == [2, 2]  # the advance and the denoising forward: one op per causal layer
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
