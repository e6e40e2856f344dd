"""Precision that does not depend on autocast: the operator accumulates in float32 inside
``torch.autocast`` too, and MHLA's own small parameters stay float32 in a model cast to bf16."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from helpers.attention import make_inputs
from helpers.models import run, wan_inputs
from mhla_diffusion import MHLAConfig, convert_to_mhla, mhla_attention, mhla_attention_reference, mixing_init
from mhla_diffusion.loaders.weight_files import dtype_on_load
from mhla_diffusion.models.processors.base import FP32_PARAMETERS, MHLAProcessor
from mhla_diffusion.ops.context_parallel import TokenShard, mhla_attention_context_parallel

GRID, LAYOUT = (4, 6, 5), (2, 2, 2)


def _inputs(dtype: torch.dtype, grid: tuple[int, ...] = GRID):
    q, k, v, q_rot, k_rot = make_inputs(grid, heads=2, dim=16, value_dim=16, dtype=torch.float32, seed=3)
    mixing = mixing_init(LAYOUT, "linear")
    return [t.to(dtype) for t in (q, k, v, q_rot, k_rot)], mixing


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


@pytest.mark.parametrize("grid,normalize", [(GRID, True), ((4, 6, 4), "scalar_mixed_denominator")])
def test_operator_accumulates_in_float32_under_autocast(grid, normalize):
    (q, k, v, q_rot, k_rot), mixing = _inputs(torch.float32, grid)
    kwargs = dict(q_rot=q_rot, k_rot=k_rot, normalize=normalize)
    want = mhla_attention_reference(
        q.double(),
        k.double(),
        v.double(),
        grid,
        LAYOUT,
        mixing.double(),
        q_rot=q_rot.double(),
        k_rot=k_rot.double(),
        normalize=normalize,
    )
    plain = mhla_attention(q, k, v, grid, LAYOUT, mixing, **kwargs)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = mhla_attention(q, k, v, grid, LAYOUT, mixing, **kwargs)
    assert autocast.dtype == torch.float32
    # bf16 products would be off by ~1e-2 relative; float32 ones agree with the fp64 reference to ~1e-7
    assert _relative_error(plain, want) < 1e-5
    assert _relative_error(autocast, want) < 1e-5
    torch.testing.assert_close(autocast, plain, rtol=0, atol=0)


def test_bf16_inputs_give_the_same_result_with_and_without_autocast():
    (q, k, v, q_rot, k_rot), mixing = _inputs(torch.bfloat16)
    plain = mhla_attention(q, k, v, GRID, LAYOUT, mixing, q_rot=q_rot, k_rot=k_rot)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = mhla_attention(q, k, v, GRID, LAYOUT, mixing, q_rot=q_rot, k_rot=k_rot)
    assert autocast.dtype == torch.bfloat16
    torch.testing.assert_close(autocast, plain, rtol=0, atol=0)


def test_context_parallel_operator_accumulates_in_float32_under_autocast(tmp_path):
    (q, k, v, q_rot, k_rot), mixing = _inputs(torch.float32)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        shard = TokenShard(group=None, rank=0, sizes=(q.shape[1],))
        plain = mhla_attention_context_parallel(q, k, v, GRID, LAYOUT, mixing, shard, q_rot=q_rot, k_rot=k_rot)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            autocast = mhla_attention_context_parallel(q, k, v, GRID, LAYOUT, mixing, shard, q_rot=q_rot, k_rot=k_rot)
    finally:
        dist.destroy_process_group()
    torch.testing.assert_close(autocast, plain, rtol=0, atol=0)


def _mhla_processors(model: torch.nn.Module) -> list[MHLAProcessor]:
    return [module for module in model.modules() if isinstance(module, MHLAProcessor)]


FULL = MHLAConfig(layout=(1, 2, 2), output_norm=True, gate=True, lepe=True)


@pytest.mark.parametrize("cast", ["to", "bfloat16", "half"])
def test_a_model_cast_to_half_keeps_mhla_parameters_in_float32(tiny_wan, cast):
    convert_to_mhla(tiny_wan, FULL)
    before = {name: p.detach().clone() for name, p in tiny_wan.named_parameters() if "processor.mixing" in name}
    if cast == "to":
        tiny_wan.to(torch.bfloat16)
    else:
        getattr(tiny_wan, cast)()
    half = torch.bfloat16 if cast != "half" else torch.float16
    processors = _mhla_processors(tiny_wan)
    assert processors
    for proc in processors:
        assert proc.mixing.dtype == torch.float32
        assert proc.out_norm.weight.dtype == torch.float32
        assert proc.gate.weight.dtype == half  # follows the model like the q/k/v projections
        assert proc.lepe.weight.dtype == half
    for name, p in tiny_wan.named_parameters():  # values kept exactly, not rounded through the half type
        if name in before:
            torch.testing.assert_close(p, before[name], rtol=0, atol=0)
    assert tiny_wan.blocks[0].attn1.to_q.weight.dtype == half
    assert set(FP32_PARAMETERS) >= {"mixing", "out_norm"}


def test_a_small_update_to_the_mixing_survives_in_a_bf16_model(tiny_wan):
    convert_to_mhla(tiny_wan, MHLAConfig(layout=(1, 2, 2)))
    tiny_wan.to(torch.bfloat16)
    mixing = tiny_wan.blocks[0].attn1.processor.mixing
    before = mixing.detach().clone()
    output = tiny_wan(
        **{k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in wan_inputs().items()}
    ).sample
    output.float().square().mean().backward()
    assert mixing.grad is not None and mixing.grad.dtype == torch.float32
    with torch.no_grad():  # an update far below bf16's resolution at 1.0 (2**-8)
        mixing.add_(torch.full_like(mixing, 1e-4))
    assert (mixing - before).abs().min().item() == pytest.approx(1e-4, rel=1e-2)


def test_a_bf16_model_runs_and_stays_close_to_float32(tiny_wan, wan_batch):
    convert_to_mhla(tiny_wan, FULL)
    want = run(tiny_wan, wan_batch)
    tiny_wan.to(torch.bfloat16)
    got = run(tiny_wan, {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in wan_batch.items()})
    assert got.dtype == torch.bfloat16
    assert _relative_error(got.float(), want) < 5e-2


def test_importers_load_mhla_parameters_in_float32(tiny_wan):
    convert_to_mhla(tiny_wan, FULL)
    assert dtype_on_load(tiny_wan, "blocks.0.attn1.processor.mixing", torch.bfloat16) == torch.float32
    assert dtype_on_load(tiny_wan, "blocks.0.attn1.processor.out_norm.weight", torch.float16) == torch.float32
    assert dtype_on_load(tiny_wan, "blocks.0.attn1.processor.gate.weight", torch.bfloat16) == torch.bfloat16
    assert dtype_on_load(tiny_wan, "blocks.0.attn1.processor.mixing", torch.float64) == torch.float64
    assert dtype_on_load(tiny_wan, "blocks.0.attn1.to_q.weight", torch.bfloat16) == torch.bfloat16


def test_the_output_norm_is_rms_norm_without_a_float32_copy():
    from torch.nn import functional as F

    from mhla_diffusion.models.processors.base import head_rms_norm

    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 40, 3, 16, generator=g, dtype=torch.float64)
    weight = torch.rand(16, generator=g, dtype=torch.float64)
    want = F.rms_norm(x, (16,), weight, 1e-6)
    torch.testing.assert_close(head_rms_norm(x, weight, 1e-6), want, rtol=1e-12, atol=1e-12)
    half = head_rms_norm(x.bfloat16(), weight.float(), 1e-6)  # a float32 weight, as the processors keep it
    assert half.dtype == torch.bfloat16
    assert _relative_error(half.float(), want) < 1e-2
