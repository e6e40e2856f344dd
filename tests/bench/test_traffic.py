"""The memory-traffic count (mhla_diffusion.ops.traffic) and `mhla bench --traffic`."""

from __future__ import annotations

import math

import pytest
import torch

from mhla_diffusion import MHLAConfig
from mhla_diffusion.benchmarks.attention_traffic import TRAFFIC_PATHS, traffic_settings, wan_attention_traffic
from mhla_diffusion.cli import main
from mhla_diffusion.ops import triton_mhla
from mhla_diffusion.ops.block_layout import block_plan
from mhla_diffusion.ops.traffic import count_traffic, floor_bytes, tensor_bytes
from mhla_diffusion.ops.triton_mhla import fused_available, fused_traffic, recording_launches


def _meta(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.empty(*shape, device="meta", dtype=dtype)


def test_ops_count_their_inputs_and_outputs_and_views_count_nothing():
    x = _meta(4, 5)  # 40 bytes in bf16
    counter = count_traffic(lambda: x.float().t().contiguous())
    # cast: reads 40, writes 80; transpose: a view; contiguous: reads 80, writes 80
    assert (counter.read, counter.written) == (40 + 80, 80 + 80)
    assert set(counter.by_op) == {"_to_copy", "clone"}
    assert counter.total == 280


def test_a_broadcast_input_counts_its_distinct_elements_once():
    row = _meta(1, 5, dtype=torch.float32).expand(1000, 5)
    assert tensor_bytes(row) == 20
    counter = count_traffic(lambda: _meta(1000, 5, dtype=torch.float32) * row)
    assert counter.read == 1000 * 5 * 4 + 20 and counter.written == 1000 * 5 * 4


def test_in_place_ops_read_and_write_their_tensor():
    x = _meta(10, dtype=torch.float32)
    counter = count_traffic(lambda: x.add_(1.0))
    assert (counter.read, counter.written) == (40, 40)


def test_floor_is_q_k_v_and_output_plus_summaries():
    b, n, h, d, m = 1, 31_500, 12, 128, 150
    unit = b * n * h * d * 2
    assert floor_bytes(b, n, h, d, d, m) == 4 * unit + 2 * b * h * m * (d * d + d) * 4
    assert floor_bytes(b, n, h, d, d, m, summaries=False) == 4 * unit
    assert floor_bytes(b, n, h, d, d, m) / unit == pytest.approx(6.46, abs=0.01)


@pytest.mark.parametrize("config", [MHLAConfig(layout=(1, 2, 2)), MHLAConfig.released_wan(layout=(1, 2, 2))])
def test_a_wan_layer_count_covers_every_pass_over_q_k_v(config):
    row = wan_attention_traffic((3, 4, 5), config, heads=2, head_dim=8)
    unit = 60 * 2 * 8 * 2
    assert row["unit_bytes"] == unit and row["tokens"] == 60 and row["blocks"] == 4
    assert row["units"] == pytest.approx(row["gigabytes"] * 1e9 / unit)
    assert row["units"] > row["floor_units"] >= 4  # at least q, k, v and the output
    assert row["ops"] and all(op["calls"] >= 1 for op in row["ops"].values())


def test_the_count_does_not_depend_on_the_machine_and_needs_no_memory():
    config = traffic_settings()["paper"]
    first = wan_attention_traffic((21, 30, 50), config)
    assert first == wan_attention_traffic((21, 30, 50), config)
    assert first["tokens"] == 31_500 and first["blocks"] == 150
    assert first["unit_bytes"] == 31_500 * 12 * 128 * 2
    assert math.isfinite(first["over_floor"])


def test_bench_traffic_prints_the_table(tmp_path, capsys):
    out = tmp_path / "traffic.json"
    assert main(["bench", "--traffic", "--traffic-grid", "3x4x10", "--output", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| 3x4x10 | 120 | paper | 3x5x10 | 150 | eager PyTorch |" in text
    assert f"| 3x4x10 | 120 | paper | 3x5x10 | 150 | {TRAFFIC_PATHS[1]} |" in text
    assert "| 3x4x10 | 120 | released |" in text and "x floor" in text
    # a stream's denoising chunk (Wan2.1-1.3B, 3 latent frames at 480p) both ways: the fused launch mixes the
    # carried blocks in as extra rows, a term of its own
    import json

    from mhla_diffusion.benchmarks.stream_state import STREAM_TRAFFIC_SETTING

    stream = [r for r in json.loads(out.read_text())["traffic"] if r["setting"] == STREAM_TRAFFIC_SETTING]
    assert [r["path"] for r in stream] == list(TRAFFIC_PATHS) and [r["fused_launches"] for r in stream] == [0, 2]
    assert stream[0]["tokens"] == 3 * 30 * 52 and stream[1]["units"] < stream[0]["units"]
    assert stream[1]["ops"]["carried blocks mixed in (PyTorch): W S, W z"]["calls"] == 2  # a launch per head group
    assert f"| 3x30x52 | 4,680 | {STREAM_TRAFFIC_SETTING} | 3x3x5 | 45 | {TRAFFIC_PATHS[1]} |" in text
    assert main(["bench", "--traffic", "--traffic-grid", "3x4"]) == 2
    assert "--traffic-grid must be frames x height x width" in capsys.readouterr().err


def test_the_speed_page_table_is_what_the_command_prints(capsys):
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "speed.md").read_text()
    assert main(["bench", "--traffic"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("| 21x30x5", "| 3x30x52"))]
    assert len(rows) == 18  # 2 grids x 2 settings x (eager, fused) x (forward, forward + backward); a stream chunk
    for row in rows:
        assert row in page


def test_an_out_argument_is_written_not_read():
    x, out = _meta(10, dtype=torch.float32), _meta(10, dtype=torch.float32)
    counter = count_traffic(lambda: torch.clamp_min(x, 0, out=out))
    assert (counter.read, counter.written) == (40, 40)
    assert count_traffic(lambda: torch.empty_like(x)).total == 0


def test_fused_count_by_hand():
    """16 tokens, 2 heads of 16 channels, 4 blocks of 4 slots, bf16, float32 RoPE tables read by the kernels (no
    angle plan fits them), denominator."""
    terms = fused_traffic(1, 16, 2, 16, 16, 4, 4, rope_angles=False)
    tokens_x_heads = 16 * 2
    qkvo = tokens_x_heads * 16 * 2  # one of q, k, v, out: 1024 bytes
    tables = tokens_x_heads * 8 * 2 * 2  # per head, each token's 8 angles, cos and sin, bf16
    summaries = 2 * 4 * 16 * 16 * 2  # S (or S̃): B*H*M x D x Dv, bf16
    key_sums = 2 * 4 * 16 * 4  # z (or z̃): float32, apart from the bf16 summaries
    index = 2 * 4 * 4 * 8  # plan.gather (int64) of every slot, by each (batch x head)'s programs
    assert terms == {
        # even channels of the float32 (1, 16, 1, 16) tables read, written as bf16 (N, 8) once per call
        "RoPE tables to the summaries' dtype (PyTorch, once per forward)": 2 * 16 * 8 * 4 + 2 * 16 * 8 * 2,
        "summaries kernel: plan index": index,
        "summaries kernel: k": qkvo,  # one value tile: k once
        "summaries kernel: RoPE tables": tables,
        "summaries kernel: v": qkvo,
        "summaries kernel: S stored": summaries,
        "summaries kernel: z stored": key_sums,
        # W (float32, 64 B) cast to bf16 (32 B), read by the bf16 GEMM: S read, S̃ written; the float32 W by the
        # float32 one: z read, z̃ written
        "mixing (PyTorch): W S, W z": (64 + 32) + 32 + 2 * summaries + 64 + 2 * key_sums,
        "output kernel: mixed summary": summaries,  # once per (batch x head, block)
        "output kernel: mixed key sum": key_sums,
        "output kernel: plan index": index,
        "output kernel: q": qkvo,
        "output kernel: RoPE tables": tables,
        "output kernel: output stored": qkvo,
    }
    float32 = fused_traffic(
        1,
        16,
        2,
        16,
        16,
        4,
        4,
        dtype=torch.float32,
        rope_dtype=None,
        normalize="none",
        padded=True,
        per_head_mixing=True,
        rope_angles=False,
    )
    assert (
        float32["RoPE tables to the summaries' dtype (PyTorch, once per forward)"]
        == float32["output kernel: RoPE tables"]
        == 0
    )
    assert float32["summaries kernel: plan index"] == 2 * 4 * 4 * (8 + 1)  # plan.valid (uint8) too
    assert float32["summaries kernel: S stored"] == 2 * summaries  # float32 summaries
    assert float32["summaries kernel: z stored"] == float32["output kernel: mixed key sum"] == 0
    assert float32["mixing (PyTorch): W S, W z"] == 2 * 4 * 4 * 4 + 2 * 2 * summaries  # (H, M, M) W, S, S̃
    float16 = fused_traffic(1, 16, 2, 16, 16, 4, 4, dtype=torch.float16)  # as bf16: z apart, in float32
    assert {k: v for k, v in float16.items() if "RoPE" not in k} == {k: v for k, v in terms.items() if "RoPE" not in k}
    # tables that an angle plan gives (Wan's): each program reads the (3, 8) float32 plan once, computes the rest
    angles = fused_traffic(1, 16, 2, 16, 16, 4, 4)
    plan = 2 * 4 * 3 * 8 * 4  # B*H*M programs a kernel
    assert angles["summaries kernel: RoPE angle plan"] == angles["output kernel: RoPE angle plan"] == plan
    assert {k: v for k, v in angles.items() if "RoPE" not in k} == {k: v for k, v in terms.items() if "RoPE" not in k}


def test_the_angle_plan_is_fitted_in_one_read_of_the_tables():
    """Fitting and checking the plan (once per forward) reads each float32 table's even channels once, plus the
    check's boolean: at most 6 bytes an angle of each table beyond 1 %, against 12 to convert them to bf16."""
    tokens = 31_500
    fit = fused_traffic(1, tokens, 12, 128, 128, 150, 210)[
        "RoPE angle plan from the tables (PyTorch, once per forward)"
    ]
    angles = 2 * tokens * 64  # cos and sin, 64 pairs a token
    assert 4 * angles <= fit <= 6 * angles * 1.01


def test_fused_count_takes_the_launch_tiles():
    """Values wider than one summaries tile (Dv > 128): each value tile's programs read k and the angle plan again."""
    one, two = fused_traffic(1, 16, 2, 16, 128, 4, 4), fused_traffic(1, 16, 2, 16, 136, 4, 4)
    assert triton_mhla._tiles(4, 16, 128).value_tiles == 1 and triton_mhla._tiles(4, 16, 136).value_tiles == 2
    for term in ("summaries kernel: k", "summaries kernel: RoPE angle plan", "summaries kernel: plan index"):
        assert two[term] == 2 * one[term], term
    assert two["summaries kernel: v"] == one["summaries kernel: v"] * 136 // 128  # each column once


def test_the_fused_path_is_under_ten_units_at_21x30x50():
    """The issue's target, paper setting (denominator and RoPE): the processor's fused path as launched."""
    unit = 31_500 * 12 * 128 * 2
    row = wan_attention_traffic((21, 30, 50), traffic_settings()["paper"], fused=True)
    kernels = sum(fused_traffic(1, 31_500, 12, 128, 128, 150, 210).values())
    assert row["fused_launches"] == 1
    assert row["units"] == pytest.approx(kernels / unit, abs=0.05)  # and the block plan built (~0.02 U)
    assert row["units"] <= 10
    eager = wan_attention_traffic((21, 30, 50), traffic_settings()["paper"])
    assert eager["fused_launches"] == 0 and row["units"] < eager["units"]


def test_recording_launches_takes_the_processors_call_on_meta_tensors():
    q = torch.empty(1, 60, 2, 8, device="meta")
    assert not fused_available(q)  # meta tensors take the eager operator outside a recording
    with recording_launches() as launches:
        assert fused_available(q)
        row = wan_attention_traffic(
            (3, 4, 5), MHLAConfig.released_wan(layout=(1, 2, 2)), heads=2, head_dim=8, fused=True
        )
    assert not fused_available(q)
    # the row: the kernels as launched, and the processor's output norm and gate op by op
    assert {"output kernel: q", "mixing (PyTorch): W S, W z", "silu", "linalg_vector_norm"} <= set(row["ops"])
    # 5 columns in blocks of 2: uneven, 3 x 2 x 3 = 18 slots a block
    assert launches == [
        dict(
            batch=1,
            tokens=60,
            heads=2,
            head_dim=8,
            value_dim=8,
            num_blocks=4,
            block_len=18,
            padded=True,
            dtype=torch.bfloat16,
            rope_dtype=torch.float32,
            normalize="none",
            per_head_mixing=False,
            rope_converted=True,
            rope_angles=True,
        )
    ]


def test_a_forward_fits_its_angle_plan_once():
    """Later calls with the same tables (the layers of one Wan forward) reuse the first call's angle plan: their
    count has no fit, and the rest of it is the same."""
    q = torch.empty(1, 60, 2, 8, device="meta", dtype=torch.bfloat16)
    cos, sin = (torch.empty(1, 60, 1, 8, device="meta") for _ in range(2))
    plan = block_plan((3, 4, 5), (1, 2, 2), "meta")
    mixing = torch.empty(4, 4, device="meta")
    first, later = (triton_mhla._launch_arguments(q, q, plan, mixing, cos, "none", sin=sin) for _ in range(2))
    assert first["rope_converted"] and not later["rope_converted"]
    term = "RoPE angle plan from the tables (PyTorch, once per forward)"
    one, other = fused_traffic(**first), fused_traffic(**later)
    assert 2 * 60 * 4 * 4 <= one[term] and other[term] == 0  # at least the even channels read in float32
    assert {k: v for k, v in one.items() if k != term} == {k: v for k, v in other.items() if k != term}
    sin.add_(1.0)  # changed tables (a new version): converted again
    assert triton_mhla._launch_arguments(q, q, plan, mixing, cos, "none", sin=sin)["rope_converted"]


def test_training_rows_count_the_fused_backward():
    """The forward + backward rows (autograd on meta tensors), paper setting at 21x30x50: the fused one is
    the fused kernels' forward and backward as launched (nothing else runs around the operator), far below
    the eager one, and at most 3x the fused forward (the backward mixes the summaries the forward kept)."""
    from mhla_diffusion.benchmarks.attention_traffic import wan_attention_training_traffic
    from mhla_diffusion.ops.triton_mhla_backward import fused_backward_traffic

    config, unit = traffic_settings()["paper"], 31_500 * 12 * 128 * 2
    forward = wan_attention_traffic((21, 30, 50), config, fused=True)
    eager = wan_attention_training_traffic((21, 30, 50), config)
    fused = wan_attention_training_traffic((21, 30, 50), config, fused=True)
    assert (eager["fused_launches"], fused["fused_launches"]) == (0, 1)
    kernels = sum(fused_traffic(1, 31_500, 12, 128, 128, 150, 210).values())
    kernels += sum(fused_backward_traffic(1, 31_500, 12, 128, 128, 150, 210).values())
    assert fused["units"] == pytest.approx(kernels / unit, abs=0.05)  # and the block plan built (~0.02 U)
    assert "backward: query grad kernel: q" in fused["ops"] and "output kernel: q" in fused["ops"]
    assert fused["units"] < eager["units"] / 5
    assert fused["units"] <= 3 * forward["units"]


def test_the_dram_estimate_reads_what_every_head_shares_once():
    """At Wan2.1-1.3B's 21x30x50 the fused forward counts 6.8 U, of which L2 serves the angle plan and slot indices
    that 11 of the 12 heads read again: 6.7 U from DRAM. Read as tables, the rotation counts 8.8 U, 6.9 U from DRAM."""
    from mhla_diffusion.ops.block_layout import block_plan
    from mhla_diffusion.ops.traffic import dram_estimate

    plan = block_plan((21, 30, 50), (3, 5, 10))
    terms = fused_traffic(1, 31_500, 12, 128, 128, plan.num_blocks, plan.block_len)
    unit = 31_500 * 12 * 128 * 2
    dram, served = dram_estimate(terms, 12)
    assert dram + served == sum(terms.values()) and round(dram / unit, 1) == 6.7
    shared = sum(v for k, v in terms.items() if k.endswith((": RoPE angle plan", ": plan index")))
    assert served == pytest.approx(shared * 11 / 12, rel=1e-6)
    tables = fused_traffic(1, 31_500, 12, 128, 128, plan.num_blocks, plan.block_len, rope_angles=False)
    assert round(sum(tables.values()) / unit, 1) == 8.8 and round(dram_estimate(tables, 12)[0] / unit, 1) == 6.9
    assert dram_estimate(terms, 1) == (sum(terms.values()), 0)
