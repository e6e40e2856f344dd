"""benchmarks/gpu_session.sh, the script a lent GPU runs, checked on the CPU: its smoke mode runs every stage
at tiny sizes and writes each stage's JSON entry and the docs/speed.md section; its pure parts (the loop timer
on a fake clock, the budget planner, the graph recorder, the Markdown from synthetic timings) are checked
directly; bad arguments are one line and write nothing; a stage past its time limit or the session's budget is
recorded, not fatal."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mhla_diffusion.benchmarks.families import FAMILY_MODELS

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_session.py"


@pytest.fixture(scope="module")
def gpu_session():
    """benchmarks/gpu_session.py as a module (it is a script, not part of the package): every name of the
    stages' package ``benchmarks/gpu_stages/``, whose modules (``runner``, ``environment``, ...) are where a test
    patches what the stages look up."""
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
        timeout=400,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return out, done.stdout, time.perf_counter() - started


# ----------------------------------------------------------------------------- the loop timer on a fake clock


class FakeClock:
    """A clock that only the timed calls move: each call of a method adds its next duration."""

    def __init__(self) -> None:
        self.now = 0.0
        self.syncs = 0

    def method(self, durations: list[float], log: list[str], name: str):
        durations = iter(durations)

        def call() -> None:
            log.append(name)
            self.now += next(durations)

        return call


class FakeTimer:
    name = "fake clock"

    def __init__(self, clock: FakeClock) -> None:
        self.clock, self.started = clock, None

    def sync(self) -> None:
        self.clock.syncs += 1

    def start(self) -> None:
        self.started = self.clock.now

    def stop(self) -> float:
        return self.clock.now - self.started


def test_calls_for_fills_the_target_within_bounds(gpu_session):
    plan = gpu_session.LoopPlan(repeats=3, warmup=1, target_s=0.05, min_calls=10, max_calls=500)
    assert gpu_session.calls_for(0.0004, plan) == 125  # ceil(0.05 / 0.0004)
    assert gpu_session.calls_for(0.00001, plan) == 500  # a 10 µs call: capped
    assert gpu_session.calls_for(0.02, plan) == 10  # a 20 ms call: at least min_calls
    assert gpu_session.calls_for(0.0, plan) == 500  # an immeasurably short call: the most calls


def test_time_loops_times_whole_loops_and_reports_median_per_call(gpu_session):
    clock, log = FakeClock(), []
    plan = gpu_session.LoopPlan(repeats=3, warmup=2, target_s=0.01, min_calls=1, max_calls=100)
    # a: 2 warm-up calls, a 1 ms sizing call -> loops of 10 calls; rounds of 10 calls at 1, 2, 1.5 ms each
    a = [0.5, 0.5, 0.001] + [0.001] * 10 + [0.002] * 10 + [0.0015] * 10
    # b: sizing call of 5 ms -> loops of 2 calls
    b = [0.1, 0.1, 0.005] + [0.004] * 6
    fns = {"a": clock.method(a, log, "a"), "b": clock.method(b, log, "b")}
    timings, errors = gpu_session.time_loops(fns, FakeTimer(clock), plan)
    assert errors == {}
    assert timings["a"].calls == 10 and timings["b"].calls == 2
    assert timings["a"].loops_s == pytest.approx([0.01, 0.02, 0.015])
    assert timings["a"].per_call_s == pytest.approx(0.0015)  # median loop / calls, not mean, not the warm-up
    assert timings["a"].spread == pytest.approx(2.0)
    assert timings["b"].per_call_s == pytest.approx(0.004) and timings["b"].spread == pytest.approx(1.0)
    # warm-up and sizing first, per method, with a sync after the warm-up; then rounds of whole loops, each round
    # starting one method later: a's loop, b's loop | b, a | a, b
    assert log[:3] == ["a"] * 3 and log[3:6] == ["b"] * 3 and clock.syncs == 2
    loops = log[6:]
    assert loops == ["a"] * 10 + ["b"] * 2 + ["b"] * 2 + ["a"] * 10 + ["a"] * 10 + ["b"] * 2


def test_time_loops_keeps_going_past_a_method_that_fails(gpu_session):
    clock, log = FakeClock(), []
    plan = gpu_session.LoopPlan(repeats=2, warmup=1, target_s=0.002, min_calls=1, max_calls=10)

    def broken() -> None:
        raise RuntimeError("No viable backend\nsecond line")

    fns = {"broken": broken, "ok": clock.method([0.001] * 10, log, "ok")}
    timings, errors = gpu_session.time_loops(fns, FakeTimer(clock), plan)
    assert errors == {"broken": "RuntimeError: No viable backend"}
    assert list(timings) == ["ok"] and timings["ok"].calls == 2 and timings["ok"].loops_s == pytest.approx([0.002] * 2)


def test_the_wall_timer_waits_for_the_device_at_both_ends(gpu_session):
    waits = []
    timer = gpu_session.WallTimer(lambda: waits.append(time.perf_counter()))
    timer.start()
    time.sleep(0.01)
    seconds = timer.stop()
    assert len(waits) == 2 and seconds >= 0.01 and seconds == pytest.approx(waits[1] - waits[0], abs=0.005)
    assert isinstance(gpu_session.timer_for(torch.device("cpu")), gpu_session.WallTimer)


# ----------------------------------------------------------------------------- the budget


def test_every_stage_gets_what_it_needs_in_the_default_budget(gpu_session):
    """Worst case: each stage runs to its limit; the later ones still start. The compile stage, third, gets
    minutes, and the whole call (budget, the wrapper's 30 s and the machine's start) fits 10 minutes."""
    plan = gpu_session.plan_budget(gpu_session.DEFAULT_BUDGET_S, gpu_session.STAGE_NAMES)
    assert [p["stage"] for p in plan] == list(gpu_session.STAGE_NAMES)
    assert gpu_session.STAGE_NAMES.index("endtoend") == 2
    assert all(p["limit_s"] is not None and p["limit_s"] >= p["needs_s"] for p in plan), plan
    assert sum(p["limit_s"] for p in plan) <= gpu_session.DEFAULT_BUDGET_S
    endtoend = next(p for p in plan if p["stage"] == "endtoend")
    assert endtoend["limit_s"] >= 2 * gpu_session.FULL.compile_estimate_s  # two compiles at least
    assert gpu_session.DEFAULT_BUDGET_S + 30 + 120 <= 600


def test_a_stage_never_takes_what_the_later_stages_need(gpu_session):
    stage = gpu_session.Stage("a", lambda ctx: None, needs_s=20, limit_s=100)
    assert gpu_session.stage_limit(stage, left_s=300, later_needs_s=50) == 100  # its own limit
    assert gpu_session.stage_limit(stage, left_s=120, later_needs_s=50) == 70  # what the later ones leave
    assert gpu_session.stage_limit(stage, left_s=60, later_needs_s=50) is None  # 10 s < its 20 s: skipped
    stages = (
        gpu_session.Stage("a", lambda ctx: None, needs_s=10, limit_s=100),
        gpu_session.Stage("b", lambda ctx: None, needs_s=50, limit_s=60),
        gpu_session.Stage("c", lambda ctx: None, needs_s=30, limit_s=30),
    )
    plan = gpu_session.plan_budget(120, ("a", "b", "c"), stages)
    assert [(p["stage"], p["starts_after_s"], p["limit_s"]) for p in plan] == [
        ("a", 0, 40),  # 120 - (50 + 30) kept back
        ("b", 40, 50),
        ("c", 90, 30),
    ]
    # a stage not asked for keeps nothing back, nor one that needs more than the whole budget
    assert gpu_session.plan_budget(120, ("a", "c"), stages)[0]["limit_s"] == 90
    assert gpu_session.kept_back(list(stages[1:]), budget_s=40) == 30


def test_a_stage_past_its_limit_or_the_budget_is_recorded(gpu_session, tmp_path, monkeypatch):
    # the isolated stage's process is stopped at its limit (here before torch has even imported)
    short = gpu_session.Stage("versions", gpu_session.stage_versions, needs_s=0, limit_s=0.2)
    monkeypatch.setattr(gpu_session.runner, "STAGES", (short,) + gpu_session.STAGES[1:])
    session = gpu_session.run_session(tmp_path, smoke=True, budget_s=60, stages=("versions", "endtoend"), isolate=True)
    entry = session["stages"]["versions"]
    assert entry["status"] == "timeout" and "stopped after 0 s" in entry["error"]
    # 60 s of budget cannot start the end-to-end stage (it needs 90 s): skipped, saying why
    assert session["stages"]["endtoend"]["status"] == "skipped"
    assert "the stage needs about 90 s" in session["stages"]["endtoend"]["notes"][0]
    assert session["plan"][1] == {"stage": "endtoend", "needs_s": 90, "starts_after_s": 0.2, "limit_s": None}
    markdown = gpu_session.render_markdown(session)
    assert "*versions*: timeout (stopped after" in markdown and "*endtoend*: skipped (skipped:" in markdown
    assert "*timing*: not run." not in markdown  # stages not asked for are left out


# ----------------------------------------------------------------------------- the compiled graph's attention


def test_the_graph_recorder_finds_an_mhla_custom_op_in_the_compiled_graph(gpu_session):
    """What the end-to-end stage reads from a compiled model: the MHLA custom op's calls when the graph keeps
    it, SDPA's calls, and every op outside aten."""

    @torch.library.custom_op("mhla_gpu_session_test::scale", mutates_args=())
    def scale(x: torch.Tensor, s: float) -> torch.Tensor:
        return x * s

    @scale.register_fake
    def _(x, s):
        return torch.empty_like(x)

    def attention(x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.scaled_dot_product_attention(x, x, x)
        return scale(scale(y, 2.0), 0.5) + 1

    torch._dynamo.reset()
    recorder = gpu_session.GraphRecorder("aot_eager")
    x = torch.randn(1, 2, 8, 4)
    out = torch.compile(attention, fullgraph=True, backend=recorder)(x)
    torch.testing.assert_close(out, attention(x))
    summary = recorder.summary()
    assert summary == {
        "graphs": 1,
        "mhla_op_calls": 2,
        "sdpa_calls": 1,
        "custom_ops": {"mhla_gpu_session_test::scale.default": 2},
    }
    assert gpu_session.attention_path("mhla paper", summary, 60) == (
        "MHLA custom op kept in the graph (2 calls); 60 fused kernel launches per forward"
    )
    assert gpu_session.attention_path("mhla paper", {**summary, "mhla_op_calls": 0}, None) == (
        "eager MHLA operator traced into the graph (no MHLA custom op)"
    )
    assert gpu_session.attention_path("sdpa", summary, None) == "SDPA (1 calls in the graph)"
    assert gpu_session.fused_launches({"_summaries_kernel": 30, "_output_kernel": 30, "ampere_bf16_gemm": 90}) == 60


# ----------------------------------------------------------------------------- Markdown from synthetic timings


def synthetic_session(gpu_session) -> dict:
    """A session as a GPU run writes it, with made-up numbers (no stage runs)."""
    fa3 = gpu_session.fa3_status()
    return {
        "format": gpu_session.FORMAT,
        "smoke": False,
        "device": "cuda",
        "torch": "2.11.0+cu130",
        "started": "2026-12-05T10:00:00+00:00",
        "requested": list(gpu_session.STAGE_NAMES),
        "stages": {
            "versions": {
                "status": "ok",
                "versions": {"torch": "2.11.0+cu130", "cuda": "13.0", "cudnn": 91300, "triton": "3.6.0"},
                "gpu": {"name": "NVIDIA H200"},
                "sdpa_kernels": {"flash": "ok", "cudnn": "ok", "efficient": "ok", "math": "ok"},
                "fa3": fa3,
                "flash_attn": "not installed",
                "ceilings": {"copy_gb_per_s": 4300.0, "bf16_matmul_tflop_per_s": 780.0},
            },
            "endtoend": {
                "status": "ok",
                "grid": "21x30x52",
                "layout": "3x5x10",
                "layers": 30,
                "text_tokens": 512,
                "timer": gpu_session.CudaEventTimer.name,
                "cross_attention": "native",
                "compile_call": "torch.compile(transformer, fullgraph=True, backend=GraphRecorder('inductor'))",
                "rows": [
                    {"method": "sdpa (_native_cudnn, FA3 stand-in)", "attention": "SDPA", "median_s": 0.5},
                    {"method": "mhla paper", "attention": "MHLA", "median_s": 0.25, "sdpa_over_mhla": 2.0},
                ],
                "compiled": [
                    {
                        "setting": "mhla paper",
                        "attention_path": "MHLA custom op kept in the graph (30 calls)",
                        "graphs": 1,
                        "compile_s": 71.5,
                        "eager_s": 0.25,
                        "compiled_s": 0.2,
                        "eager_over_compiled": 1.25,
                        "rel_diff_vs_eager": 0.004,
                    },
                    {"setting": "mhla released", "error": "skipped: 40 s of the stage left"},
                ],
            },
            "timing": {
                "status": "ok",
                "heads": 12,
                "head_dim": 128,
                "dtype": "bfloat16",
                "layout": "3x5x10",
                "repeats": 10,
                "timer": gpu_session.CudaEventTimer.name,
                "fused": "available",
                "fa3": fa3,
                "floor_units": {"21x30x50": 6.5},
                "rows": [
                    {
                        "grid": "21x30x50",
                        "method": "fused Triton kernel, denominator (feature map, RoPE)",
                        "calls": 200,
                        "median_ms": 0.25,
                        "spread": 1.02,
                        "graph_ms": 0.24,
                        "counted_units": 8.8,
                        "bytes_basis": "counted from the launch",
                        "gb_per_s": 3400.0,
                        "floor_gb_per_s": 2500.0,
                    },
                    {"grid": "21x30x50", "method": "SDPA cudnn (FA3 stand-in)", "calls": 10, "median_ms": 4.1},
                ],
            },
            "training": {
                "status": "ok",
                "heads": 12,
                "head_dim": 128,
                "dtype": "bfloat16",
                "layout": "3x5x10",
                "repeats": 7,
                "timer": gpu_session.CudaEventTimer.name,
                "fused_backward": "mhla_diffusion.ops.triton_mhla_backward imports",
                "fa3": fa3,
                "rows": [
                    {
                        "grid": "21x30x50",
                        "method": "MHLA fused (mhla_attention_fused), denominator",
                        "calls": 100,
                        "forward_ms": 0.25,
                        "forward_backward_ms": 0.75,
                        "backward_ms": 0.5,
                        "backward_over_forward": 2.0,
                        "spread": 1.01,
                    }
                ],
                "fused_backward_kernels": {"21x30x50": {"_summaries_kernel": 2, "_output_kernel": 1}},
            },
            "profile": {"status": "timeout", "error": "stopped after 30 s (its time limit in this session)"},
        },
    }


def test_the_markdown_says_what_was_timed_and_how(gpu_session, tmp_path):
    session = synthetic_session(gpu_session)
    markdown = gpu_session.render_markdown(session)
    assert markdown.startswith("`benchmarks/gpu_session.sh` on NVIDIA H200, 2026-12-05: torch 2.11.0+cu130")
    for text in (
        "Measured ceilings: device copy 4300 GB/s, bf16 matmul 780 TFLOP/s.",
        # the FA3 stand-in is said in the versions line, above the tables, and in the rows' names
        "SDPA cuDNN (torch.nn.attention.sdpa_kernel(SDPBackend.CUDNN_ATTENTION)) stands in for FlashAttention-3",
        "| 21x30x50 | SDPA cudnn (FA3 stand-in) | 10 | 4.100 |",
        "| sdpa (_native_cudnn, FA3 stand-in) | SDPA | 0.500 |",
        # loops, not single calls
        "CUDA events around loops of back-to-back calls, per call = median loop / calls over 10 rounds",
        "| 21x30x50 | fused Triton kernel, denominator (feature map, RoPE) | 200 | 0.250 | 1.02 | 0.240 | 8.8 |",
        # the compiled model and its attention path
        "`torch.compile(transformer, fullgraph=True, backend=GraphRecorder('inductor'))`",
        "| mhla paper | MHLA custom op kept in the graph (30 calls) | 1 | 71.5 | 0.250 | 0.200 | 1.25 | 4.0e-03 |",
        "| mhla released |  |  |  |  |  |  |  | skipped: 40 s of the stage left |",
        # the training rows and the fused backward's kernels
        "Fused backward: mhla_diffusion.ops.triton_mhla_backward imports.",
        "| 21x30x50 | MHLA fused (mhla_attention_fused), denominator | 100 | 0.250 | 0.750 | 0.500 | 2.00 | 1.01 |",
        "Kernels of one fused forward + backward at 21x30x50: _summaries_kernel x2, _output_kernel x1.",
        "*correctness*: not run.",
        "*profile*: timeout (stopped after 30 s (its time limit in this session)).",
    ):
        assert text in markdown, text
    saved = tmp_path / "gpu_session.json"
    saved.write_text(json.dumps(session))
    page = tmp_path / "speed.md"
    page.write_text("# T\n<!-- mhla-bench:cuda -->\nNot measured yet.\n<!-- /mhla-bench:cuda -->\nafter\n")
    assert gpu_session.main(["--report", str(saved), "--write-doc", str(page)]) == 0
    assert page.read_text() == f"# T\n<!-- mhla-bench:cuda -->\n{markdown}\n<!-- /mhla-bench:cuda -->\nafter\n"


def test_the_fa3_stand_in_is_named_only_where_fa3_is_missing(gpu_session):
    assert gpu_session.sdpa_method("cudnn", fa3_imports=False) == "SDPA cudnn (FA3 stand-in)"
    assert gpu_session.sdpa_method("cudnn", fa3_imports=True) == "SDPA cudnn"
    assert gpu_session.sdpa_method("flash", fa3_imports=False) == "SDPA flash"
    assert gpu_session.module_status("no_such_module_for_gpu_session") == "not installed"


# ----------------------------------------------------------------------------- the smoke run


@pytest.mark.slow
def test_smoke_runs_every_stage_and_writes_its_entry(smoke, gpu_session):
    out, _, seconds = smoke
    session = json.loads((out / "gpu_session.json").read_text())
    assert session["format"] == gpu_session.FORMAT and session["smoke"] and session["device"] == "cpu"
    stages = session["stages"]
    assert list(stages) == list(gpu_session.STAGE_NAMES)
    assert {name: entry["status"] for name, entry in stages.items()} == dict.fromkeys(gpu_session.STAGE_NAMES, "ok")
    assert seconds < 240  # about 55 s on two shared cores

    gradients = stages["gradients"]
    assert [r["tensor"] for r in gradients["rows"]] == ["out", "dq", "dk", "dv", "dW"]
    assert all(0 < r["eager"] < 0.1 for r in gradients["rows"]) and 0 < gradients["negative_share"] < 1
    assert any("CUDA-only" in note and "gradients" in note for note in gradients["notes"])  # no fused path here
    assert "Gradients before timing" in gpu_session.render_markdown(session)

    families = stages["families"]
    assert [r["family"] for r in families["rows"]] == list(FAMILY_MODELS)
    assert all(r["sdpa_s"] > 0 and r["mhla_s"] > 0 for r in families["rows"])
    assert "Each family's self-attention" in gpu_session.render_markdown(session)

    versions = stages["versions"]
    assert versions["versions"]["torch"] and set(versions["sdpa_kernels"]) == {"flash", "cudnn", "efficient", "math"}
    assert versions["sdpa_kernels"]["math"] == "ok"
    assert any("CUDA-only" in note and "ceilings" in note for note in versions["notes"]) and "ceilings" not in versions
    assert set(versions["fa3"]) == {"flash_attn_interface", "stand_in"}
    assert any("custom op" in path for path in versions["mhla_paths"])

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

    endtoend = stages["endtoend"]
    assert [r["method"] for r in endtoend["rows"]] == [
        "sdpa (native)",
        "mhla paper",
        "mhla paper, eager operator",
        "mhla released",
    ]
    assert all(r["median_s"] > 0 and r["video_s"] == pytest.approx(100 * r["median_s"]) for r in endtoend["rows"])
    assert all(r["sdpa_over_mhla"] > 0 for r in endtoend["rows"][1:])
    compiled = endtoend["compiled"]
    assert [r["setting"] for r in compiled] == ["mhla paper", "sdpa"]
    assert all("error" not in r and r["graphs"] == 1 and r["compiled_s"] > 0 for r in compiled), compiled
    assert all(r["rel_diff_vs_eager"] < 1e-2 for r in compiled)  # aot_eager: the same ops
    # on the CPU the processors take the eager operator, which Dynamo traces in; the stock model keeps SDPA
    assert compiled[0]["attention_path"].startswith(("eager MHLA operator traced", "MHLA custom op kept"))
    # one block's graph, reused by every block (regional compilation): its self- and cross-attention
    assert compiled[1]["sdpa_calls"] == 2 and gpu_session.SMOKE.transformer_layers > 1

    timing = stages["timing"]
    methods = {row["method"] for row in timing["rows"]}
    assert {
        "MHLA operator, plan per call",
        "MHLA operator, plan precomputed",
        "plain linear attention (einsum)",
        "SDPA flash",
        "SDPA efficient",
    } <= methods
    assert "SDPA cudnn (FA3 stand-in)" in methods or "FlashAttention-3 (flash_attn_interface)" in methods
    assert any(m.startswith("Wan processor path, released") for m in methods)
    assert {row["grid"] for row in timing["rows"]} == {"3x5x10", "3x5x12"}
    timed = [row for row in timing["rows"] if row["median_ms"] is not None]
    plan = gpu_session.SMOKE.attention_loops
    assert all(plan.min_calls <= row["calls"] <= plan.max_calls and row["spread"] >= 1 for row in timed)
    assert all(row["median_ms"] > 0 and row["counted_units"] > 0 and row["gb_per_s"] > 0 for row in timed)
    assert any("TF32" in note for note in timing["notes"]) and not any("TF32" in m for m in methods)
    assert any("CUDA graph" in note for note in timing["notes"]) and not any("graph_ms" in row for row in timed)

    training = stages["training"]
    rows = {row["method"]: row for row in training["rows"]}
    assert {"MHLA eager operator, denominator", "MHLA eager operator, none", "SDPA flash"} <= set(rows)
    for name in ("MHLA eager operator, denominator", "SDPA flash"):
        row = rows[name]
        assert row["forward_backward_ms"] > 0 and row["backward_ms"] == pytest.approx(
            row["forward_backward_ms"] - row["forward_ms"]
        )
    assert training["fused_backward"].startswith(gpu_session.FUSED_BACKWARD_MODULE)

    assert "aten::" in stages["profile"]["tables"]["Wan processor path, paper"]


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
        "| mhla released | MHLA, fused kernels where they run |",
        "GraphRecorder('aot_eager')",
        "CUDA-only, skipped on cpu: the TF32 rows",
        "| 3x5x10 | MHLA eager operator, denominator |",
    ):
        assert text in markdown, text


@pytest.mark.parametrize(
    "argv, message",
    [
        (["{out}", "--smoke", "--write-doc", "{page}"], "--write-doc {page}: expected exactly one section"),
        (["{out}"], "no CUDA device here: run on a GPU, or with --smoke"),
        (["{out}", "--smoke", "--stages", "versions,speed"], "--stages: unknown speed"),
        (["{out}", "--smoke", "--budget-s", "0"], "--budget-s 0: give a positive number of seconds"),
        (["--report", "{out}/gpu_session.json"], "no such file"),
    ],
)
def test_bad_arguments_are_one_line_and_write_nothing(argv, message, gpu_session, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out, page = tmp_path / "out", tmp_path / "speed.md"
    page.write_text("no markers\n")
    fill = lambda text: text.format(out=out, page=page)  # noqa: E731
    assert gpu_session.main([fill(a) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gpu_session: ") and fill(message) in err and err.count("\n") == 1
    assert not out.exists() and page.read_text() == "no markers\n"


def test_a_report_of_another_version_is_refused(gpu_session, tmp_path, capsys):
    old = tmp_path / "gpu_session.json"
    old.write_text(json.dumps({"format": "mhla-gpu-session/1", "stages": {}}))
    assert gpu_session.main(["--report", str(old)]) == 2
    assert "not a GPU session result of this version (mhla-gpu-session/2)" in capsys.readouterr().err


def test_the_gpu_sizes_are_the_issues(gpu_session):
    """What docs/speed.md says the GPU session measures: Wan2.1-1.3B's heads at 21x30x50 and 21x30x52, and a
    30-block transformer at 21x30x52 with 512 text tokens, compiled whole with Inductor; loops of calls long
    enough that launch gaps do not count (at least 10 calls and 50 ms)."""
    full = gpu_session.FULL
    assert (full.heads, full.head_dim, full.layout) == (12, 128, (3, 5, 10))
    assert full.timing_grids == ((21, 30, 50), (21, 30, 52)) and full.training_grids == ((21, 30, 50),)
    assert full.compile_backend == "inductor" and full.compile_targets[0] == "mhla paper"
    assert (full.transformer_grid, full.transformer_layers, full.text_tokens) == ((21, 30, 52), 30, 512)
    assert set(full.correctness_grids) == {"even", "uneven", "empty blocks"}
    loops = full.attention_loops
    assert loops.min_calls >= 10 and loops.target_s >= 0.05 and loops.repeats >= 5 and loops.warmup >= 1
    assert math.prod(full.timing_grids[0]) * full.heads * full.head_dim * 2 > 60e6  # q alone is larger than L2


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
    ).to(v.dtype)


def test_the_fused_kernel_is_checked_timed_trained_and_profiled_when_it_runs(gpu_session, tmp_path, monkeypatch):
    """Under Triton's interpreter (as on CUDA) the session calls the fused entry with its signature, forward
    and backward; a stand-in with the kernel's contract takes its place here."""
    monkeypatch.setattr(gpu_session.environment, "fused_kernel", lambda: (_stand_in_fused, "available"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    import mhla_diffusion.models.processors.base as processors

    # the Wan processor rows keep the eager operator here: the real kernels under the interpreter took ~3 minutes
    # of this test, and tests/attention/test_triton_mhla.py checks the processors' choice of them
    monkeypatch.setattr(processors, "fused_available", lambda tensor: False)
    session = gpu_session.run_session(
        tmp_path, smoke=True, budget_s=300, stages=("correctness", "timing", "training", "profile"), isolate=False
    )
    assert [entry["status"] for entry in session["stages"].values()] == ["ok"] * 4
    fused = [c for c in session["stages"]["correctness"]["checks"] if c["path"] == "fused"]
    assert len(fused) == 12 and all(c["ok"] for c in fused)  # 3 grids x 2 settings x autocast off / on
    rows = [r for r in session["stages"]["timing"]["rows"] if r["method"].startswith("fused Triton kernel")]
    assert {(r["grid"], r["method"].split(",")[1].split()[0]) for r in rows} == {
        (grid, mode) for grid in ("3x5x10", "3x5x12") for mode in ("denominator", "none")
    }
    assert all(r["bytes_basis"] == "counted from the launch" and r["median_ms"] > 0 for r in rows)
    assert all(0 < r["dram_units"] < r["counted_units"] for r in rows)  # L2 serves the heads' shared reads
    timing = session["stages"]["timing"]
    dtype = getattr(torch, timing["dtype"])
    for r in rows:  # the bytes each row is divided by: its launch's count (fused_traffic)
        unit = r["tokens"] * timing["heads"] * timing["head_dim"] * dtype.itemsize
        grid, mode = tuple(map(int, r["grid"].split("x"))), r["method"].split(",")[1].split()[0]
        assert r["counted_units"] * unit == pytest.approx(gpu_session.fused_bytes(grid, gpu_session.SMOKE, dtype, mode))
    training = {r["method"]: r for r in session["stages"]["training"]["rows"]}
    for mode in gpu_session.FUSED_MODES:  # forward + backward through the public fused entry's autograd
        row = training[f"MHLA fused (mhla_attention_fused), {mode}"]
        assert "error" not in row and row["forward_backward_ms"] > 0 and row["forward_ms"] > 0
    assert "fused Triton kernel, denominator (feature map, RoPE)" in session["stages"]["profile"]["tables"]


def test_training_calls_give_the_gradients_of_each_attention(gpu_session):
    """The forward + backward calls differentiate what they say: the fused entry (here its stand-in) and the
    eager operator give the same gradients for q, k, v and the mixing; SDPA's give q, k, v's."""
    sizes = gpu_session.SMOKE
    calls, errors = gpu_session.training_calls((3, 5, 10), sizes, torch.device("cpu"), torch.float32, _stand_in_fused)
    fused = calls["MHLA fused (mhla_attention_fused), denominator | forward + backward"]()
    eager = calls["MHLA eager operator, denominator | forward + backward"]()
    assert len(fused) == len(eager) == 4  # q, k, v, mixing
    for a, b in zip(fused, eager):
        assert a.abs().sum() > 0
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    none = calls["MHLA fused (mhla_attention_fused), none | forward + backward"]()
    assert not torch.allclose(none[0], fused[0])  # the other normalisation: other gradients
    flash = calls["SDPA flash | forward + backward"]()
    assert len(flash) == 3
    assert all(g.shape == (1, sizes.heads, 150, sizes.head_dim) and g.abs().sum() > 0 for g in flash)
    assert set(errors) <= {"SDPA cudnn (FA3 stand-in)", "SDPA cudnn", "SDPA efficient"}


def test_the_headline_rows_are_timed_first(gpu_session):
    names = [
        "MHLA operator, paper",
        "SDPA flash",
        "Wan processor path, paper (feature map, RoPE)",
        "SDPA efficient",
        "fused Triton kernel, denominator (feature map, RoPE)",
        "fused Triton kernel, none (feature map, RoPE)",
    ]
    headline, rest = gpu_session.headline_first(names)
    assert headline == [names[1], names[2], names[4]] and rest == [names[0], names[3], names[5]]
