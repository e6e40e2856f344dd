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

import torch
from torch import nn

from .conversion import get_mhla_conversion, self_attention_layers
from .processors.base import apply_interleaved_rotary
from .processors.wan import wan_qkv
from .streaming import ChunkStream

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
        query, key, value = wan_qkv(attn, hidden_states)
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
