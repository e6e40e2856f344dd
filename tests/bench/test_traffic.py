"""The memory-traffic count (mhla_diffusion.ops.traffic) and `mhla bench --traffic`."""

from __future__ import annotations

import math

import pytest
import torch

from mhla_diffusion import MHLAConfig
from mhla_diffusion.bench import traffic_settings, wan_attention_traffic
from mhla_diffusion.cli import main
from mhla_diffusion.ops.traffic import count_traffic, floor_bytes, tensor_bytes


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
    assert "| 3x4x10 | 120 | released |" in text and "x floor" in text
    assert out.exists()
    assert main(["bench", "--traffic", "--traffic-grid", "3x4"]) == 2
    assert "--traffic-grid must be frames x height x width" in capsys.readouterr().err


def test_the_readme_table_is_what_the_command_prints(capsys):
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert main(["bench", "--traffic"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 21x30x5")]
    assert len(rows) == 4
    for row in rows:
        assert row in readme


def test_an_out_argument_is_written_not_read():
    x, out = _meta(10, dtype=torch.float32), _meta(10, dtype=torch.float32)
    counter = count_traffic(lambda: torch.clamp_min(x, 0, out=out))
    assert (counter.read, counter.written) == (40, 40)
    assert count_traffic(lambda: torch.empty_like(x)).total == 0
