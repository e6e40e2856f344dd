"""Block-causal softmax attention with a KV cache (models/kv_cache.py): a stream of chunks equals one pass over the
whole clip with a block-causal attention mask over chunks, and its cache grows by one chunk per advance. Block-causal
over frames (``use_kv_cache(..., block_causal=True)``): one pass is a written-out frame mask, a stream in chunks of
any size equals one such pass, and the transformer's config records it through a save and load."""

from __future__ import annotations

import math

import pytest
import torch

from mhla_diffusion import MHLAConfig, convert_to_mhla
from mhla_diffusion.models.kv_cache import (
    BLOCK_CAUSAL_KEY,
    KVCacheStream,
    KVCacheWanAttnProcessor,
    kv_cache_processors,
    restore_block_causal,
    use_kv_cache,
)
from mhla_diffusion.models.processors.base import apply_interleaved_rotary
from mhla_diffusion.models.tiny import tiny_wan_transformer

SIZE = 8  # latent height and width: 4 x 4 tokens with patch (1, 2, 2)
TOKENS_PER_FRAME = (SIZE // 2) ** 2


class BlockCausalSoftmax:
    """Wan self-attention over a whole clip with a block-causal mask over chunks, written out (no SDPA, no cache):
    a query of chunk ``i`` sees the keys of chunks ``0 .. i``. ``chunk_of_token`` ``(N,)`` numbers the chunks."""

    def __init__(self, chunk_of_token: torch.Tensor) -> None:
        self.chunk_of_token = chunk_of_token

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        heads = (attn.heads, -1)
        q = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, heads)
        k = attn.norm_k(attn.to_k(hidden_states)).unflatten(2, heads)
        v = attn.to_v(hidden_states).unflatten(2, heads)
        q, k = apply_interleaved_rotary(q, *rotary_emb), apply_interleaved_rotary(k, *rotary_emb)
        scores = torch.einsum("bnhd,bmhd->bhnm", q, k) / math.sqrt(q.shape[-1])
        hidden = self.chunk_of_token[None, :] > self.chunk_of_token[:, None]  # key's chunk after the query's
        weights = scores.masked_fill(hidden, float("-inf")).softmax(dim=-1)
        out = torch.einsum("bhnm,bmhd->bnhd", weights, v).flatten(2, 3)
        return attn.to_out[1](attn.to_out[0](out))


def _model(rope_max_seq_len: int = 32):
    return tiny_wan_transformer(num_layers=2, rope_max_seq_len=rope_max_seq_len).double()


def _one_pass(model, latents, timesteps_per_frame, text, chunks):
    """One pass over ``latents`` with the block-causal mask over ``chunks`` (latent frames each) and one timestep per
    frame (per-token timesteps ``(B, N)``); the KV-cache processors are put back afterwards."""
    chunk_of_token = torch.repeat_interleave(torch.arange(len(chunks)), torch.tensor(chunks) * TOKENS_PER_FRAME)
    attns = [block.attn1 for block in model.blocks]
    kept = [attn.processor for attn in attns]
    for attn in attns:
        attn.set_processor(BlockCausalSoftmax(chunk_of_token))
    per_token = timesteps_per_frame.repeat_interleave(TOKENS_PER_FRAME)[None].expand(latents.shape[0], -1)
    try:
        with torch.no_grad():
            return model(latents, per_token, text).sample
    finally:
        for attn, processor in zip(attns, kept):
            attn.set_processor(processor)


@pytest.mark.parametrize("rope_max_seq_len", [32, 4])  # 4: the stream's 8 frames run past the rotary table
def test_cached_chunks_equal_one_pass_with_a_block_causal_mask(rope_max_seq_len):
    model = _model(rope_max_seq_len)
    use_kv_cache(model)
    generator = torch.Generator().manual_seed(1)
    chunks = (2, 1, 3, 2)  # latent frames per chunk
    clean = torch.randn(2, 16, sum(chunks), SIZE, SIZE, generator=generator, dtype=torch.float64)
    text = torch.randn(2, 5, 32, generator=generator, dtype=torch.float64)
    stream = KVCacheStream(model)
    start = 0
    for index, size in enumerate(chunks):
        noisy = torch.randn(2, 16, size, SIZE, SIZE, generator=generator, dtype=torch.float64)
        t = torch.tensor([700.0 - 100 * index], dtype=torch.float64)
        with stream.chunk(), torch.no_grad():
            streamed = model(noisy, t.expand(2), text).sample
        timesteps = torch.cat([torch.zeros(start, dtype=torch.float64), t.expand(size)])
        latents = torch.cat([clean[:, :, :start], noisy], dim=2)
        reference = _one_pass(model, latents, timesteps, text, chunks[: index + 1])
        torch.testing.assert_close(streamed, reference[:, :, start:], rtol=0, atol=1e-10)
        with stream.chunk(advance=True), torch.no_grad():
            model(clean[:, :, start : start + size], torch.zeros(2, dtype=torch.float64), text)
        start += size
        # the cache holds every consumed frame's keys and values: 2 layers x (k, v) x B x tokens x H x D doubles
        assert stream.nbytes == 2 * 2 * 2 * start * TOKENS_PER_FRAME * 2 * 12 * 8
    assert stream.frames == sum(chunks)


def _per_token(timesteps_per_frame: torch.Tensor, batch: int) -> torch.Tensor:
    return timesteps_per_frame.repeat_interleave(TOKENS_PER_FRAME)[None].expand(batch, -1)


def test_block_causal_pass_is_a_written_out_frame_mask():
    model = _model()
    use_kv_cache(model, block_causal=True)
    generator = torch.Generator().manual_seed(2)
    latents = torch.randn(2, 16, 4, SIZE, SIZE, generator=generator, dtype=torch.float64)
    text = torch.randn(2, 5, 32, generator=generator, dtype=torch.float64)
    timesteps = torch.tensor([0.0, 0.0, 300.0, 900.0], dtype=torch.float64)
    with torch.no_grad():
        ours = model(latents, _per_token(timesteps, 2), text).sample
    reference = _one_pass(model, latents, timesteps, text, (1, 1, 1, 1))  # every latent frame a block
    torch.testing.assert_close(ours, reference, rtol=0, atol=1e-10)
    bidirectional = _one_pass(model, latents, timesteps, text, (4,))
    assert (ours - bidirectional).abs().max() > 1e-3  # the mask matters


@pytest.mark.parametrize("rope_max_seq_len", [32, 4])
def test_block_causal_stream_equals_one_block_causal_pass(rope_max_seq_len):
    model = _model(rope_max_seq_len)
    use_kv_cache(model, block_causal=True)
    generator = torch.Generator().manual_seed(1)
    chunks = (2, 1, 3, 2)  # chunks of several frames: inside a chunk the frames stay causal
    clean = torch.randn(2, 16, sum(chunks), SIZE, SIZE, generator=generator, dtype=torch.float64)
    text = torch.randn(2, 5, 32, generator=generator, dtype=torch.float64)
    stream = KVCacheStream(model)
    start = 0
    for index, size in enumerate(chunks):
        noisy = torch.randn(2, 16, size, SIZE, SIZE, generator=generator, dtype=torch.float64)
        t = torch.tensor([700.0 - 100 * index], dtype=torch.float64)
        with stream.chunk(), torch.no_grad():
            streamed = model(noisy, t.expand(2), text).sample
        # one block-causal pass of the same model: clean context at timestep 0, the noisy chunk at t
        timesteps = torch.cat([torch.zeros(start, dtype=torch.float64), t.expand(size)])
        if start + size <= rope_max_seq_len:  # one pass reads Wan's own rotary table
            with torch.no_grad():
                whole = model(torch.cat([clean[:, :, :start], noisy], dim=2), _per_token(timesteps, 2), text).sample
            torch.testing.assert_close(streamed, whole[:, :, start:], rtol=0, atol=1e-10)
        frames = (1,) * (start + size)  # the written-out frame mask, past the rotary table too
        reference = _one_pass(model, torch.cat([clean[:, :, :start], noisy], dim=2), timesteps, text, frames)
        torch.testing.assert_close(streamed, reference[:, :, start:], rtol=0, atol=1e-10)
        with stream.chunk(advance=True), torch.no_grad():
            model(clean[:, :, start : start + size], torch.zeros(2, dtype=torch.float64), text)
        start += size
    assert stream.frames == sum(chunks)


def test_block_causal_is_recorded_in_the_config_and_restored_on_load(tmp_path):
    from diffusers import WanTransformer3DModel

    model = tiny_wan_transformer(num_layers=2)
    assert restore_block_causal(model) == [] and kv_cache_processors(model) == []  # an unmarked model is left alone
    use_kv_cache(model, block_causal=True)
    assert model.config[BLOCK_CAUSAL_KEY] is True
    model.save_pretrained(tmp_path)
    loaded = WanTransformer3DModel.from_pretrained(tmp_path)
    assert kv_cache_processors(loaded) == []  # Diffusers loads the stock processors
    processors = restore_block_causal(loaded)
    assert len(processors) == 2 and all(p.block_causal for p in processors)
    assert restore_block_causal(loaded) == processors  # already there: kept
    latents = torch.randn(1, 16, 3, SIZE, SIZE)
    text = torch.randn(1, 5, 32)
    with torch.no_grad():
        torch.testing.assert_close(
            loaded(latents, torch.tensor([500.0]), text).sample, model(latents, torch.tensor([500.0]), text).sample
        )
    assert all(p.block_causal for p in use_kv_cache(loaded))  # block_causal=None: what the config records
    assert not any(p.block_causal for p in use_kv_cache(loaded, block_causal=False))
    assert loaded.config[BLOCK_CAUSAL_KEY] is False


def test_outside_a_stream_it_is_wans_own_self_attention():
    from helpers.models import run, wan_inputs

    model = tiny_wan_transformer(num_layers=2)
    inputs = wan_inputs(frames=3, height=4, width=4)
    stock = run(model, inputs)
    use_kv_cache(model)
    torch.testing.assert_close(run(model, inputs), stock, rtol=0, atol=0)


def test_kv_cache_refusals():
    converted = tiny_wan_transformer(num_layers=1)
    convert_to_mhla(converted, MHLAConfig(layout=(1, 2, 2), causal=True))
    with pytest.raises(ValueError, match="stream it with CausalStream"):
        use_kv_cache(converted)
    with pytest.raises(ValueError, match="use_kv_cache"):
        KVCacheStream(tiny_wan_transformer(num_layers=1))
    model = tiny_wan_transformer(num_layers=1)
    processors = use_kv_cache(model)
    assert all(isinstance(p, KVCacheWanAttnProcessor) for p in processors)
    stream = KVCacheStream(model)
    with stream.chunk():
        with pytest.raises(RuntimeError, match="do not nest"):
            with stream.chunk():
                pass
    with pytest.raises(RuntimeError, match="one forward"):
        with stream.chunk(advance=True):
            pass


@pytest.mark.parametrize(("chunks", "rope_max_seq_len"), [((2, 1, 3, 2), 32), ((1, 3, 3), 4)])
def test_teacher_forcing_equals_the_cached_stream_chunk_by_chunk(chunks, rope_max_seq_len):
    """One forward of ``[clean | noisy]`` under TeacherForcing (a block mask over 2N tokens, both copies at the same
    positions): the noisy half is, chunk by chunk, the KV-cache stream's denoising forward against the clean chunks
    before it; the clean half is one block-causal pass; also past the rotary table (7 frames, a table of 4)."""
    from mhla_diffusion.models.teacher_forcing import TeacherForcing

    model = _model(rope_max_seq_len)
    use_kv_cache(model, block_causal=True)
    generator = torch.Generator().manual_seed(3)
    frames = sum(chunks)
    clean = torch.randn(2, 16, frames, SIZE, SIZE, generator=generator, dtype=torch.float64)
    noisy = torch.randn(2, 16, frames, SIZE, SIZE, generator=generator, dtype=torch.float64)
    text = torch.randn(2, 5, 32, generator=generator, dtype=torch.float64)
    levels = [800.0 - 100 * c for c in range(len(chunks))]
    per_frame = torch.cat([torch.full((size,), level, dtype=torch.float64) for size, level in zip(chunks, levels)])
    timesteps = torch.cat([torch.zeros(frames, dtype=torch.float64), per_frame])
    with TeacherForcing(model, list(chunks)), torch.no_grad():
        forced = model(torch.cat([clean, noisy], dim=2), _per_token(timesteps, 2), text).sample

    stream, start, streamed = KVCacheStream(model), 0, []
    for size, level in zip(chunks, levels):
        with stream.chunk(), torch.no_grad():
            streamed.append(model(noisy[:, :, start : start + size], torch.tensor([level] * 2).double(), text).sample)
        with stream.chunk(advance=True), torch.no_grad():
            model(clean[:, :, start : start + size], torch.zeros(2, dtype=torch.float64), text)
        start += size
    torch.testing.assert_close(forced[:, :, frames:], torch.cat(streamed, dim=2), rtol=0, atol=1e-10)
    with torch.no_grad():
        context = model(clean, _per_token(torch.zeros(frames, dtype=torch.float64), 2), text).sample
    torch.testing.assert_close(forced[:, :, :frames], context, rtol=0, atol=1e-10)
