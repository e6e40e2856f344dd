"""What a GPU run relies on, checked on the CPU: a converted Wan transformer in bf16 (the operator still
accumulating in float32), the whole converted transformer under ``torch.compile(fullgraph=True)``, and
the `mhla bench` JSON and docs/speed.md tables that a GPU run writes (here with --device cpu at toy sizes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from helpers.cli import TINY_BENCH
from helpers.models import run, wan_inputs
from mhla_diffusion import MHLAConfig, convert_to_mhla
from mhla_diffusion.benchmarks.bench import replace_marked_section
from mhla_diffusion.cli import main
from mhla_diffusion.models.tiny import tiny_wan_transformer

SPEED_PAGE = Path(__file__).resolve().parents[2] / "docs" / "speed.md"
CONFIGS = {
    "paper": MHLAConfig(layout=(2, 2, 2), gate=True, output_norm=True, lepe=True),
    "released": MHLAConfig.released_wan(layout=(2, 2, 2), lepe=True),
}


def converted_wan(config: MHLAConfig, num_layers: int = 2) -> torch.nn.Module:
    """A tiny converted Wan transformer whose MHLA parameters are away from their init (so they matter)."""
    model = tiny_wan_transformer(num_layers=num_layers)
    convert_to_mhla(model, config)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if ".processor." in name:
                parameter.add_(0.2 * torch.rand(parameter.shape, generator=g))
    return model


class _MatmulDtypes(TorchDispatchMode):
    """Records the dtype of every matrix product run inside the ``with`` block."""

    PRODUCTS = {"bmm", "mm", "matmul", "addmm", "baddbmm", "einsum"}

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: list[torch.dtype] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.__name__.split(".")[0] in self.PRODUCTS:
            self.dtypes.append(out.dtype)
        return out


@pytest.mark.parametrize("setting", sorted(CONFIGS))
def test_converted_wan_runs_in_bf16_with_float32_accumulation(setting, monkeypatch):
    model = converted_wan(CONFIGS[setting])
    inputs = wan_inputs(3, 5, 7)
    reference = run(model, inputs)
    model.to(torch.bfloat16)
    half = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in inputs.items()}

    import mhla_diffusion.models.processors.base as base

    seen = []
    operator = base.mhla_attention

    def spying_operator(q, k, v, *args, **kwargs):
        with _MatmulDtypes() as products:
            out = operator(q, k, v, *args, **kwargs)
        seen.append((q.dtype, v.dtype, out.dtype, set(products.dtypes)))
        return out

    monkeypatch.setattr(base, "mhla_attention", spying_operator)
    out = run(model, half)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    # raw bf16 projections in (the operator applies the feature map and RoPE in bf16), bf16 out; the large
    # products take bf16 operands (GEMMs accumulate them in float32), the denominators are float32
    assert seen and all(entry[:3] == (torch.bfloat16,) * 3 for entry in seen), seen
    assert all(torch.bfloat16 in entry[3] and entry[3] <= {torch.bfloat16, torch.float32} for entry in seen), seen
    scale = reference.abs().max()
    torch.testing.assert_close(out.float(), reference, rtol=0, atol=0.03 * scale)


@pytest.mark.slow  # Inductor compiles a whole transformer
@pytest.mark.parametrize("setting", sorted(CONFIGS))
def test_whole_converted_wan_compiles_fullgraph_and_matches_eager(setting):
    """Dynamo traces the transformer with its grid hook, processors and operator as one graph
    (fullgraph=True raises on any graph break), also after a new grid recompiles it. AOTAutograd's
    eager backend keeps the test short; Inductor's C++ build would take minutes on two cores."""
    model = converted_wan(CONFIGS[setting])
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    for grid in ((3, 5, 7), (2, 4, 6)):
        inputs = wan_inputs(*grid)
        torch.testing.assert_close(run(compiled, inputs), run(model, inputs), rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # Inductor compiles a whole transformer, forward and backward
def test_converted_wan_compiles_with_inductor_and_matches_eager():
    """torch.compile(fullgraph=True) with Inductor, the backend users get by default, on this CPU (its C++
    build takes ~40 s here): generated kernels for the operator's feature map, RoPE and block products give
    the eager output."""
    model = converted_wan(MHLAConfig(layout=(2, 2, 2)))  # the paper setting: denominator, RoPE
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="inductor")
    inputs = wan_inputs(3, 5, 7)  # uneven blocks: gathers, padding and masks too
    torch.testing.assert_close(run(compiled, inputs), run(model, inputs), rtol=1e-5, atol=1e-5)


def test_bench_writes_json_and_the_speed_page_tables(tmp_path, capsys):
    result_file = tmp_path / "bench.json"
    assert (
        main(["bench", *TINY_BENCH, "--device", "cpu", "--transformer-layers", "1", "--output", str(result_file)]) == 0
    )
    printed = capsys.readouterr().out
    result = json.loads(result_file.read_text())
    assert result["device_type"] == "cpu" and "fresh process" in result["device"] and result["spec"]["malloc"] == "auto"
    assert [r["method"] for r in result["attention"]] == [
        "sdpa (native)",
        "linear",
        "linear (MHLA, 1 block)",
        "linear + φ",
        "mhla + φ",
        "mhla",
    ]
    assert [r["method"] for r in result["wan_block"]] == ["default (sdpa)", "mhla"]
    transformer = result["wan_transformer"]
    assert [r["method"] for r in transformer] == ["sdpa (native)", "mhla (cross-attention native)"]
    assert transformer[-1]["layers"] == 1 and transformer[-1]["sdpa_over_mhla"] > 0 and transformer[0]["median_s"] > 0

    page = tmp_path / "speed.md"
    page.write_text("before\n<!-- mhla-bench:cpu -->\nno numbers yet\n<!-- /mhla-bench:cpu -->\nafter\n")
    assert main(["bench", "--report", str(result_file), "--write-doc", str(page)]) == 0
    report = capsys.readouterr().out.strip()
    assert report == printed.strip()  # the same tables, from the JSON alone
    text = page.read_text()
    assert text.startswith("before\n<!-- mhla-bench:cpu -->\n`mhla bench` on ") and text.endswith(
        "<!-- /mhla-bench:cpu -->\nafter\n"
    )
    assert "no numbers yet" not in text and "| 2x4x4 | 32 | 1x2x2 | 1 | mhla (cross-attention native) |" in text

    page.write_text("no markers\n")
    assert main(["bench", "--report", str(result_file), "--write-doc", str(page)]) == 2
    assert "mhla-bench:cpu" in capsys.readouterr().err and page.read_text() == "no markers\n"


def test_the_speed_page_has_the_sections_the_bench_writes():
    text = SPEED_PAGE.read_text()
    for section in ("cuda", "cpu"):
        assert "NEW TABLES" in replace_marked_section(text, section, "NEW TABLES")
    assert "mhla bench --device cuda" in text and "--write-doc docs/speed.md" in text
    with pytest.raises(ValueError, match="mhla-bench:nowhere"):
        replace_marked_section(text, "nowhere", "x")
