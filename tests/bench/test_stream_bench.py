"""``mhla bench --stream`` (benchmarks/stream.py) at toy size: the rows, what they count, the command line."""

from __future__ import annotations

import json

import pytest

from mhla_diffusion.benchmarks.stream import StreamSpec, stream_report_markdown, stream_table
from mhla_diffusion.cli import main
from mhla_diffusion.ops.block_layout import auto_layout

#: A toy stream bench: chunks of one 4x6-token frame, 2 chunks times 1, 2, 4, two blocks 32 wide, one round.
TINY = dict(
    chunk_grid=(1, 4, 6),
    base_chunks=2,
    multiples=(1, 2, 4),
    layers=2,
    blocks=(2, 2),
    window=1,
    dim=32,
    heads=2,
    ffn_dim=64,
    text_tokens=4,
    repeats=1,
    quick_passes=1,
    warmup=0,
)
TINY_ARGS = (
    "--stream",
    "--stream-chunk",
    "1x4x6",
    "--stream-base",
    "2",
    "--stream-multiples",
    "1,2,4",
    "--stream-blocks",
    "2x2",
    "--stream-window",
    "1",
    "--block-dim",
    "32",
    "--block-heads",
    "2",
    "--block-ffn",
    "64",
    "--block-text-tokens",
    "4",
    "--repeats",
    "1",
    "--quick-passes",
    "1",
    "--warmup",
    "0",
    "--threads",
    "1",
)
METHODS = ["mhla stream", "mhla stream, bf16 state", "mhla stream, old path", "softmax KV cache", "mhla one pass"]


def test_stream_rows_count_the_carried_state_and_the_growing_cache():
    spec = StreamSpec(**TINY, one_pass_max_tokens=100)
    rows = stream_table(spec)
    assert [(r["chunks"], r["method"].split(" (")[0]) for r in rows] == [(n, m) for n in (2, 4, 8) for m in METHODS]
    assert rows[-1]["method"] == "mhla one pass (skipped: 192 tokens > 100)" and "chunk_s" not in rows[-1]
    by = {(r["chunks"], r["method"]): r for r in rows}
    tokens_per_chunk, floats = 4 * 6, 4
    assert len({r["weights_mb"] for r in rows}) == 1 and rows[0]["weights_mb"] > 0  # the one model, not counted
    for chunks in (2, 4, 8):
        mhla, kv = by[chunks, "mhla stream"], by[chunks, "softmax KV cache"]
        # MHLA: per layer (K + 1) rows of S summaries (D x Dv) and key sums (D), per head, whatever the length
        state = 2 * 2 * (1 + 1) * 4 * (16 * 16 + 16) * floats
        assert mhla["carried_mb"] * 2**20 == state
        # KV cache: per layer the keys and values of the chunks before the measured one
        assert kv["carried_mb"] * 2**20 == 2 * 2 * (chunks - 1) * tokens_per_chunk * 32 * floats
        for row in (mhla, kv):
            assert row["chunk_s"] == row["denoise_s"] + row["advance_s"] > 0
            assert row["peak_mb"] > row["carried_mb"]  # the chunk's activations come on top
        # the bfloat16 state: summaries in 2 bytes (the fold float16 with a float32 scale per block), key sums float32
        bf16 = by[chunks, "mhla stream, bf16 state"]
        assert bf16["carried_mb"] * 2**20 == 2 * 2 * 4 * ((1 + 1) * (16 * 16 * 2 + 16 * floats) + floats)
        # the old path: the same state, but each denoising forward builds a next state and projects the text again
        old = by[chunks, "mhla stream, old path"]
        assert old["carried_mb"] == mhla["carried_mb"] and old["denoise_extra_mb"] > mhla["denoise_extra_mb"]
        if chunks <= 4:
            assert mhla["denoise_vs_one_pass"] == mhla["denoise_s"] / by[chunks, "mhla one pass"]["chunk_s"]
    assert rows[0]["text_kept_mb"] > 0  # the text embedding and cross-attention keys and values, kept per prompt
    assert by[8, "softmax KV cache"]["peak_vs_base"] > 1.5  # 7 cached chunks against 1
    one_pass = by[4, "mhla one pass"]
    assert one_pass["chunk_s"] == one_pass["one_pass_s"] / 4
    assert one_pass["layout"] == "x".join(map(str, auto_layout((4, 4, 6))))  # what convert's "auto" picks there
    assert by[2, "mhla one pass"]["peak_vs_base"] == 1 and one_pass["peak_vs_base"] > 1
    table = stream_report_markdown(
        {"spec": spec.to_json(), "device": "cpu", "dtype": "float32", "torch": "x"} | {"stream": rows}
    )
    assert "| 8 | 8 | 192 | mhla stream | 2x2 per frame |" in table and "window K = 1" in table


def test_stream_settings_are_checked_before_anything_runs():
    with pytest.raises(ValueError, match="increasing"):
        StreamSpec(**{**TINY, "multiples": (2, 1)})
    with pytest.raises(ValueError, match="per frame"):
        StreamSpec(**{**TINY, "blocks": (2, 2, 2)})
    with pytest.raises(ValueError, match="even size"):
        StreamSpec(**{**TINY, "dim": 30, "heads": 2})


@pytest.mark.slow  # measures in a fresh process
def test_stream_command_writes_json_and_the_docs_section(tmp_path, capsys):
    out, page = tmp_path / "stream.json", tmp_path / "page.md"
    page.write_text("# Streaming\n\n<!-- mhla-bench:stream-cpu -->\nto be replaced\n<!-- /mhla-bench:stream-cpu -->\n")
    assert main(["bench", *TINY_ARGS, "--output", str(out), "--write-doc", str(page)]) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["spec"]["multiples"] == [1, 2, 4] and result["threads"] == 1 and "1 threads" in result["device"]
    assert [r["method"] for r in result["stream"][:5]] == METHODS
    assert "| 8 | 8 | 192 | softmax KV cache |" in printed and "fresh process" in printed
    assert "| 8 | 8 | 192 | softmax KV cache |" in page.read_text() and "to be replaced" not in page.read_text()
    # the saved result prints again without measuring
    assert main(["bench", "--report", str(out)]) == 0
    assert capsys.readouterr().out.strip() == printed.strip()


def test_stream_command_refuses_bad_input_before_measuring(tmp_path, capsys):
    page = tmp_path / "page.md"
    page.write_text("# no section\n")
    assert main(["bench", *TINY_ARGS, "--write-doc", str(page)]) == 2
    assert "mhla-bench:stream-cpu" in capsys.readouterr().err
    assert main(["bench", *TINY_ARGS, "--stream-multiples", "4,2"]) == 2
    assert "increasing" in capsys.readouterr().err


def test_state_size_table_at_wan_480p():
    """Measured from empty states (checked inside against the formula): the 3x5 layout's float32 state is the
    issue's 1,020 MiB, its 2-byte state half of it, and each is smaller than the full bf16 KV cache from the frame
    after it stops being larger."""
    from mhla_diffusion.benchmarks.stream_state import state_size_rows

    rows = state_size_rows()
    by = {(r["layout"], r["dtype"].split(" ")[0]): r for r in rows if r["layout"]}
    frame = next(r["mib"] for r in rows if r["what"] == "bf16 KV cache, one latent frame")
    assert round(by["3x5", "float32"]["mib"]) == 1020 and round(frame) == 274
    for layout in ("3x5", "5x9"):
        wide, narrow = by[layout, "float32"], by[layout, "bfloat16"]
        assert 0.5 < narrow["mib"] / wide["mib"] < 0.505
        for row in (wide, narrow):
            frames = int(row["smaller_from"])
            assert (frames - 1) * frame <= row["mib"] < frames * frame


def test_stream_state_command_refuses_a_page_without_its_section_before_the_work(tmp_path, capsys):
    page = tmp_path / "page.md"
    page.write_text("# no section\n")
    assert main(["bench", "--stream-state", "--write-doc", str(page)]) == 2
    assert "mhla-bench:stream-state" in capsys.readouterr().err
    kept = tmp_path / "state.json"
    kept.write_text("an earlier result")
    assert main(["bench", "--stream-state", "--output", str(kept)]) == 2
    assert "exists" in capsys.readouterr().err and kept.read_text() == "an earlier result"
