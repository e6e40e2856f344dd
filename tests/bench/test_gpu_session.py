"""benchmarks/gpu_session.sh, the script a lent GPU runs, checked on the CPU: its smoke mode runs every stage
at tiny sizes and writes each stage's JSON entry and the docs/speed.md section; bad arguments are one line and
write nothing; a stage past its time limit or the session's budget is recorded, not fatal."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_session.py"


@pytest.fixture(scope="module")
def gpu_session():
    """benchmarks/gpu_session.py as a module (it is a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location("gpu_session", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_session"] = module  # its dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    yield module
    del sys.modules["gpu_session"]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One smoke session through the shell wrapper: (output folder, its stdout, seconds it took)."""
    out = tmp_path_factory.mktemp("gpu_session") / "out"
    started = time.perf_counter()
    done = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_session.sh"), "--smoke", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return out, done.stdout, time.perf_counter() - started


@pytest.mark.slow
def test_smoke_runs_every_stage_and_writes_its_entry(smoke, gpu_session):
    out, _, seconds = smoke
    session = json.loads((out / "gpu_session.json").read_text())
    assert session["format"] == gpu_session.FORMAT and session["smoke"] and session["device"] == "cpu"
    stages = session["stages"]
    assert list(stages) == list(gpu_session.STAGE_NAMES)
    assert {name: entry["status"] for name, entry in stages.items()} == dict.fromkeys(gpu_session.STAGE_NAMES, "ok")
    assert seconds < 120  # about 25 s on two shared cores

    versions = stages["versions"]
    assert versions["versions"]["torch"] and set(versions["sdpa_kernels"]) == {"flash", "cudnn", "efficient", "math"}
    assert versions["sdpa_kernels"]["math"] == "ok"
    assert any("CUDA-only" in note and "ceilings" in note for note in versions["notes"]) and "ceilings" not in versions

    correctness = stages["correctness"]
    checks = correctness["checks"]
    assert {(c["grid_kind"], c["setting"], c["path"], c["autocast"]) for c in checks} == {
        (kind, setting, path, autocast)
        for kind in ("even", "uneven", "empty blocks")
        for setting in ("paper", "released")
        for path in ("operator", "processor")
        for autocast in (False, True)
    }
    assert correctness["failed"] == 0 and all(c["rel_err"] < 1e-2 for c in checks)

    timing = stages["timing"]
    methods = {row["method"] for row in timing["rows"]}
    assert {
        "MHLA operator, plan per call",
        "MHLA operator, plan precomputed",
        "plain linear attention (einsum)",
        "SDPA flash",
        "SDPA cudnn",
        "SDPA efficient",
    } <= methods
    assert any(m.startswith("Wan processor path, released") for m in methods)
    assert {row["grid"] for row in timing["rows"]} == {"3x5x10", "3x5x12"}
    timed = [row for row in timing["rows"] if row["median_ms"] is not None]
    assert all(row["median_ms"] > 0 and row["counted_units"] > 0 and row["gb_per_s"] > 0 for row in timed)
    assert any("TF32" in note for note in timing["notes"]) and not any("TF32" in m for m in methods)

    assert "aten::" in stages["profile"]["tables"]["Wan processor path, paper"]
    rows = stages["transformer"]["rows"]
    assert [r["method"] for r in rows] == [
        "sdpa (native)",
        "mhla paper (cross-attention native)",
        "mhla released (cross-attention native)",
    ]
    assert all(r["video_s"] == pytest.approx(100 * r["median_s"]) for r in rows) and rows[-1]["sdpa_over_mhla"] > 0
    compiled = stages["compile"]["rows"]
    assert [r["setting"] for r in compiled] == ["paper", "released"]
    assert all("error" not in r and r["compiled_ms"] > 0 and r["max_abs_diff_vs_eager"] < 0.05 for r in compiled)


@pytest.mark.slow
def test_smoke_renders_the_markdown_from_the_json(smoke, gpu_session, tmp_path):
    out, stdout, _ = smoke
    session = json.loads((out / "gpu_session.json").read_text())
    markdown = gpu_session.render_markdown(session)
    assert (out / "gpu_session.md").read_text().strip() == markdown == stdout.strip()
    assert markdown.startswith("**Smoke run on the CPU")
    for text in (
        "SDPA kernels: ",
        "24 checks pass, 0 fail",
        "| 3x5x12 | plain linear attention (einsum) |",
        "<details><summary>Profile of one call",
        "| mhla released (cross-attention native) |",
        "`torch.compile` (aot_eager)",
        "CUDA-only, skipped on cpu: the TF32 rows",
    ):
        assert text in markdown, text

    page = tmp_path / "speed.md"
    page.write_text("# T\n<!-- mhla-bench:cuda -->\nNot measured yet.\n<!-- /mhla-bench:cuda -->\nafter\n")
    assert gpu_session.main(["--report", str(out / "gpu_session.json"), "--write-doc", str(page)]) == 0
    assert page.read_text() == f"# T\n<!-- mhla-bench:cuda -->\n{markdown}\n<!-- /mhla-bench:cuda -->\nafter\n"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["{out}", "--smoke", "--write-doc", "{page}"], "--write-doc {page}: expected exactly one section"),
        (["{out}"], "no CUDA device here: run on a GPU, or with --smoke"),
        (["{out}", "--smoke", "--stages", "versions,speed"], "--stages: unknown speed"),
        (["--report", "{out}/gpu_session.json"], "no such file"),
    ],
)
def test_bad_arguments_are_one_line_and_write_nothing(argv, message, gpu_session, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(gpu_session.torch.cuda, "is_available", lambda: False)
    out, page = tmp_path / "out", tmp_path / "speed.md"
    page.write_text("no markers\n")
    fill = lambda text: text.format(out=out, page=page)  # noqa: E731
    assert gpu_session.main([fill(a) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gpu_session: ") and fill(message) in err and err.count("\n") == 1
    assert not out.exists() and page.read_text() == "no markers\n"


def test_a_stage_past_its_limit_or_the_budget_is_recorded(gpu_session, tmp_path, monkeypatch):
    # the isolated stage's process is stopped at its limit (here before torch has even imported)
    short = gpu_session.Stage("versions", gpu_session.stage_versions, needs_s=0, limit_s=0.2)
    monkeypatch.setattr(gpu_session, "STAGES", (short,) + gpu_session.STAGES[1:])
    session = gpu_session.run_session(tmp_path, smoke=True, budget_s=10, stages=("versions", "compile"), isolate=True)
    entry = session["stages"]["versions"]
    assert entry["status"] == "timeout" and "stopped after 0 s" in entry["error"]
    # 10 s of budget cannot start the compile stage (it needs 45 s): skipped, saying why
    assert session["stages"]["compile"]["status"] == "skipped"
    assert "the stage needs about 45 s" in session["stages"]["compile"]["notes"][0]
    markdown = gpu_session.render_markdown(session)
    assert "*versions*: timeout (stopped after" in markdown and "*compile*: skipped (skipped:" in markdown
    assert "*timing*: not run." not in markdown  # stages not asked for are left out


def test_the_gpu_sizes_are_the_issues(gpu_session):
    """What docs/speed.md says the GPU session measures: Wan2.1-1.3B's heads at 21x30x50 and 21x30x52, and a
    30-block transformer at 21x30x52 with 512 text tokens."""
    full = gpu_session.FULL
    assert (full.heads, full.head_dim, full.layout) == (12, 128, (3, 5, 10))
    assert full.timing_grids == ((21, 30, 50), (21, 30, 52)) and full.compile_backend == "inductor"
    assert (full.transformer_grid, full.transformer_layers, full.text_tokens) == ((21, 30, 52), 30, 512)
    assert set(full.correctness_grids) == {"even", "uneven", "empty blocks"}


def _stand_in_fused(
    q, k, v, plan, mixing, *, cos=None, sin=None, feature_eps=1e-6, normalize="denominator", eps=1e-6, dot_dtype=None
):
    """The fused kernel's contract (raw q, k; feature map and RoPE inside) computed by the eager operator."""
    import torch.nn.functional as F

    from mhla_diffusion import mhla_attention
    from mhla_diffusion.models.processors.base import apply_interleaved_rotary

    qf, kf = (F.relu(x.float()) + feature_eps for x in (q, k))
    q_rot, k_rot = (None, None) if cos is None else (apply_interleaved_rotary(x, cos, sin) for x in (qf, kf))
    return mhla_attention(
        qf, kf, v, plan.grid, plan.layout, mixing, q_rot=q_rot, k_rot=k_rot, normalize=normalize, eps=eps, plan=plan
    )


def test_the_fused_kernel_is_checked_timed_and_profiled_when_it_runs(gpu_session, tmp_path, monkeypatch):
    """Under Triton's interpreter (as on CUDA) the session calls the fused kernel with its signature; a stand-in
    with the kernel's contract takes its place here."""
    monkeypatch.setattr(gpu_session, "fused_kernel", lambda: (_stand_in_fused, "available"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    import mhla_diffusion.models.processors.base as processors

    # the Wan processor rows keep the eager operator here: the real kernels under the interpreter took ~3 minutes
    # of this test, and tests/attention/test_triton_mhla.py checks the processors' choice of them
    monkeypatch.setattr(processors, "fused_available", lambda tensor: False)
    session = gpu_session.run_session(
        tmp_path, smoke=True, budget_s=300, stages=("correctness", "timing", "profile"), isolate=False
    )
    assert [entry["status"] for entry in session["stages"].values()] == ["ok"] * 3
    fused = [c for c in session["stages"]["correctness"]["checks"] if c["path"] == "fused"]
    assert len(fused) == 12 and all(c["ok"] for c in fused)  # 3 grids x 2 settings x autocast off / on
    rows = [r for r in session["stages"]["timing"]["rows"] if r["method"].startswith("fused Triton kernel")]
    assert {(r["grid"], r["method"].split(",")[1].split()[0]) for r in rows} == {
        (grid, mode) for grid in ("3x5x10", "3x5x12") for mode in ("denominator", "none")
    }
    assert all(r["bytes_basis"] == "counted from the launch" and r["median_ms"] > 0 for r in rows)
    timing = session["stages"]["timing"]
    dtype = getattr(torch, timing["dtype"])
    for r in rows:  # the bytes each row is divided by: its launch's count (fused_traffic)
        unit = r["tokens"] * timing["heads"] * timing["head_dim"] * dtype.itemsize
        grid, mode = tuple(map(int, r["grid"].split("x"))), r["method"].split(",")[1].split()[0]
        assert r["counted_units"] * unit == pytest.approx(gpu_session.fused_bytes(grid, gpu_session.SMOKE, dtype, mode))
    assert "fused Triton kernel, denominator (feature map, RoPE)" in session["stages"]["profile"]["tables"]
