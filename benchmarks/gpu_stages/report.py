"""The session as Markdown (:func:`render_markdown`) and into ``docs/speed.md`` (:func:`write_doc`)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from mhla_diffusion.benchmarks.bench import format_table, replace_marked_section

from .common import DOC_SECTION
from .runner import STAGE_NAMES

TIMING_COLUMNS = (
    ("grid", "grid", ""),
    ("method", "method", ""),
    ("calls", "calls / loop", "d"),
    ("median_ms", "ms / call", ".3f"),
    ("spread", "spread", ".2f"),
    ("graph_ms", "graph ms / call", ".3f"),
    ("counted_units", "bytes (U)", ".1f"),
    ("bytes_basis", "bytes are", ""),
    ("gb_per_s", "GB/s", ".0f"),
    ("dram_units", "DRAM estimate (U)", ".1f"),
    ("dram_gb_per_s", "DRAM GB/s", ".0f"),
    ("floor_gb_per_s", "floor GB/s", ".0f"),
    ("peak_extra_mb", "peak extra MiB", ".0f"),
    ("error", "error", ""),
)
TRAINING_COLUMNS = (
    ("grid", "grid", ""),
    ("method", "method", ""),
    ("calls", "calls / loop", "d"),
    ("forward_ms", "forward ms", ".3f"),
    ("forward_backward_ms", "forward + backward ms", ".3f"),
    ("backward_ms", "backward ms", ".3f"),
    ("backward_over_forward", "backward / forward", ".2f"),
    ("spread", "spread", ".2f"),
    ("error", "error", ""),
)
CORRECTNESS_COLUMNS = (
    ("path", "path", ""),
    ("setting", "setting", ""),
    ("grid_kind", "grids", ""),
    ("checks", "checks", "d"),
    ("worst_rel_err", "worst ‖out − ref‖ / ‖ref‖", ".1e"),
    ("failed", "failed", "d"),
)
GRADIENT_COLUMNS = (
    ("tensor", "tensor", ""),
    ("eager", "eager bf16 error", ".1e"),
    ("fused", "fused bf16 error", ".1e"),
    ("fused_over_eager", "fused / eager", ".2f"),
    ("ok", "ok", ""),
)
ENDTOEND_COLUMNS = (
    ("method", "method", ""),
    ("attention", "self-attention", ""),
    ("median_s", "median s", ".3f"),
    ("spread", "spread", ".2f"),
    ("video_s", "100 forwards s", ".1f"),
    ("peak_extra_mb", "peak extra MiB", ".0f"),
    ("fused_launches", "fused launches", "d"),
    ("sdpa_over_mhla", "SDPA / MHLA", ".2f"),
    ("error", "error", ""),
)
COMPILE_COLUMNS = (
    ("setting", "model", ""),
    ("attention_path", "attention in the compiled graph", ""),
    ("graphs", "graphs", "d"),
    ("compile_s", "compile s", ".1f"),
    ("eager_s", "eager s", ".3f"),
    ("compiled_s", "compiled s", ".3f"),
    ("eager_over_compiled", "eager / compiled", ".2f"),
    ("rel_diff_vs_eager", "‖compiled − eager‖ / ‖eager‖", ".1e"),
    ("error", "error", ""),
)


def _status_line(session: dict[str, Any], name: str) -> list[str]:
    """What a reader must know beside a stage's numbers: not run (though asked for), cut, failed, notes."""
    entry = session.get("stages", {}).get(name)
    if entry is None:
        return [f"*{name}*: not run."] if name in session.get("requested", STAGE_NAMES) else []
    lines = []
    if entry.get("status") not in ("ok", None):
        reason = entry.get("error") or "; ".join(entry.get("notes", [])) or "no reason recorded"
        lines.append(f"*{name}*: {entry['status']} ({reason}).")
    lines += [f"*{name}*: {note}" for note in entry.get("notes", []) if entry.get("status") == "ok"]
    return lines


def _correctness_summary(checks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (path, setting): how many checks, the worst relative error, how many failed."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for check in checks:
        groups.setdefault((check["path"], check["setting"]), []).append(check)
    return [
        {
            "path": path,
            "setting": setting,
            "grid_kind": ", ".join(dict.fromkeys(c["grid_kind"] for c in rows)),
            "checks": len(rows),
            "worst_rel_err": max((c.get("rel_err", math.inf) for c in rows), default=None),
            "failed": sum(not c["ok"] for c in rows),
        }
        for (path, setting), rows in groups.items()
    ]


def _fa3_line(entry: dict[str, Any]) -> str:
    fa3 = entry.get("fa3") or {}
    return (
        f"FlashAttention-3 (`flash_attn_interface`): {fa3.get('flash_attn_interface', '?')}; {fa3.get('stand_in', '')}."
    )


def render_markdown(session: dict[str, Any]) -> str:
    """The "On a GPU" section of ``docs/speed.md`` from a session's JSON (whatever stages it holds)."""
    stages = session.get("stages", {})
    versions = stages.get("versions", {})
    v = versions.get("versions", {})
    gpu = versions.get("gpu") or {}
    where = gpu.get("name") or versions.get("cpu") or session.get("device", "?")
    head = (
        f"`benchmarks/gpu_session.sh` on {where}, {session.get('started', '?')[:10]}: "
        f"torch {v.get('torch', session.get('torch', '?'))}, "
        f"CUDA {v.get('cuda')}, cuDNN {v.get('cudnn')}, Triton {v.get('triton')}, Diffusers {v.get('diffusers')}"
        + (f", commit {v['commit']}" if v.get("commit") else "")
        + "."
    )
    lines = (
        ["**Smoke run on the CPU at toy sizes: checks that the session runs, not measurements.**", ""]
        if session.get("smoke")
        else []
    )
    lines += [head, ""]
    lines += _status_line(session, "versions")
    if versions.get("sdpa_kernels"):
        lines.append(
            "SDPA kernels: "
            + ", ".join(
                f"{k} {'runs' if s == 'ok' else 'fails (' + s + ')'}" for k, s in versions["sdpa_kernels"].items()
            )
            + "."
        )
    if versions.get("fa3"):
        lines.append(_fa3_line(versions) + f" FlashAttention-2 (`flash_attn`): {versions.get('flash_attn')}.")
    if versions.get("mhla_paths"):
        lines.append("MHLA paths: " + "; ".join(f"{k}: {s}" for k, s in versions["mhla_paths"].items()) + ".")
    if versions.get("ceilings"):
        c = versions["ceilings"]
        lines.append(
            f"Measured ceilings: device copy {c['copy_gb_per_s']:.0f} GB/s, bf16 matmul "
            f"{c['bf16_matmul_tflop_per_s']:.0f} TFLOP/s."
        )
    lines.append("")

    correctness = stages.get("correctness", {})
    lines += _status_line(session, "correctness")
    if correctness.get("checks"):
        lines += [
            f"Correctness, bf16 on {session.get('device')} against float64 on the CPU (tolerance "
            f"{correctness.get('tolerance')}, autocast off and on; fused kernel: {correctness.get('fused')}): "
            f"{correctness.get('passed', '?')} checks pass, {correctness.get('failed', '?')} fail.",
            "",
            format_table(_correctness_summary(correctness["checks"]), CORRECTNESS_COLUMNS),
            "",
        ]
        lines += [
            f"- {c['path']} {c['setting']} {c['grid']}: {c['error']}" for c in correctness["checks"] if c.get("error")
        ]

    gradients = stages.get("gradients", {})
    lines += _status_line(session, "gradients")
    if gradients.get("rows"):
        lines += [
            f"Gradients before timing: at {gradients['grid']} tokens ({gradients['heads']} heads x "
            f"{gradients['head_dim']}, layout {gradients['layout']}), mixing {gradients['negative_share']:.0%} "
            f"negative, {gradients['dtype']} against a float32 eager reference on the device (largest error / largest "
            f"value); fused: {gradients['fused']}. A row passes when the fused error is within "
            f"{gradients['factor']}x the eager operator's: {len(gradients['rows']) - gradients['failed']} of "
            f"{len(gradients['rows'])} pass.",
            "",
            format_table(gradients["rows"], GRADIENT_COLUMNS),
            "",
        ]

    endtoend = stages.get("endtoend", {})
    lines += _status_line(session, "endtoend")
    if endtoend.get("rows"):
        lines += [
            f"Wan2.1-1.3B-shaped transformer, {endtoend['layers']} blocks, random weights, one eager forward at "
            f"{endtoend['grid']} tokens (MHLA layout {endtoend['layout']}) with {endtoend['text_tokens']} text "
            f"tokens, {endtoend['timer']}; MHLA's cross-attention on Diffusers' {endtoend['cross_attention']} "
            "backend; 100 forwards = 50 steps with guidance:",
            "",
            format_table(endtoend["rows"], ENDTOEND_COLUMNS),
            "",
        ]
    if endtoend.get("compiled"):
        lines += [
            f"The transformer compiled: `{endtoend['compile_call']}` (compile s: the first call):",
            "",
            format_table(endtoend["compiled"], COMPILE_COLUMNS),
            "",
        ]

    timing = stages.get("timing", {})
    lines += _status_line(session, "timing")
    if timing.get("rows"):
        floors = ", ".join(f"{g}: {u:.1f} U" for g, u in timing.get("floor_units", {}).items())
        lines += [
            f"Attention forwards, B=1, H={timing['heads']}, D={timing['head_dim']}, {timing['dtype']}, "
            f"layout {timing['layout']}; {timing['timer']}, per call = median loop / calls over "
            f"{timing['repeats']} rounds (spread: slowest / fastest loop); graph: the call replayed from a CUDA "
            f"graph; bytes counted on meta tensors in U = N x H x D x 2 bytes (floor of an MHLA call: {floors}); "
            "DRAM estimate (fused rows): the counted bytes less the RoPE angle plan and slot indices that every head "
            "reads again, which L2 serves after the first head; "
            f"fused kernel: {timing.get('fused')}. {_fa3_line(timing)}",
            "",
            format_table(timing["rows"], TIMING_COLUMNS),
            "",
        ]

    training = stages.get("training", {})
    lines += _status_line(session, "training")
    if training.get("rows"):
        lines += [
            f"Attention for fine-tuning, forward (grad on) and forward + backward, B=1, H={training['heads']}, "
            f"D={training['head_dim']}, {training['dtype']}, layout {training['layout']}; MHLA from raw q, k, v "
            f"with feature map, RoPE and mixing requiring grad; {training['timer']}, {training['repeats']} rounds. "
            f"Fused backward: {training.get('fused_backward')}. {_fa3_line(training)}",
            "",
            format_table(training["rows"], TRAINING_COLUMNS),
            "",
        ]
        for grid, kernels in training.get("fused_backward_kernels", {}).items():
            listed = ", ".join(f"{name} x{n}" for name, n in kernels.items())
            lines += [f"Kernels of one fused forward + backward at {grid}: {listed}.", ""]

    families = stages.get("families", {})
    lines += _status_line(session, "families")
    if families.get("rows"):
        from mhla_diffusion.benchmarks.families import FAMILY_COLUMNS

        lines += [
            f"Each family's self-attention at its published size (`mhla bench --families`), {families['dtype']}, "
            f"median of {families['repeats']} interleaved rounds, from the raw projections; SDPA over image + text "
            "tokens.",
            "",
            format_table(families["rows"], FAMILY_COLUMNS),
            "",
        ]

    profile = stages.get("profile", {})
    lines += _status_line(session, "profile")
    for name, table in profile.get("tables", {}).items():
        lines += [
            f"<details><summary>Profile of one call: {name}, {profile.get('grid')}</summary>",
            "",
            "```",
            table.rstrip(),
            "```",
            "",
            "</details>",
            "",
        ]
    return "\n".join(lines).strip()


def write_doc(page: Path, session: dict[str, Any]) -> None:
    """Replace the marked GPU section of the Markdown ``page`` by :func:`render_markdown` of ``session``."""
    page.write_text(replace_marked_section(page.read_text(), DOC_SECTION, render_markdown(session)))
