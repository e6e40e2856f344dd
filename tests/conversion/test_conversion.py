"""Converting tiny Wan / DiT transformers: what changes, what does not, and that the processors are right."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from diffusers.models.transformers.transformer_wan import WanAttnProcessor

from helpers.models import dit_inputs, run, wan_inputs
from mhla_diffusion import (
    DiTMHLAProcessor,
    MHLAConfig,
    WanMHLAProcessor,
    convert_to_mhla,
    get_mhla_conversion,
    mhla_attention_reference,
    revert_mhla,
    softmax_attention,
    video_token_grid,
)
from mhla_diffusion.models.tiny import tiny_wan_transformer


def capture_attention_outputs(model, inputs):
    outputs, handles = {}, []
    for name, module in model.named_modules():
        if name.endswith(("attn1", "attn2")):
            handles.append(module.register_forward_hook(lambda m, a, out, name=name: outputs.__setitem__(name, out)))
    run(model, inputs)
    for h in handles:
        h.remove()
    return outputs


def test_only_chosen_wan_self_attention_layers_change(tiny_wan, wan_batch):
    base_state = {k: v.clone() for k, v in tiny_wan.state_dict().items()}
    before_procs = {n: m.processor for n, m in tiny_wan.named_modules() if n.endswith(("attn1", "attn2"))}
    before = capture_attention_outputs(tiny_wan, wan_batch)

    conversion = convert_to_mhla(tiny_wan, MHLAConfig(layers=[1], layout=(1, 2, 2)))
    assert conversion.layer_names == ["blocks.1.attn1"] and conversion.num_layers == 3
    for name, module in tiny_wan.named_modules():
        if name.endswith(("attn1", "attn2")):
            if name == "blocks.1.attn1":
                assert isinstance(module.processor, WanMHLAProcessor)
            else:
                assert module.processor is before_procs[name]
    state = tiny_wan.state_dict()
    new_keys = sorted(set(state) - set(base_state))
    assert new_keys == ["blocks.1.attn1.processor.mixing"]
    assert all(torch.equal(state[k], v) for k, v in base_state.items())

    after = capture_attention_outputs(tiny_wan, wan_batch)
    assert torch.equal(after["blocks.0.attn1"], before["blocks.0.attn1"])  # upstream of the change
    assert torch.equal(after["blocks.0.attn2"], before["blocks.0.attn2"])
    assert not torch.allclose(after["blocks.1.attn1"], before["blocks.1.attn1"])


def test_hybrid_converts_20_of_30_layers():
    model = tiny_wan_transformer(num_layers=30)
    conversion = convert_to_mhla(model, MHLAConfig(layers="hybrid", layout=(1, 2, 2)))
    assert conversion.layers == [i for i in range(30) if i % 3 != 0]
    assert len(conversion.layer_names) == 20
    kinds = [type(b.attn1.processor) for b in model.blocks]
    assert kinds.count(WanMHLAProcessor) == 20 and kinds[0] is WanAttnProcessor and kinds[3] is WanAttnProcessor


def independent_rope(x, cos, sin):
    """RoPE via complex numbers: pair (2i, 2i+1) is one complex number rotated by angle_i."""
    angle = torch.atan2(sin[..., 0::2], cos[..., 0::2])
    z = torch.view_as_complex(x.double().unflatten(-1, (-1, 2)).contiguous())
    return torch.view_as_real(z * torch.polar(torch.ones_like(angle.double()), angle.double())).flatten(-2)


@pytest.mark.parametrize("released", [False, True])
def test_wan_processor_matches_manual_computation(tiny_wan, released):
    config = MHLAConfig.released_wan(layout=(2, 2, 3), lepe=True) if released else MHLAConfig(layout=(2, 2, 3))
    convert_to_mhla(tiny_wan, config)
    inputs = wan_inputs(frames=3, height=5, width=7)  # grid 3x5x7: uneven blocks
    seen = {}
    attn = tiny_wan.blocks[0].attn1
    handle = attn.register_forward_hook(lambda m, args, out: seen.update(x=args[0], rope=args[3], out=out))
    run(tiny_wan, inputs)
    handle.remove()
    x, (cos, sin), out = seen["x"], seen["rope"], seen["out"]
    proc = attn.processor

    heads, eps = attn.heads, 1e-6
    q = (F.relu(attn.norm_q(attn.to_q(x))) + eps).unflatten(2, (heads, -1))
    k = (F.relu(attn.norm_k(attn.to_k(x))) + eps).unflatten(2, (heads, -1))
    v = attn.to_v(x).unflatten(2, (heads, -1))
    expected = mhla_attention_reference(
        q.double(),
        k.double(),
        v.double(),
        (3, 5, 7),
        (2, 2, 3),
        proc.mixing.double(),
        q_rot=independent_rope(q, cos, sin),
        k_rot=independent_rope(k, cos, sin),
        normalize=not released,
    )
    if released:
        expected = expected * torch.rsqrt(expected.pow(2).mean(-1, keepdim=True) + 1e-6) * proc.out_norm.weight.double()
    expected = expected.flatten(2)
    if released:
        expected = expected * F.silu(proc.gate(x)).double()
        grid_v = v.flatten(2).transpose(1, 2).reshape(1, -1, 3, 5, 7)
        expected = expected + proc.lepe(grid_v).flatten(2).transpose(1, 2).double()
    expected = attn.to_out[0](expected.float())
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


def test_dit_processor_matches_manual_computation(tiny_dit, dit_batch):
    convert_to_mhla(tiny_dit, MHLAConfig(lepe=True, gate=True))
    attn = tiny_dit.transformer_blocks[1].attn1
    proc = attn.processor
    assert isinstance(proc, DiTMHLAProcessor) and proc.layout == (2, 2)
    seen = {}
    handle = attn.register_forward_hook(lambda m, args, kwargs, out: seen.update(x=args[0], out=out), with_kwargs=True)
    run(tiny_dit, dit_batch)
    handle.remove()
    x, out = seen["x"], seen["out"]
    q = (F.relu(attn.to_q(x)) + 1e-6).unflatten(2, (attn.heads, -1))
    k = (F.relu(attn.to_k(x)) + 1e-6).unflatten(2, (attn.heads, -1))
    v = attn.to_v(x).unflatten(2, (attn.heads, -1))
    expected = mhla_attention_reference(q, k, v, (4, 4), (2, 2), proc.mixing).flatten(2)
    expected = expected * F.silu(proc.gate(x)) + v.flatten(2)  # LePE starts as the identity
    torch.testing.assert_close(out, attn.to_out[0](expected), rtol=1e-4, atol=1e-5)


def test_dit_default_layout_and_lepe_identity(tiny_dit):
    conversion = convert_to_mhla(tiny_dit, MHLAConfig(lepe=True))
    assert conversion.layout == (2, 2)  # auto from sample_size 8 / patch 2 = 4x4 tokens
    lepe = tiny_dit.transformer_blocks[0].attn1.processor.lepe
    image = torch.randn(1, lepe.in_channels, 4, 4)
    torch.testing.assert_close(lepe(image), image)


@pytest.mark.parametrize("family", ["wan", "dit"])
def test_gradients_reach_mixing_weights(family, tiny_wan, tiny_dit):
    model, inputs = (tiny_wan, wan_inputs()) if family == "wan" else (tiny_dit, dit_inputs())
    convert_to_mhla(model, MHLAConfig(layout=(2, 2, 2)) if family == "wan" else MHLAConfig(per_head_mixing=True))
    if family == "dit":
        for module in model.modules():  # Diffusers' LabelEmbedding drops labels at random in train mode
            if hasattr(module, "dropout_prob"):
                module.dropout_prob = 0.0
    model.train()
    model(**inputs).sample.square().mean().backward()
    grads = [p.grad for n, p in model.named_parameters() if n.endswith("processor.mixing")]
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)


def test_gradient_checkpointing_gives_same_mixing_gradients(tiny_wan):
    convert_to_mhla(tiny_wan, MHLAConfig(layout=(2, 2, 2)))
    twin = copy.deepcopy(tiny_wan)
    twin.enable_gradient_checkpointing()
    grads = []
    for model in (tiny_wan, twin):
        model.train()
        model(**wan_inputs()).sample.square().mean().backward()
        grads.append(model.blocks[0].attn1.processor.mixing.grad)
    torch.testing.assert_close(grads[0], grads[1])


def test_new_grid_on_next_call_just_works(tiny_wan):
    convert_to_mhla(tiny_wan, MHLAConfig(layout=(2, 3, 3), target_grid=(3, 8, 10)))
    for frames, height, width in [(3, 8, 10), (5, 3, 4), (2, 7, 9)]:
        out = run(tiny_wan, wan_inputs(frames, height, width))
        assert out.shape == (1, 16, frames, 2 * height, 2 * width) and torch.isfinite(out).all()


def test_revert_restores_the_original(tiny_wan, wan_batch):
    reference = run(tiny_wan, wan_batch)
    convert_to_mhla(tiny_wan, MHLAConfig(layout=(2, 2, 2), gate=True))
    assert not torch.allclose(run(tiny_wan, wan_batch), reference)
    revert_mhla(tiny_wan)
    assert get_mhla_conversion(tiny_wan) is None
    assert torch.equal(run(tiny_wan, wan_batch), reference)
    assert not any(".processor." in k for k in tiny_wan.state_dict())


def test_deepcopy_gets_its_own_grid(tiny_wan):
    convert_to_mhla(tiny_wan, MHLAConfig(layout=(2, 2, 2)))
    twin = copy.deepcopy(tiny_wan)
    run(twin, wan_inputs(3, 4, 6))
    assert twin.blocks[0].attn1.processor.grid_context.grid == (3, 4, 6)
    assert tiny_wan.blocks[0].attn1.processor.grid_context.grid is None
    torch.testing.assert_close(run(twin, wan_inputs()), run(tiny_wan, wan_inputs()))


def test_bf16_model_gives_finite_output(tiny_wan):
    convert_to_mhla(tiny_wan, MHLAConfig.released_wan(layout=(2, 2, 2)))
    tiny_wan.to(torch.bfloat16)
    inputs = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in wan_inputs().items()}
    out = run(tiny_wan, inputs)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


def test_conversion_errors(tiny_wan):
    with pytest.raises(ValueError, match="3 axes"):
        convert_to_mhla(tiny_wan, MHLAConfig(target_grid=(4, 4)))  # a DiT-shaped grid for Wan
    with pytest.raises(ValueError, match="out of range"):
        convert_to_mhla(tiny_wan, MHLAConfig(layers=[0, 7], layout=(1, 2, 2)))
    with pytest.raises(ValueError, match="3 axes"):
        convert_to_mhla(tiny_wan, MHLAConfig(layout=(2, 2)))
    with pytest.raises(ValueError, match="layers"):
        MHLAConfig(layers="some")
    assert get_mhla_conversion(tiny_wan) is None  # nothing was changed by the failed calls
    convert_to_mhla(tiny_wan, MHLAConfig(target_grid=video_token_grid(81, 480, 832)))
    assert get_mhla_conversion(tiny_wan).layout == (3, 5, 9)
    with pytest.raises(ValueError, match="already converted"):
        convert_to_mhla(tiny_wan, MHLAConfig(layout=(1, 1, 1)))
    with pytest.raises(TypeError, match="WanTransformer3DModel"):
        convert_to_mhla(torch.nn.Linear(2, 2))


def test_layout_larger_than_the_grid_converts_and_runs(tiny_wan):
    """More blocks than tokens on an axis (of the target grid, or of a forward's grid) leaves empty blocks."""
    convert_to_mhla(tiny_wan, MHLAConfig(layout=(2, 2, 20), target_grid=(3, 8, 10)))
    assert get_mhla_conversion(tiny_wan).layout == (2, 2, 20)
    assert torch.isfinite(run(tiny_wan, wan_inputs(frames=1))).all()


def test_only_chosen_dit_layers_change_and_frozen_mixing(tiny_dit, dit_batch):
    before = capture_attention_outputs(tiny_dit, dit_batch)
    original = tiny_dit.transformer_blocks[0].attn1.processor
    convert_to_mhla(tiny_dit, MHLAConfig(layers=[1], learnable_mixing=False))
    assert tiny_dit.transformer_blocks[0].attn1.processor is original
    processor = tiny_dit.transformer_blocks[1].attn1.processor
    assert isinstance(processor, DiTMHLAProcessor) and not processor.mixing.requires_grad
    after = capture_attention_outputs(tiny_dit, dit_batch)
    assert torch.equal(after["transformer_blocks.0.attn1"], before["transformer_blocks.0.attn1"])
    assert not torch.allclose(after["transformer_blocks.1.attn1"], before["transformer_blocks.1.attn1"])


def test_softmax_attention_context_switches_and_restores(tiny_wan, wan_batch):
    reference = run(tiny_wan, wan_batch)
    convert_to_mhla(tiny_wan, MHLAConfig(layout=(2, 2, 2)))
    mhla_out = run(tiny_wan, wan_batch)
    keys = set(tiny_wan.state_dict())
    with softmax_attention(tiny_wan):
        assert torch.equal(run(tiny_wan, wan_batch), reference)
    assert torch.equal(run(tiny_wan, wan_batch), mhla_out)
    assert set(tiny_wan.state_dict()) == keys
