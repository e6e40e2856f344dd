"""``mhla bench --stream``: memory and time per chunk of video generated chunk by chunk, at growing lengths.

One Wan2.1-1.3B-shaped transformer (random weights, a few blocks) runs a video of ``L`` chunks, ``L`` a multiple of
a base length, three ways, on the same latents and text:

* ``"mhla stream"``: block-causal MHLA (``MHLAConfig(causal=True)``) carried by a
  :class:`~mhla_diffusion.models.streaming.CausalStream`;
* ``"softmax KV cache"``: the same model with block-causal softmax self-attention whose keys and values of earlier
  chunks are cached and concatenated for SDPA (:mod:`mhla_diffusion.models.kv_cache`);
* ``"mhla one pass"``: bidirectional MHLA (the auto layout of the clip's grid) over the whole clip in one forward,
  up to a token limit.

A stream's cost at length ``L`` is that of its ``L``-th chunk, given the state (or cache) of the ``L - 1`` chunks
before it: one denoising forward of the chunk (at timestep 500) against the state, and one advance forward of the
clean chunk (timestep 0) that adds it to the state, timed separately. Each timed call starts from the stream as it
stood after ``L - 1`` chunks (states are immutable: restoring one is two assignments). The one-pass rows time one
forward of the clip and divide it by ``L``: one denoising step's share per chunk.

Memory is tensor memory as the bench counts it elsewhere (:class:`~mhla_diffusion.benchmarks.bench.PeakMemory`):
for a stream, the state or cache carried into the chunk plus the peak extra memory of the larger of its two
forwards (activations, the new state, the concatenated keys and values); for one pass, the peak extra memory of
the forward. The model's weights (``weights_mb`` of every row) and the inputs are not counted. Every call of
every length and method is interleaved in rounds (:func:`~mhla_diffusion.benchmarks.bench.time_calls`); times
are medians.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch

from ..config import MHLAConfig
from .bench import MALLOC_MODES, _cast_like_from_pretrained, _dims, _where, format_table, time_calls

__all__ = ["STREAM_COLUMNS", "StreamSpec", "measure_stream", "stream_report_markdown", "stream_section", "stream_table"]

#: The methods of the table, in row order within a length.
MHLA_STREAM, KV_CACHE, ONE_PASS = "mhla stream", "softmax KV cache", "mhla one pass"
#: The same stream with its state stored in bfloat16, and as it ran before denoising only read the state (every
#: forward built a next state) and before the text conditioning was kept per prompt.
MHLA_STREAM_BF16, MHLA_STREAM_OLD = "mhla stream, bf16 state", "mhla stream, old path"
STREAM_METHODS = (MHLA_STREAM, MHLA_STREAM_BF16, MHLA_STREAM_OLD, KV_CACHE)

STREAM_COLUMNS = (
    ("chunks", "chunks", "d"),
    ("frames", "latent frames", "d"),
    ("tokens", "N", ",d"),
    ("method", "method", ""),
    ("layout", "layout", ""),
    ("denoise_s", "denoise s / chunk", ".3f"),
    ("advance_s", "advance s / chunk", ".3f"),
    ("chunk_s", "s / chunk", ".3f"),
    ("denoise_vs_one_pass", "denoise vs one pass", ".2f"),
    ("carried_mb", "carried MiB", ".1f"),
    ("denoise_extra_mb", "denoise extra MiB", ".1f"),
    ("peak_mb", "peak MiB", ".1f"),
    ("chunk_s_vs_base", "s / chunk vs base", ".2f"),
    ("peak_vs_base", "peak vs base", ".2f"),
)


@dataclass
class StreamSpec:
    """Everything one ``mhla bench --stream`` measurement needs; plain values, so a fresh process gets it as JSON.

    ``chunk_grid`` is one chunk's token grid ``(latent frames, height, width)``; lengths are ``base_chunks`` times
    each of ``multiples`` chunks. ``blocks`` are the causal MHLA blocks per frame ``(height, width)``; ``window``
    the causal window ``K``. The one-pass rows are skipped above ``one_pass_max_tokens`` (``None``: never).
    """

    chunk_grid: tuple[int, int, int] = (3, 15, 26)  # the streaming pipeline's default chunk: 3 latent frames
    base_chunks: int = 2
    multiples: tuple[int, ...] = (1, 2, 4, 8)
    layers: int = 2
    blocks: tuple[int, int] = (3, 5)
    window: int = MHLAConfig.causal_window
    dim: int = 1536
    heads: int = 12
    ffn_dim: int = 8960
    text_tokens: int = 512
    one_pass_max_tokens: int | None = None
    dtype: str = "float32"
    device: str = "cpu"
    repeats: int = 3
    quick_passes: int = 5
    warmup: int = 1
    malloc: str = "auto"
    threads: int | None = None

    def __post_init__(self) -> None:
        for name in ("chunk_grid", "multiples", "blocks"):
            setattr(self, name, tuple(int(x) for x in getattr(self, name)))
        self.check()

    def check(self) -> None:
        """One clear ``ValueError`` for settings that cannot be measured, before anything is built."""
        if len(self.chunk_grid) != 3 or min(self.chunk_grid) < 1:
            raise ValueError(f"the stream chunk must be latent frames x height x width tokens, got {self.chunk_grid}")
        if len(self.blocks) != 2 or min(self.blocks) < 1:
            raise ValueError(f"the stream blocks must be per frame, height x width (e.g. 3x5), got {self.blocks}")
        if not self.multiples or min(self.multiples) < 1 or list(self.multiples) != sorted(set(self.multiples)):
            raise ValueError(f"the stream length multiples must be increasing positive ints, got {self.multiples}")
        if self.base_chunks < 1 or self.layers < 1 or self.window < 0:
            raise ValueError("the stream's base chunks and layers must be >= 1 and its window >= 0")
        if self.dim % self.heads or (self.dim // self.heads) % 2:
            raise ValueError(f"dim {self.dim} must split into {self.heads} heads of an even size")
        if self.repeats < 1 or self.quick_passes < 1 or self.warmup < 0:
            raise ValueError("--repeats and --quick-passes must be >= 1 and --warmup >= 0")
        if self.malloc not in MALLOC_MODES:
            raise ValueError(f"`malloc` must be one of {MALLOC_MODES}, got {self.malloc!r}")

    @property
    def lengths(self) -> list[int]:
        """Chunks of each measured video."""
        return [self.base_chunks * m for m in self.multiples]

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "StreamSpec":
        return cls(**data)

    def to_json(self) -> dict[str, Any]:
        """Plain JSON values (tuples become lists)."""
        return asdict(self)


def _wan_model(spec: StreamSpec, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """Wan2.1-T2V-1.3B's config with ``spec``'s width and blocks, random weights, built on ``device``."""
    from diffusers import WanTransformer3DModel

    from ..utils.wan_configs import wan_transformer_config

    config = wan_transformer_config("Wan2.1-T2V-1.3B")
    config.update(
        num_layers=spec.layers,
        num_attention_heads=spec.heads,
        attention_head_dim=spec.dim // spec.heads,
        ffn_dim=spec.ffn_dim,
    )
    torch.manual_seed(0)
    with torch.device(device):
        return _cast_like_from_pretrained(WanTransformer3DModel(**config).eval(), dtype)


def stream_table(spec: StreamSpec, log: Callable[[str], None] = lambda _: None) -> list[dict[str, Any]]:
    """The rows of ``mhla bench --stream`` (:data:`STREAM_COLUMNS`): every length, then method (module docstring)."""
    from ..models.conversion import build_mhla_processors, convert_to_mhla, self_attention_layers
    from ..models.kv_cache import KVCacheStream, KVCacheWanAttnProcessor
    from ..models.streaming import CausalStream
    from ..models.text_cache import TextConditioningCache
    from ..ops.block_layout import auto_layout

    device, dtype = torch.device(spec.device), getattr(torch, spec.dtype)
    model = _wan_model(spec, device, dtype)
    weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    layers = [name for name, _ in self_attention_layers(model)]
    causal = MHLAConfig(layout=(1, *spec.blocks), causal=True, causal_window=spec.window)
    convert_to_mhla(model, causal)
    attns = dict(self_attention_layers(model))
    causal_processors = {name: attns[name].processor for name in layers}
    context = causal_processors[layers[0]].grid_context  # the grid the conversion's hook records on every forward
    kv_processors = {name: KVCacheWanAttnProcessor() for name in layers}

    def use(processors: dict[str, Any]) -> None:  # the methods share the model's weights: swap self-attention
        for name in layers:
            attns[name].set_processor(processors[name])

    frames, height, width = spec.chunk_grid
    patch = model.config.patch_size
    g = torch.Generator().manual_seed(0)
    shape = (1, model.config.in_channels, max(spec.lengths) * frames * patch[0], height * patch[1], width * patch[2])
    clip = torch.randn(shape, generator=g).to(device, dtype)
    text = torch.randn(1, spec.text_tokens, model.config.text_dim, generator=g).to(device, dtype)
    noisy_t, clean_t = torch.tensor([500.0], device=device), torch.tensor([0.0], device=device)

    def chunk(i: int) -> torch.Tensor:
        return clip[:, :, i * frames * patch[0] : (i + 1) * frames * patch[0]]

    # each stream run to the longest length once; what it carried before the L-th chunk is kept for every L
    streams: dict[str, tuple[Any, dict[str, Any], dict[int, tuple[dict, int]]]] = {}
    for method, processors, make in (
        (MHLA_STREAM, causal_processors, CausalStream),
        (MHLA_STREAM_BF16, causal_processors, lambda model: CausalStream(model, torch.bfloat16)),
        (KV_CACHE, kv_processors, KVCacheStream),
    ):
        use(processors)
        stream, kept = make(model), {}
        log(f"  {method}: running the stream to {max(spec.lengths)} chunks")
        for i in range(max(spec.lengths)):
            if i + 1 in spec.lengths:
                kept[i + 1] = (dict(stream.states), stream.frames)
            if i + 1 < max(spec.lengths):
                with torch.no_grad(), stream.chunk(advance=True):
                    model(chunk(i), clean_t, text, return_dict=False)
        streams[method] = (stream, processors, kept)
    streams[MHLA_STREAM_OLD] = streams[MHLA_STREAM]
    # a pipeline keeps the text embedding and cross-attention keys and values per prompt: every method but the old
    # path reads them from here (filled by the warm-up runs)
    text_cache = TextConditioningCache(model)

    def stream_call(method: str, length: int, advance: bool) -> Callable[[], object]:
        stream, processors, kept = streams[method]
        old = method == MHLA_STREAM_OLD

        def run() -> object:
            use(processors)
            stream.states, stream.frames = dict(kept[length][0]), kept[length][1]  # as after L - 1 chunks
            # the old path's denoising forward builds a next state too (every run starts again from the kept one)
            with stream.chunk(advance=advance or old), text_cache if not old else contextlib.nullcontext():
                return model(chunk(length - 1), clean_t if advance else noisy_t, text, return_dict=False)

        return run

    def one_pass_call(processors: dict[str, Any], length: int) -> Callable[[], object]:
        def run() -> object:
            use(processors)
            with text_cache:
                return model(clip[:, :, : length * frames * patch[0]], noisy_t, text, return_dict=False)

        return run

    calls: dict[str, Callable[[], object]] = {}
    one_pass_layouts: dict[int, tuple[int, ...] | None] = {}
    for length in spec.lengths:
        for method in STREAM_METHODS:
            calls[f"{length}/{method}/denoise"] = stream_call(method, length, advance=False)
            calls[f"{length}/{method}/advance"] = stream_call(method, length, advance=True)
        grid = (length * frames, height, width)
        one_pass_layouts[length] = None
        if spec.one_pass_max_tokens is None or math.prod(grid) <= spec.one_pass_max_tokens:
            layout = one_pass_layouts[length] = auto_layout(grid)
            _, processors = build_mhla_processors(model, MHLAConfig(layout=layout), context)
            calls[f"{length}/{ONE_PASS}"] = one_pass_call(processors, length)
    carried = {}
    for method, (stream, processors, kept) in streams.items():
        for length, (states, _) in kept.items():
            stream.states = states
            carried[length, method] = stream.nbytes
    timings = time_calls(
        calls, spec.repeats, spec.warmup, device, lambda text: log(f"  {text}"), quick_passes=spec.quick_passes
    )

    rows = []
    for length in spec.lengths:
        grid = (length * frames, height, width)
        case = {"chunks": length, "frames": grid[0], "tokens": math.prod(grid), "weights_mb": weights / 2**20}
        one_pass = timings.get(f"{length}/{ONE_PASS}")
        for method in STREAM_METHODS:
            (denoise, denoise_peak), (advance, advance_peak) = (
                timings[f"{length}/{method}/{step}"] for step in ("denoise", "advance")
            )
            held = carried[length, method]
            rows.append(
                {
                    **case,
                    "method": method,
                    "layout": _dims(causal.layout[1:]) + " per frame" if method != KV_CACHE else "",
                    "denoise_s": denoise,
                    "denoise_vs_one_pass": None if one_pass is None else denoise / (one_pass[0] / length),
                    "advance_s": advance,
                    "chunk_s": denoise + advance,
                    "carried_mb": held / 2**20,
                    "peak_mb": (held + max(denoise_peak, advance_peak)) / 2**20,
                    "denoise_extra_mb": denoise_peak / 2**20,  # above the carried state, each forward on its own
                    "advance_extra_mb": advance_peak / 2**20,
                }
            )
        layout = one_pass_layouts[length]
        if layout is None:
            limit = f"{case['tokens']:,} tokens > {spec.one_pass_max_tokens:,}"
            rows.append({**case, "method": f"{ONE_PASS} (skipped: {limit})", "layout": ""})
            continue
        seconds, peak = timings[f"{length}/{ONE_PASS}"]
        rows.append(
            {
                **case,
                "method": ONE_PASS,
                "layout": _dims(layout),
                "denoise_s": seconds / length,
                "chunk_s": seconds / length,
                "carried_mb": 0.0,
                "denoise_extra_mb": peak / 2**20,
                "peak_mb": peak / 2**20,
                "one_pass_s": seconds,
            }
        )
    for row in rows:
        row["text_kept_mb"] = text_cache.nbytes / 2**20  # held by every method but the old path, not counted above
    base = {row["method"]: row for row in rows if row["chunks"] == spec.lengths[0]}
    for row in rows:
        first = base.get(row["method"])
        if first is not None and "chunk_s" in row:
            row["chunk_s_vs_base"] = row["chunk_s"] / first["chunk_s"]
            row["peak_vs_base"] = row["peak_mb"] / first["peak_mb"]
    return rows


def measure_stream(
    spec: StreamSpec, log: Callable[[str], None] = lambda _: None, fresh_process: bool = False
) -> dict[str, Any]:
    """:func:`stream_table` in this process; a JSON-ready dict with the spec, the machine and the rows."""
    if spec.threads is not None:
        torch.set_num_threads(spec.threads)
    if torch.device(spec.device).type == "cpu" and spec.malloc == "retain":
        from ..ops.cpu_memory import retain_freed_memory

        retain_freed_memory()
    rows = stream_table(spec, log)
    return {
        "spec": spec.to_json(),
        "device": _where(spec, torch.device(spec.device), fresh_process),
        "device_type": torch.device(spec.device).type,
        "dtype": spec.dtype,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "stream": rows,
    }


def stream_section(result: dict[str, Any]) -> str:
    """The name of the marked section of a docs page that holds a ``--stream`` result's table (``stream-cpu``)."""
    return f"stream-{result['device_type']}"


def stream_report_markdown(result: dict[str, Any]) -> str:
    """The table of a :func:`measure_stream` result (or its saved JSON) as Markdown, with a header line."""
    spec = result["spec"]
    frames, height, width = spec["chunk_grid"]
    passes = spec["quick_passes"]
    samples = f"median of {spec['repeats']} rounds" + (f" (up to {spec['repeats'] * passes} runs)" * (passes > 1))
    return "\n".join(
        [
            f"`mhla bench --stream` on {result['device']}, {result['dtype']}, torch {result['torch']}, {samples}, "
            "every length and method interleaved.",
            "",
            f"Wan2.1-1.3B-shaped transformer with {spec['layers']} blocks (dim {spec['dim']}, {spec['heads']} heads, "
            f"ffn {spec['ffn_dim']}, {spec['text_tokens']} text tokens), random weights; a chunk is {frames} latent "
            f"frame{'s' * (frames != 1)} of {height}x{width} tokens; lengths are {spec['base_chunks']} chunks (the "
            f"base) times {', '.join(map(str, spec['multiples']))}. Causal MHLA: window K = {spec['window']}, "
            "one temporal block row per latent frame. A stream's row is its last chunk against the state or cache "
            "of the chunks before it: one denoising forward plus one advance forward (s / chunk is their sum); "
            "the one-pass row is one forward of the whole clip divided by its chunks. Peak MiB: the carried state "
            "or cache plus the peak extra tensor memory of the chunk's larger forward (one pass: of its forward); "
            "the model's weights and the inputs are not counted.",
            "",
            format_table(result["stream"], STREAM_COLUMNS),
        ]
    )


if __name__ == "__main__":  # the fresh measuring process: python -m mhla_diffusion.benchmarks.stream '<spec json>'
    _spec = StreamSpec.from_json(json.loads(sys.argv[1]))
    _result = measure_stream(_spec, lambda text: print(text, file=sys.stderr, flush=True), fresh_process=True)
    print(json.dumps(_result))
