"""A converted causal MHLA Wan transformer run as a stream (models/streaming.py): chunk by chunk with carried
state equals one causal pass with per-token timesteps, in constant memory, past the rotary table."""

from __future__ import annotations

import pytest
import torch

from mhla_diffusion import MHLAConfig, convert_to_mhla
from mhla_diffusion.models.streaming import CausalStream, WanFramePositions
from mhla_diffusion.models.tiny import tiny_wan_transformer
from mhla_diffusion.utils.choices import CAUSAL_FOLDS

SIZE = 8  # latent height and width: 4 x 4 tokens with patch (1, 2, 2)


def _causal_model(fold: str = "sum", window: int = 1, rope_max_seq_len: int = 32):
    torch.manual_seed(0)
    model = tiny_wan_transformer(num_layers=2, rope_max_seq_len=rope_max_seq_len).double().eval()
    convert_to_mhla(model, MHLAConfig(layout=(1, 2, 2), causal=True, causal_window=window, causal_fold=fold))
    with torch.no_grad():  # away from the initialisation, so every offset and the fold matter
        for name, param in model.named_parameters():
            if ".processor." in name:
                param.add_(0.3 * torch.rand_like(param))
    return model


def _tokens_per_frame() -> int:
    return (SIZE // 2) ** 2


def _one_pass(model, latents, timesteps_per_frame, text):
    """One causal pass with one timestep per latent frame, as per-token timesteps ``(B, N)``."""
    per_token = timesteps_per_frame.repeat_interleave(_tokens_per_frame())[None].expand(latents.shape[0], -1)
    with torch.no_grad():
        return model(latents, per_token, text).sample


@pytest.mark.parametrize("fold", CAUSAL_FOLDS)
def test_chunks_with_carried_state_equal_one_causal_pass(fold):
    model = _causal_model(fold)
    generator = torch.Generator().manual_seed(1)
    chunks = (2, 1, 3, 2)  # latent frames per chunk
    frames = sum(chunks)
    clean = torch.randn(2, 16, frames, SIZE, SIZE, generator=generator, dtype=torch.float64)
    text = torch.randn(2, 5, 32, generator=generator, dtype=torch.float64)
    stream = CausalStream(model)
    start = 0
    for size in chunks:
        stop = start + size
        noisy = torch.randn(2, 16, size, SIZE, SIZE, generator=generator, dtype=torch.float64)
        t = torch.tensor([700.0 - 100 * len(stream.states)], dtype=torch.float64)
        with stream.chunk(), torch.no_grad():
            streamed = model(noisy, t.expand(2), text).sample
        # one pass over the clean context and this noisy chunk: context at timestep 0, the chunk at t
        timesteps = torch.cat([torch.zeros(start, dtype=torch.float64), t.expand(size)])
        reference = _one_pass(model, torch.cat([clean[:, :, :start], noisy], dim=2), timesteps, text)
        torch.testing.assert_close(streamed, reference[:, :, start:], rtol=0, atol=1e-10)
        with stream.chunk(advance=True), torch.no_grad():
            model(clean[:, :, start:stop], torch.zeros(2, dtype=torch.float64), text)
        start = stop
    assert stream.frames == frames


def test_state_size_is_constant_and_runs_past_the_rotary_table():
    model = _causal_model(window=2, rope_max_seq_len=8)
    text = torch.randn(1, 5, 32, dtype=torch.float64)
    stream = CausalStream(model)
    sizes = []
    clips = []
    for chunk in range(12):  # 24 latent frames: three times the table's 8 positions
        clip = torch.randn(1, 16, 2, SIZE, SIZE, dtype=torch.float64)
        with stream.chunk(advance=True), torch.no_grad():
            model(clip, torch.zeros(1, dtype=torch.float64), text)
        sizes.append(stream.nbytes)
        clips.append(clip)
    assert len(set(sizes)) == 1 and sizes[0] > 0
    # the last chunk, noisy, against the stream equals one pass over the whole clip (frames 0 .. 25)
    noisy = torch.randn(1, 16, 2, SIZE, SIZE, dtype=torch.float64)
    t = torch.tensor([500.0], dtype=torch.float64)
    with stream.chunk(), torch.no_grad():
        streamed = model(noisy, t, text).sample
    timesteps = torch.cat([torch.zeros(24, dtype=torch.float64), t.expand(2)])
    reference = _one_pass(model, torch.cat([*clips, noisy], dim=2), timesteps, text)
    torch.testing.assert_close(streamed, reference[:, :, -2:], rtol=0, atol=1e-10)


def test_frame_positions_follow_wans_table_and_extend_it():
    model = tiny_wan_transformer(num_layers=1)
    positions = WanFramePositions(model.rope)
    whole = model.rope(torch.zeros(1, 16, 12, SIZE, SIZE))
    positions.origin = 5
    moved = positions(torch.zeros(1, 16, 4, SIZE, SIZE))
    n = _tokens_per_frame()
    for table, expected in zip(moved, whole):
        assert torch.equal(table, expected[:, 5 * n : 9 * n])  # the formula gives the table's own values


def test_stream_refusals():
    plain = tiny_wan_transformer(num_layers=1)
    convert_to_mhla(plain, MHLAConfig(layout=(1, 2, 2)))
    with pytest.raises(ValueError, match="no block-causal MHLA layer"):
        CausalStream(plain)
    stream = CausalStream(_causal_model())
    with stream.chunk():
        with pytest.raises(RuntimeError, match="do not nest"):
            with stream.chunk():
                pass
    with pytest.raises(RuntimeError, match="one forward"):
        with stream.chunk(advance=True):
            pass


@pytest.mark.parametrize("fold", CAUSAL_FOLDS)
@pytest.mark.parametrize(("chunks", "table"), [((2, 1, 3, 2), 32), ((1, 3, 3, 3), 8)])
def test_teacher_forcing_equals_the_streams_denoising_chunk_by_chunk(fold, chunks, table):
    """One forward of ``[clean | noisy]`` under TeacherForcing: the noisy half is, chunk by chunk, what the stream's
    denoising forward gives against a state advanced with the clean chunks (their context level included), and the
    clean half is one causal pass over the clean copy; also past the rotary table (10 frames, a table of 8)."""
    from mhla_diffusion.models.teacher_forcing import TeacherForcing

    model = _causal_model(fold, window=1, rope_max_seq_len=table)
    generator = torch.Generator().manual_seed(2)
    frames = sum(chunks)
    clean = torch.randn(2, 16, frames, SIZE, SIZE, generator=generator, dtype=torch.float64)
    noisy = torch.randn(2, 16, frames, SIZE, SIZE, generator=generator, dtype=torch.float64)
    text = torch.randn(2, 5, 32, generator=generator, dtype=torch.float64)
    context_level = 30.0  # the clean copy at a small context level, as causal_context_noise trains it
    levels = [900.0 - 150 * c for c in range(len(chunks))]  # one level per noisy chunk
    per_frame = torch.cat([torch.full((size,), level, dtype=torch.float64) for size, level in zip(chunks, levels)])
    timesteps = torch.cat([torch.full((frames,), context_level, dtype=torch.float64), per_frame])
    per_token = timesteps.repeat_interleave(_tokens_per_frame())[None].expand(2, -1)
    with TeacherForcing(model, chunks), torch.no_grad():
        forced = model(torch.cat([clean, noisy], dim=2), per_token, text).sample
    assert model.rope.frame_positions is None  # positions as before once the block ends

    stream, start, streamed = CausalStream(model), 0, []
    for size, level in zip(chunks, levels):
        with stream.chunk(), torch.no_grad():
            streamed.append(model(noisy[:, :, start : start + size], torch.tensor([level] * 2).double(), text).sample)
        with stream.chunk(advance=True), torch.no_grad():
            model(clean[:, :, start : start + size], torch.tensor([context_level] * 2).double(), text)
        start += size
    torch.testing.assert_close(forced[:, :, frames:], torch.cat(streamed, dim=2), rtol=0, atol=1e-10)
    context = _one_pass(model, clean, torch.full((frames,), context_level, dtype=torch.float64), text)
    torch.testing.assert_close(forced[:, :, :frames], context, rtol=0, atol=1e-10)


def test_teacher_forcing_refuses_an_input_that_is_not_two_copies():
    from mhla_diffusion.models.teacher_forcing import TeacherForcing

    model = _causal_model()
    latents = torch.randn(1, 16, 6, SIZE, SIZE, dtype=torch.float64)
    with TeacherForcing(model, [2, 2]), pytest.raises(ValueError, match="the clip twice, \\[clean \\| noisy\\]"):
        model(latents, torch.zeros(1, dtype=torch.float64), torch.randn(1, 5, 32, dtype=torch.float64))
    with pytest.raises(ValueError, match="has none"):
        TeacherForcing(tiny_wan_transformer(num_layers=1), [2])
