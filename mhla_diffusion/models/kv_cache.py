"""Block-causal softmax self-attention with a KV cache for Diffusers' Wan transformer: streaming's softmax baseline.

This is how autoregressive video models with softmax attention (CausVid, Self-Forcing) generate chunk by chunk,
written as a user would for a stock ``WanTransformer3DModel``: each self-attention layer keeps the rotated keys
and values of the earlier (clean) chunks, and the current chunk's queries attend to those cached keys
concatenated with its own (one SDPA call; within a chunk every token sees every other). The cache grows by one
chunk of keys and values per layer at every step of the stream, unlike the constant state of block-causal MHLA
(:class:`~mhla_diffusion.models.streaming.CausalStream`), whose use it mirrors::

    use_kv_cache(transformer)
    stream = KVCacheStream(transformer)
    for chunk in range(num_chunks):
        for t in timesteps:                       # denoise the chunk against the cached keys and values
            with stream.chunk():
                noise_pred = transformer(noisy, t, text).sample
        with stream.chunk(advance=True):          # the finished (clean) chunk's keys and values join the cache
            transformer(clean, zeros, text)

The chunks are the blocks of the block-causal pattern: a stream gives what one pass over the clean earlier
chunks and the noisy current one gives with a block-causal attention mask over chunks. Frames keep their
absolute positions past Wan's rotary table (:class:`~mhla_diffusion.models.streaming.WanFramePositions`), so
cached keys were rotated where they stand in the video.

Block-causal over frames (``use_kv_cache(transformer, block_causal=True)``): every latent frame is a block, as
every latent frame is a temporal row of causal MHLA. A query in latent frame ``f`` sees the keys of frames
``<= f`` (every token of its own frame), in a pass over a whole clip (training, one-pass generation) and inside a
stream's chunk alike (the cache, then the chunk's frames up to the query's), so a stream in chunks of any size
gives what one block-causal pass gives. The processors learn the frames from the transformer's token-grid
pre-hook (:mod:`~mhla_diffusion.models.processors.grid`). The transformer's config records the choice
(:data:`BLOCK_CAUSAL_KEY`), so a saved model reloads block-causal (:func:`restore_block_causal`).
"""

from __future__ import annotations

import torch
from torch import nn

from ..utils.stream_frames import BLOCK_CAUSAL_KEY
from .conversion import get_mhla_conversion, self_attention_layers
from .processors.base import apply_interleaved_rotary
from .processors.grid import TokenGridContext, install_grid_hook, remove_grid_hook
from .processors.wan import wan_qkv
from .streaming import ChunkStream

__all__ = [
    "BLOCK_CAUSAL_KEY",
    "KVCache",
    "KVCacheStream",
    "KVCacheWanAttnProcessor",
    "frame_causal_mask",
    "teacher_forcing_mask",
    "is_block_causal",
    "kv_cache_processors",
    "restore_block_causal",
    "use_kv_cache",
]

#: One layer's cache: rotated keys and values ``(B, N_cached, H, D)`` of every chunk the stream has consumed.
KVCache = tuple[torch.Tensor, torch.Tensor]


class KVCacheWanAttnProcessor:
    """Softmax self-attention of one Wan ``attn1`` that attends to the keys and values cached by a stream.

    Outside a :class:`KVCacheStream` chunk it is plain bidirectional self-attention, the same as Diffusers'
    ``WanAttnProcessor`` (same projections, q/k norms, Wan's RoPE and attention backend). Inside a chunk, the
    layer's cached keys and values come before the chunk's own (``torch.cat``, then one SDPA call); a chunk run
    with ``advance=True`` hands the concatenation to the stream as the layer's new cache.

    With a ``grid_context`` (the transformer's token grid, :func:`use_kv_cache` with ``block_causal=True``) it is
    block-causal over latent frames, in and out of a stream (:func:`frame_causal_mask`).
    """

    _attention_backend = None
    _parallel_config = None

    def __init__(self, grid_context: TokenGridContext | None = None) -> None:
        #: The :class:`KVCacheStream` whose chunk is running, or ``None``.
        self.stream: KVCacheStream | None = None
        #: The token grid of the running forward (block-causal), or ``None`` (bidirectional within a chunk).
        self.grid_context = grid_context
        #: The :class:`~mhla_diffusion.models.teacher_forcing.TeacherForcing` in force (block-causal layers only).
        self.forcing = None

    @property
    def block_causal(self) -> bool:
        """Whether a query sees only the keys of its own and earlier latent frames."""
        return self.grid_context is not None

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``hidden_states`` ``(B, N, C)`` -> ``(B, N, C)``."""
        from diffusers.models.attention_dispatch import dispatch_attention_fn

        if encoder_hidden_states is not None:
            raise ValueError("KVCacheWanAttnProcessor is for self-attention (attn1); cross-attention keeps its own")
        if attention_mask is not None:
            raise ValueError("KVCacheWanAttnProcessor takes no `attention_mask`: the stream's chunks make the mask")
        if self._parallel_config is not None:
            raise ValueError("KVCacheWanAttnProcessor has no context parallelism: run the stream on one process")
        query, key, value = wan_qkv(attn, hidden_states)
        if rotary_emb is not None:
            query, key = (apply_interleaved_rotary(x, *rotary_emb) for x in (query, key))
        if self.stream is not None:
            cache = self.stream.state(self)
            if cache is not None:  # what a user writes: the earlier chunks' keys and values, then this chunk's
                key, value = torch.cat([cache[0], key], dim=1), torch.cat([cache[1], value], dim=1)
            self.stream.stage(self, (key, value))
        mask = None
        if self.grid_context is not None and self.forcing is not None:  # [clean | noisy] copies of a clip
            frames = self.grid_context.require(query.shape[1])[0]
            mask = self.forcing.softmax_mask(query.shape[1] // frames, query.device)
        elif self.grid_context is not None:
            frames = self.grid_context.require(query.shape[1])[0]
            mask = frame_causal_mask(frames, query.shape[1] // frames, key.shape[1] - query.shape[1], query.device)
        out = dispatch_attention_fn(query, key, value, attn_mask=mask, backend=self._attention_backend)
        out = attn.to_out[0](out.flatten(2, 3).type_as(query))
        return attn.to_out[1](out)


def frame_causal_mask(
    frames: int, tokens_per_frame: int, cached: int, device: torch.device | str | None = None
) -> torch.Tensor | None:
    """Which keys each query sees, block-causal over latent frames: ``(1, 1, N, cached + N)`` booleans with
    ``N = frames * tokens_per_frame`` queries in row-major frame order. The ``cached`` keys (earlier chunks of a
    stream) are all seen; of the ``N`` own keys a query sees those of its frame and the frames before it.
    ``None`` for one frame (every key seen). Four dimensions: Diffusers reads a 2-D mask as a padding mask."""
    if frames == 1:
        return None
    frame = torch.arange(frames, device=device).repeat_interleave(tokens_per_frame)
    own = frame[None, :] <= frame[:, None]
    seen = torch.cat([own.new_ones(own.shape[0], cached), own], dim=1)
    return seen[None, None]


def teacher_forcing_mask(
    chunk_frames: list[int], tokens_per_frame: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Which keys each query sees under teacher forcing (:mod:`mhla_diffusion.models.teacher_forcing`), over the
    ``2N`` tokens of ``[clean | noisy]``: ``(1, 1, 2N, 2N)`` booleans. A clean query sees the clean keys of its frame
    and the frames before it; a noisy query of chunk ``c`` sees the clean keys of the chunks before ``c`` and the
    noisy keys of its own chunk up to its frame (what a KV-cache stream's denoising forward sees)."""
    from ..ops.teacher_forcing import teacher_forcing_offsets

    noisy = teacher_forcing_offsets(chunk_frames, device) >= 0  # (F, 2F): over the clean frames, then the noisy
    frame = torch.arange(noisy.shape[0], device=device)
    clean = torch.cat([frame[None, :] <= frame[:, None], torch.zeros_like(noisy[:, : noisy.shape[0]])], dim=1)
    seen = torch.cat([clean, noisy]).repeat_interleave(tokens_per_frame, 0).repeat_interleave(tokens_per_frame, 1)
    return seen[None, None]


def kv_cache_processors(transformer: nn.Module) -> list[KVCacheWanAttnProcessor]:
    """The :class:`KVCacheWanAttnProcessor` processors of ``transformer``'s self-attention layers, in layer order."""
    return [
        attn.processor
        for _, attn in self_attention_layers(transformer)
        if isinstance(attn.processor, KVCacheWanAttnProcessor)
    ]


def is_block_causal(transformer: nn.Module) -> bool:
    """Whether ``transformer``'s config records block-causal softmax self-attention (:data:`BLOCK_CAUSAL_KEY`)."""
    config = getattr(transformer, "config", None)
    return bool(config is not None and config.get(BLOCK_CAUSAL_KEY, False))


def use_kv_cache(transformer: nn.Module, block_causal: bool | None = None) -> list[KVCacheWanAttnProcessor]:
    """Give every self-attention layer of a stock Wan ``transformer`` a :class:`KVCacheWanAttnProcessor`; returns them.

    ``block_causal``: ``True`` makes every layer block-causal over latent frames (module docstring), in a pass over
    a whole clip too, and records it in the transformer's config (:data:`BLOCK_CAUSAL_KEY`, saved with it);
    ``False`` leaves a pass over a whole clip bidirectional (the blocks are a stream's chunks); ``None``: what the
    config records. Cross-attention keeps its processor. An MHLA-converted transformer is refused: its layers carry
    their own state (:class:`~mhla_diffusion.models.streaming.CausalStream`).
    """
    if get_mhla_conversion(transformer) is not None:
        raise ValueError(
            "this transformer's self-attention is MHLA: stream it with CausalStream, or call revert_mhla(transformer) "
            "first for the softmax KV cache"
        )
    if block_causal is None:
        block_causal = is_block_causal(transformer)
    context = None
    if block_causal:
        context = TokenGridContext()
        install_grid_hook(transformer, transformer.config.patch_size, context)
    else:
        remove_grid_hook(transformer)
    if block_causal or is_block_causal(transformer):
        transformer.register_to_config(**{BLOCK_CAUSAL_KEY: block_causal})
    processors = []
    for _, attn in self_attention_layers(transformer):
        processors.append(KVCacheWanAttnProcessor(context))
        attn.set_processor(processors[-1])
    return processors


def restore_block_causal(transformer: nn.Module) -> list[KVCacheWanAttnProcessor]:
    """Put back the block-causal KV-cache processors of a loaded ``transformer`` whose config records them
    (:data:`BLOCK_CAUSAL_KEY`) and that lacks them; returns its KV-cache processors (``[]`` for any other, and for
    one converted to MHLA since: its MHLA layers are what it runs)."""
    if not is_block_causal(transformer) or get_mhla_conversion(transformer) is not None:
        return []
    processors = kv_cache_processors(transformer)
    if processors and all(p.block_causal for p in processors):
        return processors
    return use_kv_cache(transformer, block_causal=True)


class KVCacheStream(ChunkStream):
    """The keys and values a Wan ``transformer`` with :class:`KVCacheWanAttnProcessor` layers carries between chunks.

    Used as :class:`~mhla_diffusion.models.streaming.CausalStream` (see the module docstring): inside
    :meth:`chunk` every KV-cache layer attends to its cache; with ``advance=True`` the chunk's keys and values
    are appended and the stream's position moves past the chunk's latent frames. Unlike MHLA's state, the cache
    grows with every chunk (:attr:`nbytes`).
    """

    def __init__(self, transformer: nn.Module) -> None:
        processors = kv_cache_processors(transformer)
        if not processors:
            raise ValueError(
                "this transformer has no KVCacheWanAttnProcessor layer: call use_kv_cache(transformer) first"
            )
        super().__init__(transformer, processors)

    @staticmethod
    def state_nbytes(cache: KVCache) -> int:
        return sum(t.numel() * t.element_size() for t in cache)
