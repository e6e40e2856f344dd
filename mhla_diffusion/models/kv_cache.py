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
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import nn

from .conversion import get_mhla_conversion, self_attention_layers
from .processors.base import apply_interleaved_rotary
from .streaming import install_frame_positions

__all__ = ["KVCache", "KVCacheStream", "KVCacheWanAttnProcessor", "kv_cache_processors", "use_kv_cache"]

#: One layer's cache: rotated keys and values ``(B, N_cached, H, D)`` of every chunk the stream has consumed.
KVCache = tuple[torch.Tensor, torch.Tensor]


class KVCacheWanAttnProcessor:
    """Softmax self-attention of one Wan ``attn1`` that attends to the keys and values cached by a stream.

    Outside a :class:`KVCacheStream` chunk it is plain bidirectional self-attention, the same as Diffusers'
    ``WanAttnProcessor`` (same projections, q/k norms, Wan's RoPE and attention backend). Inside a chunk, the
    layer's cached keys and values come before the chunk's own (``torch.cat``, then one SDPA call); a chunk run
    with ``advance=True`` hands the concatenation to the stream as the layer's new cache.
    """

    _attention_backend = None
    _parallel_config = None

    def __init__(self) -> None:
        #: The :class:`KVCacheStream` whose chunk is running, or ``None``.
        self.stream: KVCacheStream | None = None

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
        if getattr(attn, "fused_projections", False):
            query, key, value = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        query, key = attn.norm_q(query), attn.norm_k(key)
        heads = (attn.heads, -1)
        query, key, value = query.unflatten(2, heads), key.unflatten(2, heads), value.unflatten(2, heads)
        if rotary_emb is not None:
            query, key = (apply_interleaved_rotary(x, *rotary_emb) for x in (query, key))
        if self.stream is not None:
            cache = self.stream.state(self)
            if cache is not None:  # what a user writes: the earlier chunks' keys and values, then this chunk's
                key, value = torch.cat([cache[0], key], dim=1), torch.cat([cache[1], value], dim=1)
            self.stream.stage(self, (key, value))
        out = dispatch_attention_fn(query, key, value, backend=self._attention_backend)
        out = attn.to_out[0](out.flatten(2, 3).type_as(query))
        return attn.to_out[1](out)


def kv_cache_processors(transformer: nn.Module) -> list[KVCacheWanAttnProcessor]:
    """The :class:`KVCacheWanAttnProcessor` processors of ``transformer``'s self-attention layers, in layer order."""
    return [
        attn.processor
        for _, attn in self_attention_layers(transformer)
        if isinstance(attn.processor, KVCacheWanAttnProcessor)
    ]


def use_kv_cache(transformer: nn.Module) -> list[KVCacheWanAttnProcessor]:
    """Give every self-attention layer of a stock Wan ``transformer`` a :class:`KVCacheWanAttnProcessor`; returns them.

    Cross-attention keeps its processor. An MHLA-converted transformer is refused: its layers carry their own
    state (:class:`~mhla_diffusion.models.streaming.CausalStream`).
    """
    if get_mhla_conversion(transformer) is not None:
        raise ValueError(
            "this transformer's self-attention is MHLA: stream it with CausalStream, or call revert_mhla(transformer) "
            "first for the softmax KV cache"
        )
    processors = []
    for _, attn in self_attention_layers(transformer):
        processors.append(KVCacheWanAttnProcessor())
        attn.set_processor(processors[-1])
    return processors


class KVCacheStream:
    """The keys and values a Wan ``transformer`` with :class:`KVCacheWanAttnProcessor` layers carries between chunks.

    Used as :class:`~mhla_diffusion.models.streaming.CausalStream` (see the module docstring): inside
    :meth:`chunk` every KV-cache layer attends to its cache; with ``advance=True`` the chunk's keys and values
    are appended and the stream's position moves past the chunk's latent frames. Unlike MHLA's state, the cache
    grows with every chunk (:attr:`nbytes`). One stream per sequence of calls with the same batch size.
    """

    def __init__(self, transformer: nn.Module) -> None:
        self.processors = kv_cache_processors(transformer)
        if not self.processors:
            raise ValueError(
                "this transformer has no KVCacheWanAttnProcessor layer: call use_kv_cache(transformer) first"
            )
        self.transformer = transformer
        self.positions = install_frame_positions(transformer)
        self.frames = 0  # latent frames (token-grid frames) consumed: the next chunk's first position
        self.states: dict[int, KVCache] = {}
        self._staged: dict[int, KVCache] = {}
        self._chunk_frames = 0
        self.advancing = False

    def _record_frames(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        latents = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        self._chunk_frames = latents.shape[2] // module.config.patch_size[0]

    @contextmanager
    def chunk(self, advance: bool = False) -> Iterator["KVCacheStream"]:
        """Run the transformer on the next chunk inside this block; ``advance``: the chunk joins the cache."""
        if any(p.stream is not None for p in self.processors):
            raise RuntimeError("a chunk of this transformer is already running (chunks do not nest)")
        hook = self.transformer.register_forward_pre_hook(self._record_frames, with_kwargs=True)
        for processor in self.processors:
            processor.stream = self
        self.positions.origin, self.advancing, self._staged = self.frames, advance, {}
        try:
            yield self
        finally:
            hook.remove()
            for processor in self.processors:
                processor.stream = None
            self.positions.origin, self.advancing = 0, False
        if advance:
            if len(self._staged) != len(self.processors):
                raise RuntimeError("advance=True needs one forward of the transformer inside the chunk block")
            self.states, self._staged = self._staged, {}
            self.frames += self._chunk_frames

    def state(self, processor: KVCacheWanAttnProcessor) -> KVCache | None:
        """``processor``'s cached keys and values (``None`` before the first chunk)."""
        return self.states.get(id(processor))

    def stage(self, processor: KVCacheWanAttnProcessor, cache: KVCache) -> None:
        """Record ``processor``'s keys and values up to the running chunk (kept only when the chunk advances)."""
        if self.advancing:
            self._staged[id(processor)] = cache

    @property
    def nbytes(self) -> int:
        """Bytes of every layer's cached keys and values: one chunk's worth more after every advance."""
        return sum(t.numel() * t.element_size() for cache in self.states.values() for t in cache)
