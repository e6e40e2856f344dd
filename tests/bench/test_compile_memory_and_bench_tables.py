"""The fast path's promises -- torch.compile without graph breaks, head chunking, bounded peak memory --
and the machinery of `mhla bench` (memory tracker, tables, command). No timing is asserted."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from helpers.attention import make_inputs
from helpers.cli import TINY_BENCH
from mhla_diffusion import mhla_attention, mhla_attention_reference, mixing_init
from mhla_diffusion.benchmarks.bench import (
    BenchCase,
    BenchSpec,
    PeakMemory,
    attention_table,
    report_markdown,
    time_calls,
)
from mhla_diffusion.cli import main


@pytest.mark.parametrize("grid,layout", [((3, 4, 6), (1, 2, 3)), ((5, 7), (2, 3))])
def test_compiles_without_graph_breaks(grid, layout):
    q, k, v, q_rot, k_rot = make_inputs(grid, dtype=torch.float32)
    mixing = mixing_init(layout)

    def fn(q, k, v, q_rot, k_rot, mixing):
        return mhla_attention(q, k, v, grid, layout, mixing, q_rot=q_rot, k_rot=k_rot, heads_per_chunk=2)

    torch._dynamo.reset()
    explanation = torch._dynamo.explain(fn)(q, k, v, q_rot, k_rot, mixing)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v, q_rot, k_rot, mixing), fn(q, k, v, q_rot, k_rot, mixing))


@pytest.mark.parametrize("per_head", [False, True])
def test_head_chunks_equal_one_pass_and_reference(per_head):
    grid, layout = (3, 5, 4), (2, 2, 2)
    q, k, v, q_rot, k_rot = make_inputs(grid, heads=5)
    mixing = mixing_init(layout, dtype=torch.float64) + 0.01
    if per_head:
        mixing = mixing.expand(5, -1, -1) * torch.linspace(0.5, 1.5, 5, dtype=torch.float64)[:, None, None]
    whole = mhla_attention(q, k, v, grid, layout, mixing, q_rot=q_rot, k_rot=k_rot)
    for chunk in (1, 2, 3):
        torch.testing.assert_close(
            mhla_attention(q, k, v, grid, layout, mixing, q_rot=q_rot, k_rot=k_rot, heads_per_chunk=chunk), whole
        )
    torch.testing.assert_close(whole, mhla_attention_reference(q, k, v, grid, layout, mixing, q_rot=q_rot, k_rot=k_rot))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    mhla_attention(*leaves, grid, layout, mixing, heads_per_chunk=2).sum().backward()
    grads = [t.grad for t in leaves]
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    mhla_attention(*leaves, grid, layout, mixing).sum().backward()
    for a, b in zip(grads, (t.grad for t in leaves)):
        torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="heads_per_chunk"):
        mhla_attention(q, k, v, grid, layout, mixing, heads_per_chunk=0)


@pytest.mark.parametrize("grid,layout", [((6, 10, 10), (2, 2, 5)), ((6, 10, 10), (4, 3, 3))])
def test_peak_extra_memory_within_1_5x_of_io(grid, layout):
    q, k, v, _, _ = make_inputs(grid, heads=4, dim=32, value_dim=32, batch=1, dtype=torch.float32)
    io_bytes = 4 * q.numel() * q.element_size()
    with torch.no_grad(), PeakMemory() as memory:
        out = mhla_attention(q, k, v, grid, layout, mixing_init(layout))
    assert out.shape == v.shape
    assert 0 < memory.peak <= 1.5 * io_bytes, memory.peak / io_bytes
    with torch.no_grad(), PeakMemory() as chunked:
        mhla_attention(q, k, v, grid, layout, mixing_init(layout), heads_per_chunk=1)
    assert chunked.peak < memory.peak


def test_peak_memory_tracker_counts_new_tensors_only():
    x = torch.ones(1000)
    with PeakMemory() as memory:
        view = x[:500]  # no new memory
        y = x * 2  # 4000 bytes
        z = y + 1  # 4000 more while y lives
        del y, view
        w = z * 3  # y freed: peak stays 8000
    assert memory.peak == 8000 and w.numel() == 1000


def test_peak_memory_tracker_counts_memory_reused_at_a_freed_address():
    """New memory at the address of a freed tensor counts with its own size, not the freed one's (the freed
    tensor's entry is pruned only after each op). Tensors over one numpy buffer give both the same address."""
    buffer = np.zeros(1000, dtype=np.float32)
    memory = PeakMemory()
    made = [torch.from_numpy(buffer[:10])]
    memory.__torch_dispatch__(made.pop, ())  # an op that made 40 bytes, freed once it returns
    memory.__torch_dispatch__(lambda: torch.from_numpy(buffer), ())  # then 4000 at the same address
    assert memory.peak == 4000


def test_rounds_rotate_the_order_and_repeat_quick_methods(monkeypatch):
    import mhla_diffusion.benchmarks.bench as bench

    calls = []
    durations = {"slow": 5.0, "a": 0.1, "b": 0.2}
    monkeypatch.setattr(bench, "_wall_seconds", lambda fn: fn())  # a "run" returns its duration untimed
    fns = {name: (lambda name=name: calls.append(name) or durations[name]) for name in durations}
    timings = time_calls(fns, repeats=3, warmup=1, device=torch.device("cpu"), quick_seconds=1.0, quick_passes=2)
    timed = calls[6:]  # after one warm-up and one memory-tracked run of each
    rounds = [timed[:5], timed[5:10], timed[10:]]
    # 3 methods, 3 rounds: every round starts one method later; the quick methods run once more per round
    assert rounds == [
        ["slow", "a", "b", "a", "b"],
        ["a", "b", "slow", "a", "b"],
        ["b", "slow", "a", "b", "a"],
    ]
    assert timings["slow"][0] == 5.0 and timings["a"][0] == 0.1
    assert time_calls({"x": fns["a"]}, 2, 0, torch.device("cpu"))["x"][0] == 0.1 and calls[-2:] == ["a", "a"]
    # 6 methods, 3 rounds: the rounds start 2 methods apart, so none always follows the same method
    calls.clear()
    many = {name: (lambda name=name: calls.append(name) or 5.0) for name in "uvwxyz"}
    time_calls(many, repeats=3, warmup=0, device=torch.device("cpu"))
    assert [calls[6:][i * 6] for i in range(3)] == ["u", "w", "y"]


def test_report_header_says_how_many_runs_a_median_covers():
    spec = BenchSpec(cases=[((2, 4, 6), None)], repeats=3, quick_passes=5).to_json()
    result = {"spec": spec, "device": "cpu", "device_type": "cpu", "dtype": "float32", "torch": "x", "attention": []}
    assert "median of 3 rounds (15 runs for operators under 1 s per call)" in report_markdown(result)
    del spec["quick_passes"]  # a run saved before the option: one run per round
    assert "torch x, median of 3." in report_markdown(result)
    assert BenchSpec.from_json(spec).quick_passes == 1


def test_attention_table_reports_ratios():
    rows = attention_table(
        [BenchCase.of((2, 4, 6)), BenchCase.of((3, 4, 4), (1, 2, 2))], heads=2, head_dim=8, repeats=1
    )
    methods = [r["method"] for r in rows]
    assert methods == ["sdpa (native)", "linear", "linear (MHLA, 1 block)", "linear + φ", "mhla + φ", "mhla"] * 2
    mapped, mhla = rows[4], rows[5]
    assert mhla["layout"].endswith("(auto)") and mhla["blocks"] == math.prod(BenchCase.of((2, 4, 6)).layout)
    assert mhla["sdpa_over_mhla"] > 0 and mhla["mhla_over_linear"] > 0 and mhla["median_ms"] > 0
    assert mapped["mhla_over_linear"] > 0 and "sdpa_over_mhla" not in mapped
    assert "sdpa_over_mhla" not in rows[0] and "mhla_over_linear" not in rows[3]


def test_bench_command_prints_both_tables(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", *TINY_BENCH, "--output", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| 2x4x6 | 48 |" in text and "SDPA / MHLA" in text and "default (sdpa)" in text
    assert out.is_file()
    assert main(["bench", "--case", "2x4:3"]) == 2  # one block count for a 2-axis grid
    assert "`layout`" in capsys.readouterr().err


@pytest.mark.parametrize("family", ["wan", "dit"])
def test_converted_models_trace_without_graph_breaks(family, tiny_wan, tiny_dit):
    from helpers.models import dit_inputs, wan_inputs
    from mhla_diffusion import MHLAConfig, convert_to_mhla

    if family == "wan":
        model, inputs = tiny_wan, wan_inputs(3, 5, 7)
        convert_to_mhla(model, MHLAConfig.released_wan(layout=(2, 2, 2), lepe=True))
    else:
        model, inputs = tiny_dit, dit_inputs()
        convert_to_mhla(model, MHLAConfig(lepe=True, gate=True))
    torch._dynamo.reset()
    with torch.no_grad():
        explanation = torch._dynamo.explain(model)(**inputs)
    assert explanation.graph_break_count == 0, explanation.break_reasons


def test_retain_freed_memory_is_accepted_on_linux(monkeypatch):
    import sys

    from mhla_diffusion import retain_freed_memory

    monkeypatch.delenv("MHLA_KEEP_MALLOC", raising=False)  # that opt-out is tested in test_cpu_allocator.py
    assert retain_freed_memory() is sys.platform.startswith("linux")
